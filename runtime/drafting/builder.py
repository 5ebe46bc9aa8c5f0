"""Merge every drafter's candidates into one trie per row and keep the best nodes under a budget.

Each node's *conditional* estimate c = P(accepted | parent accepted) comes from the sequence's
online statistics (``stats.AcceptanceStats``); a node proposed by several drafters combines them
as a noisy-or, 1 - prod(1 - c_i). Its *path* estimate s = c * s(parent) is the probability that
it is accepted, so a tree with nodes S emits 1 + sum_{n in S} s_n tokens in expectation (the
events "n is on the accepted path" for the nodes of one depth are disjoint). The builder takes
nodes in decreasing s (parents never below their children: c <= 1, ties broken by depth) and
stops at the count n that maximises (1 + sum of the first n) / cost(n + 1): the measured verify
cost per step width (``CostModel``), so a flat-cost engine gets bigger trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from medusa_trt.runtime.drafting.base import DETERMINISTIC, Fragment, StepTree
from medusa_trt.runtime.drafting.stats import AcceptanceStats

# Verify-step cost by tokens per step, relative to one token: SmolLM2-135M on ONNX Runtime fp32,
# 2 CPU threads, 256-token context (medusa-calibrate's table; ../shared/README.md agrees).
DEFAULT_STEP_COST = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.29, 16: 1.55, 32: 2.71, 64: 3.63}


@dataclass(frozen=True)
class CostModel:
    table: dict = field(default_factory=lambda: dict(DEFAULT_STEP_COST))  # tokens per step -> relative cost

    def __post_init__(self):
        sizes = sorted(self.table)
        object.__setattr__(self, "_x", np.array(sizes, dtype=np.float64))
        object.__setattr__(self, "_y", np.array([self.table[s] for s in sizes], dtype=np.float64))

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A fixed table learns nothing (``OnlineCost`` does)."""

    def cost(self, tokens: np.ndarray, rows: int = 1) -> np.ndarray:
        """Relative cost of a step of ``tokens`` tokens per row over ``rows`` rows, against one
        token per row: the table read at rows x tokens (a step's work is its token count, linear
        between measured sizes and beyond them)."""
        return self._read(rows * np.asarray(tokens, dtype=np.float64)) / self._read(np.array([float(rows)]))[0]

    def _read(self, t: np.ndarray) -> np.ndarray:
        x, y = self._x, self._y
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else 0.0
        return np.where(t <= x[-1], np.interp(t, x, y), y[-1] + (t - x[-1]) * slope)


class OnlineCost:
    """The step cost as this engine on this machine pays it, learnt online around the prior table's
    shape: seconds(W) ~ s * table(W) + h, fitted by least squares through the last ``window``
    steps' (width, seconds) per row count B (seconds include the heads call, which is the fixed
    part h). The relative cost is table(W) + h / s: a measured fixed overhead per step makes bigger
    trees worth more, while the table keeps the shape sane (no slope learnt from noise, so a bad
    fit cannot lock the budget at the root). Until three widths are seen, the table alone answers.
    The fit is redone every ``refit_every`` steps of a row count (a least-squares solve per step
    cost 0.4 ms of host time, 0.7 % of a SmolLM2 step, for a value that moves slowly)."""

    def __init__(self, prior: CostModel, *, window: int = 128, min_samples: int = 16, refit_every: int = 8):
        self.prior, self.window, self.min_samples, self.refit_every = prior, window, min_samples, refit_every
        self._samples: dict[int, list[tuple[int, float]]] = {}
        self._seen: dict[int, int] = {}  # B -> steps observed
        self._overhead: dict[int, float] = {}  # B -> h / s in table units

    def observe(self, rows: int, width: int, seconds: float) -> None:
        samples = self._samples.setdefault(rows, [])
        samples.append((width, seconds))
        if len(samples) > self.window:
            del samples[0]
        seen = self._seen[rows] = self._seen.get(rows, 0) + 1
        if seen % self.refit_every == 0 and len(samples) >= self.min_samples and len({w for w, _ in samples}) >= 3:
            w, t = np.array(samples, dtype=np.float64).T
            x = np.stack([self.prior.cost(w, rows), np.ones_like(w)], axis=1)  # (N, 2)
            (scale, fixed), *_ = np.linalg.lstsq(x, t, rcond=None)
            if scale > 0:
                self._overhead[rows] = max(fixed, 0.0) / scale

    def cost(self, tokens: np.ndarray, rows: int = 1) -> np.ndarray:
        return self.prior.cost(tokens, rows) + self._overhead.get(rows, 0.0)


