"""Drafters and the per-step tree builder (see ``builder``): every draft is the model's own.

``heads``: the Medusa heads' proposals through the compiled tree (the heads' template);
``lookup``: continuations of earlier occurrences of the context's suffix (``lookup``);
``recycle``: the base model's own successors of a token from earlier steps (``recycle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_trt.runtime.drafting.base import DETERMINISTIC, Drafter, Fragment, Observed, PerSequence, Proposal, Proposer
from medusa_trt.runtime.drafting.builder import CostModel, OnlineCost, StepTree, build_tree
from medusa_trt.runtime.drafting.heads import HeadsProposer, HeadsTemplate
from medusa_trt.runtime.drafting.lookup import LookupConfig, LookupDrafter, NgramIndex
from medusa_trt.runtime.drafting.recycle import RecycleConfig, RecycleDrafter
from medusa_trt.runtime.drafting.stats import AcceptanceStats
from medusa_trt.runtime.errors import MedusaError

DRAFTERS = ("heads", "lookup", "recycle")  # in the order their candidates enter the tree


@dataclass(frozen=True)
class DraftingConfig:
    lookup: LookupConfig = LookupConfig()
    recycle: RecycleConfig = RecycleConfig()
    max_depth: int = 8  # deepest draft (the heads stop at their own depth)
    max_nodes: int = 64  # largest tree, root included (the engine's tokens per step caps it too)
    cost: CostModel = field(default_factory=CostModel)  # the prior (or, with learn_cost False, the fixed) step cost
    learn_cost: bool = True  # fit the real step cost online (OnlineCost) and prefer it to the table once it has data


class Drafting:
    """A runtime's drafter set: which drafters run, their shared tables, the tree budget."""

    def __init__(self, names: tuple[str, ...], template: HeadsTemplate | None, config: DraftingConfig, *, engine_max_nodes: int | None):
        unknown = [n for n in names if n not in DRAFTERS]
        if unknown:
            raise MedusaError(f"unknown drafter {unknown[0]!r}: choose from {', '.join(DRAFTERS)} (or none for plain decoding)")
        if "heads" in names and template is None:
            raise MedusaError(
                "drafter 'heads' needs Medusa heads and a tree deeper than chain-0: this engine or tree has none; draft with lookup,recycle"
            )
        self.names = tuple(n for n in DRAFTERS if n in names)
        self.template, self.config = template, config
        self.cost = OnlineCost(config.cost) if config.learn_cost else config.cost  # learns this engine's real step cost
        self.max_nodes = min(config.max_nodes, engine_max_nodes or config.max_nodes)
        depth = config.max_depth
        if self.names == ("heads",):
            depth = template.tree.depth_max
        self.max_depth = depth if self.names else 0

    def proposers(self, backend) -> tuple[Proposer, ...]:
        """Fresh proposers for one loop over ``backend`` (the heads call it; None: proposals are set by hand)."""
        return tuple(_FACTORIES[name](self, backend) for name in self.names)


_FACTORIES = {
    "heads": lambda d, backend: HeadsProposer(d.template, backend),
    "lookup": lambda d, backend: PerSequence("lookup", lambda history: LookupDrafter(d.config.lookup, history)),
    "recycle": lambda d, backend: PerSequence("recycle", lambda history: RecycleDrafter(d.config.recycle)),
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
