"""How much of an end-to-end benchmark is the prompt: each engine's and each peer's prefill against its decoding, on
the same prompt ids, interleaved prompt by prompt, in one run (not a test).

    .venv/bin/python scripts/prefill_share.py --engine build/smollm2-135m-medusa --engine build/smollm2-int8-channel \\
        --peer openvino:build/openvino/smollm2-fp32 --prompts $DEV --every 3 --out docs/results/prefill-share.json

``medusa-bench`` times generation end to end, the prompt included, as a user waits for it. This splits that time:
per prompt, every row generates once with ``--max-new-tokens`` and once with one new token (the prompt and its
first token: "prefill"); the rest is decoding. Engines decode with their default drafting (``--plain``: plain
steps); peers (``medusa-bench --peer`` forms, each in a worker process of its own) as they are. Reported per row:
prefill ms per prompt token, prefill's share of the end-to-end time, end-to-end tokens/s and decoding tokens/s
(new tokens over the time after prefill). Prompt ids are the first engine's (its chat template), as
``medusa-bench`` makes them; prompts that leave no room for ``--max-new-tokens`` are skipped, as there.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from step_graph_report import cpu_name, write_report

log = logging.getLogger("prefill_share")


@dataclass
class Row:
    name: str
    prefill_s: float = 0.0  # prompt + first token, summed over prompts
    total_s: float = 0.0  # end to end with --max-new-tokens
    new_tokens: int = 0
    prompt_tokens: int = 0
    mode: str = ""

    def figures(self) -> dict:
        decode = self.total_s - self.prefill_s
        return {
            "mode": self.mode,
            "prefill_ms_per_prompt_token": round(1000 * self.prefill_s / max(self.prompt_tokens, 1), 3),
            "prefill_share": round(self.prefill_s / self.total_s, 4) if self.total_s else None,
            "end_to_end_tok_s": round(self.new_tokens / self.total_s, 2) if self.total_s else None,
            "decode_tok_s": round(max(self.new_tokens - 1, 0) / decode, 2) if decode > 0 else None,
            "prefill_s": round(self.prefill_s, 3),
            "total_s": round(self.total_s, 3),
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


@dataclass
class Report:
    prompts: int
    rows: list[Row] = field(default_factory=list)


def run(args) -> Report:
    from medusa_trt.bench.peer_process import PeerProcess
    from medusa_trt.bench.peers import parse_peer
    from medusa_trt.bench.prompts import read_prompts
    from medusa_trt.runtime.config import RuntimeConfig
    from medusa_trt.runtime.errors import MedusaError
    from medusa_trt.runtime.medusa import MedusaRuntime

    specs = [parse_peer(p) for p in args.peer or []]  # refused before any engine loads
    texts = read_prompts(args.prompts)[:: args.every]
    config = RuntimeConfig(threads=args.threads)
    engines = [(str(e), MedusaRuntime(e, config=config)) for e in args.engine]
    if args.plain:
        engines = [(name, rt.plain()) for name, rt in engines]
    first = engines[0][1]
    room = min(rt.max_context for _, rt in engines) - args.max_new_tokens
    ids = [x for x in (first.codec.encode(t, chat=first.is_chat) for t in texts) if len(x) <= room]
    if len(ids) < len(texts):
        log.warning("skipping %d of %d prompts longer than %d tokens", len(texts) - len(ids), len(texts), room)
    if not ids:
        raise MedusaError(f"no prompt leaves room for --max-new-tokens {args.max_new_tokens} in the engines' context: lower it")
    eos = frozenset(first.eos)
    peers = []
    try:
        for spec in specs:  # each in a worker process of its own, closed below whatever happens
            peers.append(PeerProcess(spec, threads=args.threads, context=first.max_context, vocab_size=first.backend.meta.vocab_size))
        rows = [Row(name, mode="plain" if args.plain else "default drafting") for name, _ in engines]
        rows += [Row(s.text, mode=getattr(p, "mode", "")) for s, p in zip(specs, peers)]
        for _, rt in engines:  # warm-up: first calls pay one-time costs
            rt.generate(ids[0], max_new_tokens=4)
        for p in peers:
            p.generate(ids[0], 4, eos)
        for i, prompt in enumerate(ids):
            log.info("prompt %d of %d (%d tokens)", i + 1, len(ids), len(prompt))
            for row, (_, rt) in zip(rows, engines):
                row.prefill_s += rt.generate(prompt, max_new_tokens=1).stats.seconds
                stats = rt.generate(prompt, max_new_tokens=args.max_new_tokens).stats
                row.total_s += stats.seconds
                row.new_tokens += stats.new_tokens
                row.prompt_tokens += len(prompt)
            for row, p in zip(rows[len(engines) :], peers):
                row.prefill_s += p.generate(prompt, 1, eos)[1]
                out, seconds = p.generate(prompt, args.max_new_tokens, eos)
                row.total_s += seconds
                row.new_tokens += len(out)
                row.prompt_tokens += len(prompt)
    finally:
        for p in peers:
            p.close()
    return Report(len(ids), rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, action="append", required=True, help="an engine folder or file (repeat)")
    p.add_argument("--peer", action="append", help="a medusa-bench peer, KIND:PATH (repeat)")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL")
    p.add_argument("--every", type=int, default=1, help="every n-th prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="engines decode plain steps (default: their default drafting)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    for engine in args.engine:
        if not engine.exists():
            p.error(f"--engine {engine} does not exist: pass an engine folder medusa-export wrote")
    if args.every < 1 or args.max_new_tokens < 2:
        p.error("--every must be at least 1 and --max-new-tokens at least 2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from medusa_trt.runtime.errors import MedusaError

    load = os.getloadavg()
    try:
        report = run(args)
    except MedusaError as exc:
        p.exit(2, f"prefill_share: error: {exc}\n")
    figures = {row.name: row.figures() for row in report.rows}
    log.info("\n%s, %d threads, %d prompts, %d new tokens", cpu_name(), args.threads, report.prompts, args.max_new_tokens)
    log.info("| row | prefill ms / prompt token | prefill share | end to end tok/s | decoding tok/s |")
    log.info("| --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        log.info(
            f"| {name} ({f['mode']}) | {f['prefill_ms_per_prompt_token']:.2f} | {100 * (f['prefill_share'] or 0):.1f} % | "
            f"{f['end_to_end_tok_s']} | {f['decode_tok_s']} |"
        )
    if args.out:
        end = os.getloadavg()
        write_report(args.out, args.threads, (load, end), argv, prompts=report.prompts, max_new_tokens=args.max_new_tokens, rows=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
