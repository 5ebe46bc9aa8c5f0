"""What a quantization costs in quality: perplexity and next-token agreement with the first engine on held-out text.

Each engine scores the same texts teacher-forced (prefill steps of the engine's max_tokens, batch 1):
the perplexity of every next token, and the share of positions whose argmax equals the first
engine's (usually fp32) argmax. The texts are Spec-Bench dev prompts with their reference answers
where they have one: never used to train or tune the heads.

    .venv/bin/python -m medusa_trt.bench.quality --prompts spec_bench_dev.jsonl --engine build/smollm2-135m-medusa \\
        --engine build/smollm2-int8-channel --engine build/smollm2-int8-block --engine build/smollm2-int4 \\
        --out docs/results/quality-quant.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def texts(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        reference = [r for r in (row.get("reference") or []) if isinstance(r, str)][:1]  # some rows hold lists: skipped
        out.append("\n\n".join([row["turns"][0], *reference]))
    return out


def score(engine: str, docs: list[str], max_len: int, threads: int) -> tuple[float, list[np.ndarray]]:
    """(perplexity, per text the argmax after each token) of ``engine`` over ``docs``."""
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.text import FileTextCodec

    backend = OnnxBackend(engine, max_batch=1, threads=threads)
    codec = FileTextCodec(backend.files.tokenizer)
    nll, count, picks = 0.0, 0, []
    for doc in docs:
        ids = codec.encode(doc, chat=False)[:max_len]
        chosen = []
        for start in range(0, len(ids), backend.max_tokens):
            chunk = ids[start : start + backend.max_tokens]
            n = len(chunk)
            out = backend.step(np.array([chunk]), start + np.arange(n)[None], np.tri(n, dtype=bool)[None], np.array([start]))
            logits = out.logits()[0].astype(np.float64)  # (n, V)
            backend.commit(out, np.arange(n)[None], np.array([n]), np.array([start]))
            chosen.append(logits.argmax(axis=-1))
            targets = ids[start + 1 : start + n + 1]  # the next token after each position (none after the last)
            shifted = logits - logits.max(axis=-1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
        picks.append(np.concatenate(chosen)[: len(ids) - 1])
    return float(np.exp(nll / count)), picks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_trt.bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--engine", action="append", required=True, help="an ONNX engine; the first is the reference; repeatable")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL: turns[0], and reference[0] where it is a string")
    p.add_argument("--max-len", type=int, default=512, help="tokens of each text scored")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the figures here (JSON)")
    args = p.parse_args(argv)
    docs = texts(Path(args.prompts))
    rows, reference = [], None
    print("| engine | perplexity | vs first | next-token argmax = first's |")
    print("| --- | --- | --- | --- |")
    for engine in args.engine:
        ppl, picks = score(engine, docs, args.max_len, args.threads)
        reference = reference or (ppl, picks)
        agree = float(np.mean(np.concatenate([a == b for a, b in zip(picks, reference[1])])))
        rows.append({"engine": engine, "perplexity": ppl, "vs_first": ppl / reference[0], "argmax_agreement": agree})
        print(f"| {engine} | {ppl:.3f} | {ppl / reference[0]:.3f}x | {agree:.1%} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"texts": len(docs), "max_len": args.max_len, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
