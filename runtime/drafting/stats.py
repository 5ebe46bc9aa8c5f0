"""Online acceptance estimates: P(a draft is accepted | its parent was), per statistics key.

Each key (drafter, depth, rank or match length) starts from a prior worth ``PRIOR_WEIGHT``
observations and is updated after every step from the nodes that step actually tested (a node
is tested when its parent was accepted), so the tree builder spends its budget where drafts of
this sequence have been landing.

The priors belong to the drafters: each ``Proposer`` carries ``priors``, its starting estimate
per statistics-key kind (a key's first element), and ``Drafting.prior`` reads them. The fitted
tables sit beside each drafter (``heads.HEADS_P_PRIOR``, ``lookup.LOOKUP_PRIOR``,
``recycle.RECYCLE_TOP_PRIOR``): accepted / tested per key over an offline replay of the 50
calibration prompts (SmolLM2-135M, the shipped heads, 128 greedy tokens, every drafter; disjoint
from the training and the benchmark prompts), shrunk towards the previous hand-set value with the
weight of 8 observations. Rerun: .venv/bin/python -m medusa_trt.bench.replay --tree
assets/smollm2-135m-medusa/template.json --prompts assets/calibration_prompts.jsonl --every 1
--draft heads,lookup,recycle --tally tally.json
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

PRIOR_WEIGHT = 4.0
UNKNOWN_PRIOR = 0.1  # a key no drafter claims


def prior_of(priors: Mapping[str, Callable[[tuple], float]]) -> Callable[[tuple], float]:
    """One prior over every key from per-kind priors (``Proposer.priors``, merged): keyed by ``key[0]``."""

    def prior(key: tuple) -> float:
        own = priors.get(key[0])
        return UNKNOWN_PRIOR if own is None else own(key)

    return prior


class AcceptanceStats:
    def __init__(self, prior: Callable[[tuple], float], weight: float = PRIOR_WEIGHT):
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

    def learn(self, tree, path: list[int]) -> None:
        """Update from the nodes one step tested: the children of every accepted node of ``tree``
        (a ``StepTree``; one of them accepted, unless ``path``, root first, ends there)."""
        on_path = set(path)
        for node in path:
            for child in tree.children[node]:
                accepted = child in on_path
                for key in tree.keys[child]:
                    self.update(key, accepted)
