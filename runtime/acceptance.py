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
