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


def prefill(backend, ids: np.ndarray) -> int:
    """Score ``ids`` (int64 [C]) as a chain from an empty cache, commit them; the engine's next token."""
    n = len(ids)
    out = backend.step(ids[None], np.arange(n)[None], np.tri(n, dtype=bool)[None], np.array([0]))
    backend.commit(out, np.arange(n)[None], np.array([n]), np.array([0]))
    return int(out.argmax[0, -1])


def plain_steps(backend, ids: np.ndarray, count: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill ``ids``, then ``count`` plain one-token steps: the tokens scored (the first is the
    prefill's choice) and each one's logits (V,), a copy."""
    n = len(ids)
    path, logits = [prefill(backend, ids)], []  # path[j] is scored at position n + j
    for j in range(count):
        out = backend.step(np.array([[path[-1]]]), np.array([[n + j]]), np.ones((1, 1, 1), bool), np.array([n + j]))
        logits.append(out.logits()[0, 0].copy())  # (V,)
        path.append(int(out.argmax[0, 0]))
        backend.commit(out, np.array([[0]]), np.array([1]), np.array([n + j]))
    return path[:count], logits


def tree_step(backend, tokens: list[int], parents: list[int], cache: int) -> np.ndarray:
    """One verify step of ``tokens`` at cache length ``cache``: ``parents[i]`` is node i's parent,
    -1 for the root, -2 for a filler at depth 1 that sees only itself. Returns its logits (W, V)."""
    n = len(tokens)
    mask, depth = np.eye(n, dtype=bool), np.zeros(n, dtype=np.int64)  # (W, W), (W,)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
        elif p == -2:
            depth[i] = 1
    return backend.step(np.array([tokens]), (cache + depth)[None], mask[None], np.array([cache])).logits()[0]


def layouts(path: list[int], vocab: int) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """The verify steps that re-score ``path`` (the plain steps' tokens), as {name: (tokens, parents,
    where each path token sits)}: a chain, and (two tokens or more) a tree with a sibling of the
    first draft beside the path."""
    n = len(path)
    found = {"chain": (path, [-1, *range(n - 1)], list(range(n)))}
    if n > 1:
        sibling = (path[1] + 1) % vocab
        found["tree"] = ([path[0], sibling, *path[1:]], [-1, 0, 0, *range(2, n)], [0, *range(2, n + 1)])
    return found


def verify_diffs(backend, ids: np.ndarray, layout: tuple, plain: list[np.ndarray]) -> list[float]:
    """Prefill ``ids`` again, run one verify step of ``layout`` (tokens, parents, where) after it and
    return each path token's max absolute logit difference from its plain-step logits ``plain``."""
    tokens, parents, where = layout
    prefill(backend, ids)
    logits = tree_step(backend, tokens, parents, len(ids))  # (W, V)
    return [float(np.abs(logits[i] - plain[j]).max()) for j, i in enumerate(where)]


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
    path, plain = plain_steps(backend, ids, tokens)
    diffs = [d for layout in layouts(path, vocab).values() for d in verify_diffs(backend, ids, layout, plain)]
    worst = max(diffs)
    return Exactness(worst == 0.0, worst, len(diffs))
