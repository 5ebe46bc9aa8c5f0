"""What a wide native step cannot go below on this CPU: its linears' arithmetic, at the rate the matmul kernel reaches
when its weights are already in cache (not a test; one run, one machine).

A one-token step reads every weight once and does one multiply-add with each: memory bounds it. A step of T tokens
reads the same bytes and does T times the arithmetic, so past some T the kernel's arithmetic, not the memory, sets
its time. This script measures where, in one run:

  * the engine's native steps of each ``--tokens`` size over ``--context`` committed tokens (median of the steps of
    ``--seconds`` a size, as ``native_build_ab.py`` times them);
  * the kernel's rate at each row count on a piece of layer 0's gate/up matmul (the engine's own weights, cut to
    ``--cached-mb`` so both threads' halves stay in their L2), called back to back: multiply-adds a second;
  * the floor of a T-token step: every linear's K x N x T multiply-adds (the lm_head's too) at that rate. Nothing
    else of the step (attention, norms, threads' start and end) is in it.

    .venv/bin/python scripts/sums_floor.py --engine build/smollm2-int8-default --out docs/results/sums-floor-int8.json

The CPU's name and the instruction set the library runs are printed beside the figures.
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
from native_build_ab import worker
from step_graph_report import cpu_name, write_report

log = logging.getLogger("sums_floor")


def kernel_rate(m, rows: int, seconds: float, threads: int) -> tuple[float, float]:
    """(median ms a call, multiply-adds a second) of ``m`` on ``rows`` rows, called back to back."""
    from medusa_trt.runtime.native_step import LinearRun

    k, n = m.shape
    run = LinearRun(m, rows, threads)
    try:
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)  # (rows, K)
        y = np.zeros((rows, n), dtype=np.float32)
        for _ in range(3):
            run(x, y)
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 20:
            begin = time.perf_counter()
            run(x, y)
            times.append(time.perf_counter() - begin)
    finally:
        run.close()
    ms = statistics.median(times) * 1e3
    return ms, rows * k * n / (ms * 1e-3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine native runs (a folder medusa-export wrote)")
    p.add_argument("--tokens", type=int, action="append", help="tokens a step (repeat; default 1, 2, 4, 8, 16)")
    p.add_argument("--context", type=int, default=300, help="committed tokens before each timed step")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of calls for each figure")
    p.add_argument("--cached-mb", type=float, default=1.8, help="weight megabytes of the in-cache matmul (both threads)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if not args.engine.exists():
        p.error(f"--engine {args.engine} does not exist: pass an engine medusa-export wrote")
    sizes = sorted(set(args.tokens or (1, 2, 4, 8, 16)))
    if sizes[0] < 1:
        p.error("--tokens must be 1 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.runtime.backends.onnx_backend import checked_files
    from medusa_trt.runtime.native_weights import read_weights

    load_start = os.getloadavg()
    files, meta = checked_files(args.engine, checksums=False)
    weights = read_weights(files.step, meta.architecture)
    linears = [m for group in (weights.qkv, weights.o, weights.gate_up, weights.down) for m in group if m is not None]
    linears.append(weights.lm_head)
    per_row = sum(m.shape[0] * m.shape[1] for m in linears)  # multiply-adds a token
    probe = weights.gate_up[0] or weights.qkv[0]
    k, n = probe.shape
    per_output = k * probe.weight.itemsize * (0.5 if probe.bits == 4 else 1.0)  # weight bytes an output column
    width = max(64, min(n, int(args.cached_mb * 2**20 / per_output) // 64 * 64))  # outputs kept in the cache
    probe = probe.outputs(slice(0, width))  # the linear cut to its first outputs (scales and zero points with it)
    log.info("timing the engine's steps (%s)", ", ".join(map(str, sizes)))
    steps = worker(args.engine, args.context, sizes, args.seconds, args.threads)
    rows = []
    for t in sizes:
        ms, rate = kernel_rate(probe, t, args.seconds, args.threads)
        floor = per_row * t / rate * 1e3
        rows.append({"tokens": t, "step_ms": steps["ms"][t], "kernel_ms": ms, "gmac_s": rate / 1e9, "floor_ms": floor})
    load_end = os.getloadavg()
    one = rows[0]["step_ms"] if sizes[0] == 1 else None
    load = f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end"
    print(f"\n{cpu_name()}, {args.threads} threads, {steps['isa']}; {load}")
    print(f"{args.engine}: {per_row / 1e6:.1f} M multiply-adds a token in {len(linears)} linears; in-cache matmul "
          f"{probe.shape[0]} x {probe.shape[1]} of layer 0; steps over {args.context} cached tokens\n")  # fmt: skip
    print("| tokens | step ms | in-cache matmul ms | GMAC/s | linears' floor ms | floor / step | step / one-token step "
          "| floor / one-token step |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        against = f"{r['step_ms'] / one:.2f}x | {r['floor_ms'] / one:.2f}x" if one else "- | -"
        print(f"| {r['tokens']} | {r['step_ms']:.2f} | {r['kernel_ms']:.3f} | {r['gmac_s']:.1f} | {r['floor_ms']:.2f} | "
              f"{r['floor_ms'] / r['step_ms']:.2f} | {against} |")  # fmt: skip
    if args.out:
        write_report(args.out, args.threads, (load_start[0], load_end[0]), argv, engine=str(args.engine),
                     isa=steps["isa"], context=args.context, macs_per_token=per_row, probe=list(probe.shape), rows=rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
