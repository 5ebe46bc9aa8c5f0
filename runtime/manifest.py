"""The engine's file manifest: the size and sha256 of every file an export wrote.

``model.onnx.files.json`` sits beside ``model.onnx`` (``engine.plan.files.json`` beside ``engine.plan``) and lists each file of the
engine (graphs, external data, tokenizer files) by its path relative to the engine's folder.
Every load checks the sizes (a truncated or replaced file is named before ONNX Runtime reads
it); a server checks the sha256 sums once at load (``checksums=True``), which catches a file
corrupted in place. Engines exported before the manifest existed load with one log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from medusa_trt.runtime.durable import FOLDER_MANIFEST, write_text
from medusa_trt.runtime.engine import EngineError, EngineFiles

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
_CHUNK = 1 << 20


def manifest_path(files: EngineFiles) -> Path:
    """model.onnx -> model.onnx.files.json, engine.plan -> engine.plan.files.json (an ONNX export and
    the TensorRT plan built from it may share a folder and a stem); an engine folder's files.json."""
    if files.folder is not None:
        return files.folder / FOLDER_MANIFEST
    return files.step.with_name(files.step.name + ".files.json")


def engine_file_list(files: EngineFiles) -> list[Path]:
    """Every file that belongs to the engine: the graphs, their external data, the tokenizer files
    (in an engine folder: every file in it but the manifest and hidden ones)."""
    folder = files.step.parent
    if files.folder is not None:
        return sorted(
            p
            for p in files.folder.rglob("*")
            if p.is_file() and p.name != FOLDER_MANIFEST and not any(part.startswith(".") for part in p.relative_to(files.folder).parts)
        )
    found = []
    for p in (files.step, files.heads, files.sidecar):
        found += [q for q in (p, p.with_name(p.name + ".data")) if q.is_file()]
    found += [p for p in sorted(folder.glob(files.step.name + "*.data")) if p not in found]  # other external data names
    if files.tokenizer.is_dir():
        found += sorted(p for p in files.tokenizer.rglob("*") if p.is_file())
    return found


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _write_listing(path: Path, folder: Path, files: list[Path], kind: str) -> Path:
    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    write_text(path, json.dumps({"version": MANIFEST_VERSION, "kind": kind, "files": entries}, indent=1, sort_keys=True))
    return path


def write_manifest(files: EngineFiles) -> Path:
    """Record size and sha256 of every engine file (call it on the staged files, before they move).
    The manifest is also what proves a later export that it may replace these files (``runtime/durable.py``)."""
    return _write_listing(manifest_path(files), files.step.parent, engine_file_list(files), "engine")


def write_folder_manifest(folder: str | Path, kind: str) -> Path:
    """``files.json`` of a heads or FasterDecoding folder: size and sha256 of every file in it, which
    lets a later write replace the folder (``runtime/durable.py``: only what is provably ours is)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != FOLDER_MANIFEST)
    return _write_listing(folder / FOLDER_MANIFEST, folder, files, kind)


def _entries(path: Path, what: str) -> dict:
    """A manifest's ``files`` table (name -> {size, sha256}); ``EngineError`` "PATH is not a valid WHAT" when unreadable."""
    try:
        entries = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} is not a valid {what}") from exc
    if not isinstance(entries, dict):
        raise EngineError(f"{path} is not a valid {what}")
    return entries


def check_folder_manifest(folder: str | Path) -> bool:
    """Raise ``EngineError`` naming the first file a heads (or FasterDecoding) folder's ``files.json``
    lists that is missing or has another size or sha256; False when the folder has no manifest."""
    folder = Path(folder)
    path = folder / FOLDER_MANIFEST
    if not path.is_file():
        return False
    entries = _entries(path, "manifest: write the folder again")
    for name, entry in sorted(entries.items()):
        f = folder / name
        if not f.is_file() or f.stat().st_size != entry.get("size") or sha256(f) != entry.get("sha256"):
            raise EngineError(f"{f} is missing or differs from what {path.name} recorded: write the folder again")
    return True


def check_manifest(files: EngineFiles, *, checksums: bool = False) -> bool:
    """Raise ``EngineError`` naming the first engine file that is missing, has another size or
    (with ``checksums``) another sha256 than the export recorded. False when there is no manifest."""
    path = manifest_path(files)
    if not path.is_file():
        log.info("%s has no %s (exported before manifests): its files are not checked", files.step, path.name)
        return False
    entries = _entries(path, "engine manifest: export the engine again")
    folder = files.step.parent
    for name, entry in sorted(entries.items()):
        f = folder / name
        if not f.is_file():
            raise EngineError(f"engine file {f} is missing: copy the whole engine (every file listed in {path.name}) or export again")
        size = f.stat().st_size
        if size != entry.get("size"):
            raise EngineError(
                f"engine file {f} has {size} bytes but the export wrote {entry.get('size')} "
                "(truncated or replaced): copy it again or export again"
            )
    if checksums:
        for name, entry in sorted(entries.items()):
            f = folder / name
            if sha256(f) != entry.get("sha256"):
                raise EngineError(f"engine file {f} does not match its recorded sha256 (corrupted): copy it again or export again")
    return True
