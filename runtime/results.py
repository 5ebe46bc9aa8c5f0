"""What generation gives back: per-step draft counts, per-sequence statistics, the result and
the streamed events (``from medusa_trt.runtime import GenerationResult, GenerationStats, StreamEvent``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from medusa_trt.runtime.drafting.base import StepTree


@dataclass(frozen=True)
class StepDrafts:
    """What one verify step drafted and accepted for one sequence, in vLLM's terms (the serving
    metrics count these). ``drafted``: the draft tokens verified, i.e. the step tree's nodes below
    its root (the root is the previous step's bonus token, already emitted: not a draft).
    ``accepted``: the drafted tokens on the accepted path that were committed (a path cut by the
    request's budget counts what was kept); the bonus token after them is not counted, so the step
    emitted ``accepted + 1`` tokens (fewer when an EOS or stop string ends the sequence inside
    them). ``by_drafter``: (drafter, drafted, accepted) per drafter credited with a node; a node
    several drafters proposed is credited once, to the one whose candidate created it (drafters
    enter the tree in ``drafting.DRAFTERS`` order), so the per-drafter counts add up to the totals."""

    drafted: int
    accepted: int
    by_drafter: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, tree: StepTree, path: list[int]) -> StepDrafts:
        """The counts of one row's step: its tree and its committed path (root first)."""
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for node in range(1, tree.num_nodes):
            name = tree.sources[node][0] if tree.sources[node] else "unknown"
            drafted[name] = drafted.get(name, 0) + 1
        for node in path[1:]:
            name = tree.sources[node][0] if tree.sources[node] else "unknown"
            accepted[name] = accepted.get(name, 0) + 1
        return cls(tree.num_nodes - 1, len(path) - 1, tuple((n, d, accepted.get(n, 0)) for n, d in drafted.items()))


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0  # verify steps (prefill steps not counted)
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per verify step
    drafts: list[StepDrafts] = field(default_factory=list)  # per verify step: drafted and accepted draft tokens
    seconds: float = 0.0  # wall time from joining the batch to finishing
    verify_seconds: float = 0.0  # of which engine steps this sequence took part in after its prefill
    heads_seconds: float = 0.0  # of which Medusa heads calls
    host_seconds: float = 0.0  # of which host work of its steps: draft, tree, accept, commit, emit

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens verified over the whole generation (``StepDrafts.drafted`` summed)."""
        return sum(d.drafted for d in self.drafts)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted over the whole generation (``StepDrafts.accepted`` summed)."""
        return sum(d.accepted for d in self.drafts)

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted_per_step)) if self.accepted_per_step else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class GenerationResult:
    text: str  # new text, special tokens skipped, cut before a stop string
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context) or "cancelled"
    stats: GenerationStats
    # with hidden=True: float32 (len(token_ids), H), row i the heads' input hidden state at the token
    # before token_ids[i] (the prompt's last for i = 0): what the engine computed, recorded as it ran
    hidden: np.ndarray | None = None


@dataclass(frozen=True)
class StreamEvent:
    index: int  # which prompt (generate/stream) or request id (ContinuousBatcher)
    token_ids: list[int]  # tokens committed in this step
    text: str  # text added by them (held back while a multi-byte character is incomplete)
    finish_reason: str | None = None  # set on the sequence's last event
    drafts: StepDrafts | None = None  # a verify step's drafted / accepted counts; None for prefill and cancellation events
