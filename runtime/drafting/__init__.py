"""Drafters and the per-step tree builder (see ``builder``): every draft is the model's own.

``heads``: the Medusa heads' proposals through the compiled tree (the heads' template);
``lookup``: continuations of earlier occurrences of the context's suffix (``lookup``);
``recycle``: the base model's own successors of a token from earlier steps (``recycle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_trt.runtime.drafting.base import DETERMINISTIC, Drafter, Fragment, Observed, PerSequence, Proposal, Proposer, StepTree
from medusa_trt.runtime.drafting.builder import CostModel, OnlineCost, build_tree
from medusa_trt.runtime.drafting.heads import HeadsProposer, HeadsTemplate
from medusa_trt.runtime.drafting.lookup import LookupConfig, LookupDrafter, NgramIndex
from medusa_trt.runtime.drafting.recycle import RecycleConfig, RecycleDrafter
from medusa_trt.runtime.drafting.stats import AcceptanceStats, prior_of
from medusa_trt.runtime.errors import MedusaError

DRAFTERS = ("heads", "lookup", "recycle")  # in the order their candidates enter the tree


@dataclass(frozen=True)
class DraftingConfig:
    lookup: LookupConfig = LookupConfig()
    recycle: RecycleConfig = RecycleConfig()
    max_depth: int = 8  # deepest draft of a drafter without a depth of its own (the heads stop at their template's)
    max_nodes: int = 64  # largest tree, root included (the engine's tokens per step caps it too)
    cost: CostModel = field(default_factory=CostModel)  # the prior (or, with learn_cost False, the fixed) step cost
    learn_cost: bool = True  # fit the real step cost online (OnlineCost) and prefer it to the table once it has data


class Drafting:
    """A runtime's drafter set: which drafters run, their shared tables, the tree budget.

    ``names`` None: every drafter this engine supports. A drafter this engine cannot run (the heads
    without a heads template) is an error when named, unless ``available_only`` drops it. What the
    budget needs of the set it reads from the proposers themselves (``Proposer``: priors, depth,
    cost), never from their names. ``heads_cost``: the heads call's cost relative to a one-token
    step (the engine folder's measurement)."""

    def __init__(
        self,
        names: tuple[str, ...] | None,
        template: HeadsTemplate | None,
        config: DraftingConfig,
        *,
        engine_max_nodes: int | None,
        heads_cost: float = 0.0,
        available_only: bool = False,
    ):
        unknown = [n for n in names or () if n not in DRAFTERS]
        if unknown:
            raise MedusaError(f"unknown drafter {unknown[0]!r}: choose from {', '.join(DRAFTERS)} (or none for plain decoding)")
        self.template, self.config, self.heads_cost = template, config, heads_cost
        wanted = [n for n in DRAFTERS if names is None or n in names]
        described = {n: _FACTORIES[n](self, None) for n in wanted}  # the proposers without an engine: what they say of themselves
        missing = [n for n, p in described.items() if p is None]
        if missing and names is not None and not available_only:
            raise MedusaError(f"drafter {missing[0]!r} {_UNAVAILABLE[missing[0]]}")
        self.described = tuple(p for p in described.values() if p is not None)
        self.names = tuple(p.name for p in self.described)
        self.cost = OnlineCost(config.cost) if config.learn_cost else config.cost  # learns this engine's real step cost
        self.max_nodes = min(config.max_nodes, engine_max_nodes or config.max_nodes)
        self.max_depth = max((config.max_depth if p.max_depth is None else p.max_depth for p in self.described), default=0)
        self.fixed_cost = sum(p.cost for p in self.described)  # what the drafters add to every step, relative to one token
        self.prior = prior_of({kind: prior for p in self.described for kind, prior in p.priors.items()})

    def proposers(self, backend) -> tuple[Proposer, ...]:
        """Fresh proposers for one loop over ``backend`` (the heads call it; None: proposals are set by hand)."""
        return tuple(_FACTORIES[name](self, backend) for name in self.names)


def _heads(d: Drafting, backend) -> HeadsProposer | None:
    return None if d.template is None else HeadsProposer(d.template, backend, cost=d.heads_cost)


# name -> the drafter's proposer for a Drafting and a backend (None: this engine cannot run it)
_FACTORIES = {
    "heads": _heads,
    "lookup": lambda d, backend: PerSequence(LookupDrafter, lambda history: LookupDrafter(d.config.lookup, history)),
    "recycle": lambda d, backend: PerSequence(RecycleDrafter, lambda history: RecycleDrafter(d.config.recycle)),
}
_UNAVAILABLE = {  # why a drafter's factory gave none
    "heads": "needs Medusa heads and a tree deeper than chain-0: this engine or tree has none; draft with lookup,recycle",
}


__all__ = [
    "DETERMINISTIC",
    "DRAFTERS",
    "AcceptanceStats",
    "CostModel",
    "Drafter",
    "Drafting",
    "DraftingConfig",
    "Fragment",
    "HeadsProposer",
    "HeadsTemplate",
    "LookupConfig",
    "OnlineCost",
    "LookupDrafter",
    "NgramIndex",
    "Observed",
    "PerSequence",
    "Proposal",
    "Proposer",
    "RecycleConfig",
    "RecycleDrafter",
    "StepTree",
    "build_tree",
]
