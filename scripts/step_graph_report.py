"""The step graph before and after the lean passes (``exporter/lean.py``), in one run on one machine (not a test).

    .venv/bin/python scripts/step_graph_report.py --out docs/results/step-graph-report.json

Exports the model's step graph as traced (``ExportConfig(lean=False)``, the "before"), no heads,
batch 1, into ``--work`` (reused when there: pass a fresh folder to export again), rewrites a copy
with the lean passes as the exporter's default does (the "after"), then prints:

  * op counts by type, before and after;
  * whether the two graphs give the same outputs bit for bit (every step timed below is compared)
    and whether the lean engine's verify steps equal its plain steps (``runtime/exactness.py``);
  * a step-cost table: one step of T = 1, 2, 4, 8, 16, 32 chained tokens over ``--context``
    committed tokens, through the ONNX Runtime backend the loop uses, before and after in
    alternating order round by round (a disturbance spreads over both), median and best ms, and
    after / before as a ratio;
  * the fp32 one-token step against its floor: the step graph's weight bytes over the memory
    bandwidth ``--threads`` threads read here (numpy sums over a 1 GiB buffer, one part per thread;
    ``--bandwidth`` gives a figure measured another way).

The CPU's name, the thread count and the load average at the start and end are printed beside the
figures: on a shared machine, read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from medusa_trt.runtime.host_attention import cpu_name  # the scripts beside this one import it from here too
from medusa_trt.runtime.step_cost import time_steps  # engine_step_ab imports it from here too

SIZES = (1, 2, 4, 8, 16, 32)
ENGINES = ("before", "after")
BANDWIDTH_BYTES = 2**30  # the buffer the bandwidth probe reads (far past any CPU cache)


def export(model: str, work: Path, *, context: int) -> dict[str, Path]:
    """The before / after step graphs in ``work``: "before" exported as traced (``lean=False``, unless
    it is there already), "after" its copy rewritten by ``lean_step_file``, the very call
    ``export_onnx`` makes on the default path (one trace instead of two)."""
    import shutil

    from medusa_trt.exporter.external_data import data_path
    from medusa_trt.exporter.lean import lean_step_file
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.manifest import write_manifest

    paths = {name: work / f"{name}.onnx" for name in ENGINES}
    if paths["before"].is_file():
        logging.info("reusing %s (pass another --work to export again)", paths["before"])
    else:
        from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
        from medusa_trt.exporter.wrapper import load_medusa

        work.mkdir(parents=True, exist_ok=True)
        logging.info("exporting %s as traced (lean=False)", paths["before"])
        config = ExportConfig(out=paths["before"], max_batch=1, max_context=context + 64, max_tokens=64, verify=False, lean=False)
        export_onnx(load_medusa(model), config)
    if not paths["after"].is_file():
        before, after = EngineFiles.beside(paths["before"]), EngineFiles.beside(paths["after"])
        for taken in (data_path(after.step), after.tokenizer):  # never write over files this script did not make
            if taken.exists():
                raise SystemExit(f"step_graph_report: {taken} exists without {after.step}: pass another --work")
        logging.info("%s: %s", paths["after"], lean_step_file(before.step, out=after.step).describe())
        if before.tokenizer.is_dir():
            shutil.copytree(before.tokenizer, after.tokenizer)
        write_manifest(after)  # the backend checks the files' sizes against it
    return paths


def op_counts(path: Path) -> dict[str, int]:
    import onnx

    from medusa_trt.exporter.lean import op_counts

    return op_counts(onnx.load(str(path), load_external_data=False).graph)


def weight_bytes(path: Path) -> int:
    """Bytes of the step graph's initializers (its external data file, or inside the graph)."""
    data = path.with_name(path.name + ".data")
    return data.stat().st_size if data.is_file() else path.stat().st_size


def bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second ``threads`` threads read: each sums its own part of a 1 GiB buffer (numpy
    releases the GIL in the reduction); the best of ``repeats``."""
    buffer = np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32)
    parts = np.array_split(buffer, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def prefill(backend, ids: np.ndarray) -> None:
    """Commit ``ids`` (int64 [C]) in chunks of the engine's step size."""
    chunk = backend.max_tokens or len(ids)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        t = len(part)
        out = backend.step(part[None], (start + np.arange(t))[None], np.tri(t, dtype=bool)[None], np.array([start]))
        backend.commit(out, np.arange(t)[None], np.array([t]), np.array([start]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a model medusa-export takes (default: the demo model)")
    p.add_argument("--work", type=Path, default=Path("build/step-graph-report"), help="where the two engines go (reused)")
    p.add_argument("--context", type=int, default=300, help="committed tokens before each timed step")
    p.add_argument("--rounds", type=int, default=15, help="timed steps of each size per engine")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth", type=float, help="GB/s for the floor, measured elsewhere (default: measured here)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.exactness import probe

    load_start = os.getloadavg()
    paths = export(args.model, args.work, context=args.context)
    counts = {name: op_counts(path) for name, path in paths.items()}
    backends = {name: OnnxBackend(path, max_batch=1, threads=args.threads) for name, path in paths.items()}
    vocab = backends["before"].meta.vocab_size
    context_ids = (np.arange(args.context, dtype=np.int64) * 7919 + 11) % vocab  # (C,) any ids: the cost is the same
    for backend in backends.values():
        prefill(backend, context_ids)
    times, same = time_steps(backends, args.context, SIZES, args.rounds)
    exact = probe(backends["after"])  # last: it overwrites the committed context
    floor_bytes = weight_bytes(paths["after"])
    read = args.bandwidth * 1e9 if args.bandwidth else bandwidth(args.threads)
    load_end = os.getloadavg()

    cpu = cpu_name()
    load = f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end"
    print(f"\n{cpu}, {args.threads} threads, {os.cpu_count()} CPUs; {load}")
    if max(load_start[0], load_end[0]) > 0.5 * (os.cpu_count() or 1):
        print("the machine was loaded by other work: read the ratios (before and after alternate), not the milliseconds")
    print("\n| op | before | after |\n| --- | --- | --- |")
    ops = sorted(set(counts["before"]) | set(counts["after"]), key=lambda op: -counts["before"].get(op, 0))
    print(f"| all | {sum(counts['before'].values())} | {sum(counts['after'].values())} |")
    for op in ops:
        print(f"| {op} | {counts['before'].get(op, 0)} | {counts['after'].get(op, 0)} |")
    print(f"\nsame outputs before and after, bit for bit, at every size: {'yes' if all(same.values()) else 'NO: ' + str(same)}")
    print(f"lean engine: verify step = plain step bit for bit: {'yes' if exact.exact else f'NO (max diff {exact.max_diff:.3g})'}")
    print(f"\nstep over {args.context} cached tokens, ms (median / best of {args.rounds}), after / before\n")
    print("| tokens | before | after | after / before (median) | (best) |\n| --- | --- | --- | --- | --- |")
    table = {}
    for t in SIZES:
        med = {n: statistics.median(times[n][t]) * 1e3 for n in ENGINES}
        best = {n: min(times[n][t]) * 1e3 for n in ENGINES}
        table[t] = {"median_ms": med, "best_ms": best}
        row = f"| {t} | {med['before']:.1f} / {best['before']:.1f} | {med['after']:.1f} / {best['after']:.1f} |"
        print(f"{row} {med['after'] / med['before']:.3f} | {best['after'] / best['before']:.3f} |")
    floor_ms = floor_bytes / read * 1e3
    print(f"\nfloor: {floor_bytes / 1e6:.0f} MB of weights at {read / 1e9:.1f} GB/s ({args.threads} threads) = {floor_ms:.1f} ms")
    for n in ENGINES:
        med, best = table[1]["median_ms"][n] / floor_ms, table[1]["best_ms"][n] / floor_ms
        print(f"one-token step {n}: {med:.2f}x the floor (median), {best:.2f}x (best)")
    if args.out:
        write_report(
            args.out, args.threads, (load_start[0], load_end[0]), argv,
            context=args.context, op_counts=counts, same_outputs=same, verify_equals_plain=exact.to_json(), steps=table,
            floor={"weight_bytes": floor_bytes, "bytes_per_second": read, "ms": floor_ms},
        )  # fmt: skip
    return 0


def write_report(out: Path, threads: int, load, argv, **figures) -> None:
    """A study's figures as JSON at ``out``, durably (whole or not at all): the CPU, threads, load average,
    ``figures`` in their order, then the command that made them (the scripts beside this one write theirs here)."""
    from medusa_trt.runtime.durable import write_text

    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    payload = {"cpu": cpu_name(), "threads": threads, "load_average": list(load), **figures, "command": command}
    write_text(out, json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
