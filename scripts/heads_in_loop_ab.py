"""What the Medusa heads cost where the loop calls them: after a step, whose weights have just pushed the heads' out
of the CPU's caches, and the loop's host work (``--host-ms``, a busy wait). One native engine, its steps alone and each
followed by the heads (native ``NativeHeads``, also with their fused weights not read ahead (``NativeStep.read_ahead``),
and the heads graph on ONNX Runtime, ``OrtHeads``; on an int8-channel engine, whose native heads read the step's lm_head
rows, also native heads with their own copy of them), in rounds with the orders taking turns; the heads' cost is the
difference of medians, and each heads call is also timed by itself right after its step (on a machine whose steps vary
by more than the heads cost, the difference is noise). For the heads target (a call under 0.3 ms), not a benchmark of
generation (that is ``medusa-bench``).

    .venv/bin/python scripts/heads_in_loop_ab.py --engine build/smollm2-int8-default --context 300 --tokens 8 \\
        --rounds 9 --out docs/results/native-heads-ab.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from step_graph_report import cpu_name, prefill, write_report

log = logging.getLogger("heads_in_loop_ab")
OWN_COPY = "step + native heads, own copy of the lm_head rows"  # int8-channel engines (NativeHeads' share_lm_head)
NO_READ_AHEAD = "step + native heads, not read ahead"  # NativeStep.read_ahead off


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine folder native runs, with heads")
    p.add_argument("--context", type=int, default=300, help="committed tokens before each timed step")
    p.add_argument("--tokens", type=int, default=8, help="tokens each timed step scores")
    p.add_argument("--rounds", type=int, default=9, help="rounds of the three ways, each 0.5 s of steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--host-ms", type=float, default=0.3,
        help="the loop's host work between a step and its heads call (accept, commit, emit: 0.26-0.31 ms in "
        "medusa-bench's loop on an AMD EPYC), a busy wait here; 0: the heads right after the step",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.runtime import native_step, native_weights
    from medusa_trt.runtime.backends.native_backend import open_native
    from medusa_trt.runtime.backends.onnx_backend import OrtHeads, heads_session_options, open_heads
    from medusa_trt.runtime.errors import MedusaError

    load_start = os.getloadavg()
    try:
        backend = open_native(args.engine, max_batch=1, threads=args.threads)
        if not isinstance(backend.heads, native_step.NativeHeads):
            raise MedusaError(f"{args.engine}'s heads do not run natively (its log says why): nothing to compare")
        ways = {
            "step alone": None,
            "step + native heads": backend.heads,
            "step + onnxruntime heads": OrtHeads(
                open_heads(backend.files, backend.meta, heads_session_options(args.threads), ["CPUExecutionProvider"])
            ),
        }
        if backend.heads.reads_ahead:  # the same heads, their fused weights not read ahead after each step
            ways[NO_READ_AHEAD] = backend.heads
        if backend.heads.shares_lm_head:  # int8-channel: the heads project with the step's lm_head rows; and a copy
            weights = native_weights.read_heads(backend.files.heads)
            ways[OWN_COPY] = native_step.NativeHeads.of(weights, backend.kernel, backend.meta, 1, share_lm_head=False)
        native = {way: h for way, h in ways.items() if isinstance(h, native_step.NativeHeads) and way != NO_READ_AHEAD}
        regions = {way: native[way].fused_weights if way in native else None for way in ways}  # what each way reads ahead
        vocab = backend.meta.vocab_size
        prefill(backend, (np.arange(args.context, dtype=np.int64) * 7919 + 11) % vocab)
        t = args.tokens
        ids = ((np.arange(t, dtype=np.int64) * 131 + 7) % vocab)[None]  # (1, T)
        step = (ids, (args.context + np.arange(t))[None], np.tri(t, dtype=bool)[None], np.array([args.context]))
        times: dict[str, list[float]] = {way: [] for way in ways}
        calls: dict[str, list[float]] = {way: [] for way in ways}  # each heads call alone, right after its step
        names = list(ways)
        for round_ in range(args.rounds):
            for way in names[round_ % len(names) :] + names[: round_ % len(names)]:
                backend.heads = ways[way]
                backend.kernel.read_ahead(regions[way])
                start, n = time.perf_counter(), 0
                while time.perf_counter() - start < 0.5:
                    out = backend.step(*step)
                    host_work(args.host_ms)
                    if ways[way] is not None:
                        begin = time.perf_counter()
                        backend.propose(out, np.array([t - 1]), backend.meta.top_k, out.argmax[:, t - 1])
                        calls[way].append(time.perf_counter() - begin)
                    n += 1
                times[way].append((time.perf_counter() - start) / n * 1e3)
    except MedusaError as exc:
        p.exit(2, f"heads_in_loop_ab: error: {exc}\n")
    load_end = os.getloadavg()
    med = {way: statistics.median(v) for way, v in times.items()}
    heads = {way: med[way] - med["step alone"] for way in names[1:]}
    alone = {way: statistics.median(calls[way]) * 1e3 for way in names[1:]}
    print(f"\n{cpu_name()}, {args.threads} threads; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    print(
        f"{t}-token steps over {args.context} cached tokens, each then {args.host_ms} ms of host work and the heads at its "
        f"last node; median of {args.rounds} rounds\n"
    )
    print("| way | ms a step | the heads: the steps' difference | the heads call itself (median) |")
    print("| --- | --- | --- | --- |")
    for way in names:
        cells = ("-", "-") if way not in heads else (f"{heads[way]:.2f} ms", f"{alone[way]:.2f} ms")
        print(f"| {way} | {med[way]:.2f} | " + " | ".join(cells) + " |")
    if args.out:
        write_report(
            args.out, args.threads, (load_start[0], load_end[0]), argv,
            engine=str(args.engine), context=args.context, tokens=t, host_ms=args.host_ms, median_ms=med, heads_ms=heads,
            heads_call_ms=alone,
        )  # fmt: skip
    return 0


def host_work(ms: float) -> None:
    """The loop's host work between a step and its heads call, modelled as a busy wait of ``ms``."""
    until = time.perf_counter() + ms / 1e3
    while time.perf_counter() < until:
        pass


if __name__ == "__main__":
    sys.exit(main())
