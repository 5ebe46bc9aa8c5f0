"""Load benchmark of the OpenAI-compatible server (not a test): Medusa against plain decoding.

    .venv/bin/python scripts/serve_bench.py --engine build/smollm2-135m-medusa --subset 16 --max-tokens 64

Starts two ``medusa-serve ENGINE`` processes (the OpenAI API) on free loopback ports over the same
engine: one with every drafter the engine supports, one with ``--draft none`` (plain decoding,
one token per step), and alternates between them level by level (load from elsewhere hits both
alike). For each of 1, 4 and 16 concurrent streaming clients it sends ``max(subset, clients)``
requests (the first turns of the Spec-Bench dev prompts, round-robin over the categories, that
fit the context), greedy, ``--max-tokens`` each, as chat completions for an engine with a chat
template (completions otherwise); each client sends its next request when its last one ends.
Clients are ``serving.client.stream_completion`` (server-sent events over http.client) with
``stream_options.include_usage``, so token counts are the server's own.

Reports per level: total generated tokens/s over the level's wall time, per-request latency and
time to first token (p50 / p95), and from each server's /metrics over the level the draft
acceptance (accepted / drafted tokens) and tokens per engine step (1 + accepted / drafts).
Writes JSON (``--out``) and a PNG beside it, and prints a markdown table.

The engine has a fixed number of cache rows (``max_batch``, 4 for the Makefile's engine): more
clients than rows queue inside the server (continuous batching admits them as rows free up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO.parent / "shared" / "data" / "spec_bench_dev.jsonl"


def pick_prompts(path: Path, engine: Path, count: int, max_tokens: int, max_prompt_tokens: int | None = None) -> tuple[list[str], bool]:
    """``count`` first turns, round-robin over the categories, whose prompt (chat-templated for a
    chat engine) leaves room for ``max_tokens`` new tokens in the engine's context (and has at
    most ``max_prompt_tokens`` tokens); and whether they go as chat."""
    from medusa_trt.runtime.engine import EngineFiles, engine_meta
    from medusa_trt.runtime.text import FileTextCodec

    codec, meta = FileTextCodec(EngineFiles.locate(engine).tokenizer), engine_meta(engine)
    chat = codec.has_chat_template
    by_category = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        text = row["turns"][0]
        length = len(codec.encode_chat([{"role": "user", "content": text}]) if chat else codec.encode(text, chat=False))
        if length + max_tokens <= meta.max_context and length <= (max_prompt_tokens or length):
            by_category[row["category"]].append(text)
    picked, queues = [], [list(v) for v in by_category.values()]
    while len(picked) < count and any(queues):
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    return picked, chat


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Server:
    """One ``medusa-serve ENGINE --port 0`` process; ``url`` once it serves."""

    def __init__(self, engine: Path, args: list[str], log: Path):
        cmd = [sys.executable, "-m", "medusa_trt.cli.serve", str(engine), "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True)  # noqa: SIM115
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)], daemon=True).start()
        while True:
            line = lines.get(timeout=600)
            if line is None:
                raise RuntimeError(f"medusa-serve {' '.join(args)} exited: {log.read_text()[-2000:]}")
            found = re.search(r"(http://\S+)/v1", line)
            if found:
                self.url = found.group(1)
                return

    def metrics(self) -> dict[str, float]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.url}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        out: dict[str, float] = defaultdict(float)
        for line in lines:
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key.partition("{")[0]] += float(value)  # summed over labels (drafters)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request(url: str, prompt: str, chat: bool, max_tokens: int) -> dict:
    from medusa_trt.serving.client import stream_completion

    fields = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    start = time.perf_counter()
    first, events, tokens = None, 0, 0
    for delta in stream_completion(url, max_tokens=max_tokens, temperature=0.0, **fields):
        if delta.usage is not None:
            tokens = delta.usage["completion_tokens"]
        elif delta.text:
            first = time.perf_counter() - start if first is None else first
            events += 1
    return {"latency_s": time.perf_counter() - start, "ttft_s": first, "tokens": tokens, "events": events}


def run_level(server: Server, prompts: list[str], chat: bool, clients: int, max_tokens: int) -> dict:
    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), clients))]
    lock = threading.Lock()
    records, errors = [], []

    def client():
        while True:
            with lock:
                if not requests:
                    return
                prompt = requests.pop(0)
            try:
                record = request(server.url, prompt, chat, max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the level goes on
                errors.append(repr(exc))
                continue
            with lock:
                records.append(record)

    before = server.metrics()
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server.metrics()
    moved = {
        k: after[k] - before.get(k, 0.0)
        for k in (
            "medusa:spec_decode_num_drafts_total",
            "medusa:spec_decode_num_draft_tokens_total",
            "medusa:spec_decode_num_accepted_tokens_total",
        )
    }
    drafts, drafted, accepted = moved.values()
    tokens = sum(r["tokens"] for r in records)
    latency = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {
        "clients": clients,
        "requests": len(records),
        "errors": errors,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p95_s": percentile(latency, 0.95),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafts": drafts,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
    }


def bench(
    engine: Path, prompts: list[str], chat: bool, levels: list[int], max_tokens: int, repeats: int, threads: int | None, logs: Path
) -> dict:
    """Both servers run side by side (an idle one costs nothing); the levels alternate between them."""
    extra = ["--threads", str(threads)] if threads else []
    configs = {"medusa": extra, "plain": [*extra, "--draft", "none"]}
    results = {name: {"args": args, "levels": []} for name, args in configs.items()}
    servers = {}
    try:
        for name, args in configs.items():
            started = time.perf_counter()
            servers[name] = Server(engine, args, logs / f"serve-{name}.log")
            results[name]["startup_s"] = time.perf_counter() - started
            request(servers[name].url, prompts[0], chat, 8)  # warm-up: first-run allocations
        for clients in levels:
            runs = defaultdict(list)
            for rep in range(repeats):
                for name in list(servers) if rep % 2 == 0 else list(servers)[::-1]:
                    row = run_level(servers[name], prompts, chat, clients, max_tokens)
                    print(
                        f"  {name:>6}: {clients:>2} clients  {row['tokens_per_s']:6.1f} tok/s  p50 {row['latency_p50_s']:.2f} s  "
                        f"ttft p50 {row['ttft_p50_s']:.2f} s  {row['tokens_per_step']:.2f} tokens/step  errors {len(row['errors'])}",
                        flush=True,
                    )
                    runs[name].append(row)
            for name, rows in runs.items():  # the repeat with the median throughput
                results[name]["levels"].append(sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2] | {"repeats": rows})
    finally:
        for server in servers.values():
            server.stop()
    return results


def table(results: dict) -> str:
    lines = [
        "| decoding | clients | requests | tokens/s (total) | latency p50 / p95 (s) | TTFT p50 / p95 (s) "
        "| draft acceptance | tokens / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    plain = {r["clients"]: r for r in results["plain"]["levels"]}
    for name in ("medusa", "plain"):
        for r in results[name]["levels"]:
            speed = f"{r['tokens_per_s']:.1f}"
            if name == "medusa" and r["clients"] in plain:
                speed += f" ({r['tokens_per_s'] / plain[r['clients']]['tokens_per_s']:.2f}x)"
            acceptance = f"{r['acceptance_rate']:.2f}" if r["draft_tokens"] else "-"
            lines.append(
                f"| {name} | {r['clients']} | {r['requests']} | {speed} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
                f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {acceptance} | {r['tokens_per_step']:.2f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style, color in (("medusa", "o-", "C0"), ("plain", "s--", "C1")):
        levels = results[name]["levels"]
        clients = [r["clients"] for r in levels]
        speed.plot(clients, [r["tokens_per_s"] for r in levels], style, color=color, label=name)
        latency.plot(clients, [r["latency_p50_s"] for r in levels], style, color=color, label=f"{name} p50")
        latency.plot(clients, [r["latency_p95_s"] for r in levels], style, color=color, alpha=0.4, label=f"{name} p95")
    for ax, title, unit in ((speed, "throughput", "generated tokens/s (all clients)"), (latency, "request latency", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["clients"] for r in results["medusa"]["levels"]], [str(r["clients"]) for r in results["medusa"]["levels"]])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"medusa-serve (OpenAI API), {Path(results['engine']).name}: {results['max_tokens']} new tokens per request, greedy")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default=str(REPO / "build" / "smollm2-135m-medusa"))
    p.add_argument("--prompts", default=str(PROMPTS), help="Spec-Bench style JSONL (turns[0] is sent)")
    p.add_argument("--subset", type=int, default=16, help="requests per level (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, help="only prompts this short (long prefills slow every row's step)")
    p.add_argument("--clients", default="1,4,16", help="concurrency levels")
    p.add_argument("--repeats", type=int, default=1, help="runs per level and server, alternating servers (the median is reported)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads in each server (default: its own)")
    default_out = REPO / "docs" / "results" / "serve-bench-openai.json"
    p.add_argument("--out", default=str(default_out), help="the JSON report; the PNG goes beside it")
    args = p.parse_args(argv)
    engine = Path(args.engine).resolve()
    levels = [int(c) for c in args.clients.split(",")]
    prompts, chat = pick_prompts(Path(args.prompts), engine, args.subset, args.max_tokens, args.max_prompt_tokens)
    print(f"{len(prompts)} prompts ({'chat' if chat else 'completions'}), {args.max_tokens} new tokens each, clients {levels}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="serve-bench-"))  # the servers' logs; a server that fails to start quotes its own
    results = {
        "engine": str(engine),
        "api": "openai",
        "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "greedy": True,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        **bench(engine, prompts, chat, levels, args.max_tokens, args.repeats, args.threads, logs),
    }
    shutil.rmtree(logs, ignore_errors=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out)
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
