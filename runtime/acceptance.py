"""Acceptance rules: which drafted tree path a sequence keeps after verification.

Terms (per sequence): the *root* is the token the base model already chose; a *drafted* token
is a non-root tree node; a path's drafted token at depth d+1 is *accepted* when every drafted
token above it was accepted and the rule accepts it against the base model's output at its
parent (depth d). The *bonus* token is the base model's own choice after the last accepted node,
which becomes the next root. A step therefore emits accepted + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from medusa_trt.runtime.sampling import sample
from medusa_trt.runtime.tree import CompiledTree

# ---------------------------------------------------------------------------- sampling rules
#
# Terms as above. For sampling, the base model's distribution at node i is p_i = warp(logits_i)
# (temperature, top-k, top-p: ``sampling.warp``); head d's draft distribution q_d is the same warp
# of head d's logits, made at the last committed node.


@dataclass(frozen=True, eq=False)
class TreeWalk:
    """Tables of the heads' template, derived once per tree from its ``CompiledTree``."""

    rank: np.ndarray  # int64 [T]: position among its siblings (root 0)
    rank_gather: np.ndarray  # int64 [T]: into [root, head1 draws, ..., headD draws] (1 + D*K): the node's head's rank-th draw
    draws: np.ndarray  # int64 [D]: draws needed from head d (most children of any node at depth d-1)


def tree_walk(tree: CompiledTree) -> TreeWalk:
    count = tree.num_nodes
    children: list[list[int]] = [[] for _ in range(count)]
    rank = np.zeros(count, dtype=np.int64)
    for node in range(1, count):
        siblings = children[tree.parent[node]]
        rank[node] = len(siblings)
        siblings.append(node)
    draws = np.zeros(tree.depth_max, dtype=np.int64)
    for node in range(count):
        if children[node]:
            draws[tree.depth[node]] = max(draws[tree.depth[node]], len(children[node]))
    rank_gather = np.where(np.arange(count) == 0, 0, 1 + (tree.depth - 1) * tree.top_k + rank)
    return TreeWalk(rank, rank_gather, draws)


def accepts(u: float, p_x: float, q_x: float) -> bool:
    """Accept a draft x drawn from q with probability min(1, p(x)/q(x)), given u ~ U[0, 1)."""
    return u * q_x < p_x


# ---------------------------------------------------------------------------- rules on per-step trees
#
# The loop builds a new tree per row and step (``drafting.builder.StepTree``) from several
# drafters. A node is either one of head d's draws (lossless sampling: ``draw = (d-1) * K + j``,
# the j-th draw without replacement from q_d) or a deterministic draft (retrieved, recycled, or a
# head's top-k in greedy / typical decoding), whose draft distribution is the point mass on its token.


@dataclass(frozen=True)
class Verdict:
    path: list  # accepted nodes from the root (root included)
    bonus: int  # the base model's token after the last of them


@dataclass(frozen=True, eq=False)
class Draws:
    """The draft distributions of a tree's sampled nodes (lossless sampling): node ``draw = d * K + j``
    is ``ids[d, j]``, the j-th draw without replacement from ``q[d]``."""

    q: np.ndarray  # float64 [D, V]: head d's warped distribution (V: the draft vocabulary)
    ids: np.ndarray  # int64 [D, K]: its draws by rank (-1 past the draws made)


Probs = Callable[[int], np.ndarray]  # node -> the base model's warped distribution there, float64 [V]


def greedy(tree, argmax: np.ndarray) -> Verdict:
    """Drafted token accepted iff it equals the base argmax [T] at its parent; the bonus is the argmax
    at the last accepted node. Children are disjoint by token, so at most one child matches."""
    node, path = 0, [0]
    while True:
        want = int(argmax[node])
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        node = nxt
        path.append(node)


class AcceptanceRule(Protocol):
    """What the loop needs of a rule: which output it reads, how its drafts are made, whether its
    tree may depend on the other rows, and ``accept`` (one of the pure functions here)."""

    needs_logits: bool  # it reads the base model's distributions (``probs``), not only the argmax
    sampled_drafts: bool  # the heads draw without replacement from their warped distributions (``draws``)
    learnt_budget: bool  # its tree may follow the step cost learnt from every row (its output does not depend on the tree)

    def accept(self, tree, argmax: np.ndarray, probs: Probs | None, draws: Draws | None, rng) -> Verdict:
        """The accepted path (root first) and the bonus token of one row's verified tree."""
        ...


class GreedyRule:
    """``greedy`` as a rule: what the loop needs to know of it."""

    needs_logits = False  # the step's argmax is enough
    sampled_drafts = False  # heads draft their top-k
    learnt_budget = True  # the tree may follow the cost learnt from every row: the output does not depend on the tree

    def accept(self, tree, argmax: np.ndarray, probs: Probs | None, draws: Draws | None, rng) -> Verdict:
        return greedy(tree, argmax)


