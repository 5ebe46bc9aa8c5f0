"""What the heads cost beside a verify step: at the accepted node only (what the loop does) against
every tree node (what a graph that evaluates the heads everywhere would pay)."""

from __future__ import annotations

import numpy as np

CONTEXT = 128  # committed tokens the steps are timed over
REPEATS = 10  # timed calls per measurement (median kept)


def heads_cost(runtime) -> dict | None:
    """Milliseconds of a verify step of the runtime's tree, of one of 3 nodes, of the heads at one
    node and on all nodes; None where the backend cannot run its heads on given hidden states."""
    backend = runtime.backend
    run_heads = getattr(backend, "run_heads", None)  # the heads graph outside the loop's buffers (ONNX Runtime engines)
    if run_heads is None or not backend.meta.num_heads:
        return None
    from medusa_trt.runtime.step_cost import median_ms

    def timed(fn):
        return median_ms(fn, REPEATS)

    meta, tree, t = backend.meta, runtime.tree, runtime.tree.num_nodes
    hidden = np.zeros((t, meta.hidden_size), dtype=backend.dtype)  # (T, H): one hidden state per tree node
    roots = np.zeros(t, dtype=np.int64) if meta.reads_roots else None  # (T,): next-token-aware heads also read each row's root
    lengths = np.array([CONTEXT])
    last = []  # the latest step's output, which the heads call reads

    def verify():
        last[:] = [backend.step(np.zeros((1, t), dtype=np.int64), tree.depth[None] + CONTEXT, tree.mask[None], lengths)]

    step = timed(verify)
    root = np.zeros(1, dtype=np.int64)  # what the loop does after that step: the heads at one node, given the next token
    one = timed(lambda: backend.propose(last[0], root, max(tree.top_k, 1), root))
    every = timed(lambda: run_heads(hidden, roots))
    three = np.tril(np.ones((1, 3, 3), dtype=bool))
    step3 = timed(lambda: backend.step(np.zeros((1, 3), dtype=np.int64), np.arange(3)[None] + CONTEXT, three, lengths))
    return {
        "tree_nodes": t,
        "verify_step_ms_ctx128": step,
        "verify_3_nodes_ms_ctx128": step3,
        "heads_one_node_ms": one,
        "heads_all_nodes_ms": every,
    }
