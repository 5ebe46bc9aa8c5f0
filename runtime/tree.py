"""Medusa trees: plain data compiled once into frozen numpy buffers.

A tree is a list of paths of per-head top-k indices, e.g. ``[[0], [1], [0, 0]]``: ``[i]`` is
head 1's i-th best proposal (a child of the root), ``[0, 1]`` is head 2's 2nd best proposal
placed under node ``[0]``. The root (the base model's own next token) is implicit, node 0.

``compile_tree`` sorts the paths by (length, path), so node ``i + 1`` is ``paths[i]`` and every
parent comes before its children (topological order). Draft candidates are laid out as
``[root, head1 top-K, head2 top-K, ...]`` (1 + D*K entries); ``gather_index`` picks each node's
token from that layout. ``mask`` is what the verify step feeds as ``tree_mask`` and ``depth``
gives ``position_ids - cache_length``; ``retrieve`` lists root-to-leaf node indices per leaf.

numpy only: the exporter, plugin tests and every backend import this without torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

DEFAULT_MAX_NODES = 128  # root included
PRESETS_ENV = "MEDUSA_TRT_TREE_PRESETS"  # another presets file (optional)
# the published presets: package data in a wheel (setup.py copies them in), the shared source in a checkout
_PACKAGED_PRESETS = Path(__file__).resolve().parent / "presets" / "medusa_choices.json"
_CHECKOUT_PRESETS = Path(__file__).resolve().parent.parent.parent / "shared/trees/medusa_choices.json"


def default_presets_file() -> Path:
    """Where preset names are looked up: $MEDUSA_TRT_TREE_PRESETS, else the package's own copy, else
    (an editable checkout) the shared source beside the checkout."""
    if os.environ.get(PRESETS_ENV):
        return Path(os.environ[PRESETS_ENV])
    return _PACKAGED_PRESETS if _PACKAGED_PRESETS.is_file() else _CHECKOUT_PRESETS


class InvalidTreeError(MedusaError):
    """A tree spec or path list the user gave cannot be compiled; the message says how to fix it."""


@dataclass(frozen=True, eq=False)  # eq=False: array fields make `==` ambiguous
class CompiledTree:
    name: str
    paths: tuple[tuple[int, ...], ...]  # sorted by (len, path); node i+1 is paths[i]
    top_k: int  # K: proposals taken from each head
    depth_max: int  # D: longest path = number of heads the tree needs
    num_nodes: int  # T = len(paths) + 1
    depth: np.ndarray  # int64 [T]; root 0
    parent: np.ndarray  # int64 [T]; root -1
    gather_index: np.ndarray  # int64 [T]; into [root, head1 top-K, ..., headD top-K] (1 + D*K)
    mask: np.ndarray  # bool [T, T]; [i, j] True iff j == i or j is an ancestor of i
    retrieve: np.ndarray  # int64 [P, D+1]; per leaf (by node index), root-to-leaf nodes, -1 pad
    path_lengths: np.ndarray  # int64 [P]; valid entries per retrieve row (leaf depth + 1)

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "paths": [list(p) for p in self.paths], "top_k": self.top_k})


def _fmt(path) -> str:
    return str(list(path)) if isinstance(path, (list, tuple)) else repr(path)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_paths(paths, top_k: int | None, max_depth: int | None) -> list[tuple[int, ...]]:
    """Validate the raw path list; return it as sorted tuples (topological order)."""
    if not isinstance(paths, (list, tuple)):
        raise InvalidTreeError(f"a tree must be a list of paths (lists of ints), got {type(paths).__name__}")
    seen: set[tuple[int, ...]] = set()
    for raw in paths:
        if not isinstance(raw, (list, tuple)) or not all(_is_int(i) for i in raw):
            raise InvalidTreeError(f"tree path {_fmt(raw)} is not a list of ints; write each path like [0, 1]")
        if len(raw) == 0:
            raise InvalidTreeError("tree path [] is empty; the root is implicit, remove []")
        path = tuple(int(i) for i in raw)
        if min(path) < 0:
            raise InvalidTreeError(f"tree path {_fmt(path)} has a negative index; top-k indices start at 0")
        if path in seen:
            raise InvalidTreeError(f"tree path {_fmt(path)} appears twice; remove the duplicate")
        if top_k is not None and max(path) >= top_k:
            raise InvalidTreeError(
                f"tree path {_fmt(path)} uses index {max(path)} but heads propose only top_k={top_k}; raise top_k or remove the path"
            )
        if max_depth is not None and len(path) > max_depth:
            raise InvalidTreeError(
                f"tree path {_fmt(path)} has depth {len(path)}: the tree needs {len(path)} heads but only "
                f"{max_depth} are available; use a shallower tree"
            )
        seen.add(path)
    nodes = sorted(seen, key=lambda p: (len(p), p))
    for path in nodes:  # sorted, so the shallowest gap is reported
        if len(path) > 1 and path[:-1] not in seen:
            raise InvalidTreeError(
                f"tree path {_fmt(path)} has no parent {_fmt(path[:-1])}: a tree must be prefix-closed; "
                f"add {_fmt(path[:-1])} or remove {_fmt(path)}"
            )
    return nodes


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def compile_tree(
    paths, *, top_k: int | None = None, max_depth: int | None = None, max_nodes: int = DEFAULT_MAX_NODES, name: str = "custom"
) -> CompiledTree:
    """Compile a list of paths into frozen buffers. Pure; call once per tree."""
    if top_k is not None and top_k < 1:
        raise InvalidTreeError(f"top_k must be >= 1, got {top_k}")
    nodes = _check_paths(paths, top_k, max_depth)
    T = len(nodes) + 1
    if T > max_nodes:
        raise InvalidTreeError(
            f"tree has {T} nodes (root included) but at most {max_nodes} are allowed; first node past the "
            f"limit is path {_fmt(nodes[max_nodes - 1])}; prune the tree or raise max_nodes"
        )
    K = top_k if top_k is not None else max((max(p) for p in nodes), default=0) + 1
    D = max((len(p) for p in nodes), default=0)

    index = {p: i + 1 for i, p in enumerate(nodes)}  # path -> node index
    depth = np.zeros(T, dtype=np.int64)  # [T]
    parent = np.full(T, -1, dtype=np.int64)  # [T]
    gather = np.zeros(T, dtype=np.int64)  # [T]
    mask = np.eye(T, dtype=bool)  # [T, T]
    has_child = np.zeros(T, dtype=bool)  # [T]
    for i, p in enumerate(nodes, start=1):
        par = index.get(p[:-1], 0)
        depth[i], parent[i] = len(p), par
        gather[i] = 1 + (len(p) - 1) * K + p[-1]
        mask[i] |= mask[par]  # parents precede children, so mask[par] is complete
        has_child[par] = True

    leaves = np.flatnonzero(~has_child)  # [P], ascending node index
    retrieve = np.full((len(leaves), D + 1), -1, dtype=np.int64)  # [P, D+1]
    for row, leaf in enumerate(leaves):
        chain = np.flatnonzero(mask[leaf])  # ancestors + self; topological order = root first
        retrieve[row, : len(chain)] = chain
    path_lengths = depth[leaves] + 1  # [P]

    log.debug("compiled tree %r: %d nodes, depth %d, top-k %d, %d leaves", name, T, D, K, len(leaves))
    return CompiledTree(
        name=name,
        paths=tuple(nodes),
        top_k=K,
        depth_max=D,
        num_nodes=T,
        depth=_frozen(depth),
        parent=_frozen(parent),
        gather_index=_frozen(gather),
        mask=_frozen(mask),
        retrieve=_frozen(retrieve),
        path_lengths=_frozen(path_lengths),
    )


def chain_paths(n: int) -> list[list[int]]:
    """chain-N: each head's top-1 stacked, [[0], [0, 0], ...] (N paths). chain-0 is plain decoding."""
    return [[0] * d for d in range(1, n + 1)]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidTreeError(f"cannot read tree JSON file {path}: {e}") from e


