"""The heads call as the loop pays it (not a test): right after a verify step, whose weight stream
has pushed the heads' projection out of the cache, against the same call repeated (warm).

    .venv/bin/python scripts/heads_cost_after_step.py --engine build/smollm2-135m-medusa \\
        --engine build/smollm2-135m-fullvocab --out docs/heads-cost-after-step.json

(the second folder: the demo export without --draft-vocab). Rows alternate engines per round.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from medusa_trt.runtime import MedusaRuntime


def time_round(runtime: MedusaRuntime, width: int, context: int) -> tuple[float, float, float]:
    """One round: (verify step ms, heads ms right after it, heads ms repeated). ``runtime.step_cost.measure``
    times the heads after a step only; this sets the repeated (warm) call beside it."""
    backend = runtime.backend
    mask = np.tril(np.ones((1, width, width), dtype=bool))  # (1, W, W)
    ids, pos = np.zeros((1, width), dtype=np.int64), np.arange(width)[None] + context  # (1, W)
    node, root = np.array([width - 1]), np.array([5])
    tick = time.perf_counter()
    backend.step(ids, pos, mask, np.array([context]))
    step = time.perf_counter() - tick
    tick = time.perf_counter()
    backend.propose(node, runtime.tree.top_k, root)
    cold = time.perf_counter() - tick
    tick = time.perf_counter()
    backend.propose(node, runtime.tree.top_k, root)
    warm = time.perf_counter() - tick
    return 1e3 * step, 1e3 * cold, 1e3 * warm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="append", required=True, help="an engine with heads; repeat to compare")
    p.add_argument("--width", type=int, default=10, help="tokens of the verify step before each heads call")
    p.add_argument("--context", type=int, default=300, help="cached tokens the verify step attends to")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runtimes = {e: MedusaRuntime(e, max_batch=1, threads=args.threads) for e in args.engine}
    for name, rt in runtimes.items():
        if not rt.backend.meta.num_heads:
            p.error(f"{name} has no heads to time")
        time_round(rt, args.width, args.context)  # warm-up
    rounds: dict[str, list] = {e: [] for e in runtimes}
    for _ in range(args.rounds):
        for name, rt in runtimes.items():
            rounds[name].append(time_round(rt, args.width, args.context))
    report = {}
    for name, rows in rounds.items():
        step, cold, warm = np.median(np.array(rows), axis=0)
        meta = runtimes[name].backend.meta
        report[name] = {
            "heads_vocab": meta.heads_vocab,
            "quantization": meta.quantization,
            "verify_step_ms": float(step),
            "heads_after_step_ms": float(cold),
            "heads_repeated_ms": float(warm),
        }
        logging.info(
            "%s (%d heads columns): verify %.1f ms, heads after it %.2f ms, repeated %.2f ms", name, meta.heads_vocab, step, cold, warm
        )
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps({"width": args.width, "context": args.context, "threads": args.threads, "engines": report}, indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
