"""The benchmarks: ``run(BenchConfig(...))`` is what ``medusa-bench`` runs (``runner``), its report and
table (``report``), the peer engines beside it (``peers``), the prompt and output files it shares with
``medusa-calibrate`` (``prompts``, ``files``)."""

from medusa_trt.bench.files import check_out, staged
from medusa_trt.bench.prompts import read_prompts
from medusa_trt.bench.report import table_lines, write_report
from medusa_trt.bench.runner import BenchConfig, run

__all__ = ["BenchConfig", "check_out", "read_prompts", "run", "staged", "table_lines", "write_report"]
