"""Online acceptance estimates: P(a draft is accepted | its parent was), per statistics key.

Each key (drafter, depth, rank or match length) starts from a prior worth ``PRIOR_WEIGHT``
observations and is updated after every step from the nodes that step actually tested (a node
is tested when its parent was accepted), so the tree builder spends its budget where drafts of
this sequence have been landing.
"""

from __future__ import annotations

PRIOR_WEIGHT = 4.0

# Starting estimates fitted to an offline replay of the 50 calibration prompts (SmolLM2-135M, the
# shipped heads, 128 greedy tokens, every drafter; disjoint from the training and the benchmark
# prompts): accepted / tested per key, shrunk towards the previous hand-set value with the weight
# of 8 observations. Rerun: .venv/bin/python scripts/replay_drafts.py --tree assets/smollm2-135m-medusa/template.json
# --prompts assets/calibration_prompts.jsonl --every 1 --draft heads,lookup,recycle --tally tally.json
# Heads drafts by probability bucket (heads.CONFIDENCE_EDGES), depths 1-2 pooled (deeper ones
# agree within their noise): a head's softmax probability is close to its acceptance rate.
HEADS_P_PRIOR = (0.08, 0.11, 0.14, 0.21, 0.30, 0.36, 0.45, 0.56, 0.62, 0.68, 0.87)
# Retrieval by (matched suffix length, depth): a 3-token match's continuation lands 74-91 % of the
# time, far more than the hand-set 0.5; past depth 4 the depth-4 value holds.
LOOKUP_PRIOR = {1: (0.23, 0.47, 0.44, 0.34), 2: (0.46, 0.51, 0.68, 0.48), 3: (0.74, 0.82, 0.84, 0.91)}
# Recycled best successors by depth (the replay sees only on-path successors, so the lower ranks
# keep the hand-set 0.25 * 0.8 ** (depth - 1) / (1 + rank) ** 1.5).
RECYCLE_TOP_PRIOR = (0.45, 0.57, 0.70, 0.73)


def default_prior(key: tuple) -> float:
    """Starting estimates (see the tables above); keys of rank-keyed heads drafts (lossless draws,
    or heads without probabilities) keep the hand-set decay."""
    source = key[0]
    if source == "heads-p":  # (depth, confidence bucket)
        return HEADS_P_PRIOR[key[2]]
    if source == "heads":
        _, depth, rank = key
        return 0.4 * 0.75 ** (depth - 1) / (1 + rank) ** 1.2
    if source == "lookup":
        _, match, depth = key
        table = LOOKUP_PRIOR[min(match, 3)]  # a longer match (max_ngram > 3) is at least as good
        return table[min(depth, len(table)) - 1]
    if source == "recycle":
        _, depth, rank = key
        if rank == 0:
            return RECYCLE_TOP_PRIOR[min(depth, len(RECYCLE_TOP_PRIOR)) - 1]
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

    def learn(self, tree, path: list[int]) -> None:
        """Update from the nodes one step tested: the children of every accepted node of ``tree``
        (a ``StepTree``; one of them accepted, unless ``path``, root first, ends there)."""
        on_path = set(path)
        for node in path:
            for child in tree.children[node]:
                accepted = child in on_path
                for key in tree.keys[child]:
                    self.update(key, accepted)
