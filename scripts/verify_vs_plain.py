"""Is a token's verify-step output its plain-step output, bit for bit? (issue 25, the exactness diagnosis)

For each engine: prefill a prompt, decode ``--tokens`` plain steps (one token a step), then score the
same tokens again in one verify step laid out three ways, and compare each token's logits with its
plain-step logits:

  chain         the tokens as a chain (every ancestor at the key index of its position)
  tree          a branching tree: a sibling drafted beside the first token sits between the root and
                the path, so the path's keys are one index later than in plain decoding
  tree+aligned  the same tree with masked filler nodes before the path, so each path node's key index
                is its position modulo ``--align`` again

    .venv/bin/python scripts/verify_vs_plain.py --engine build/q-fp32 --engine build/q-int8-channel

On an engine with key slots (the default since 2026-12-03) the backend lays every layout out as
plain decoding would, so all three are bit-exact (docs/exactness.md); ``--no-key-slots`` engines
show the diagnosis below. What it showed on ONNX Runtime 1.32 CPU (SmolLM2-135M and stories260K, fp32 and int8-channel): chains
are bit-exact, trees are not (2e-5 in fp32 logits), and the aligned tree is bit-exact again with
``--align 8``: the attention's softmax sums its row in 8-lane blocks, so a key's contribution rounds
by its index modulo 8, and a sibling between a node's ancestors moves them to other lanes. An int8
engine amplifies those last-bit differences into other roundings of its activations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without an install

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def compare(engine: str, prompt: str, count: int, align: int, threads: int) -> dict[str, tuple[int, int, float]]:
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.exactness import layouts, plain_steps, verify_diffs
    from medusa_trt.runtime.text import FileTextCodec

    backend = OnnxBackend(engine, max_batch=1, max_context=256, threads=threads)
    ids = np.array(FileTextCodec(backend.files.tokenizer).encode(prompt, chat=False), dtype=np.int64)
    path, plain = plain_steps(backend, ids, count)  # plain decoding: one token a step
    steps = layouts(path, backend.meta.vocab_size)  # chain; tree: root, a sibling of path[1], then the rest of the path
    sibling = steps["tree"][0][1]
    filler = (align - 1) % align  # puts path[1] at index 1 + align: its position modulo align again
    steps["tree+aligned"] = (
        [path[0], sibling, *[sibling] * filler, *path[1:]],
        [-1, 0, *[-2] * filler, 0, *range(2 + filler, count + filler)],
        [0, *range(2 + filler, count + 1 + filler)],
    )
    found = {}
    for name, layout in steps.items():
        diffs = verify_diffs(backend, ids, layout, plain)
        found[name] = (sum(d == 0.0 for d in diffs), len(diffs), max(diffs))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", action="append", required=True, help="an ONNX engine (folder or .onnx); repeatable")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tokens", type=int, default=4, help="plain steps decoded, then verified in one step")
    p.add_argument("--align", type=int, default=8, help="key-index period the aligned tree restores")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    print("| engine | layout | bit-equal tokens | max abs logit diff |")
    print("| --- | --- | --- | --- |")
    for engine in args.engine:
        for name, (equal, total, diff) in compare(engine, args.prompt, args.tokens, args.align, args.threads).items():
            print(f"| {engine} | {name} | {equal}/{total} | {diff:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
