"""Recycled successors (Token Recycling): the base model's own top-k after a token, remembered
from every node any step scored (accepted or not), proposed again the next time the token shows up.

The table is per sequence (one request's text never shapes another's drafts) and costs nothing
to fill: the step graph already returns each node's top-k (or at least its argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.drafting.base import Fragment


@dataclass(frozen=True)
class RecycleConfig:
    widths: tuple[int, ...] = (3, 2, 1, 1)  # children per node at depth 1, 2, ...: a wide top, a chain below


# Starting estimates of the best successor by depth, fitted as ``stats`` says (the replay sees only
# on-path successors, so the lower ranks keep the hand-set 0.25 * 0.8 ** (depth - 1) / (1 + rank) ** 1.5).
RECYCLE_TOP_PRIOR = (0.45, 0.57, 0.70, 0.73)


def recycle_prior(key: tuple) -> float:
    """(kind, depth, rank)."""
    _, depth, rank = key
    if rank == 0:
        return RECYCLE_TOP_PRIOR[min(depth, len(RECYCLE_TOP_PRIOR)) - 1]
    return 0.25 * 0.8 ** (depth - 1) / (1 + rank) ** 1.5


class RecycleDrafter:
    name = "recycle"
    priors = {name: recycle_prior}

    def __init__(self, config: RecycleConfig):
        self.config = config
        self.table: dict[int, np.ndarray] = {}  # token -> int64 [k] successors, best first

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        widths = self.config.widths[:max_depth]
        paths, keys = [], []
        frontier = [([], [], int(history[-1]))]  # (path, keys, last token)
        for depth, width in enumerate(widths, start=1):
            nxt = []
            for path, path_keys, tok in frontier:
                succ = self.table.get(tok)
                if succ is None:
                    if path:
                        paths.append(path)
                        keys.append(path_keys)
                    continue
                for rank, s in enumerate(succ[:width]):
                    nxt.append((path + [int(s)], path_keys + [(self.name, min(depth, 4), rank)], int(s)))
            frontier = nxt
        paths += [p for p, _, _ in frontier]
        keys += [k for _, k, _ in frontier]
        return Fragment.paths(self.name, paths, keys) if paths else Fragment.empty(self.name)

    def observe(self, history, scored_tokens: np.ndarray, scored_next: np.ndarray) -> None:
        successors = np.array(scored_next, dtype=np.int64)  # a copy: the backend reuses its buffers
        for tok, succ in zip(scored_tokens.tolist(), successors):
            self.table[tok] = succ
