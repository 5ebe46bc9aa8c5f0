"""Durable writes: every file and folder this project writes is replaced whole, and nothing a user owns is lost.

One tested way, used by every writer (exports, TensorRT builds, heads, training, benchmarks, Triton
repositories). Terms: the *target* is the path being written; a *leftover* is a hidden entry beside
it, ``.<target name>.<step>.<pid>.<n>@<host>``, that names the process which made it, so the next
writer can tell it is ours and that its writer is gone.

* A file: ``write_text`` / ``write_bytes`` / ``staged_file`` write a temporary file beside the
  target, flush it to disk (fsync), rename it over the target (``os.replace``) and flush the folder
  entry. A reader, or the disk after a crash, holds the old content or the new, never half.
* A folder: ``make_staging`` builds a hidden folder beside the target (step ``new``), and
  ``replace_folder`` swaps it in: one atomic exchange where the OS has one (Linux renameat2
  ``RENAME_EXCHANGE``), else target -> backup (step ``old``), new -> target, backup removed, the
  backup put back on failure. The old folder is never deleted before the new one is in place.
* A set of loose files (``X.onnx``, ``X.onnx.data``, ``X.heads.onnx``, ``X.tokenizer/``, ...):
  ``replace_set`` sets the old members aside in one folder (step ``set``) whose journal says which
  members existed, moves the new ones in (the main file last), then removes what it set aside.

A writer killed at any point leaves the old or the new at the target, or the old in a leftover
that the next writer to the same target puts back (``recover``, run by ``make_staging``).

And one rule, ``check_folder_ours`` / ``check_set_ours``: something is replaced only if it is
provably ours: its manifest (``files.json``; ``X.onnx.files.json`` beside loose files, written
by ``runtime/manifest.py``) is of the same kind and lists every file there at its recorded size.
Anything else (a model folder, a folder with a ``config.json`` of its own) is refused with
``NotOursError``, naming the first file that is not ours. A missing path or an empty folder is fine.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

FOLDER_MANIFEST = "files.json"  # in every folder this project writes (engine, heads, FasterDecoding heads)
KINDS = ("engine", "heads", "fasterdecoding", "eagle")  # what a manifest says its folder is; none said: "engine" (the first)
STEPS = ("new", "old", "set", "done")  # leftovers: a staged file or folder, a folder's backup, a set aside, one to remove
JOURNAL = "journal.json"  # in a set-aside folder: the set's member names and which of them existed
LEGACY_OWNER = ".owner"  # staging folders of earlier versions held "pid host" in this file
_counter = itertools.count()


class NotOursError(MedusaError):
    """A path this project would replace holds something it did not write; the message names it."""


# ----------------------------------------------------------------------------- files


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename is durable only once its folder is)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folders themselves (before the folder is swapped in)."""
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                _fsync_file(path)
        fsync_dir(root)


