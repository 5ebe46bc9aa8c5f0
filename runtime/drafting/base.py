"""What a drafter hands the tree builder, and the Protocol every drafter speaks.

A drafter proposes a *fragment*: candidate nodes below the step's root (the token the base model
already chose, emitted, not yet in the cache), in topological order. Each node names its parent
(-1: the root), its token, the statistics key its acceptance is estimated under, and, for drafts
sampled from a head's distribution (lossless sampling), which draw it is. Retrieved and recycled
drafts are deterministic: their draft distribution is a point mass on the token.

The loop speaks to every drafter through one ``Proposer`` (vLLM v1's proposers are the model): it
serves every row of the loop, keeps each sequence's state itself, learns from each committed step
(``observe``: the Medusa heads make their batched engine call there, and their draws) and returns
each sequence's ``Proposal`` before the next. Drafters that need nothing of the engine (retrieval,
recycling) are per-sequence ``Drafter`` objects behind ``PerSequence``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from medusa_trt.runtime.acceptance import Draws

if TYPE_CHECKING:
    from medusa_trt.runtime.contract import StepOutput
    from medusa_trt.runtime.sampling import SamplingParams

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
        return cls(
            source,
            np.array(tokens, dtype=np.int64),
            np.array(parent, dtype=np.int64),
            tuple(node_keys),
            np.full(len(tokens), DETERMINISTIC, dtype=np.int64),
        )

    @classmethod
    def empty(cls, source: str) -> Fragment:
        none = np.zeros(0, dtype=np.int64)
        return cls(source, none, none, (), none)


class Drafter(Protocol):
    """One sequence's drafter. The loop calls ``propose`` before each verify step and ``observe``
    after it, in that order; drafters never touch the engine."""

    name: str
    priors: Mapping[str, Prior]  # its starting estimates per statistics-key kind (``Proposer.priors``)

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        """Candidates below the root ``history[-1]`` (prompt + emitted tokens), at most ``max_depth`` deep."""
        ...

    def observe(self, history: list[int], scored_tokens: np.ndarray, scored_next: np.ndarray) -> None:
        """After a step: ``history`` now holds the newly emitted tokens; ``scored_tokens`` [N] are the
        step's tree tokens and ``scored_next`` [N, k] the base model's top-k after each of them
        (k >= 1: argmax first), accepted or not."""
        ...


@dataclass(frozen=True, eq=False)
class StepTree:
    """One row's verify tree for one step: root first, parents before children, siblings in the
    order acceptance tries them (sampled head draws first, by rank)."""

    tokens: np.ndarray  # int64 [N]: root token first
    parent: np.ndarray  # int64 [N]: root -1
    depth: np.ndarray  # int64 [N]: root 0
    draw: np.ndarray  # int64 [N]: head d's j-th draw as d * K + j, DETERMINISTIC for retrieved / recycled / greedy drafts
    keys: tuple  # [N]: per node, the statistics keys of the drafters that proposed it (root: ())
    sources: tuple  # [N]: per node, the names of the drafters that proposed it
    children: tuple  # [N]: per node, its children in test order
    score: np.ndarray  # float64 [N]: estimated probability that the node is accepted (root 1)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def mask(self) -> np.ndarray:
        """bool [N, N]: [i, j] iff j is i or an ancestor of i (the verify step's tree mask)."""
        n = self.num_nodes
        mask = np.eye(n, dtype=bool)
        for i in range(1, n):
            mask[i] |= mask[self.parent[i]]
        return mask

    def path(self, node: int) -> list[int]:
        """Nodes from the root to ``node``."""
        out = [node]
        while self.parent[out[-1]] >= 0:
            out.append(int(self.parent[out[-1]]))
        return out[::-1]

    @classmethod
    def chain(cls, root: int) -> StepTree:
        """The root alone: plain decoding."""
        return cls(
            np.array([root], dtype=np.int64),
            np.array([-1], dtype=np.int64),
            np.zeros(1, dtype=np.int64),
            np.full(1, DETERMINISTIC, dtype=np.int64),
            ((),),
            ((),),
            ((),),
            np.ones(1),
        )


@dataclass(frozen=True, eq=False)
class Proposal:
    """One sequence's candidates for a step: a fragment and, when it holds sampled drafts
    (``Fragment.draw``), the distributions they were drawn from (what the lossless rule tests)."""

    fragment: Fragment
    draws: Draws | None = None


@dataclass(frozen=True, eq=False)
class Observed:
    """One row of a committed step, as a proposer sees it: a decode row, or a prefill row whose
    prompt is now in (the first token was chosen)."""

    key: int  # the sequence (rows move between steps; keys do not)
    row: int  # its row in this step
    history: list[int]  # prompt + emitted tokens, the next root last
    node: int  # its last committed node: the heads read the hidden state there
    tree: StepTree | None  # the step's tree (None: the prompt's last chunk)
    scored_tokens: np.ndarray  # int64 [N]: the step's tokens in this row
    scored_next: np.ndarray  # int64 [N, k]: the base model's top-k after each of them, argmax first
    params: SamplingParams
    rng: np.random.Generator  # the sequence's own generator


Prior = Callable[[tuple], float]  # a statistics key -> the starting estimate of P(accepted | parent accepted)


class Proposer(Protocol):
    """A drafter over every row of the loop. Per sequence the loop calls ``start`` when it takes a
    row, ``propose`` before each verify step, ``observe`` after each commit (all rows of the step at
    once) and ``finish`` when it leaves.

    It describes itself, so the loop, the statistics and the budget never ask for it by name:
    ``priors`` (its starting estimate per statistics-key kind, ``key[0]`` of the keys it makes),
    ``max_depth`` (the deepest it drafts; None: as deep as the budget lets it) and ``cost`` (what
    it adds to every step's engine time, relative to a one-token step: the heads call)."""

    name: str
    priors: Mapping[str, Prior]
    max_depth: int | None
    cost: float

    def start(self, key: int, history: list[int], *, sampled: bool) -> None:
        """A new sequence whose context is ``history`` (its prompt); ``sampled``: its rule tests sampled drafts."""
        ...

    def propose(self, key: int, history: list[int], max_depth: int) -> Proposal | None:
        """Candidates below the root ``history[-1]``, at most ``max_depth`` deep (None: none this step)."""
        ...

    def observe(self, rows: list[Observed], roots: np.ndarray, out: StepOutput | None) -> dict[int, float]:
        """After a commit: ``rows`` committed, ``roots`` int64 (B,) every row's next root, ``out`` the
        step's output. Returns the engine seconds spent per sequence key (none for host-only drafters)."""
        ...

    def finish(self, key: int) -> None:
        """The sequence left the loop: drop its state."""
        ...


class PerSequence:
    """A ``Proposer`` over one ``Drafter`` per sequence, for drafters that need nothing of the engine
    (no engine cost; ``kind`` the drafter class: its name and priors)."""

    cost = 0.0

    def __init__(self, kind: type, make: Callable[[list[int]], Drafter], *, max_depth: int | None = None):
        self.name, self.priors, self.max_depth, self._make = kind.name, kind.priors, max_depth, make
        self._drafters: dict[int, Drafter] = {}

    def start(self, key: int, history: list[int], *, sampled: bool) -> None:
        self._drafters[key] = self._make(history)

    def propose(self, key: int, history: list[int], max_depth: int) -> Proposal:
        return Proposal(self._drafters[key].propose(history, max_depth))

    def observe(self, rows: list[Observed], roots: np.ndarray, out: StepOutput | None) -> dict[int, float]:
        for r in rows:
            self._drafters[r.key].observe(r.history, r.scored_tokens, r.scored_next)
        return {}

    def finish(self, key: int) -> None:
        self._drafters.pop(key, None)
