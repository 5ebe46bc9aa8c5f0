"""ONNX Runtime against the OpenVINO backend (f32, and bf16 where the CPU has it) on one engine, in one run.

    python scripts/openvino_backend_bench.py --engine build/smollm2-135m-medusa \\
        --prompts ../shared/data/spec_bench_dev.jsonl --limit 4 --threads 2 --out build/openvino-backend.json

1. Step cost: steps of 1, 8 and 32 tokens (a chain) over ``--past`` cached tokens, each backend in turn
   inside every repetition (interleaved, so load on the machine falls on all alike); the median of the
   first step at a width after another width (drafting) and of the next one at the same width (plain).
2. End to end: plain and drafted greedy decoding of the first ``--limit`` prompts on each backend,
   interleaved per prompt; tokens/s, and agreement: prompts whose output equals ONNX Runtime's plain
   output, and the backend's own plain output (drafting is exact there when all do).
Each backend's exactness verdict (the load-time probe: verify steps = plain steps bit for bit) is shown.
Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from medusa_trt.bench.prompts import read_prompts
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.backends.openvino_backend import cpu_has_bf16
from medusa_trt.runtime.durable import write_text
from medusa_trt.runtime.errors import MedusaError

WIDTHS = (1, 8, 32)


def backends(engine: str, threads: int, bf16: bool) -> dict[str, MedusaRuntime]:
    """name -> runtime (drafting: the engine's default) for ONNX Runtime, OpenVINO f32 and bf16."""
    runtimes = {"onnxruntime": MedusaRuntime(engine, max_batch=1, threads=threads)}
    runtimes["openvino-f32"] = MedusaRuntime(engine, backend="openvino", max_batch=1, threads=threads)
    if bf16:
        runtimes["openvino-bf16"] = MedusaRuntime(engine, backend="openvino", precision="bf16", max_batch=1, threads=threads)
    return runtimes


def step_costs(runtimes: dict[str, MedusaRuntime], past: int, reps: int, seed: int = 0) -> dict[str, dict[str, dict[int, float]]]:
    """Median ms of one step of each width over ``past`` cached slots (their contents do not matter for time):
    ``"switch"`` the first step at a width after another width (drafting changes it every step), ``"steady"``
    the next one at the same width (plain decoding)."""
    rng = np.random.default_rng(seed)
    vocab = next(iter(runtimes.values())).backend.meta.vocab_size
    times = {name: {kind: {t: [] for t in WIDTHS} for kind in ("switch", "steady")} for name in runtimes}
    for rep in range(reps + 1):  # the first round warms up
        for t in WIDTHS:
            ids = rng.integers(0, vocab, (1, t), dtype=np.int64)  # (1, T)
            positions = (past + np.arange(t, dtype=np.int64))[None]  # (1, T)
            mask = np.tri(t, dtype=bool)[None]  # (1, T, T)
            for name, rt in runtimes.items():
                for kind in ("switch", "steady"):
                    start = time.perf_counter()
                    rt.backend.step(ids, positions, mask, np.array([past]))
                    if rep:
                        times[name][kind][t].append(time.perf_counter() - start)
    return {name: {k: {t: 1e3 * statistics.median(v) for t, v in by.items()} for k, by in kinds.items()} for name, kinds in times.items()}


def end_to_end(runtimes: dict[str, MedusaRuntime], prompts: list[list[int]], max_new_tokens: int) -> dict[str, dict]:
    """Per row (backend x plain / drafted): tokens/s over all prompts and each prompt's tokens."""
    rows = {f"{name}:{kind}": rt.plain() if kind == "plain" else rt for name, rt in runtimes.items() for kind in ("plain", "drafted")}
    for rt in rows.values():  # first calls pay one-time costs
        rt.generate(prompts[0], max_new_tokens=8)
    found = {row: {"tokens": [], "seconds": 0.0, "steps": 0} for row in rows}
    for prompt in prompts:
        for row, rt in rows.items():
            start = time.perf_counter()
            result = rt.generate(prompt, max_new_tokens=max_new_tokens)
            found[row]["seconds"] += time.perf_counter() - start
            found[row]["tokens"].append(result.token_ids)
            found[row]["steps"] += len(result.stats.accepted_per_step)
    reference = found["onnxruntime:plain"]["tokens"]
    for row, f in found.items():
        own = found[row.split(":")[0] + ":plain"]["tokens"]
        count = sum(len(t) for t in f["tokens"])
        f["tok_s"] = count / f["seconds"]
        f["tokens_per_step"] = count / max(1, f["steps"])
        f["same_as_onnxruntime_plain"] = sum(a == b for a, b in zip(f["tokens"], reference))
        f["same_as_own_plain"] = sum(a == b for a, b in zip(f["tokens"], own))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="an ONNX engine (folder or .onnx)")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL")
    p.add_argument("--limit", type=int, default=4, help="prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--past", type=int, default=300, help="cached tokens under the timed steps")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions of each step")
    p.add_argument("--no-bf16", action="store_true", help="skip OpenVINO bf16 (also skipped where the CPU lacks AMX / AVX512-BF16)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        runtimes = backends(args.engine, args.threads, cpu_has_bf16() and not args.no_bf16)
        first = next(iter(runtimes.values()))
        ids = [first.codec.encode(text, chat=first.is_chat) for text in read_prompts(args.prompts, args.limit)]
    except MedusaError as exc:
        print(f"openvino_backend_bench: error: {exc}", file=sys.stderr)
        return 2
    # OpenVINO: its load-time probe; onnxruntime: its lane probe found a lane count (the export-time probe is in drafting.json)
    exact = {name: getattr(rt.backend, "exact", rt.backend.key_lanes is not None) for name, rt in runtimes.items()}
    lanes = {name: rt.backend.key_lanes for name, rt in runtimes.items()}
    costs = step_costs(runtimes, args.past, args.reps)
    print(f"step cost, ms (median of {args.reps}, 1 sequence, {args.past} cached, {args.threads} threads); ratio to onnxruntime")
    for kind in ("steady", "switch"):
        print(f" {kind}: {'the same width again' if kind == 'steady' else 'the first step after another width'}")
        for name, kinds in costs.items():
            by, ort = kinds[kind], costs["onnxruntime"][kind]
            cells = "  ".join(f"T={t}: {ms:7.1f} ({ms / ort[t]:.2f})" for t, ms in by.items())
            print(f"  {name:15s} {cells}   exact: {exact[name]} (lanes {lanes[name]})")
    rows = end_to_end(runtimes, ids, args.max_new_tokens)
    base = rows["onnxruntime:plain"]["tok_s"]
    print(f"end to end: {len(ids)} prompts, {args.max_new_tokens} new tokens, greedy")
    for row, f in rows.items():
        print(
            f"  {row:22s} {f['tok_s']:6.1f} tok/s ({f['tok_s'] / base:.2f}x)  {f['tokens_per_step']:.2f} tok/step  "
            f"= onnxruntime plain {f['same_as_onnxruntime_plain']}/{len(ids)}  = own plain {f['same_as_own_plain']}/{len(ids)}"
        )
    if args.out:
        report = {
            "engine": args.engine,
            "threads": args.threads,
            "past": args.past,
            "step_ms": costs,
            "exact": exact,
            "key_lanes": lanes,
            "end_to_end": {row: {k: v for k, v in f.items() if k != "tokens"} for row, f in rows.items()},
            "prompts": len(ids),
            "max_new_tokens": args.max_new_tokens,
        }
        write_text(Path(args.out), json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
