"""What a drafter hands the tree builder, and the Protocol every drafter speaks.

A drafter proposes a *fragment*: candidate nodes below the step's root (the token the base model
already chose, emitted, not yet in the cache), in topological order. Each node names its parent
(-1: the root), its token, the statistics key its acceptance is estimated under, and, for drafts
sampled from a head's distribution (lossless sampling), which draw it is. Retrieved and recycled
drafts are deterministic: their draft distribution is a point mass on the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

DETERMINISTIC = -1  # Fragment.draw for a draft that is not a sample of a head's distribution


@dataclass(frozen=True, eq=False)
class Fragment:
    source: str  # the drafter's name
    tokens: np.ndarray  # int64 [M]: each node's token
    parent: np.ndarray  # int64 [M]: index into this fragment, -1 for a child of the root; parents come first
    keys: tuple  # [M]: hashable statistics keys (e.g. ("heads", depth, rank)); acceptance is estimated per key
    draw: np.ndarray  # int64 [M]: head d's j-th draw as d * K + j (lossless), DETERMINISTIC otherwise

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def paths(cls, source: str, paths: list[list[int]], keys: list[list]) -> Fragment:
        """A fragment from token paths below the root (shared prefixes become one node), with a key per token."""
        tokens, parent, node_keys, index = [], [], [], {}
        for path, path_keys in zip(paths, keys):
            above = -1
            for depth, (tok, key) in enumerate(zip(path, path_keys)):
                prefix = tuple(path[: depth + 1])
                if prefix not in index:
                    index[prefix] = len(tokens)
                    tokens.append(int(tok))
                    parent.append(above)
                    node_keys.append(key)
                above = index[prefix]
        return cls(source, np.array(tokens, dtype=np.int64), np.array(parent, dtype=np.int64), tuple(node_keys),
                   np.full(len(tokens), DETERMINISTIC, dtype=np.int64))

    @classmethod
    def empty(cls, source: str) -> Fragment:
        none = np.zeros(0, dtype=np.int64)
        return cls(source, none, none, (), none)


class Drafter(Protocol):
    """One sequence's drafter. The loop calls ``propose`` before each verify step and ``observe``
    after it, in that order; drafters never touch the engine."""

    name: str

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        """Candidates below the root ``history[-1]`` (prompt + emitted tokens), at most ``max_depth`` deep."""
        ...

    def observe(self, history: list[int], scored_tokens: np.ndarray, scored_next: np.ndarray) -> None:
        """After a step: ``history`` now holds the newly emitted tokens; ``scored_tokens`` [N] are the
        step's tree tokens and ``scored_next`` [N, k] the base model's top-k after each of them
        (k >= 1: argmax first), accepted or not."""
        ...
