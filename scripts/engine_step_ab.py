"""Two or more exported engines' steps side by side, in one run: the same chain steps after the same committed
context, the engines taking turns (a few steps each, their order flipping every round), and whether their outputs are
the same bit for bit at every size. For a graph change (a rewrite, a quantizer form) on engines that should
compute the same numbers, not for a benchmark of generation (that is ``medusa-bench``).

    .venv/bin/python scripts/engine_step_ab.py --engine before=OLD_ENGINE --engine after=build/smollm2-int8-channel \\
        --context 300 --tokens 1 --tokens 8 --tokens 16 --tokens 64 --rounds 20 --out docs/results/row-quantizer-ab.json

``--busy N`` times the steps beside N processes that each keep a core busy (a loaded machine, a CPU quota below the
thread count), started after the engines load and stopped before the report.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from step_graph_report import bandwidth, cpu_name, op_counts, prefill, time_steps, weight_bytes, write_report

log = logging.getLogger("engine_step_ab")
BURST = 4  # steps an engine takes in a row, the first untimed: the others' thread pools have stopped spinning by then


BACKENDS = ("onnxruntime", "native")  # what @BACKEND names (native:ISA caps native's instruction set, e.g. native:avx2)


def parse_engine(text: str) -> tuple[str, tuple[Path, str]]:
    name, sep, path = text.partition("=")
    path, _, backend = path.partition("@")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--engine {text!r} is not NAME=PATH[@BACKEND]: pass e.g. before=build/old-engine")
    if (backend or BACKENDS[0]).partition(":")[0] not in BACKENDS:
        raise argparse.ArgumentTypeError(f"--engine {text!r}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return name, (Path(path), backend or BACKENDS[0])


def open_backend(path: Path, backend: str, threads: int):
    if backend.partition(":")[0] == "native":
        from medusa_trt.runtime.backends.native_backend import open_native

        return open_native(path, max_batch=1, threads=threads, isa=backend.partition(":")[2] or None)
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    return OnnxBackend(path, max_batch=1, threads=threads)


@contextmanager
def busy(processes: int):
    """``processes`` Python processes spinning on a core each, for the duration; stopped by pid."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--engine", type=parse_engine, action="append", required=True, help="NAME=PATH[@BACKEND] of an engine (repeat; 2 or more)"
    )
    p.add_argument("--context", type=int, default=300, help="committed tokens before each timed step")
    p.add_argument("--tokens", type=int, action="append", help="tokens a timed step scores (repeat; default 1, 8, 16, 64)")
    p.add_argument("--rounds", type=int, default=20, help=f"rounds; an engine takes {BURST - 1} timed steps of each size a round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--busy", type=int, default=0, help="time beside this many processes that each keep a core busy")
    p.add_argument(
        "--floor", action="store_true", help="also measure the bandwidth here and print each one-token step against its own floor"
    )
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    engines = dict(args.engine)
    if len(engines) < 2:
        p.error("pass two or more --engine NAME=PATH with distinct names")
    for name, (path, _) in engines.items():
        if not path.exists():
            p.error(f"--engine {name}={path} does not exist: pass an engine medusa-export wrote")
    sizes = tuple(args.tokens or (1, 8, 16, 64))
    if args.context < 1 or args.rounds < 1 or min(sizes) < 1:
        p.error("--context, --rounds and --tokens must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.runtime.errors import MedusaError

    load_start = os.getloadavg()
    try:
        backends = {name: open_backend(path, backend, args.threads) for name, (path, backend) in engines.items()}
        first = next(iter(backends.values()))
        if max(sizes) > (first.max_tokens or max(sizes)) or args.context + max(sizes) > first.max_context:
            raise MedusaError(f"--tokens up to {first.max_tokens} and --context + --tokens up to {first.max_context}: lower them")
        context_ids = (np.arange(args.context, dtype=np.int64) * 7919 + 11) % first.meta.vocab_size  # (C,) any ids
        for backend in backends.values():
            prefill(backend, context_ids)
        with busy(args.busy):
            times, same = time_steps(backends, args.context, sizes, args.rounds, burst=BURST)
    except MedusaError as exc:
        p.exit(2, f"engine_step_ab: error: {exc}\n")
    load_end = os.getloadavg()
    floor = None
    if args.floor:  # each engine's weights read once at the bandwidth measured now, after the timed steps
        read = bandwidth(args.threads)
        # native: the bytes of its packed weights (what a step reads); else the graph's weights file
        own = {n: getattr(getattr(b, "kernel", None), "weight_bytes", None) or weight_bytes(b.files.step) for n, b in backends.items()}
        first = next(iter(own))
        floor = {"weight_bytes": own[first], "bytes_per_s": read, "ms": own[first] / read * 1e3,
                 "engines": {n: {"weight_bytes": own[n], "ms": own[n] / read * 1e3} for n in own}}  # fmt: skip
    names = list(backends)
    nodes = {name: sum(op_counts(b.files.step).values()) for name, b in backends.items()}  # the step graph's nodes
    beside = f"; beside {args.busy} busy process{'es' if args.busy > 1 else ''}" if args.busy else ""
    print(f"\n{cpu_name()}, {args.threads} threads{beside}; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    print(f"steps over {args.context} cached tokens, ms (median / best of {args.rounds * (BURST - 1)}); nodes {nodes}")
    print(f"same outputs bit for bit at every size: {'yes' if all(same.values()) else 'NO: ' + str(same)}\n")
    print("| tokens | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("| --- " * (2 * len(names)) + "|")
    table = {}
    for t in sizes:
        med = {n: statistics.median(times[n][t]) * 1e3 for n in names}
        best = {n: min(times[n][t]) * 1e3 for n in names}
        table[t] = {"median_ms": med, "best_ms": best}
        cells = [f"{med[n]:.2f} / {best[n]:.2f}" for n in names] + [f"{med[n] / med[names[0]]:.3f}" for n in names[1:]]
        print(f"| {t} | " + " | ".join(cells) + " |")
    if floor:
        one = table.get(1)
        mine = floor["engines"]
        print(f"\nfloors at {floor['bytes_per_s'] / 1e9:.1f} GB/s: " + ", ".join(
            f"{n} {mine[n]['weight_bytes'] / 1e6:.0f} MB = {mine[n]['ms']:.2f} ms" for n in names))  # fmt: skip
        if one:
            print("one-token step / floor (median): " + ", ".join(f"{n} {one['median_ms'][n] / mine[n]['ms']:.2f}x" for n in names))
    if args.out:
        write_report(
            args.out, args.threads, (load_start[0], load_end[0]), argv,
            context=args.context, engines={n: f"{p}@{b}" for n, (p, b) in engines.items()}, nodes=nodes, same_outputs=same, busy=args.busy,
            steps=table, floor=floor,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
