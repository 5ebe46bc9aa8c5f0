"""The Medusa heads as a drafter: their top-k proposals laid out by the compiled tree, which is
now the heads' *template* (the step's tree is built from every drafter's candidates).

Greedy drafts are keyed by the heads' own confidence: a node's key is (depth, bucket of the
head's softmax probability of its token), so the builder's online estimates learn how often a
head-1 guess at p = 0.8 lands against one at p = 0.1 in this sequence, and spends the budget on
the confident branches (deeper where the heads agree, none where they guess) instead of on a
fixed rank. Without probabilities (lossless draws, or before the first heads call) the key is
(depth, rank) as before."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.acceptance import Draws, TreeWalk
from medusa_trt.runtime.contract import StepOutput
from medusa_trt.runtime.drafting.base import DETERMINISTIC, Fragment, Observed, Proposal
from medusa_trt.runtime.drafting.sequential import Expansion
from medusa_trt.runtime.sampling import draw_without_replacement, warp
from medusa_trt.runtime.tree import CompiledTree


class HeadsTemplate:
    """Per-tree tables, computed once and shared by every sequence the ``HeadsProposer`` serves.

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
        self.greedy_keys = tuple((RANK_KIND, int(d), int(i)) for d, i in zip(self.depth, index))
        self.lossless_keys = tuple((RANK_KIND, int(d), int(r)) for d, r in zip(self.depth, rank))
        self.draw = ((self.depth - 1) * tree.top_k + rank).astype(np.int64)  # (M,) which draw of which head
        self.no_draw = np.full(len(self.parent), DETERMINISTIC, dtype=np.int64)
        self.index = index  # (M,) which of its row's top-k

    @property
    def sequential(self) -> bool:
        """Sequential heads: proposals per expanded node, drafts always deterministic."""
        return self.expansion is not None


HEADS_IDLE = 4  # steps in a row whose trees kept none of the heads' nodes before the heads rest
HEADS_REST = 8  # steps a sequence then drafts without the heads (and calls them not)

# Bucket edges of a head's probability for its token (the confidence keys); bucket i covers
# [EDGES[i-1], EDGES[i]), with 0 below the first edge.
CONFIDENCE_EDGES = np.array([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])

RANK_KIND, CONFIDENCE_KIND = "heads", "heads-p"  # statistics keys: (kind, depth, rank) and (kind, depth, bucket)
# Starting estimates by confidence bucket, depths 1-2 pooled (deeper ones agree within their noise):
# a head's softmax probability is close to its acceptance rate (fitted as ``stats`` says).
HEADS_P_PRIOR = (0.08, 0.11, 0.14, 0.21, 0.30, 0.36, 0.45, 0.56, 0.62, 0.68, 0.87)


def confidence_prior(key: tuple) -> float:
    """(kind, depth, confidence bucket): the fitted table."""
    return HEADS_P_PRIOR[key[2]]


def rank_prior(key: tuple) -> float:
    """(kind, depth, rank), for lossless draws or heads without probabilities: the hand-set decay."""
    _, depth, rank = key
    return 0.4 * 0.75 ** (depth - 1) / (1 + rank) ** 1.2


