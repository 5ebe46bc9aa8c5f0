"""Where a step's new keys sit on the attention's key axis, so a verify step is a plain step bit for bit.

A token's logits from a verify step equal its logits from a plain (one token) step only if its
attention adds up the same numbers in the same order. Measured on ONNX Runtime's CPU kernels
(``runtime/exactness.py``, docs/exactness.md) that takes three things of every visible key:

1. its index on the key axis is congruent to its position modulo the softmax's lane count: the
   softmax sums a row in vector lanes, so a key's contribution rounds by its index modulo the
   lanes (8 with AVX2 kernels, 16 with AVX-512 ones: ``probe_lanes`` measures it per machine);
2. a node's visible keys sit in increasing index in depth order: the attention's P V product
   accumulates keys in index order;
3. its index falls in the same ``BLOCK`` of the key axis as its position: the P V product sums
   ``BLOCK`` keys at a time and then adds the block sums.

In plain decoding the keys of positions 0..p sit at indices 0..p. A branching tree cannot put every
node at its position (siblings share one), so engines with a ``key_slots`` input let the host
choose: the graph scatters each new key to ``key_slots[b, i]`` of a key axis that is the bound
cache view (slots past a row's cache length are stale, so the scatter may use them), and masks
the rest. ``assign`` is that choice: a greedy pass over the nodes in order, each taking the
smallest free slot after its parent's that meets 1 and 3 (2 then holds by construction). A chain
or a prefill gets cache length + i, its plain layout. A node that cannot meet 3 takes the next
free slot (its subtree is then exact to float rounding only); a row that would pass ``limit``
falls back to cache length + i, the layout of engines without the input.

Masked filler costs attention work only (keys, not tokens through the MLPs): a key axis at most
lanes times the tree longer than the cache. The lane count and block are properties of ONNX
Runtime's CPU kernels and of the CPU: a backend measures the lanes once at load (``probe_lanes``),
and ``runtime/exactness.py`` and the tests check the whole claim.
"""

from __future__ import annotations

import logging

import numpy as np

from medusa_trt.runtime.contract import CACHE_LENGTHS, PAST_KEY, PAST_VALUE, TREE_MASK
from medusa_trt.runtime.contract import KEY_SLOTS_INPUT as INPUT  # int64 [B, T]: the step input of engines with EngineMeta.key_slots

log = logging.getLogger(__name__)

LANES = (8, 16, 32, 64)  # lane counts probe_lanes tries, smallest first
BLOCK = 256  # keys per block of the P V product's sum (MLAS sgemm's K stride at head_dim 64)
SLACK_LANES = 16  # the buffers' slack fits trees of up to 32 nodes at this lane count (more: the appended layout)


def slack(max_tokens: int) -> int:
    """Cache slots past max_context a backend allocates so that a tree's scattered keys fit."""
    return SLACK_LANES * min(max_tokens, 32)


def _is_chain(mask: np.ndarray) -> bool:
    """mask (T, T): node i sees exactly nodes 0..i (a chain, or a prefill chunk)."""
    t = mask.shape[0]
    return bool(np.array_equal(mask, np.tri(t, dtype=bool)))


