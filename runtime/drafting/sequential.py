"""Sequential heads' expansion of a template: which heads call reads which path.

Sequential heads (``head_input = "hidden+path"``) guess the tokens below a node from the path
that leads to it, so the heads' template is expanded depth by depth inside one heads call: head
1 at the root, then head d + 1 at every template node of depth d that has children, its path
being the tokens of the earlier calls' top-K at the template's ranks. The call returns one
proposals row per expanded node (``ids [B, P, K]``, ``logits [B, P, N]``) instead of one per
head; a template node's token is then ``ids[b, row[parent], rank]``.

numpy only: the exporter's heads graph, the torch backend and the heads drafter share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.errors import MedusaError


class TemplateMismatchError(MedusaError):
    """A tree needs proposals the engine's sequential heads do not compute."""


@dataclass(frozen=True, eq=False)
class Expansion:
    """The expanded nodes of a template, row 0 the root, parents before children (by depth)."""

    paths: tuple[tuple[int, ...], ...]  # [P]: each expanded node's path of ranks (root: ())
    parent: np.ndarray  # int64 [P]: the row of its parent (root -1)
    rank: np.ndarray  # int64 [P]: its rank among its parent's proposals (root 0)
    depth: np.ndarray  # int64 [P]: its depth = the head (0-based) that runs at it

    @property
    def rows(self) -> int:
        return len(self.paths)

    def row_of(self, path: tuple[int, ...], index: dict | None = None) -> int:
        """The proposals row of the expanded node at ``path`` (``index``: path -> row, when the caller has built it)."""
        index = index if index is not None else {p: i for i, p in enumerate(self.paths)}
        try:
            return index[tuple(path)]
        except KeyError:
            raise TemplateMismatchError(
                f"the tree node below {list(path)} is not in the engine's sequential heads template "
                "(which expands the template it was exported with): use a subtree of that template, or export with this tree"
            ) from None

    def levels(self) -> list[np.ndarray]:
        """Rows per depth: ``levels()[d]`` are the rows head d runs at (increasing)."""
        return [np.flatnonzero(self.depth == d) for d in range(int(self.depth.max()) + 1)]

    def node_rows(self, paths) -> np.ndarray:
        """For tree paths (root excluded), the proposals row each node's token comes from: int64 [M]."""
        index = {p: i for i, p in enumerate(self.paths)}
        return np.array([self.row_of(tuple(p[:-1]), index) for p in paths], dtype=np.int64)


def expansion(paths) -> Expansion:
    """The expansion of a template given as its node paths (ranks below the root, any order)."""
    parents = sorted({tuple(p[:-1]) for p in paths}, key=lambda p: (len(p), p))
    if not parents:
        parents = [()]
    index = {p: i for i, p in enumerate(parents)}
    parent = np.array([index[p[:-1]] if p else -1 for p in parents], dtype=np.int64)
    rank = np.array([p[-1] if p else 0 for p in parents], dtype=np.int64)
    depth = np.array([len(p) for p in parents], dtype=np.int64)
    return Expansion(tuple(parents), parent, rank, depth)