def head_confidence(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each head's softmax probability of its top-k tokens: logits float (..., D, V), ids int64
    (..., D, K) -> float32 (..., D, K)."""
    top = np.take_along_axis(logits, ids, axis=-1).astype(np.float32)  # (..., D, K)
    peak = logits.max(axis=-1, keepdims=True)  # (..., D, 1)
    norm = np.log(np.exp(logits - peak, dtype=np.float32).sum(axis=-1, keepdims=True)) + peak  # (..., D, 1)
    return np.exp(top - norm)


@dataclass
class HeadsState:
    """One sequence's heads: what their last call proposed, and whether they rest."""

    sampled: bool  # lossless draws by rank instead of top-k (never for sequential heads)
    proposals: np.ndarray | None = None  # int64 [rows, K]: top-k ids, or (sampled) draws by rank
    confidence: np.ndarray | None = None  # float32 [rows, K]: the heads' probabilities of those tokens (top-k drafts)
    q: np.ndarray | None = None  # float64 [D, V]: the distributions the draws came from (sampled)
    idle: int = 0  # steps in a row whose trees kept none of the heads' nodes
    rest: int = 0  # steps left that draft without the heads (nor call them)


class HeadsProposer:
    """The Medusa heads as a ``Proposer``: after each commit one batched heads call (``backend.propose``)
    at every row's last committed node, then each row's top-k (keyed by confidence) or, for lossless
    sampling, its draws without replacement from each head's warped distribution (``walk.draws[d]``
    of them, placed by rank, with the sequence's generator); before each step their fragment laid
    out by the template. ``backend`` None: proposals come from ``set_proposals`` only (offline replay).

    A heads call costs a fixed share of a step whatever the tree keeps (``cost``, relative to a
    one-token step: what the engine folder measured), so when the budget kept none of the heads'
    nodes ``HEADS_IDLE`` steps in a row, a sequence drafts without them (and calls them not) for
    ``HEADS_REST`` steps, then tries again. The heads draft no deeper than the template."""

    name = "heads"
    priors = {RANK_KIND: rank_prior, CONFIDENCE_KIND: confidence_prior}

    def __init__(self, template: HeadsTemplate, backend=None, *, cost: float = 0.0):
        self.template, self.backend, self.cost = template, backend, cost
        self.max_depth = int(template.tree.depth_max)
        self._state: dict[int, HeadsState] = {}

    def start(self, key: int, history: list[int], *, sampled: bool) -> None:
        self._state[key] = HeadsState(sampled and not self.template.sequential)

    def finish(self, key: int) -> None:
        self._state.pop(key, None)

    def set_proposals(self, key: int, ids: np.ndarray, confidence: np.ndarray | None = None, q: np.ndarray | None = None) -> None:
        """A sequence's heads output: ids int64 [rows, K] (a copy is kept), ``confidence`` float32 [rows, K]
        for top-k drafts, ``q`` float64 [D, V] for sampled ones."""
        state = self._state[key]
        state.proposals, state.confidence, state.q = np.array(ids), confidence, q

    def propose(self, key: int, history: list[int], max_depth: int) -> Proposal | None:
        state = self._state[key]
        if state.rest:
            return None
        draws = Draws(state.q, state.proposals) if state.sampled and state.q is not None else None
        return Proposal(heads_fragment(self.template, state, history, max_depth), draws)

    def observe(self, rows: list[Observed], roots: np.ndarray, out: StepOutput) -> dict[int, float]:
        """One heads call for the rows that want it (B,): at each observed row's last node."""
        called = [r for r in rows if self._wants(r)]
        if not called:
            return {}
        tick = time.perf_counter()
        tree, rows_per_seq = self.template.tree, self.template.rows  # D heads, or P expanded nodes (sequential heads)
        nodes = np.zeros(len(roots), dtype=np.int64)  # (B,)
        for r in rows:
            nodes[r.row] = r.node
        proposals = self.backend.propose(out, nodes, tree.top_k, roots)
        head_logits = proposals.logits()  # (B, n | P, V) on the host
        computed = proposals.confidence  # (B, n | P, K) where the heads computed it, else None
        for r in called:
            ids = proposals.ids[r.row, :rows_per_seq]  # (rows, K)
            if not self._state[r.key].sampled:  # top-k drafts (greedy rows, sequential heads): keyed by the heads' confidence
                if computed is None:
                    confidence = head_confidence(head_logits[r.row, :rows_per_seq], ids)
                else:  # a copy: the buffer is the next call's
                    confidence = computed[r.row, :rows_per_seq].copy()
                self.set_proposals(r.key, ids, confidence)
            else:
                self.set_proposals(r.key, ids)
                self._state[r.key].q = self._draw(r, head_logits[r.row])
        spent = time.perf_counter() - tick
        return {r.key: spent for r in called}

    def _draw(self, r: Observed, logits: np.ndarray) -> np.ndarray:
        """Lossless sampling: the warped distributions q [D, V] and, in the row's proposals, the draws by rank."""
        tree, walk, proposals = self.template.tree, self.template.walk, self._state[r.key].proposals
        q = warp(logits[: tree.depth_max], r.params)  # (D, V)
        for d in range(tree.depth_max):
            proposals[d, : walk.draws[d]] = draw_without_replacement(r.rng, q[d], int(walk.draws[d]))
        return q

    def _wants(self, r: Observed) -> bool:
        """Whether the row's heads run now; after a decode step, counts idle steps and rests (see the class)."""
        state = self._state[r.key]
        if r.tree is None:  # the prompt is in: the first proposals
            return True
        if state.rest:
            state.rest -= 1
            return state.rest == 0
        state.idle = 0 if any(self.name in sources for sources in r.tree.sources) else state.idle + 1
        if state.idle >= HEADS_IDLE:
            state.idle, state.rest = 0, HEADS_REST
        return state.rest == 0


def heads_fragment(template: HeadsTemplate, state: HeadsState, history: list[int], max_depth: int) -> Fragment:
    """The heads' candidates below the root ``history[-1]`` from their last proposals, laid out by the template."""
    t = template
    if state.proposals is None or t.tree.depth_max == 0:
        return Fragment.empty(HeadsProposer.name)
    candidates = np.concatenate([[history[-1]], state.proposals.reshape(-1)])  # (1 + D*K,)
    gather = t.walk.rank_gather if state.sampled else t.gather
    tokens = candidates[gather[1:]]  # (M,); -1 where a head had no draw left
    keep = (t.depth <= max_depth) & (tokens >= 0)
    keys = t.lossless_keys if state.sampled else _greedy_keys(t, state.confidence)
    draw = t.draw if state.sampled else t.no_draw
    if not keep.all():  # drop nodes (and their subtrees) past the budget or without a draw
        return _subset(HeadsProposer.name, tokens, t.parent, keys, draw, _keep_subtrees(keep, t.parent))
    return Fragment(HeadsProposer.name, tokens, t.parent, keys, draw)


def _greedy_keys(t: HeadsTemplate, confidence: np.ndarray | None) -> tuple:
    if confidence is None:
        return t.greedy_keys
    bucket = np.searchsorted(CONFIDENCE_EDGES, confidence[t.row, t.index], side="right")  # (M,)
    return tuple((CONFIDENCE_KIND, int(d), int(q)) for d, q in zip(t.depth, bucket))


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
