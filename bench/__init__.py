"""The benchmarks: ``run(BenchConfig(...))`` is what ``medusa-bench`` runs (``runner``), its report and
table (``report``), the peer engines beside it (``peers``), the prompt and output files it shares with
``medusa-calibrate`` (``prompts``, ``files``). Two studies run as modules: ``python -m medusa_trt.bench.replay``
(drafter sets replayed offline on greedy outputs) and ``python -m medusa_trt.bench.quality`` (perplexity and
next-token agreement of quantized engines)."""

from medusa_trt.bench.files import check_out, staged
from medusa_trt.bench.prompts import read_prompts
from medusa_trt.bench.report import table_lines, write_report
from medusa_trt.bench.runner import BenchConfig, run

__all__ = ["BenchConfig", "check_out", "read_prompts", "run", "staged", "table_lines", "write_report"]
