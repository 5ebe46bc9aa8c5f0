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

import numpy as np

from medusa_trt.runtime.sampling import sample
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


# ---------------------------------------------------------------------------- sampling rules
#
# Terms as above. For sampling, the base model's distribution at node i is p_i = warp(logits_i)
# (temperature, top-k, top-p: ``sampling.warp``); head d's draft distribution q_d is the same warp
# of head d's logits, made at the last committed node.


@dataclass(frozen=True, eq=False)
class TreeWalk:
    """Tables the sampling rules walk, derived once per tree from its ``CompiledTree``."""

    children: tuple[tuple[int, ...], ...]  # per node, its children in tree (node) order
    depth: np.ndarray  # int64 [T]: root 0 (the tree's)
    rank: np.ndarray  # int64 [T]: position among its siblings (root 0)
    rank_gather: np.ndarray  # int64 [T]: into [root, head1 draws, ..., headD draws] (1 + D*K): the node's head's rank-th draw
    draws: np.ndarray  # int64 [D]: draws needed from head d (most children of any node at depth d-1)
    row_of: np.ndarray  # int64 [T]: a ``retrieve`` row whose path passes through the node


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
    row_of = np.zeros(count, dtype=np.int64)
    for row in range(tree.retrieve.shape[0] - 1, -1, -1):  # backwards: the first row through a node wins
        nodes = tree.retrieve[row, : tree.path_lengths[row]]
        row_of[nodes] = row
    return TreeWalk(tuple(tuple(c) for c in children), tree.depth, rank, rank_gather, draws, row_of)


def accepts(u: float, p_x: float, q_x: float) -> bool:
    """Accept a draft x drawn from q with probability min(1, p(x)/q(x)), given u ~ U[0, 1)."""
    return u * q_x < p_x


