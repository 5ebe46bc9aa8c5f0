"""Online acceptance estimates: P(a draft is accepted | its parent was), per statistics key.

Each key (drafter, depth, rank or match length) starts from a prior worth ``PRIOR_WEIGHT``
observations and is updated after every step from the nodes that step actually tested (a node
is tested when its parent was accepted), so the tree builder spends its budget where drafts of
this sequence have been landing.
"""

from __future__ import annotations

PRIOR_WEIGHT = 4.0


def default_prior(key: tuple) -> float:
    """Conservative starting estimates, measured roughly on SmolLM2 with the shipped heads."""
    source = key[0]
    if source == "heads":
        _, depth, rank = key
        return 0.4 * 0.75 ** (depth - 1) / (1 + rank) ** 1.2
    if source == "lookup":
        _, match, depth = key
        return {1: 0.2, 2: 0.35, 3: 0.5}[match] * (1.0 if depth == 1 else 0.9)
    if source == "recycle":
        _, depth, rank = key
        return 0.25 * 0.8 ** (depth - 1) / (1 + rank) ** 1.5
    return 0.1


class AcceptanceStats:
    def __init__(self, prior=default_prior, weight: float = PRIOR_WEIGHT):
        self._prior, self._weight = prior, weight
        self._counts: dict[tuple, list[float]] = {}  # key -> [accepted, tested] including the prior

    def estimate(self, key: tuple) -> float:
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = [self._prior(key) * self._weight, self._weight]
        return c[0] / c[1]

    def update(self, key: tuple, accepted: bool) -> None:
        self.estimate(key)
        c = self._counts[key]
        c[0] += accepted
        c[1] += 1.0
