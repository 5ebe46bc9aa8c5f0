"""Acceptance rules: which drafted tree path a sequence keeps after verification.

Terms (per sequence): the *root* is the token the base model already chose; a *drafted* token
is a non-root tree node; a path's drafted token at depth d+1 is *accepted* when every drafted
token above it was accepted and the rule accepts it against the base model's output at its
parent (depth d). The *bonus* token is the base model's own choice after the last accepted node,
which becomes the next root. A step therefore emits accepted + 1 tokens.
"""

from __future__ import annotations

import numpy as np

from medusa_trt.runtime.tree import CompiledTree


def greedy_accept(
    tree: CompiledTree,
    tokens: np.ndarray,  # int64 [B, T]: tree tokens, root first
    target: np.ndarray,  # int64 [B, T]: base model's argmax after each node
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy rule: drafted token accepted iff it equals the base argmax at its parent.

    Returns (best leaf row into ``tree.retrieve`` [B], accepted drafted tokens on it [B]).
    Ties between paths go to the first leaf row, so the choice is deterministic.
    """
    retrieve = np.maximum(tree.retrieve, 0)  # (P, D+1); padding read as root, masked below
    depth = tree.retrieve.shape[1] - 1
    if depth == 0:  # chain-0: nothing drafted
        zeros = np.zeros(tokens.shape[0], dtype=np.int64)
        return zeros, zeros
    child = tokens[:, retrieve[:, 1:]]  # (B, P, D) drafted token at depth d+1
    parent_choice = target[:, retrieve[:, :-1]]  # (B, P, D) base argmax at depth d
    valid = np.arange(depth)[None, :] < (tree.path_lengths[:, None] - 1)  # (P, D)
    match = (child == parent_choice) & valid[None]  # (B, P, D)
    accepted = np.cumprod(match, axis=2).sum(axis=2)  # (B, P) accepted prefix length per path
    best = accepted.argmax(axis=1)  # (B,) first path with the longest prefix
    return best, accepted[np.arange(tokens.shape[0]), best]
