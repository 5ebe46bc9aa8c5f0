"""Load benchmark of the Triton serving path (not a test): Medusa against plain decoding.

    .venv/bin/python scripts/serve_bench.py --engine build/smollm2-135m-medusa --subset 16 --max-tokens 64

Starts two tritonservers (``medusa-serve``'s Python API) over the same engine: one with every
drafter the engine supports (``medusa-triton-repo``'s default), one with none (``--draft none``:
plain decoding, one token per step), and
alternates between them level by level (load from elsewhere hits both alike). For each of 1, 4
and 16 concurrent streaming gRPC clients it sends ``max(subset, clients)`` requests
(the first turns of the Spec-Bench dev prompts, spread over the categories, that fit the
context), greedy, ``--max-tokens`` each; each client sends its next request when the last one
ends. Reports total generated tokens/s over the level's wall time, per-request latency
(p50 / p95), time to first token (p50 / p95) and tokens per response (tokens per engine step
as the client sees them: Medusa's acceptance plus one). Writes JSON and prints a markdown table.

The engine has a fixed number of cache rows (``max_batch``, 4 for the Makefile's engine): more
clients than rows queue inside the server (continuous batching admits them as rows free up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO.parent / "shared" / "data" / "spec_bench_dev.jsonl"


def pick_prompts(path: Path, engine: Path, count: int, max_tokens: int, max_prompt_tokens: int | None = None) -> list[str]:
    """``count`` first turns, round-robin over the categories, whose chat-templated prompt
    leaves room for ``max_tokens`` new tokens in the engine's context (and has at most
    ``max_prompt_tokens`` tokens)."""
    from medusa_trt.runtime import MedusaRuntime

    runtime = MedusaRuntime(str(engine), max_batch=1)  # its tokenizer and context only
    by_category = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        text = row["turns"][0]
        length = len(runtime.codec.encode(text, chat=runtime.is_chat))
        if length + max_tokens + 1 <= runtime.max_context and length <= (max_prompt_tokens or length):
            by_category[row["category"]].append(text)
    picked, queues = [], [list(v) for v in by_category.values()]
    while len(picked) < count and any(queues):
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    return picked


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_level(address: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    from medusa_trt.cli.serve import stream_generate

    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), clients))]
    lock = threading.Lock()
    records, errors = [], []

    def client():
        while True:
            with lock:
                if not requests:
                    return
                prompt = requests.pop(0)
            start = time.perf_counter()
            first, tokens, responses = None, 0, 0
            try:
                for chunk in stream_generate(address, prompt, max_tokens=max_tokens):
                    if chunk.token_ids and first is None:
                        first = time.perf_counter() - start
                    tokens += len(chunk.token_ids)
                    responses += bool(chunk.token_ids)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the level goes on
                errors.append(repr(exc))
                continue
            with lock:
                records.append({"latency_s": time.perf_counter() - start, "ttft_s": first, "tokens": tokens, "responses": responses})

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in records)
    latency = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {
        "clients": clients, "requests": len(records), "errors": errors, "wall_s": wall, "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "tokens_per_response": tokens / max(1, sum(r["responses"] for r in records)),
    }


def bench(engine: Path, servers_drafters: dict[str, tuple[str, ...] | None], tree: str | None, prompts: list[str], levels: list[int],
          max_tokens: int, repeats: int, python_env, threads) -> dict:
    """Both servers run side by side (an idle one costs nothing) and the levels alternate
    between them, so load from elsewhere on a shared machine hits both alike."""
    from contextlib import ExitStack

    from medusa_trt.cli.serve import ServeConfig, TritonServer, stream_generate
    from medusa_trt.exporter.triton_repo import TritonRepoConfig, write_triton_repo

    results = {name: {"tree": tree or "engine", "drafters": "default" if d is None else ",".join(d) or "none", "levels": []}
               for name, d in servers_drafters.items()}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp, ExitStack() as stack:
        servers = {}
        for name, drafters in servers_drafters.items():
            repo = Path(tmp) / name
            write_triton_repo(TritonRepoConfig(engine=engine, repo=repo, tree=tree, drafters=drafters, threads=threads))
            started = time.perf_counter()
            servers[name] = stack.enter_context(TritonServer(ServeConfig(repo=repo, python_env=python_env, log_file=Path(tmp) / f"{name}.log")))
            results[name]["startup_s"] = time.perf_counter() - started
            list(stream_generate(servers[name].grpc_address, prompts[0], max_tokens=8))  # warm-up: first-run allocations
        for clients in levels:
            runs = defaultdict(list)
            for rep in range(repeats):
                order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
                for name in order:
                    row = run_level(servers[name].grpc_address, prompts, clients, max_tokens)
                    print(f"  {name:>6}: {clients:>2} clients  {row['tokens_per_s']:6.1f} tok/s  p50 {row['latency_p50_s']:.2f} s  "
                          f"ttft p50 {row['ttft_p50_s']:.2f} s  errors {len(row['errors'])}", flush=True)
                    runs[name].append(row)
            for name, rows in runs.items():  # the repeat with the median throughput
                results[name]["levels"].append(sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2] | {"repeats": rows})
    return results


def table(results: dict) -> str:
    lines = ["| decoding | clients | requests | tokens/s (total) | latency p50 / p95 (s) | TTFT p50 / p95 (s) | tokens per response |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    plain = {r["clients"]: r for r in results["plain"]["levels"]}
    for name in ("medusa", "plain"):
        for r in results[name]["levels"]:
            speed = f"{r['tokens_per_s']:.1f}"
            if name == "medusa" and r["clients"] in plain:
                speed += f" ({r['tokens_per_s'] / plain[r['clients']]['tokens_per_s']:.2f}x)"
            lines.append(f"| {name} | {r['clients']} | {r['requests']} | {speed} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['tokens_per_response']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default=str(REPO / "build" / "smollm2-135m-medusa"))
    p.add_argument("--prompts", default=str(PROMPTS), help="Spec-Bench style JSONL (turns[0] is sent)")
    p.add_argument("--subset", type=int, default=16, help="prompts per level (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, help="only prompts this short (long prefills slow every row's step)")
    p.add_argument("--clients", default="1,4,16", help="concurrency levels")
    p.add_argument("--tree", help="the heads' template (default: the engine's)")
    p.add_argument("--repeats", type=int, default=1, help="runs per level and server, alternating servers (the median is reported)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads in the server (default: its own)")
    p.add_argument("--python-env", help="the stub's environment (numpy<2), as medusa-serve --python-env")
    p.add_argument("--out", default=str(REPO / "docs" / "serve-bench.json"))
    args = p.parse_args(argv)
    engine = Path(args.engine).resolve()
    levels = [int(c) for c in args.clients.split(",")]
    prompts = pick_prompts(Path(args.prompts), engine, args.subset, args.max_tokens, args.max_prompt_tokens)
    print(f"{len(prompts)} prompts, {args.max_tokens} new tokens each, clients {levels}", flush=True)
    results = {
        "engine": str(engine), "prompts": len(prompts), "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens, "greedy": True, "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        **bench(engine, {"medusa": None, "plain": ()}, args.tree, prompts, levels, args.max_tokens, args.repeats, args.python_env, args.threads),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