def leftover(target: Path, step: str, suffix: str = "") -> Path:
    """A fresh hidden path beside ``target`` for one ``step`` of this process: ``.NAME.STEP.PID.N@HOST``
    (+ ``suffix``: a staged file keeps its target's, which some writers read its format from)."""
    assert step in STEPS
    return target.with_name(f".{target.name}.{step}.{os.getpid()}.{next(_counter)}@{socket.gethostname()}{suffix}")


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix) to write; when the block succeeds it is
    flushed and renamed over ``path``. Whatever happens no temporary file is left."""
    path = Path(path)
    recover(path)
    tmp = leftover(path, "new", path.suffix)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def staged_files(*paths: Path) -> Iterator[list[Path]]:
    """``staged_file`` for several targets: each temporary path that was written is renamed onto its
    target, in order, once the block succeeds; one that was not written leaves its target alone."""
    paths = [Path(p) for p in paths]
    for path in paths:
        recover(path)
    temps = [leftover(p, "new", p.suffix) for p in paths]
    try:
        yield temps
        for tmp, path in zip(temps, paths):
            if tmp.exists():
                _fsync_file(tmp)
                os.replace(tmp, path)
        for folder in {p.parent for p in paths}:
            fsync_dir(folder)
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all."""
    path = Path(path)
    with staged_file(path) as tmp:
        tmp.write_bytes(data)
    return path


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` whole or not at all."""
    return write_bytes(path, text.encode(encoding))


# ----------------------------------------------------------------------------- leftovers


@dataclass(frozen=True)
class Leftover:
    path: Path
    step: str  # one of STEPS
    pid: int
    host: str

    @property
    def writer_gone(self) -> bool:
        """True only when the writer ran on this host and has exited (a running one, another user's
        included, or one on another host sharing the folder is left alone)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)  # signal 0: an existence check only
        except ProcessLookupError:
            return True
        except PermissionError:  # runs, as another user
            return False
        return False


def parse_leftover(path: Path, target: Path) -> Leftover | None:
    """The leftover ``path`` of a write to ``target``, or None for any other name."""
    prefix = f".{target.name}."
    if not path.name.startswith(prefix) or "@" not in path.name:
        return None
    head, host = path.name[len(prefix) :].rsplit("@", 1)
    parts = head.split(".")
    if len(parts) != 3 or parts[0] not in STEPS or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    host = host.removesuffix(target.suffix) if target.suffix and host.endswith(target.suffix) else host  # staged_file keeps the suffix
    return Leftover(path, parts[0], int(parts[1]), host)


def _legacy_owner_gone(folder: Path) -> bool:
    """A staging folder of an earlier version (``.owner`` holds "pid host") whose writer is gone."""
    try:
        pid, host = (folder / LEGACY_OWNER).read_text().split()
        return Leftover(folder, "new", int(pid), host).writer_gone
    except (OSError, ValueError):
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def recover(target: str | os.PathLike) -> list[Path]:
    """Finish what killed writers to ``target`` left: a backup whose target is gone is put back, a
    set aside is rolled back, staged and removable leftovers go. Only leftovers of processes of this
    host that have exited are touched. Returns the leftovers handled."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    found = []
    for path in sorted(target.parent.iterdir()):
        left = parse_leftover(path, target)
        if left is None:
            if path.name.startswith(f".{target.name}.") and path.is_dir() and _legacy_owner_gone(path):
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed %s, left by an export that was killed", path)
                found.append(path)
            continue
        if not left.writer_gone:
            continue
        found.append(path)
        if left.step == "old" and not os.path.lexists(target):
            os.rename(path, target)
            fsync_dir(target.parent)
            log.warning("put back %s: a write to it was killed between its two renames", target)
        elif left.step == "set":
            _roll_back(path, target.parent)
            log.warning("rolled back %s: a write of its files was killed midway", target)
        else:
            _remove(path)
            log.info("removed %s, left by a write to %s that was killed", path, target.name)
    return found


# ----------------------------------------------------------------------------- folders


def make_staging(target: str | os.PathLike) -> Path:
    """A fresh hidden folder beside ``target`` to build its new content in, after what killed writers
    to the same target left has been handled (``recover``)."""
    target = Path(target)
    recover(target)
    staging = leftover(target, "new")
    os.mkdir(staging, 0o755)
    return staging


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system or kernel has no exchange
        return False
    raise OSError(errno, os.strerror(errno), str(a), None, str(b))


def replace_folder(staged: Path, target: Path) -> None:
    """Put the staged folder at ``target``; an old folder there is removed only once the new one is
    in place. A failure leaves the old one (and removes the staged one)."""
    staged, target = Path(staged), Path(target)
    fsync_tree(staged)
    if not os.path.lexists(target):
        os.rename(staged, target)
        fsync_dir(target.parent)
        return
    if _exchange(staged, target):  # target: the new folder; staged's name: the old one
        fsync_dir(target.parent)
        shutil.rmtree(staged, ignore_errors=True)  # a kill here leaves a "new" leftover: removed by the next writer
        return
    backup = leftover(target, "old")
    os.rename(target, backup)  # a kill from here to the next rename: the next writer puts the backup back
    try:
        os.rename(staged, target)
    except BaseException:
        os.rename(backup, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging folder for ``target``; when the block succeeds it replaces ``target``
    (``replace_folder``). Whatever happens no staging folder is left."""
    target = Path(target)
    staging = make_staging(target)
    try:
        yield staging
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ----------------------------------------------------------------------------- sets of loose files


def replace_set(staged: Path, folder: Path, names: Sequence[str], main: str) -> None:
    """Replace the set of loose files ``names`` in ``folder`` (files or folders, ``main`` among them)
    by what ``staged`` holds of them: the old members are set aside with a journal, the staged ones
    moved in (``main`` last), then what was set aside is removed; a failure rolls the set back. Old
    members without a staged successor are removed with the set."""
    staged, folder = Path(staged), Path(folder)
    assert main in names
    fsync_tree(staged)
    aside = leftover(folder / main, "set")
    os.mkdir(aside, 0o700)
    present = [n for n in names if os.path.lexists(folder / n)]
    write_text(aside / JOURNAL, json.dumps({"names": list(names), "present": present}))
    try:
        for name in sorted(present, key=lambda n: n != main):  # main first: no reader finds it with foreign siblings
            os.rename(folder / name, aside / name)
        for name in sorted((n for n in names if os.path.lexists(staged / n)), key=lambda n: n == main):
            os.rename(staged / name, folder / name)
        fsync_dir(folder)
    except BaseException:
        _roll_back(aside, folder)
        raise
    done = leftover(folder / main, "done")
    os.rename(aside, done)  # the commit point: from here on the new set stands
    fsync_dir(folder)
    shutil.rmtree(done, ignore_errors=True)


def _roll_back(aside: Path, folder: Path) -> None:
    """Undo a ``replace_set`` stopped midway (idempotent: a kill while rolling back is rolled back again)."""
    try:
        journal = json.loads((aside / JOURNAL).read_text())
        names, present = journal["names"], set(journal["present"])
    except (OSError, ValueError, KeyError, TypeError):  # no journal yet: nothing was moved
        shutil.rmtree(aside, ignore_errors=True)
        return
    for name in names:
        if os.path.lexists(aside / name):  # set aside: the old member goes back
            _remove(folder / name)
            os.rename(aside / name, folder / name)
        elif name not in present:  # moved in by the stopped write: not part of the old set
            _remove(folder / name)
    fsync_dir(folder)
    shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- what is ours


@dataclass(frozen=True)
class Listing:
    """A manifest as far as ownership goes: which kind of folder, and each file's size."""

    kind: str
    sizes: dict  # path relative to the manifest's folder -> bytes

    @classmethod
    def read(cls, path: Path) -> Listing | None:
        """The manifest at ``path``; None when absent or not one of ours."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            files = raw["files"]
            sizes = {str(name): int(entry["size"]) for name, entry in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        kind = raw.get("kind", "engine")
        return cls(kind, sizes) if kind in KINDS else None


_REMOVE_IT = "choose another {flag}, or move or remove it yourself"


def _not_ours(path: Path, why: str, flag: str) -> NotOursError:
    return NotOursError(f"{flag} {path} would be replaced, but {why}: {_REMOVE_IT.format(flag=flag)}")


def check_folder_ours(
    folder: str | os.PathLike, *, kind: str, flag: str = "--out", keep: Sequence[str] = (), manifest: str = FOLDER_MANIFEST
) -> None:
    """Raise ``NotOursError`` unless ``folder`` may be replaced: it does not exist, holds no file, or
    is a ``kind`` folder whose manifest lists every file in it at its recorded size. ``keep``: names
    (relative to the folder) the writer carries into the new folder, which need no listing."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        return
    if folder.is_symlink() or not folder.is_dir():
        raise _not_ours(folder, "it is a file or a link, not a folder this project wrote", flag)
    files = sorted(p for p in folder.rglob("*") if p.is_symlink() or not p.is_dir())
    if not files:
        return
    listing = Listing.read(folder / manifest)
    if listing is None:
        first = next((p for p in files if p.name != manifest), files[0])
        raise _not_ours(folder, f"{first} is not a file medusa-trt wrote (the folder has no medusa-trt {manifest})", flag)
    if listing.kind != kind:
        raise _not_ours(folder, f"it holds medusa-trt {listing.kind} files, not {kind} files", flag)
    for path in files:
        name = path.relative_to(folder).as_posix()
        if name == manifest or name in keep:
            continue
        _check_listed(path, name, listing, folder / manifest, flag, folder)


def _check_listed(path: Path, name: str, listing: Listing, manifest: Path, flag: str, shown: Path) -> None:
    if name not in listing.sizes or path.is_symlink():
        raise _not_ours(shown, f"{path} is not a file medusa-trt wrote (not listed in {manifest.name})", flag)
    if path.stat().st_size != listing.sizes[name]:
        raise _not_ours(shown, f"{path} was changed after medusa-trt wrote it (its size differs from {manifest.name})", flag)


def check_set_ours(folder: str | os.PathLike, names: Sequence[str], manifest: str, *, flag: str = "--out", main: str = "") -> None:
    """Raise ``NotOursError`` unless every existing member of the loose set ``names`` in ``folder``
    (files, or folders whose every file counts) is listed in the manifest ``manifest`` beside them."""
    folder = Path(folder)
    shown = folder / (main or names[0])
    existing = []
    for name in names:
        path = folder / name
        if name == manifest or not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():
            existing += sorted(p for p in path.rglob("*") if p.is_symlink() or not p.is_dir())
        else:
            existing.append(path)
    if not existing:
        return
    listing = Listing.read(folder / manifest)
    if listing is None:
        raise _not_ours(shown, f"{existing[0]} is not a file medusa-trt wrote (there is no medusa-trt {manifest} beside it)", flag)
    if listing.kind != "engine":
        raise _not_ours(shown, f"{folder / manifest} lists medusa-trt {listing.kind} files, not an engine's", flag)
    for path in existing:
        _check_listed(path, path.relative_to(folder).as_posix(), listing, folder / manifest, flag, shown)


def link_files(paths, root: Path, dest: Path) -> None:
    """Each of ``paths`` (under ``root``) at the same relative name under ``dest``: a hard link where
    the file system allows (engine weights are hundreds of MB), else a copy."""
    for src in paths:
        target = dest / src.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, target)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(src, target)