def _resolve(spec, presets_file) -> tuple[str, list, int | None]:
    """resolve_tree plus the top_k a JSON object may record (as CompiledTree.to_json writes it)."""
    if isinstance(spec, (list, tuple)):
        return "custom", list(spec), None
    if not isinstance(spec, (str, os.PathLike)):
        raise InvalidTreeError(f"tree spec must be a preset name, 'chain-N', a JSON file or a list of paths, got {type(spec).__name__}")
    text = os.fspath(spec)
    if isinstance(spec, str) and text.startswith("chain-"):
        if not re.fullmatch(r"chain-\d+", text):
            raise InvalidTreeError(f"tree spec {text!r}: write chain-N with N a non-negative integer, e.g. chain-4")
        return text, chain_paths(int(text[len("chain-") :])), None
    file = Path(text)
    if file.is_file():
        data = _read_json(file)
        if isinstance(data, list):
            return file.stem, data, None
        if isinstance(data, dict) and "paths" in data:
            return str(data.get("name", file.stem)), data["paths"], data.get("top_k")
        raise InvalidTreeError(f"tree JSON file {file} must hold a list of paths or an object with key 'paths'")
    if not isinstance(spec, str) or text.endswith(".json"):
        raise InvalidTreeError(f"tree file {file} does not exist")

    presets_path = Path(presets_file) if presets_file else default_presets_file()
    if not presets_path.is_file():
        raise InvalidTreeError(
            f"tree preset {text!r} needs the presets file, but {presets_path} does not exist (an install built without "
            f"them: reinstall medusa-trt from a wheel); set {PRESETS_ENV} to a medusa_choices.json, or pass a JSON file of "
            "paths or chain-N"
        )
    presets = _read_json(presets_path)
    if not isinstance(presets, dict):
        raise InvalidTreeError(f"presets file {presets_path} must map preset names to lists of paths")
    if text not in presets:
        raise InvalidTreeError(f"unknown tree {text!r}; choose one of {', '.join(sorted(presets))}, chain-N, or a JSON file of paths")
    return text, presets[text], None


def resolve_tree(spec, *, presets_file: str | os.PathLike | None = None) -> tuple[str, list[list[int]]]:
    """Turn a spec (list of paths, 'chain-N', JSON file, preset name) into (name, paths)."""
    name, paths, _ = _resolve(spec, presets_file)
    return name, paths


def load_tree(
    spec, *, top_k: int | None = None, max_depth: int | None = None, max_nodes: int = DEFAULT_MAX_NODES, presets_file=None
) -> CompiledTree:
    """resolve_tree + compile_tree. An explicit top_k wins over one recorded in a JSON file."""
    name, paths, file_top_k = _resolve(spec, presets_file)
    if top_k is None and file_top_k is not None:
        if not _is_int(file_top_k):
            raise InvalidTreeError(f"tree {name!r}: 'top_k' must be an int, got {file_top_k!r}")
        top_k = int(file_top_k)
    return compile_tree(paths, top_k=top_k, max_depth=max_depth, max_nodes=max_nodes, name=name)