def _exact(slots: np.ndarray, mask: np.ndarray, length: int, lanes: int, padding: np.ndarray) -> np.ndarray:
    """bool (T,): every key node i sees (itself and its ancestors, in increasing slots) sits where plain
    decoding puts it: its position's lane and block."""
    position = length + mask.sum(axis=1) - 1  # (T,)
    placed = (slots % lanes == position % lanes) & (slots // BLOCK == position // BLOCK)  # (T,)
    return ~(mask & ~placed[None, :]).any(axis=1) & ~padding


def _row(mask: np.ndarray, length: int, limit: int, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots (T,) of one row's nodes and whether each sits exactly (T,) bool: where plain decoding
    would put it, and so do all its ancestors (see the module docstring). mask (T, T) bool, length
    the row's cache length. Nodes other than node 0 that see only themselves (padding) take any
    free slot and are never exact."""
    t = mask.shape[0]
    contiguous = length + np.arange(t, dtype=np.int64)
    if _is_chain(mask):
        return contiguous, np.ones(t, dtype=bool)
    if np.triu(mask, 1).any() or not mask.diagonal().all():  # not parents first: the appended layout, no claim
        return contiguous, np.zeros(t, dtype=bool)
    depth = mask.sum(axis=1) - 1  # (T,) ancestors of each node
    padding = (depth == 0) & (np.arange(t) > 0)  # (T,)
    ancestors = np.where(np.tril(mask, -1), depth[None, :], -1)  # (T, T): an ancestor's depth, else -1
    parent = np.where(ancestors.max(axis=1) >= 0, ancestors.argmax(axis=1), -1).tolist()  # (T,) the deepest ancestor
    depth, pads = depth.tolist(), padding.tolist()
    slots = [0] * t
    used: set[int] = set()
    for i in range(t):
        p = parent[i]
        position = length + depth[i]
        if pads[i]:  # the first free slot
            s = length
            while s in used:
                s += 1
        else:
            start = slots[p] + 1 if p >= 0 else length
            s = start + (position - start) % lanes
            while s in used:
                s += lanes
            if s // BLOCK != position // BLOCK:  # past its position's block: the next free slot instead (not exact)
                s = start
                while s in used:
                    s += 1
        if s >= limit:  # out of slack: the appended layout
            return contiguous, _exact(contiguous, mask, length, lanes, padding)
        used.add(s)
        slots[i] = s
    out = np.array(slots, dtype=np.int64)
    return out, _exact(out, mask, length, lanes, padding)


def assign(tree_mask: np.ndarray, cache_lengths: np.ndarray, limit: int, lanes: int | None = LANES[0]) -> tuple[np.ndarray, np.ndarray]:
    """Key slots int64 (B, T) for a step and which nodes sit exactly, bool (B, T) (their logits are
    their plain-step logits, bit for bit, given ``lanes``): tree_mask bool (B, T, T), cache_lengths
    int64 (B,). Every slot is < ``limit`` (the cache slots the backend can bind) and >= the row's
    cache length. ``lanes`` None: the appended layout (cache length + i) for every row, no claim."""
    batch, t = tree_mask.shape[:2]
    lengths = np.asarray(cache_lengths, dtype=np.int64)
    if t == 1:
        return lengths.reshape(batch, 1).copy(), np.ones((batch, 1), dtype=bool)
    if lanes is None:
        return lengths[:, None] + np.arange(t, dtype=np.int64)[None, :], np.zeros((batch, t), dtype=bool)
    rows = [_row(tree_mask[b], int(lengths[b]), limit, lanes) for b in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def add_to_feeds(feeds: dict) -> dict:
    """Numpy step feeds for a key-slots graph run outside a backend (export checks): ``key_slots`` for
    their tree_mask / cache_lengths (no lane claim needed), and past_key / past_value padded with zero
    slots to hold them. Returns ``feeds``, updated."""
    slots, _ = assign(feeds[TREE_MASK], feeds[CACHE_LENGTHS], limit=2**31)
    extra = int(slots.max()) + 1 - feeds[PAST_KEY].shape[0]
    if extra > 0:
        for name in (PAST_KEY, PAST_VALUE):
            past = feeds[name]
            feeds[name] = np.concatenate([past, np.zeros((extra, *past.shape[1:]), dtype=past.dtype)])
    feeds[INPUT] = slots
    return feeds


PROBE_LENGTHS = (21, 45, 77)  # cache lengths probe_lanes checks: a short row can pass at a lane count too small for longer ones


def _attention_graphs(elem: int) -> dict[str, bytes]:
    """Two one-op attention graphs, q (1, 1, G*T, D), k / v (1, 1, S, D), bias (1, 1, G*T, S) -> y, laid
    out as the exported graph lays out grouped-query attention (the G query heads of a KV head stacked
    on the query axis): ONNX's Attention op (what opset-23 engines hold) and MatMul + Softmax + MatMul
    (what older opsets hold)."""
    from medusa_trt.runtime.onnx_proto import model, node, tensor

    q, kv, bias = ("b", "h", "gt", "d"), ("b", "h", "s", "d"), ("b", "one", "gt", "s")
    inputs = [tensor("q", elem, q), tensor("k", elem, kv), tensor("v", elem, kv), tensor("bias", elem, bias)]
    out = [tensor("y", elem, q)]
    fused = model("medusa_lanes_attention", [node("Attention", ("q", "k", "v", "bias"), ("y",))], inputs, out, opset=23, ir_version=10)
    plain = model(
        "medusa_lanes_softmax",
        [
            node("Transpose", ("k",), ("kt",), perm=(0, 1, 3, 2)),
            node("MatMul", ("q", "kt"), ("scores",)),
            node("Add", ("scores", "bias"), ("masked",)),
            node("Softmax", ("masked",), ("p",), axis=-1),
            node("MatMul", ("p", "v"), ("y",)),
        ],
        inputs,
        out,
    )
    return {"attention": fused, "softmax": plain}


def probe_lanes(
    head_dim: int, groups: int, dtype=np.float32, providers=("CPUExecutionProvider",), threads: int | None = None, *, seed: int = 0
) -> int | None:
    """The smallest lane count in ``LANES`` under which ONNX Runtime's attention on this machine gives
    a branching tree's path, laid out by ``assign``, the outputs of plain one-token steps, bit for
    bit, at each of ``PROBE_LENGTHS``; None when none does (key slots then claim nothing). Checked on
    both attention forms an engine may hold (the Attention op and Softmax between two MatMuls) at the
    engine's head size, query heads per KV head (``groups``) and dtype: float math that the engine's
    quantized matmuls could otherwise hide."""
    import onnxruntime as ort

    from medusa_trt.runtime.onnx_proto import ELEM_TYPES

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    sessions = []
    for graph in _attention_graphs(ELEM_TYPES[np.dtype(dtype)]).values():
        try:
            sessions.append(ort.InferenceSession(graph, sess_options=options, providers=list(providers)))
        except Exception as exc:  # noqa: BLE001 - an op this ONNX Runtime lacks: the other form decides
            log.debug("lane probe graph not runnable here: %s", exc)
    if not sessions:
        return None
    rng = np.random.default_rng(seed)
    mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)  # root, a sibling, the path below the root
    path = [0, 2, 3]
    floor = np.finfo(dtype).min

    def stacked(x: np.ndarray) -> np.ndarray:  # (G, T, ...) -> (1, 1, G*T, ...)
        return np.ascontiguousarray(x.reshape(1, 1, -1, *x.shape[2:]))

    passing = list(LANES)
    for length in PROBE_LENGTHS:
        keys = rng.standard_normal((1, 1, length + 4, head_dim)).astype(dtype)  # cache, then the 4 new tokens' keys
        values = rng.standard_normal((1, 1, length + 4, head_dim)).astype(dtype)
        queries = rng.standard_normal((groups, 4, head_dim)).astype(dtype)  # (G, T, D)
        for session in sessions:
            plain = []
            for d, node in enumerate(path):  # node at depth d as a plain step: keys of positions 0 .. length + d in place
                order = list(range(length)) + [length + p for p in path[: d + 1]]
                feeds = {
                    "q": stacked(queries[:, node : node + 1]),
                    "k": keys[:, :, order],
                    "v": values[:, :, order],
                    "bias": np.zeros((1, 1, groups, len(order)), dtype=dtype),
                }
                plain.append(session.run(None, feeds)[0][0, 0])  # (G, D)
            for lanes in list(passing):
                slots, _ = assign(mask[None], np.array([length]), 10**9, lanes)
                width = int(slots.max()) + 1
                k = np.zeros((1, 1, width, head_dim), dtype=dtype)
                v = np.zeros_like(k)
                k[:, :, :length], v[:, :, :length] = keys[:, :, :length], values[:, :, :length]
                k[:, :, slots[0]], v[:, :, slots[0]] = keys[:, :, length:], values[:, :, length:]
                visible = np.zeros((4, width), dtype=bool)
                visible[:, :length] = True
                visible[:, slots[0]] = mask
                bias = stacked(np.broadcast_to(np.where(visible, 0, floor).astype(dtype), (groups, 4, width)))
                got = session.run(None, {"q": stacked(queries), "k": k, "v": v, "bias": bias})[0].reshape(groups, 4, head_dim)
                if not all(np.array_equal(got[:, node], plain[d]) for d, node in enumerate(path)):
                    passing.remove(lanes)
    return passing[0] if passing else None
