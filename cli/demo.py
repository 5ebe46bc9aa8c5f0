"""``medusa-demo``: what ``make demo`` runs (``bench/demo.py``): a few prompts, each generated with drafting and with
plain decoding on the same engine, greedy, so the two outputs must be the same tokens.

    medusa-demo --engine build/smollm2-135m-medusa --prompts assets/demo_prompts.json

Exit status 1 if a drafted output differs from its plain one (greedy drafting is exact: a difference is a bug),
2 on bad input (one line).
"""

from __future__ import annotations

import sys

from medusa_trt.bench.demo import read_demo_prompts, run_demo
from medusa_trt.cli.common import USER_ERRORS, VERBOSE_HELP, Parser, entry, fail, positive_int, setup_logging
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS


def build_parser() -> Parser:
    p = Parser(prog="medusa-demo", description="Generate for a few prompts with drafting and plainly, and compare.")
    p.add_argument("--engine", required=True, help="an exported engine: a folder, .onnx or .plan")
    p.add_argument("--prompts", required=True, help="the prompts: a JSON file such as assets/demo_prompts.json")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS, help="new tokens per answer")
    p.add_argument("--lines", type=positive_int, default=4, help="lines of each answer to print (default: 4)")
    p.add_argument("--threads", type=positive_int, help="the step's threads, ONNX Runtime's or native's (default: the backend's own)")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


@entry("medusa-demo")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        prompts = read_demo_prompts(args.prompts)  # a bad file fails before the engine loads
        from medusa_trt.runtime import MedusaRuntime, RuntimeConfig

        runtime = MedusaRuntime(args.engine, RuntimeConfig(threads=args.threads, verify_checksums=True))
        print(
            f"medusa-demo: {args.engine}, backend {runtime.backend.describe()}, heads template {runtime.tree.name}, "
            f"{len(prompts)} prompts from {args.prompts}"
        )
        same = run_demo(runtime, prompts, max_new_tokens=args.max_new_tokens, lines=args.lines)
    except USER_ERRORS as exc:
        return fail("medusa-demo", exc)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
