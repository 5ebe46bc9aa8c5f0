"""The Medusa heads as a drafter: their top-k proposals laid out by the compiled tree, which is
now the heads' *template* (the step's tree is built from every drafter's candidates)."""

from __future__ import annotations

import numpy as np

from medusa_trt.runtime.acceptance import TreeWalk
from medusa_trt.runtime.drafting.base import DETERMINISTIC, Fragment
from medusa_trt.runtime.tree import CompiledTree


class HeadsTemplate:
    """Per-tree tables, computed once and shared by every sequence's ``HeadsDrafter``."""

    def __init__(self, tree: CompiledTree, walk: TreeWalk):
        self.tree, self.walk = tree, walk
        self.parent = (tree.parent[1:] - 1).astype(np.int64)  # (M,): fragment index, root children -1
        self.depth = tree.depth[1:]  # (M,)
        index = np.array([p[-1] for p in tree.paths], dtype=np.int64)  # (M,) top-k index of each node
        rank = walk.rank[1:]
        self.greedy_keys = tuple(("heads", int(d), int(i)) for d, i in zip(self.depth, index))
        self.lossless_keys = tuple(("heads", int(d), int(r)) for d, r in zip(self.depth, rank))
        self.draw = ((self.depth - 1) * tree.top_k + rank).astype(np.int64)  # (M,) which draw of which head
        self.no_draw = np.full(len(self.parent), DETERMINISTIC, dtype=np.int64)


class HeadsDrafter:
    name = "heads"

    def __init__(self, template: HeadsTemplate, *, sampled: bool):
        self.template, self.sampled = template, sampled  # sampled: lossless draws by rank instead of top-k
        self.proposals: np.ndarray | None = None  # int64 [D, K], set by the loop after each heads call

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        t = self.template
        if self.proposals is None or t.tree.depth_max == 0:
            return Fragment.empty(self.name)
        candidates = np.concatenate([[history[-1]], self.proposals.reshape(-1)])  # (1 + D*K,)
        gather = t.walk.rank_gather if self.sampled else t.tree.gather_index
        tokens = candidates[gather[1:]]  # (M,); -1 where a head had no draw left
        keep = (t.depth <= max_depth) & (tokens >= 0)
        if not keep.all():  # drop nodes (and their subtrees) past the budget or without a draw
            keep = _keep_subtrees(keep, t.parent)
            return _subset(self.name, tokens, t.parent, t.lossless_keys if self.sampled else t.greedy_keys,
                           t.draw if self.sampled else t.no_draw, keep)
        return Fragment(self.name, tokens, t.parent, t.lossless_keys if self.sampled else t.greedy_keys,
                        t.draw if self.sampled else t.no_draw)

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
