"""What a heads folder says its engine should be: ``export.json`` beside ``heads.json``.

Heads are tuned for one tree template and draft vocabulary (and drafted fastest with the heads graph
in int8); ``medusa-export --model M --heads H --out DIR`` with nothing else builds that engine, and
any of ``--tree`` / ``--draft-vocab`` / ``--quantize`` given on the command line wins::

  {"version": 1, "tree": "template.json", "draft_vocab": 16384, "quantize": "heads-int8"}

``tree``: a JSON file in the heads folder (name relative to it), a preset name or ``chain-N``;
``draft_vocab``: an integer or null; ``quantize``: a ``--quantize`` mode or null. A folder without
the file (every heads folder before it) exports as before: the runtime's defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.exporter.quantize import MODES as QUANTIZE_MODES
from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError

EXPORT_DEFAULTS = "export.json"
VERSION = 1


class ExportDefaultsError(MedusaError):
    """A heads folder's export.json cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class ExportDefaults:
    tree: str | None = None  # a tree spec for load_tree (a file here is an absolute path); None: the runtime's default
    draft_vocab: int | None = None  # None: the whole vocabulary
    quantize: str | None = None  # None: fp32 graphs

    def under(self, tree: str | None, draft_vocab: int | None, quantize: str | None, *, quantizable: bool) -> tuple[ExportDefaults, dict]:
        """The settings to export with: each asked one (not None; quantize "none": fp32 graphs), else
        this default; and what was taken from here ({setting: value}, for the user). ``quantizable``:
        the graphs are standard fp32 ONNX ones (not a .plan, plugin attention or fp16), which the heads'
        quantization needs."""
        taken = {}
        if tree is None and self.tree is not None:
            taken["tree"] = tree = self.tree
        if draft_vocab is None and self.draft_vocab is not None:
            taken["draft vocabulary"] = draft_vocab = self.draft_vocab
        if quantize is None and self.quantize is not None and quantizable:
            taken["quantize"] = quantize = self.quantize
        return ExportDefaults(tree, draft_vocab, None if quantize == "none" else quantize), taken


def read_export_defaults(heads: str | os.PathLike | None) -> ExportDefaults:
    """The defaults a heads folder carries (all None without a folder or its export.json)."""
    path = Path(heads) / EXPORT_DEFAULTS if heads else None
    if path is None or not path.is_file():
        return ExportDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ExportDefaultsError(
            f"{path} is not valid JSON ({exc}): fix it or remove it (the heads then export with the runtime's defaults)"
        ) from exc
    return _checked(raw, path)


def _checked(raw, path: Path) -> ExportDefaults:
    if not isinstance(raw, dict) or raw.get("version") != VERSION or set(raw) - {"version", "tree", "draft_vocab", "quantize"}:
        raise ExportDefaultsError(f'{path} must be an object with "version": {VERSION} and only "tree", "draft_vocab", "quantize"')
    tree, vocab, quantize = raw.get("tree"), raw.get("draft_vocab"), raw.get("quantize")
    if tree is not None and not isinstance(tree, str):
        raise ExportDefaultsError(f'{path}: "tree" must be a file name in the heads folder, a preset name or chain-N, got {tree!r}')
    if tree is not None and tree.endswith(".json"):
        tree = str((path.parent / tree).resolve())  # relative to the heads folder, so the folder travels whole
        if not Path(tree).is_file():
            raise ExportDefaultsError(f'{path}: "tree" names {tree}, which does not exist: copy the whole heads folder')
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ExportDefaultsError(f'{path}: "draft_vocab" must be a whole number >= 1 or null, got {vocab!r}')
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ExportDefaultsError(f'{path}: "quantize" must be one of {", ".join(QUANTIZE_MODES)} or null, got {quantize!r}')
    return ExportDefaults(tree, vocab, quantize)


def write_export_defaults(
    heads: str | os.PathLike, *, tree: str | None = None, draft_vocab: int | None = None, quantize: str | None = None
) -> Path:
    """Check, then write (whole or not at all) a heads folder's export.json; ``tree`` as it should
    appear in it (a file name in the folder, a preset, chain-N). Returns its path."""
    path = Path(heads) / EXPORT_DEFAULTS
    raw = {"version": VERSION, "tree": tree, "draft_vocab": draft_vocab, "quantize": quantize}
    _checked(raw, path)
    return durable.write_text(path, json.dumps(raw, indent=1) + "\n")