def typical(tree, probs: Probs, rng, *, threshold: float, alpha: float) -> Verdict:
    """Medusa-2's typical acceptance on any tree: a drafted token x under its parent's distribution p
    is accepted when p(x) > min(threshold, alpha * exp(-entropy(p))); the longest accepted path
    wins, ties going to the likelier under p, then to the first; the bonus is sampled from p at its
    last node. NOT distribution-preserving: it trades exactness for acceptance (plausible tokens
    pass even when p would rarely sample them)."""
    ok = np.zeros(tree.num_nodes, dtype=bool)
    ok[0] = True
    logp = np.zeros(tree.num_nodes)
    for node in range(1, tree.num_nodes):  # parents first: only below accepted nodes
        above = int(tree.parent[node])
        if not ok[above]:
            continue
        p = probs(above)
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        p_x = p[tree.tokens[node]]
        ok[node] = p_x > min(threshold, alpha * np.exp(-entropy))
        logp[node] = (np.log(p_x) if p_x > 0 else -np.inf) + logp[above]
    candidates = np.flatnonzero(ok)
    best = max(candidates, key=lambda n: (tree.depth[n], logp[n], -n))  # longest, then likeliest, then first
    return Verdict(tree.path(int(best)), sample(rng, probs(int(best))))


@dataclass(frozen=True)
class TypicalRule:
    """``typical`` as a rule, with a request's thresholds (``SamplingParams.posterior_*``)."""

    threshold: float
    alpha: float
    needs_logits = True
    sampled_drafts = False
    learnt_budget = False  # the tree decides which uniforms a seed's generator spends: it must not depend on other rows

    def accept(self, tree, argmax, probs: Probs, draws: Draws | None, rng) -> Verdict:
        return typical(tree, probs, rng, threshold=self.threshold, alpha=self.alpha)


def lossless(tree, probs: Probs, draws: Draws | None, rng) -> Verdict:
    """Recursive rejection sampling on a tree whose siblings mix sampled and deterministic drafts.

    At the current node (root first) with target r = p_node, the children are tried in tree order
    (a node's sampled head draws first, by rank, then its deterministic drafts). Child x is tested
    against the distribution it was drawn from given everything drawn before it:
      - head d's j-th draw: q^(j) = q_d with its draws 0..j-1 removed, renormalised (draws made
        without replacement; a draw the budget left out of the tree still counts as removed);
      - a deterministic draft: the point mass on x, so q(x) = 1.
    Accept with probability min(1, r(x) / q(x)); on rejection r <- norm(max(0, r - q)) (for a point
    mass: r with x removed, renormalised) and the next sibling is tried; when every child is
    rejected the bonus token is drawn from r. With a draft vocabulary (the heads graph projects onto
    the first N token ids) q_d is a distribution over those ids: zero beyond them.

    Exactness: for one draft x ~ q against target r, P(accept, x = y) = min(q(y), r(y)) and the
    rejected mass is max(0, r - q), so a rejection followed by a sample of norm(max(0, r - q))
    yields r (the single-draft argument). By induction over the siblings left
    it suffices that each tested token is distributed as the q it is tested against given the
    history, and that this q does not depend on the base model's randomness. Both hold here: head
    draws were made from q_d before verification, and the tested draws are a subsequence in draw
    order of one without-replacement sequence, so draw j given draws 0..j-1 is q^(j) whether or
    not the earlier ones were tested; a deterministic draft is a function of the committed context
    (the retrieval index, the successor table), i.e. a point mass given the history, and a
    point mass equal to an already rejected token just has r(x) = 0. Which drafts enter the tree
    depends only on committed context and earlier steps, never on this step's uniforms. The
    accepted token at each depth is therefore distributed as p at its parent and the bonus as p at
    the last accepted node: the emitted tokens are exactly autoregressive samples of p.
    """
    node, path = 0, [0]
    top_k = draws.ids.shape[1] if draws is not None else 1
    while True:
        residual = probs(node)
        accepted = None
        q_head, head, removed = None, -1, 0
        for child in tree.children[node]:
            x = int(tree.tokens[child])
            if tree.draw[child] >= 0:
                d, j = divmod(int(tree.draw[child]), top_k)
                if d != head:
                    q_head, head, removed = draws.q[d].astype(np.float64, copy=True), d, 0
                if j > removed:
                    q_head[draws.ids[d, removed:j]] = 0.0  # earlier draws, tested or not
                    removed = j
                total = q_head.sum()
                if total <= 0:
                    continue
                q = q_head / total
                if accepts(rng.random(), residual[x], q[x]):
                    accepted = child
                    break
                left = residual.copy()  # a draft vocabulary's q is zero past its first len(q) ids
                left[: len(q)] = np.maximum(residual[: len(q)] - q, 0.0)
            else:  # point mass on x
                if accepts(rng.random(), residual[x], 1.0):
                    accepted = child
                    break
                left = residual.copy()
                left[x] = 0.0
            total = left.sum()
            residual = left / total if total > 0 else residual
        if accepted is None:
            return Verdict(path, sample(rng, residual))
        node = accepted
        path.append(node)


class LosslessRule:
    """``lossless`` as a rule."""

    needs_logits = True
    sampled_drafts = True  # heads draw without replacement from their warped distributions
    learnt_budget = False  # as typical: the same seed, the same tokens, whatever shares the batch

    def accept(self, tree, argmax, probs: Probs, draws: Draws | None, rng) -> Verdict:
        return lossless(tree, probs, draws, rng)


GREEDY, LOSSLESS = GreedyRule(), LosslessRule()
_RULES = {
    "greedy": lambda params: GREEDY,
    "typical": lambda params: TypicalRule(params.posterior_threshold, params.posterior_alpha),
    "lossless": lambda params: LOSSLESS,
}


def rule_for(params) -> AcceptanceRule:
    """A request's acceptance rule from its ``SamplingParams`` (``params.rule``: greedy, typical or lossless)."""
    return _RULES[params.rule](params)
