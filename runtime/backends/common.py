"""Host-side helpers every backend shares."""

from __future__ import annotations

import numpy as np

from medusa_trt.runtime.engine import EngineError, EngineMeta


def commit_indices(nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat (row, source node, destination slot) triples of every entry to commit: row b copies
    the new K/V of nodes[b, j] into cache slot cache_lengths[b] + j for j < counts[b].

    nodes int64 [B, A], counts int64 [B], cache_lengths int64 [B] -> three int64 [N]."""
    batch, width = nodes.shape
    valid = np.arange(width)[None, :] < counts[:, None]  # (B, A)
    rows = np.broadcast_to(np.arange(batch)[:, None], (batch, width))[valid]
    dst = (cache_lengths[:, None] + np.arange(width)[None, :])[valid]
    return rows, nodes[valid], dst


def check_proposal(meta: EngineMeta, top_k: int, roots: np.ndarray | None) -> None:
    """Refuse a ``propose`` the engine's heads cannot answer: more than their top-k, or no next tokens for heads that
    read them."""
    if top_k > meta.top_k:
        raise EngineError(f"the tree needs top-{top_k} proposals but the engine's heads return top-{meta.top_k}: export with that tree")
    if meta.reads_roots and roots is None:
        raise EngineError("these heads read the next token: pass roots to propose")
