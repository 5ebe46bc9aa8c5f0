"""What travels with an exported engine: its metadata and the files beside it.

An engine ``model.onnx`` (step graph) comes with ``model.heads.onnx`` (Medusa heads, absent
without heads), ``model.onnx.data`` (external weights, when large) and ``model.tokenizer/``.
``EngineMeta`` is stored as JSON under the key ``medusa_trt`` in both graphs' ``metadata_props``
and read back through ONNX Runtime, so this module needs neither torch nor the onnx package.
A TensorRT engine ``engine.plan`` comes with ``engine.heads.plan``, ``engine.tokenizer/`` and its
metadata in the sidecar ``engine.plan.json``.

An engine folder (``medusa-export --out DIR``) holds the same in one place, like optimum's and
onnxruntime-genai's model folders: ``config.json`` (the metadata, the graphs' inputs and outputs,
the file names; ``runtime/engine_folder.py``), ``model.onnx`` (+ ``model.onnx.data``),
``heads.onnx``, the tokenizer files at the top, ``generation_config.json``, ``drafting.json``, and
for TensorRT ``model.plan`` / ``heads.plan`` beside the ONNX graphs they were built from.
``EngineFiles.locate`` turns any of these forms into the paths the backends open.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

# EngineError and the metadata's names: imported from here by most of the package
from medusa_trt.runtime.engine_folder import FOLDER_CONFIG, FolderConfig, read_drafting, read_folder_config
from medusa_trt.runtime.engine_meta import FORMAT_VERSION, META_KEY, TENSORRT_BASELINE, EngineMeta, tensorrt_release  # noqa: F401
from medusa_trt.runtime.errors import EngineError

ENGINE_SUFFIXES = (".onnx", ".plan")  # an engine file; any other path is an engine folder
FOLDER_GRAPHS = {".onnx": ("model.onnx", "heads.onnx"), ".plan": ("model.plan", "heads.plan")}  # step, heads


@dataclass(frozen=True)
class EngineFiles:
    step: Path  # model.onnx (or engine.plan; DIR/model.onnx, DIR/model.plan)
    heads: Path  # model.heads.onnx (engine.heads.plan; DIR/heads.onnx, DIR/heads.plan)
    tokenizer: Path  # model.tokenizer/ (DIR itself: its tokenizer files lie at the top)
    folder: Path | None = None  # an engine folder; None: loose siblings of the step graph

    @classmethod
    def beside(cls, path: str | os.PathLike) -> EngineFiles:
        step = Path(path)
        stem = step.with_suffix("")
        heads = stem.with_name(stem.name + ".heads" + (step.suffix or ".onnx"))
        return cls(step=step, heads=heads, tokenizer=stem.with_name(stem.name + ".tokenizer"))

    @classmethod
    def in_folder(cls, folder: str | os.PathLike, suffix: str = ".onnx") -> EngineFiles:
        """The files of an engine folder whose graphs end in ``suffix`` (.onnx, or .plan for TensorRT)."""
        folder = Path(folder)
        step, heads = FOLDER_GRAPHS[suffix]
        return cls(step=folder / step, heads=folder / heads, tokenizer=folder, folder=folder)

    @classmethod
    def locate(cls, path) -> EngineFiles:
        """The files of the engine at ``path``: an ``.onnx`` / ``.plan`` file with its siblings, or an
        engine folder (TensorRT's plans when its config.json says it was built for TensorRT); an ``EngineSource``'s."""
        return EngineSource.read(path).files

    def check_heads(self, num_heads: int, *, fix: str = "export again") -> None:
        """Refuse an engine with Medusa heads whose heads graph is not beside its step graph."""
        if num_heads and not self.heads.is_file():
            raise EngineError(f"{self.heads} is missing: the engine has {num_heads} heads; copy it beside {self.step} or {fix}")

    @property
    def is_plan(self) -> bool:
        return self.step.suffix == ".plan"

    @property
    def sidecar(self) -> Path:
        """The metadata file: engine.plan.json for a TensorRT plan, which has no room for its own;
        an engine folder's config.json."""
        if self.folder is not None:
            return self.folder / FOLDER_CONFIG
        return self.step.with_name(self.step.name + ".json")

    @property
    def onnx(self) -> EngineFiles:
        """The ONNX graphs of this engine (a folder's TensorRT plans were built from them)."""
        return EngineFiles.in_folder(self.folder) if self.folder is not None else self


@dataclass(frozen=True)
class EngineSource:
    """An engine as found at a path, read once: its files, and for an engine folder its config.json (and drafting.json,
    on first use). ``MedusaRuntime`` reads one and hands it to the backend it opens, so a folder is read once per
    runtime; every function that takes an engine path takes an ``EngineSource`` too."""

    files: EngineFiles
    folder: FolderConfig | None = None  # an engine folder's config.json (None: loose files)

    @functools.cached_property
    def drafting(self) -> dict:
        """An engine folder's drafting.json ({} where absent, or loose files), read when first asked for."""
        return read_drafting(self.files.folder) if self.files.folder is not None else {}

    @classmethod
    def read(cls, path) -> EngineSource:
        if isinstance(path, EngineSource):
            return path
        path = Path(path)
        if path.suffix in ENGINE_SUFFIXES:
            return cls(EngineFiles.beside(path))
        if not path.is_dir():
            raise EngineError(
                f"engine {path} does not exist: export one with medusa-export --out {path} (a folder, or a file ending in .onnx / .plan)"
            )
        config = read_folder_config(path)
        return cls(EngineFiles.in_folder(path, ".plan" if config.backend == "tensorrt" else ".onnx"), config)


def check_tree_fits(tree, *, top_k: int, max_tokens: int | None) -> None:
    """Refuse a compiled heads template the engine cannot run: more proposals per head than its
    heads give (``top_k``), or more nodes than one step takes (``max_tokens``; None: no limit)."""
    if tree.top_k > top_k:
        raise EngineError(
            f"tree {tree.name} needs top-{tree.top_k} proposals per head but the engine's heads give top-{top_k}: "
            "use a tree with smaller indices, or export the engine with this tree"
        )
    if max_tokens is not None and tree.num_nodes > max_tokens:
        raise EngineError(
            f"tree {tree.name} has {tree.num_nodes} nodes but the engine takes at most {max_tokens} tokens per step: "
            "use a smaller tree, or export with a larger --max-tokens"
        )


def read_meta(path: str | os.PathLike, session=None) -> EngineMeta:
    """Metadata of an ONNX engine, with clear errors for missing, truncated or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise EngineError(f"engine file {path} does not exist: export one with medusa-export --out {path}")
    if session is None:
        session = open_session(path)
    props = session.get_modelmeta().custom_metadata_map
    if META_KEY not in props:
        raise EngineError(f"{path} is not a medusa-trt engine (no '{META_KEY}' metadata): export it with medusa-export")
    return EngineMeta.from_json(props[META_KEY], source=str(path))


def check_folder_meta(files: EngineFiles, meta: EngineMeta, folder: FolderConfig | None = None) -> None:
    """An engine folder's config.json (``folder``, where already read) must describe the graphs in it (a graph
    copied in from another export would otherwise run with the wrong tree, EOS ids or limits)."""
    if files.folder is None:
        return
    if (folder or read_folder_config(files.folder)).meta != meta:
        raise EngineError(
            f"{files.sidecar} does not describe {files.step.name} (their metadata differ): "
            "keep the files of one export together or export the folder again"
        )


def engine_meta(path) -> EngineMeta:
    """Any engine's metadata without loading its graphs: a folder's config.json, a plan's sidecar,
    an ONNX graph's ``metadata_props`` (``path``: or an ``EngineSource``)."""
    source = EngineSource.read(path)
    files = source.files
    if source.folder is not None:
        return source.folder.meta
    if not files.step.is_file():
        raise EngineError(f"engine file {files.step} does not exist: export one with medusa-export --out {files.step}")
    if files.is_plan:
        if not files.sidecar.is_file():
            raise EngineError(f"{files.sidecar} is missing: it holds the engine's metadata; copy it beside {files.step} or build again")
        return EngineMeta.from_json(files.sidecar.read_text(encoding="utf-8", errors="replace"), source=str(files.sidecar))
    from medusa_trt.runtime.onnx_props import onnx_metadata_props

    props = onnx_metadata_props(files.step)
    if META_KEY not in props:
        raise EngineError(f"{files.step} is not a medusa-trt engine (no '{META_KEY}' metadata): export it with medusa-export")
    return EngineMeta.from_json(props[META_KEY], source=str(files.step))


def open_session(path: Path, options=None, providers=None, disabled_optimizers=None):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers, disabled_optimizers=disabled_optimizers)
    except Exception as exc:  # noqa: BLE001 - ORT raises several unrelated types for unreadable files
        reason = " ".join(str(exc).split())[:300]
        raise EngineError(f"cannot load engine {path} (truncated, or not an ONNX file?): {reason}") from exc