@dataclass(frozen=True, eq=False)
class Candidates:
    """One row's merged trie before the budget: every drafted node (root first, parents first)
    with its path estimate, and the drafted nodes in the order the budget takes them."""

    tokens: list
    parent: list
    depth: np.ndarray  # int64 [C]
    draw: list
    keys: list
    sources: list
    score: np.ndarray  # float64 [C]: estimated probability that the node is accepted (root 1)
    order: np.ndarray  # int64 [C-1]: drafted nodes best first (a prefix of it is always a subtree)

    @property
    def gain(self) -> np.ndarray:
        """float64 [C-1]: expected tokens emitted with the first n drafted nodes, n = 1 .. C-1."""
        return 1.0 + np.cumsum(self.score[self.order])

    def take(self, n: int) -> StepTree:
        """The tree of the root and the ``n`` best drafted nodes (siblings in test order)."""
        depth_arr = self.depth
        chosen = np.sort(np.concatenate([[0], self.order[:n]])).astype(np.int64)
        chosen = chosen[np.lexsort((chosen, depth_arr[chosen]))]  # by depth, then insertion order (siblings in test order)
        new = np.full(len(self.tokens), -1, dtype=np.int64)
        new[chosen] = np.arange(len(chosen))
        new_parent = np.array([-1] + [int(new[self.parent[i]]) for i in chosen[1:]], dtype=np.int64)
        children: list[list[int]] = [[] for _ in chosen]
        for j in range(1, len(chosen)):
            children[new_parent[j]].append(j)
        return StepTree(
            tokens=np.array(self.tokens, dtype=np.int64)[chosen],
            parent=new_parent,
            depth=depth_arr[chosen],
            draw=np.array(self.draw, dtype=np.int64)[chosen],
            keys=tuple(tuple(self.keys[i]) for i in chosen),
            sources=tuple(tuple(self.sources[i]) for i in chosen),
            children=tuple(tuple(c) for c in children),
            score=self.score[chosen],
        )


def merge(root: int, fragments: list[Fragment], stats: AcceptanceStats) -> Candidates:
    """Every drafter's fragment in one trie below ``root``, each node scored (see the module doc)."""
    fragments = sorted(fragments, key=lambda f: not (f.draw >= 0).any())  # sampled drafts first: they keep their own nodes
    tokens, parent, depth, draw = [int(root)], [-1], [0], [DETERMINISTIC]
    keys: list[list] = [[]]
    sources: list[list] = [[]]
    kids: list[dict] = [{}]
    for frag in fragments:
        mapped = np.empty(frag.size, dtype=np.int64)
        for i in range(frag.size):
            above = 0 if frag.parent[i] < 0 else int(mapped[frag.parent[i]])
            tok = int(frag.tokens[i])
            node = kids[above].get(tok)
            if node is None:
                node = len(tokens)
                kids[above][tok] = node
                tokens.append(tok)
                parent.append(above)
                depth.append(depth[above] + 1)
                draw.append(int(frag.draw[i]))
                keys.append([])
                sources.append([])
                kids.append({})
            keys[node].append(frag.keys[i])
            if frag.source not in sources[node]:
                sources[node].append(frag.source)
            mapped[i] = node
    count = len(tokens)
    score = np.ones(count)
    for i in range(1, count):  # parents first
        miss = 1.0
        for key in keys[i]:
            miss *= 1.0 - stats.estimate(key)
        score[i] = (1.0 - miss) * score[parent[i]]
    depth_arr = np.array(depth, dtype=np.int64)
    order = np.lexsort((np.arange(count), depth_arr, -score))[1:]  # best first, the root (score 1, depth 0) leads
    return Candidates(tokens, parent, depth_arr, draw, keys, sources, score, order)


def best_count(candidates: Candidates, *, max_nodes: int, cost, rows: int = 1) -> int:
    """How many drafted nodes maximise expected tokens per unit of step cost for one row (0: the root alone)."""
    limit = min(len(candidates.order), max_nodes - 1)
    if limit <= 0:
        return 0
    costs = cost.cost(np.arange(1, limit + 2), rows)  # (limit + 1,) for 1 .. limit + 1 tokens
    value = candidates.gain[:limit] / costs[1:]
    return int(np.argmax(value)) + 1 if value.max() > 1.0 / costs[0] else 0


def shared_width(rows: list[Candidates], *, max_nodes: int, cost, batch: int, floor: int = 1) -> int:
    """The step's width W (root included) for the rows that budget together: a step pads every row
    to its widest tree, so it pays for ``batch`` x W tokens whatever each row holds, and each row
    then keeps its best W - 1 drafted nodes for free. W maximises the rows' summed expected tokens
    per unit of that cost; ``floor`` is a width the step has anyway (a prefill chunk, a sampled
    row's tree), so narrower choices cost no less."""
    limit = max(min(max((len(c.order) for c in rows), default=0) + 1, max_nodes), floor)
    widths = np.arange(1, limit + 1)  # (L,)
    tokens = np.zeros(limit)
    for c in rows:
        gain = np.concatenate([[1.0], c.gain[: min(limit, max_nodes) - 1]])  # (<= L,) expected tokens at widths 1 .. 1 + drafted
        tokens += np.concatenate([gain, np.full(limit - len(gain), gain[-1])])  # a row short of W keeps all it has
    value = tokens / cost.cost(np.maximum(widths, floor), batch)
    return int(widths[np.argmax(value)])  # ties: the narrowest


def take_width(candidates: Candidates, width: int, max_nodes: int) -> StepTree:
    """A row's tree in a step of ``width`` tokens per row: its best drafted nodes that fit."""
    return candidates.take(min(width, max_nodes) - 1)


def build_tree(root: int, fragments: list[Fragment], stats: AcceptanceStats, *, max_nodes: int, cost, rows: int = 1) -> StepTree:
    """One row's tree from the drafters' fragments (see the module doc); ``max_nodes`` caps the
    tree (root included). ``cost`` is a ``CostModel`` or an ``OnlineCost`` (asked for ``rows`` rows)."""
    candidates = merge(root, fragments, stats)
    return candidates.take(best_count(candidates, max_nodes=max_nodes, cost=cost, rows=rows))
