"""Two or more builds of the native step side by side on one engine, in one run: for a change to the C code (a kernel,
a prefetch, a tiling), not for a benchmark of generation (that is ``medusa-bench``). One process cannot map two builds
of the same library, so each build steps in processes of its own (``MEDUSA_TRT_NATIVE_DIR``), the builds taking turns
round by round, their order flipping every round. Each turn prefills the same context and times chain steps of each
size; the report gives the median of the turns' medians and whether every build's logits and hidden states are the
same bit for bit, and their next ids and top-k (a change that only moves memory must keep every bit).

    git stash && python scripts/build_native.py --out build/native-before && git stash pop   # an uncommitted change
    python scripts/build_native.py --out build/native-after
    .venv/bin/python scripts/native_build_ab.py --engine build/smollm2-int8-default --build before=build/native-before \\
        --build after=build/native-after --tokens 1 --tokens 8 --rounds 6 --out docs/results/native-prefetch-ab.json

``--isa`` caps the instruction set as ``MEDUSA_TRT_CPU_ISA`` does (every build at the same level).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from step_graph_report import cpu_name, prefill, write_report

log = logging.getLogger("native_build_ab")


def worker(engine: Path, context: int, sizes: list[int], seconds: float, threads: int) -> dict:
    """One turn in this process (its build is ``MEDUSA_TRT_NATIVE_DIR``'s): {"isa", "ms": {T: median}, "digest": {T: sha256
    of the first step's logits, hidden, next ids and top-k}}."""
    from medusa_trt.runtime.backends.native_backend import open_native

    backend = open_native(engine, max_batch=1, threads=threads)
    vocab = backend.meta.vocab_size
    prefill(backend, (np.arange(context, dtype=np.int64) * 7919 + 11) % vocab)
    ms, digest = {}, {}
    for t in sizes:
        ids = ((np.arange(t, dtype=np.int64) * 131 + 7) % vocab)[None]  # (1, T)
        call = (ids, (context + np.arange(t))[None], np.tri(t, dtype=bool)[None], np.array([context]))
        out = backend.step(*call)
        hidden = out.hidden_rows(np.zeros(t, dtype=np.int64), np.arange(t))  # (T, H)
        ranked = out.argmax.tobytes() + (out.topk.tobytes() if out.topk is not None else b"")
        digest[t] = hashlib.sha256(out.logits().tobytes() + hidden.tobytes() + ranked).hexdigest()[:16]
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 3:
            begin = time.perf_counter()
            backend.step(*call)
            times.append(time.perf_counter() - begin)
        ms[t] = statistics.median(times) * 1e3
    return {"isa": backend.kernel.isa, "ms": ms, "digest": digest}


def turn(build: Path, args, sizes: list[int], isa: str | None = None) -> dict:
    env = dict(os.environ, MEDUSA_TRT_NATIVE_DIR=str(build.resolve()))
    if isa or args.isa:
        env["MEDUSA_TRT_CPU_ISA"] = isa or args.isa
    command = [sys.executable, __file__, "--worker", "--engine", str(args.engine), "--context", str(args.context),
               "--seconds", str(args.seconds), "--threads", str(args.threads), *[f"--tokens={t}" for t in sizes]]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"native_build_ab: error: the turn of {build} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine native runs (a folder or a step graph)")
    p.add_argument("--build", action="append", default=[],
                   help="NAME=FOLDER of a build (scripts/build_native.py; repeat, 2 or more); NAME=FOLDER@ISA caps that one "
                   "build's instruction set (one build at two sets, side by side)")  # fmt: skip
    p.add_argument("--context", type=int, default=300, help="committed tokens before each timed step")
    p.add_argument("--tokens", type=int, action="append", help="tokens a timed step scores (repeat; default 1 and 8)")
    p.add_argument("--rounds", type=int, default=6, help="turns of each build")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of steps of each size a turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", help="cap every build's instruction set (avx512_vnni, avx512, avx2_vnni, avx2, baseline, neon)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = sorted(set(args.tokens or (1, 8)))
    if args.worker:
        print(json.dumps(worker(args.engine, args.context, sizes, args.seconds, args.threads)))
        return 0
    builds = dict(item.partition("=")[::2] for item in args.build)
    if len(builds) < 2 or not all(builds.values()):
        p.error("pass two or more --build NAME=FOLDER with distinct names")
    caps = {name: value.partition("@")[2] or None for name, value in builds.items()}
    builds = {name: value.partition("@")[0] for name, value in builds.items()}
    for name, folder in builds.items():
        if not Path(folder).is_dir():
            p.error(f"--build {name}={folder} is not a folder: build one with scripts/build_native.py --out {folder}")
    if not args.engine.exists():
        p.error(f"--engine {args.engine} does not exist: pass an engine medusa-export wrote")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = list(builds)
    load_start = os.getloadavg()
    turns: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            turns[name].append(turn(Path(builds[name]), args, sizes, caps[name]))
        log.info("round %d of %d done", round_ + 1, args.rounds)
    load_end = os.getloadavg()
    isas = {n: sorted({t["isa"] for t in turns[n]}) for n in names}
    med = {n: {t: statistics.median(x["ms"][str(t)] for x in turns[n]) for t in sizes} for n in names}
    digests = {t: {x["digest"][str(t)] for n in names for x in turns[n]} for t in sizes}
    same = {t: len(digests[t]) == 1 for t in sizes}
    print(f"\n{cpu_name()}, {args.threads} threads, {isas}; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    print(f"{args.engine}: steps over {args.context} cached tokens, ms (median of {args.rounds} turns' medians)")
    print(f"same logits, hidden, next ids and top-k bit for bit in every turn: {'yes' if all(same.values()) else 'NO: ' + str(same)}\n")
    print("| tokens | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("| --- " * (2 * len(names)) + "|")
    for t in sizes:
        cells = [f"{med[n][t]:.2f}" for n in names] + [f"{med[n][t] / med[names[0]][t]:.3f}" for n in names[1:]]
        print(f"| {t} | " + " | ".join(cells) + " |")
    ratios = {n: {t: med[n][t] / med[n][sizes[0]] for t in sizes[1:]} for n in names}
    print("\nagainst each build's own " + f"{sizes[0]}-token step: " + "; ".join(
        f"{n} " + ", ".join(f"{t} tokens {r:.2f}x" for t, r in ratios[n].items()) for n in names))  # fmt: skip
    if args.out:
        write_report(args.out, args.threads, (load_start[0], load_end[0]), argv, engine=str(args.engine), isa=isas,
                     context=args.context, median_ms=med, own_ratio=ratios, same_outputs=same, builds=builds)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