def lossless_accept(
    walk: TreeWalk,
    tokens: np.ndarray,  # int64 [T]: this sequence's tree tokens; -1 where the head had no draw left
    base_probs: Callable[[int], np.ndarray],  # node -> p at that node, float64 [V]
    draft_probs: np.ndarray,  # float64 [D, V]: q_d, the distribution head d's draws came from
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Multi-candidate recursive rejection sampling down the tree; returns (last accepted node, bonus).

    At the current node (the root first) with target r = p_node, the children are tried in tree
    order. Child j's token x_j is head d's j-th draw *without replacement* from q_d, so it is
    distributed as q^(j) = q_d with the earlier siblings' tokens removed and renormalised. Accept x_j
    with probability min(1, r(x_j) / q^(j)(x_j)); the accepted child becomes the current node. On
    rejection r <- norm(max(0, r - q^(j))) and the next sibling is tried. If every child is
    rejected (or the node is a leaf) the bonus token is drawn from r.

    Why the output is exactly p (per position, hence jointly): for one draft x ~ q and target r,
    P(accept, x = y) = q(y) min(1, r(y)/q(y)) = min(q(y), r(y)) and P(reject) = sum max(0, r - q),
    so emitting a sample of norm(max(0, r - q)) on rejection gives min(q, r) + max(0, r - q) = r.
    The recursion only needs the next sibling's token to be drawn from the q^(j+1) it is tested
    against, given everything before it; sampling without replacement makes q^(j+1) depend on the
    rejected tokens, which is allowed (induction on the number of siblings left, with the final
    residual draw as the base case). Siblings take the draws in rank order, so the tested tokens
    are always a prefix of the draw sequence. The draws for depth d+1 were made before
    verification from fresh random numbers and q_{d+1}, which depends only on the committed
    context, so conditioning on which child was accepted at depth d leaves them distributed as
    the rule assumes. The accepted token at each depth is therefore distributed as p at its
    parent, and the bonus token as p at the last accepted node: the emitted tokens are exactly
    autoregressive samples of p.
    """
    node = 0
    while True:
        residual = base_probs(node)
        kids = walk.children[node]
        accepted = None
        if kids:
            q = draft_probs[walk.depth[kids[0]] - 1].astype(np.float64, copy=True)  # head d drafts depth d
            for child in kids:
                x = int(tokens[child])
                if x < 0 or q.sum() <= 0:  # the head's distribution has no mass left to draw from
                    break
                if accepts(rng.random(), residual[x], q[x]):
                    accepted = child
                    break
                left = np.maximum(residual - q, 0.0)
                total = left.sum()
                residual = left / total if total > 0 else residual
                q[x] = 0.0  # the next sibling was drawn without this token
                q /= max(q.sum(), np.finfo(np.float64).tiny)
        if accepted is None:
            return node, sample(rng, residual)
        node = accepted


def typical_accept(
    tree: CompiledTree,
    tokens: np.ndarray,  # int64 [T]: this sequence's tree tokens (heads' top-k, as greedy drafts them)
    base_probs: Callable[[int], np.ndarray],  # node -> p at that node, float64 [V]
    posterior_threshold: float,
    posterior_alpha: float,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Typical acceptance (Medusa-2): a drafted token x under parent distribution p is accepted when
    p(x) > min(posterior_threshold, posterior_alpha * exp(-entropy(p))). The longest accepted path
    wins, ties going to the higher log-likelihood under p, then to the first path; the bonus token
    is sampled from p at its last node. NOT distribution-preserving: it trades exactness for
    acceptance (plausible tokens pass even when p would rarely sample them)."""
    parents = np.unique(tree.parent[1:])
    probs = {int(n): base_probs(int(n)) for n in parents}
    ok = np.zeros(tree.num_nodes, dtype=bool)
    logp = np.zeros(tree.num_nodes)
    for node in range(1, tree.num_nodes):
        p = probs[int(tree.parent[node])]
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        p_x = p[tokens[node]]
        ok[node] = p_x > min(posterior_threshold, posterior_alpha * np.exp(-entropy))
        logp[node] = np.log(p_x) if p_x > 0 else -np.inf
    best, best_len, best_ll = 0, -1, -np.inf
    for row in range(tree.retrieve.shape[0]):
        path = tree.retrieve[row, 1 : tree.path_lengths[row]]
        run = int(np.cumprod(ok[path]).sum())
        ll = float(logp[path[:run]].sum())
        if run > best_len or (run == best_len and ll > best_ll):
            best, best_len, best_ll = row, run, ll
    last = int(tree.retrieve[best, best_len])
    return last, sample(rng, probs[last] if last in probs else base_probs(last))


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


class GreedyRule:
    """Drafted token accepted iff it equals the base argmax at its parent; the bonus is the argmax
    at the last accepted node. Children are disjoint by token, so at most one child matches."""

    name = "greedy"
    needs_logits = False  # the step's argmax is enough
    sampled_drafts = False  # heads draft their top-k
    learnt_budget = True  # the tree may follow the cost learnt from every row: the output does not depend on the tree

    def accept(self, tree, argmax: np.ndarray, probs, seq) -> Verdict:
        node, path = 0, [0]
        while True:
            want = int(argmax[node])
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
            if nxt is None:
                return Verdict(path, want)
            node = nxt
            path.append(node)


class TypicalRule:
    """Medusa-2's typical acceptance on any tree (see ``typical_accept``): NOT distribution-preserving."""

    name = "typical"
    needs_logits = True
    sampled_drafts = False
    learnt_budget = False  # the tree decides which uniforms a seed's generator spends: it must not depend on other rows

    def accept(self, tree, argmax, probs, seq) -> Verdict:
        params = seq.params
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
            ok[node] = p_x > min(params.posterior_threshold, params.posterior_alpha * np.exp(-entropy))
            logp[node] = (np.log(p_x) if p_x > 0 else -np.inf) + logp[above]
        candidates = np.flatnonzero(ok)
        best = max(candidates, key=lambda n: (tree.depth[n], logp[n], -n))  # longest, then likeliest, then first
        return Verdict(tree.path(int(best)), sample(seq.rng, probs(int(best))))


class LosslessRule:
    """Recursive rejection sampling on a tree whose siblings mix sampled and deterministic drafts.

    At the current node (root first) with target r = p_node, the children are tried in tree order
    (a node's sampled head draws first, by rank, then its deterministic drafts). Child x is tested
    against the distribution it was drawn from given everything drawn before it:
      - head d's j-th draw: q^(j) = q_d with its draws 0..j-1 removed, renormalised (draws made
        without replacement; a draw the budget left out of the tree still counts as removed);
      - a deterministic draft: the point mass on x, so q(x) = 1.
    Accept with probability min(1, r(x) / q(x)); on rejection r <- norm(max(0, r - q)) (for a point
    mass: r with x removed, renormalised) and the next sibling is tried; when every child is
    rejected the bonus token is drawn from r.

    Exactness: for one draft x ~ q against target r, P(accept, x = y) = min(q(y), r(y)) and the
    rejected mass is max(0, r - q), so a rejection followed by a sample of norm(max(0, r - q))
    yields r (the single-draft argument of ``lossless_accept``). By induction over the siblings left
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

    name = "lossless"
    needs_logits = True
    sampled_drafts = True  # heads draw without replacement from their warped distributions
    learnt_budget = False  # as typical: the same seed, the same tokens, whatever shares the batch

    def accept(self, tree, argmax, probs, seq) -> Verdict:
        rng, node, path = seq.rng, 0, [0]
        top_k = seq.proposals.shape[1] if seq.proposals is not None else 1
        while True:
            residual = probs(node)
            accepted = None
            q_head, head, removed = None, -1, 0
            for child in tree.children[node]:
                x = int(tree.tokens[child])
                if tree.draw[child] >= 0:
                    d, j = divmod(int(tree.draw[child]), top_k)
                    if d != head:
                        q_head, head, removed = seq.drafts_q[d].astype(np.float64, copy=True), d, 0
                    if j > removed:
                        q_head[seq.proposals[d, removed:j]] = 0.0  # earlier draws, tested or not
                        removed = j
                    total = q_head.sum()
                    if total <= 0:
                        continue
                    q = q_head / total
                    if accepts(rng.random(), residual[x], q[x]):
                        accepted = child
                        break
                    left = np.maximum(residual - q, 0.0)
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


RULES_BY_NAME = {"greedy": GreedyRule(), "typical": TypicalRule(), "lossless": LosslessRule()}
