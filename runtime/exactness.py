"""Does a verify step give each token its plain-step logits, bit for bit, on this engine? Measured.

Key slots (``key_slots.py``) lay a tree's keys out as plain decoding does, which makes a verify step
exact only where every other kernel treats a row on its own whatever the step's width: the weight
matmuls and their activation quantization included. Most do (fp32, int8-channel, int8-block and int4
at the default block size); some kernel paths do not (``MatMulNBits`` with 64- or 128-weight blocks sums a
one-row step in another order than a wider one), and such an engine's drafted output drifts from
its own plain output. ``probe`` runs the check on a real backend: a short context, ``tokens`` plain
one-token steps, then the same tokens again in one verify step as a chain and as a tree with a
sibling beside the path, each token's logits compared with its plain-step logits. The exporter
records the result in the engine folder's ``drafting.json`` and warns when it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONTEXT = 24  # committed tokens before the probed steps
TOKENS = 4  # plain steps, then verified in one step


@dataclass(frozen=True)
class Exactness:
    exact: bool  # every probed token's verify-step logits equal its plain-step logits, bit for bit
    max_diff: float  # the largest absolute logit difference seen (0.0 when exact)
    tokens: int  # tokens compared (over both layouts)

    def to_json(self) -> dict:
        return {"verify_equals_plain": self.exact, "max_logit_diff": self.max_diff, "tokens": self.tokens}


def probe(backend, *, context: int = CONTEXT, tokens: int = TOKENS, seed: int = 0) -> Exactness:
    """Compare verify-step and plain-step logits on ``backend`` (the step contract, batch 1).

    The context is random token ids (any ids do: the claim is about arithmetic, not text); the probed
    tokens are the engine's own greedy choices after it. Leaves the cache's committed contents
    undefined: run it on a backend no sequence is using."""
    vocab = backend.meta.vocab_size
    limit = backend.max_tokens or context + tokens + 1
    tokens = max(1, min(tokens, limit - 1))  # the tree step holds the path and one sibling
    context = max(1, min(context, limit, backend.max_context - tokens - 2))
    ids = np.random.default_rng(seed).integers(0, vocab, context, dtype=np.int64)  # (C,)

    def prefill() -> int:
        out = backend.step(ids[None], np.arange(context)[None], np.tri(context, dtype=bool)[None], np.array([0]))
        backend.commit(np.arange(context)[None], np.array([context]), np.array([0]))
        return int(out.argmax[0, -1])

    path, plain = [prefill()], []  # path[j] is scored at position context + j
    for j in range(tokens):
        out = backend.step(np.array([[path[-1]]]), np.array([[context + j]]), np.ones((1, 1, 1), bool), np.array([context + j]))
        plain.append(out.logits()[0, 0].copy())  # (V,)
        path.append(int(out.argmax[0, 0]))
        backend.commit(np.array([[0]]), np.array([1]), np.array([context + j]))
    path = path[:tokens]
    sibling = (path[1] + 1) % vocab if tokens > 1 else (path[0] + 1) % vocab
    # (tokens, parents, where each path token sits): a chain, and a tree with a sibling of the first draft
    layouts = [(path, [-1, *range(tokens - 1)], list(range(tokens)))]
    if tokens > 1:
        layouts.append(([path[0], sibling, *path[1:]], [-1, 0, 0, *range(2, tokens)], [0, *range(2, tokens + 1)]))
    diffs = []
    for toks, parents, where in layouts:
        prefill()
        n = len(toks)
        mask, depth = np.eye(n, dtype=bool), np.zeros(n, dtype=np.int64)  # (W, W), (W,)
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] |= mask[p]
                depth[i] = depth[p] + 1
        logits = backend.step(np.array([toks]), (context + depth)[None], mask[None], np.array([context])).logits()[0]  # (W, V)
        diffs += [float(np.abs(logits[i] - plain[j]).max()) for j, i in enumerate(where)]
    worst = max(diffs)
    return Exactness(worst == 0.0, worst, len(diffs))
