"""Where a drafted step's time goes on the host: greedy generation over held-out prompts with every phase of the loop
timed (``Scheduler``'s draft, tree, inputs, accept, commit, emit and observe; the backend's step and heads call; the
heads' confidence where the loop computes it), per step, in one process. For a change to the loop's host work, not a
benchmark of generation (that is ``medusa-bench``). A phase's time includes the phases it calls (``_draft`` holds
``_tree`` and ``_inputs``; ``_observe`` holds the heads call and the confidence).

    .venv/bin/python scripts/host_phases.py --engine build/smollm2-int8-default --prompts $DEV --every 3 --limit 8 \\
        --out docs/results/host-phases.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from step_graph_report import cpu_name, write_report

log = logging.getLogger("host_phases")
PHASES = ("_draft", "_tree", "_inputs", "_accept", "_commit_cache", "_emit", "_observe")  # Scheduler's methods
HEADS_CALL = "backend.propose (the heads call)"


@contextmanager
def timed(wrapped: list[tuple[object, str, str]], spent: dict[str, list[float]]):
    """Within the block, each call of ``owner.name`` (a class's method or a module's function) for every (owner, name,
    label) in ``wrapped`` adds its seconds to ``spent[label]``; the originals are back after it."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def clock(inner, label: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label].append(time.perf_counter() - start)

        return wrapper

    try:
        for (owner, name, inner), (_, _, label) in zip(originals, wrapped):
            setattr(owner, name, clock(inner, label))
        yield
    finally:
        for owner, name, inner in originals:
            setattr(owner, name, inner)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine folder with heads")
    p.add_argument("--prompts", required=True, help="a Spec-Bench style JSONL file")
    p.add_argument("--every", type=int, default=3, help="every n-th prompt, as medusa-bench --every")
    p.add_argument("--limit", type=int, default=8, help="prompts, after --every")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", help="the backend to run (default: the one the engine folder names)")
    p.add_argument(
        "--confidence-in-loop", action="store_true",
        help="heads that compute their top-k's probabilities (native) leave them to the loop, as before they did (A/B)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.bench.prompts import read_prompts
    from medusa_trt.runtime import MedusaRuntime, scheduler
    from medusa_trt.runtime.drafting import heads
    from medusa_trt.runtime.errors import MedusaError

    spent: dict[str, list[float]] = defaultdict(list)
    load_start = os.getloadavg()
    try:
        prompts = read_prompts(args.prompts)[:: args.every][: args.limit]
        runtime = MedusaRuntime(args.engine, threads=args.threads, **({"backend": args.backend} if args.backend else {}))
        if args.confidence_in_loop and runtime.backend.heads is not None:
            runtime.backend.heads.confidence = False  # this object's heads no longer write HEAD_CONFIDENCE
        runtime.generate(prompts[0], max_new_tokens=16)  # warm: the first call's one-off costs stay out
        wrapped = [(scheduler.Scheduler, name, name) for name in PHASES]
        backend = type(runtime.backend)
        wrapped += [(backend, "step", "backend.step"), (backend, "propose", HEADS_CALL)]
        wrapped += [(heads, "head_confidence", "head_confidence (in the loop)")]
        with timed(wrapped, spent):
            started = time.perf_counter()
            tokens = sum(len(runtime.generate(prompt, max_new_tokens=args.max_new_tokens).token_ids) for prompt in prompts)
            seconds = time.perf_counter() - started
    except MedusaError as exc:
        p.exit(2, f"host_phases: error: {exc}\n")
    load_end = os.getloadavg()
    steps = len(spent["backend.step"])
    per_step = {label: 1e3 * sum(v) / steps for label, v in spent.items()}
    median = {label: 1e3 * statistics.median(v) for label, v in spent.items()}
    host = per_step["_draft"] + per_step["_accept"] + per_step["_commit_cache"] + per_step["_emit"] + per_step["_observe"]
    host -= per_step.get(HEADS_CALL, 0.0)
    print(f"\n{cpu_name()}, {args.threads} threads; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    print(f"{runtime.backend.name}; {len(prompts)} prompts, {tokens} tokens in {steps} steps ({tokens / seconds:.1f} tok/s, clocks on)\n")
    print("| phase | ms a step | median ms a call | calls |")
    print("| --- | --- | --- | --- |")
    for label in sorted(per_step, key=lambda k: -per_step[k]):
        print(f"| {label} | {per_step[label]:.3f} | {median[label]:.3f} | {len(spent[label])} |")
    print(f"\nhost work a step (the loop's phases less the heads call): {host:.3f} ms")
    if args.out:
        write_report(
            args.out, args.threads, (load_start[0], load_end[0]), argv,
            engine=str(args.engine), backend=runtime.backend.name, confidence_in_loop=args.confidence_in_loop,
            prompts=len(prompts), tokens=tokens, steps=steps,
            ms_a_step=per_step, median_ms=median, host_ms_a_step=host,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
