"""``medusa-bench``: Medusa against its peers, side by side in one process, interleaved per prompt.

    medusa-bench --engine build/model.onnx --prompts ../shared/data/spec_bench_dev.jsonl --max-new-tokens 128

Methods, on the same prompt token ids (greedy by default; with --temperature every method samples
with the same temperature / top-p / top-k, prompt i seeded with seed + i):
  * ``plain``      : autoregressive decoding on the same engine (no drafters)
  * ``medusa``     : the engine's drafters (``--draft`` repeatable: one row per drafter set) with
                     the engine's heads template (or ``--tree``, repeatable)
  * ``hf``         : ``transformers`` ``generate()`` on the same base model (needs torch; ``--no-hf`` skips)
  * ``hf-lookup``  : the same with ``prompt_lookup_num_tokens`` (self-speculative peer built into transformers)
  * ``llama.cpp[F]``: ``--peer llama.cpp:F.gguf`` (repeatable): llama.cpp on a GGUF of the same model, greedy,
                     the same threads (``llama.cpp+lookup`` with its prompt-lookup decoding, ``llama.cpp-norepack``
                     without its extra buffer types); ``medusa_trt.bench.peers``
  * ``openvino[D]``: ``--peer openvino:D`` (repeatable): OpenVINO GenAI on a folder optimum-cli exported
                     (scripts/openvino_models.py), f32 precision (``openvino-default``: the CPU's own, bf16 with
                     AMX; ``+lookup``: its prompt lookup). Each peer runs in a process of its own: one that
                     crashes ends its row, which says how (the signal), and the rest runs on
Repeat ``--engine`` to compare engines (int4 and int8 ones against fp32, say): each gets ``plain`` and
``medusa`` rows; greedy agreement is measured against the first engine's plain decoding (share of
prompts identical, mean matching prefix) and against the row's own engine's plain decoding (prompts
identical: drafting is lossless when all are), speed against both plain rows.
Repeat ``--acceptance`` to compare rules (lossless, typical) on the same engine and tree.
Prints a table; with ``--out FILE.json`` also writes the JSON report and a PNG plot beside it
(``FILE.png``, with matplotlib). Agreement between methods is only meaningful for greedy decoding.
Bad input prints one ``medusa-bench: error: ...`` line and exits 2, before any engine loads.
"""

from __future__ import annotations

import sys

from medusa_trt import bench
from medusa_trt.bench.runner import LOOKUP_TOKENS, SEED
from medusa_trt.cli.common import (
    USER_ERRORS,
    VERBOSE_HELP,
    Parser,
    drafter_list,
    entry,
    fail,
    non_negative_int,
    positive_int,
    setup_logging,
)
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.sampling import SamplingParams


def build_parser() -> Parser:
    p = Parser(prog="medusa-bench", description="Benchmark Medusa against plain decoding and transformers.")
    p.add_argument(
        "--engine", action="append", required=True, help="an exported engine (folder, .onnx or .plan); repeat to compare engines"
    )
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (UTF-8): turns[0] is the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS, help="new tokens per prompt and row")
    p.add_argument("--limit", type=positive_int, help="use the first N prompts (after --every)")
    p.add_argument("--every", type=positive_int, default=1, help="use every N-th prompt (a subset spread over all categories)")
    p.add_argument("--tree", action="append", help="heads template for the medusa rows (default: each engine's own); repeat to compare")
    p.add_argument(
        "--draft",
        action="append",
        type=drafter_list,
        metavar="LIST",
        help="drafter set of a medusa row, comma-separated (heads,lookup,recycle); repeat for one row each "
        "(default: every drafter the engine supports)",
    )
    p.add_argument("--model", help="base model for the transformers rows (default: the one the engine records)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows (no torch needed)")
    p.add_argument(
        "--peer",
        action="append",
        metavar="KIND:PATH",
        help="another engine on the same prompt ids, greedy, same threads, interleaved, in a process of its own: "
        "llama.cpp:FILE.gguf (llama-cpp-python; make peers builds it), llama.cpp+lookup:FILE.gguf (with its "
        "prompt-lookup decoding), llama.cpp-norepack[+lookup]:FILE.gguf (extra buffer types off: AMX, repacked "
        "weights), openvino[+lookup]:DIR (OpenVINO GenAI, f32 precision; make openvino-models), "
        "openvino-default[+lookup]:DIR (the CPU's default precision); the model must be the engine's; repeatable",
    )
    p.add_argument("--lookup-tokens", type=positive_int, help=f"prompt_lookup_num_tokens of the hf-lookup row (default {LOOKUP_TOKENS})")
    p.add_argument("--threads", type=positive_int, help="intra-op threads for ONNX Runtime and torch")
    p.add_argument(
        "--backend",
        action="append",
        metavar="NAME[:PRECISION]",
        help="run every --engine on this backend: onnxruntime, openvino, openvino:bf16 (CPUs with AMX or AVX512-BF16), native; "
        "repeat to compare backends side by side, rows named ENGINE@NAME (default: the engine's own)",
    )
    p.add_argument(
        "--out",
        help="write the JSON report here (FILE.json) and the plot beside it (FILE.png); default: print the table only, write nothing",
    )
    g = p.add_argument_group("sampling (default: greedy; these need --temperature above 0)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled rows (lossless acceptance)")
    g.add_argument("--top-p", type=float, help=f"default {SamplingParams.top_p}")
    g.add_argument("--top-k", type=non_negative_int, help=f"default {SamplingParams.top_k} (all tokens)")
    g.add_argument("--seed", type=non_negative_int, help=f"prompt i is sampled with seed + i, the same for every method (default {SEED})")
    g.add_argument(
        "--acceptance",
        action="append",
        choices=["typical", "lossless"],
        help="acceptance rule of the medusa rows (default lossless); repeat to compare",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def bench_config(args) -> bench.BenchConfig:
    """The ``BenchConfig`` of the command line (checked on construction: MedusaError)."""
    return bench.BenchConfig(
        engines=tuple(args.engine),
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        every=args.every,
        trees=tuple(args.tree or ()),
        drafts=tuple(args.draft or ()),
        model=args.model,
        hf=not args.no_hf,
        peers=tuple(args.peer or ()),
        lookup_tokens=args.lookup_tokens,
        threads=args.threads,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        acceptance=tuple(args.acceptance or ()),
        backends=tuple(args.backend or ()),
    )


@entry("medusa-bench")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        out = bench.check_out(args.out, ".json", (".png",)) if args.out else None  # before any benchmark work
        report = bench.run(bench_config(args))
        written = bench.write_report(report, out) if out else []
    except USER_ERRORS as exc:
        return fail("medusa-bench", exc)
    for line in bench.table_lines(report, written):
        print(line)
    sys.stdout.flush()  # a closed pipe (| head) surfaces here, where entry() turns it into a quiet exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
