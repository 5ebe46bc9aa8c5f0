"""The Medusa heads as a drafter: their top-k proposals laid out by the compiled tree, which is
now the heads' *template* (the step's tree is built from every drafter's candidates).

Greedy drafts are keyed by the heads' own confidence: a node's key is (depth, bucket of the
head's softmax probability of its token), so the builder's online estimates learn how often a
head-1 guess at p = 0.8 lands against one at p = 0.1 in this sequence, and spends the budget on
the confident branches (deeper where the heads agree, none where they guess) instead of on a
fixed rank. Without probabilities (lossless draws, or before the first heads call) the key is
(depth, rank) as before."""

from __future__ import annotations

import numpy as np

from medusa_trt.runtime.acceptance import TreeWalk
from medusa_trt.runtime.drafting.base import DETERMINISTIC, Fragment
from medusa_trt.runtime.drafting.sequential import Expansion
from medusa_trt.runtime.tree import CompiledTree


class HeadsTemplate:
    """Per-tree tables, computed once and shared by every sequence's ``HeadsDrafter``.

    The heads call gives ``rows`` proposals rows of top-K per sequence: one per head (row d - 1
    holds head d's guesses for depth d), or for sequential heads one per expanded template node
    (``expansion``: the row below a node holds the guesses of the head that read its path). Node
    i's token is ``proposals[row[i], index[i]]``. Sequential heads' drafts are always their top-K,
    deterministic drafts also under lossless sampling (a point-mass draft distribution: exact for
    any candidates, and the path the heads read is then the one the base model can accept)."""

    def __init__(self, tree: CompiledTree, walk: TreeWalk, expansion: Expansion | None = None):
        self.tree, self.walk, self.expansion = tree, walk, expansion
        self.parent = (tree.parent[1:] - 1).astype(np.int64)  # (M,): fragment index, root children -1
        self.depth = tree.depth[1:]  # (M,)
        index = np.array([p[-1] for p in tree.paths], dtype=np.int64)  # (M,) top-k index of each node
        # (M,) the proposals row each node's token comes from
        self.row = (self.depth - 1).astype(np.int64) if expansion is None else expansion.node_rows(tree.paths)
        self.rows = tree.depth_max if expansion is None else expansion.rows
        self.gather = np.concatenate([[0], 1 + self.row * tree.top_k + index]).astype(np.int64)  # (T,) into [root, rows x K]
        rank = walk.rank[1:]
        self.greedy_keys = tuple(("heads", int(d), int(i)) for d, i in zip(self.depth, index))
        self.lossless_keys = tuple(("heads", int(d), int(r)) for d, r in zip(self.depth, rank))
        self.draw = ((self.depth - 1) * tree.top_k + rank).astype(np.int64)  # (M,) which draw of which head
        self.no_draw = np.full(len(self.parent), DETERMINISTIC, dtype=np.int64)
        self.index = index  # (M,) which of its row's top-k

    @property
    def sequential(self) -> bool:
        """Sequential heads: proposals per expanded node, drafts always deterministic."""
        return self.expansion is not None


# Bucket edges of a head's probability for its token (the confidence keys); bucket i covers
# [EDGES[i-1], EDGES[i]), with 0 below the first edge.
CONFIDENCE_EDGES = np.array([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])


def head_confidence(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each head's softmax probability of its top-k tokens: logits float (..., D, V), ids int64
    (..., D, K) -> float32 (..., D, K)."""
    top = np.take_along_axis(logits, ids, axis=-1).astype(np.float32)  # (..., D, K)
    peak = logits.max(axis=-1, keepdims=True)  # (..., D, 1)
    norm = np.log(np.exp(logits - peak, dtype=np.float32).sum(axis=-1, keepdims=True)) + peak  # (..., D, 1)
    return np.exp(top - norm)


class HeadsDrafter:
    name = "heads"

    def __init__(self, template: HeadsTemplate, *, sampled: bool):
        # sampled: lossless draws by rank instead of top-k (never for sequential heads: their drafts are deterministic)
        self.template, self.sampled = template, sampled and not template.sequential
        self.proposals: np.ndarray | None = None  # int64 [rows, K], set by the loop after each heads call
        self.confidence: np.ndarray | None = None  # float32 [rows, K]: the heads' probabilities of those tokens (greedy drafts)

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        t = self.template
        if self.proposals is None or t.tree.depth_max == 0:
            return Fragment.empty(self.name)
        candidates = np.concatenate([[history[-1]], self.proposals.reshape(-1)])  # (1 + D*K,)
        gather = t.walk.rank_gather if self.sampled else t.gather
        tokens = candidates[gather[1:]]  # (M,); -1 where a head had no draw left
        keep = (t.depth <= max_depth) & (tokens >= 0)
        keys = t.lossless_keys if self.sampled else self._greedy_keys()
        if not keep.all():  # drop nodes (and their subtrees) past the budget or without a draw
            keep = _keep_subtrees(keep, t.parent)
            return _subset(self.name, tokens, t.parent, keys, t.draw if self.sampled else t.no_draw, keep)
        return Fragment(self.name, tokens, t.parent, keys, t.draw if self.sampled else t.no_draw)

    def _greedy_keys(self) -> tuple:
        t = self.template
        if self.confidence is None:
            return t.greedy_keys
        bucket = np.searchsorted(CONFIDENCE_EDGES, self.confidence[t.row, t.index], side="right")  # (M,)
        return tuple(("heads-p", int(d), int(q)) for d, q in zip(t.depth, bucket))

    def observe(self, history, scored_tokens, scored_next) -> None:
        pass  # the loop refreshes ``proposals`` from the heads call


def _keep_subtrees(keep: np.ndarray, parent: np.ndarray) -> np.ndarray:
    keep = keep.copy()
    for i in range(len(keep)):  # parents come first
        if parent[i] >= 0 and not keep[parent[i]]:
            keep[i] = False
    return keep


def _subset(name, tokens, parent, keys, draw, keep) -> Fragment:
    new_index = np.cumsum(keep) - 1
    idx = np.flatnonzero(keep)
    new_parent = np.where(parent[idx] >= 0, new_index[np.maximum(parent[idx], 0)], -1)
    return Fragment(name, tokens[idx], new_parent.astype(np.int64), tuple(keys[i] for i in idx), draw[idx])
