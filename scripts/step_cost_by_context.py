"""Verify-step latency by tokens per step and cached context on one engine (not a test): what a
drafted node costs on this machine, beside the 256-token table medusa-calibrate measures.

    .venv/bin/python scripts/step_cost_by_context.py --engine build/smollm2-135m-medusa --out docs/step-cost-by-context.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.step_cost import median_ms


def measure(runtime: MedusaRuntime, contexts: list[int], widths: list[int], repeats: int) -> dict:
    """{context: {width: median ms of one step of ``width`` causal tokens after ``context`` cached}}."""
    backend = runtime.backend
    table = {}
    for ctx in contexts:
        row = {}
        for w in widths:
            mask = np.tril(np.ones((1, w, w), dtype=bool))  # (1, W, W)
            ids, pos = np.zeros((1, w), dtype=np.int64), np.arange(w)[None] + ctx  # (1, W)
            lengths = np.array([ctx])  # (1,)
            row[w] = median_ms(lambda ids=ids, pos=pos, mask=mask, lengths=lengths: backend.step(ids, pos, mask, lengths), repeats)
        table[ctx] = row
        logging.info("%4d cached: %s", ctx, "  ".join(f"{w}: {ms:.1f} ms" for w, ms in row.items()))
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="build/smollm2-135m-medusa")
    p.add_argument("--contexts", default="128,512,900")
    p.add_argument("--widths", default="1,2,4,8,12,16,24,32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runtime = MedusaRuntime(args.engine, max_batch=1, threads=args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    if max(contexts) + max(widths) > runtime.backend.max_context:
        p.error(f"context {max(contexts)} + {max(widths)} tokens exceeds the engine's {runtime.backend.max_context}: lower --contexts")
    table = measure(runtime, contexts, widths, args.repeats)
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps({"engine": args.engine, "threads": args.threads, "step_ms": table}, indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
