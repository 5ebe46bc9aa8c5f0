"""The compiled native step: the library for the best instruction set this CPU runs, built with the package.

``pip install`` (wheel or editable) builds one library per instruction set (``native_isa.ISAS``); nothing is
compiled at run time, so a machine without a C compiler runs the native step. ``load`` picks, once per process:

- the sets this CPU and its operating system run, asked of the lowest library (``medusa_native_cpu``: GCC's
  ``__builtin_cpu_supports``, which checks the OS saves the wide registers);
- at or below ``$MEDUSA_TRT_CPU_ISA`` where it is set (``avx512_vnni``, ``avx512``, ``avx2_vnni``, ``avx2``,
  ``baseline``, ``neon``): how the tests run every level on one machine;
- from the package folder, or from ``$MEDUSA_TRT_NATIVE_DIR`` (a build of one's own, ``scripts/build_native.py``:
  the sanitizer build).

Before a file is mapped it is checked: owned by this user or root and writable by no one else (file and folder),
a whole ELF file (a truncated one would kill the process with SIGBUS on first touch), built from the sources beside
it where they are there (an editable install's stale build), and of this module's ABI. Whatever fails is one
``NativeUnavailable`` line naming the fix; the backend picker then falls back to ONNX Runtime.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
import platform
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime import native_isa
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

ABI = 18  # native_step.c's ABI


class NativeUnavailable(MedusaError):
    """The native step's library cannot be loaded here (not built, unreadable, unsafe, or another CPU's)."""


@dataclass(frozen=True)
class Library:
    cdll: ctypes.CDLL
    isa: str  # the instruction set it was built for
    path: Path


def _folder() -> Path:
    chosen = os.environ.get(native_isa.DIR_VARIABLE)
    return Path(chosen).resolve() if chosen else native_isa.HERE


def _file(folder: Path, isa: native_isa.Isa) -> Path | None:
    stem = native_isa.library_stem(isa)
    for suffix in (*importlib.machinery.EXTENSION_SUFFIXES, ".so"):
        if (folder / f"{stem}{suffix}").is_file():
            return folder / f"{stem}{suffix}"
    return None


def _check_owner(path: Path) -> None:
    """Refuse a file or folder another user could have written: owned by us or root, no group or other write bit."""
    me = os.geteuid()
    for item in (path, path.parent):
        st = item.stat()
        if st.st_uid not in (me, 0):
            raise NativeUnavailable(f"{item} belongs to another user (uid {st.st_uid}): the native step loads only its own files")
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (item.is_dir() and st.st_mode & stat.S_ISVTX)  # /tmp is fine
        if shared:
            raise NativeUnavailable(f"{item} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it, or reinstall")


def _check_elf(path: Path) -> None:
    """A whole ELF shared object: every segment and the section table inside the file (dlopen maps past a truncated
    file's end, and the first touch there is a SIGBUS, not an error)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
            raise NativeUnavailable(f"{path} is not a 64-bit shared library ({size} bytes): reinstall medusa-trt")
        order = "<" if head[5] == 1 else ">"
        phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
        ends = [shoff + shentsize * shnum, phoff + phentsize * phnum]
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        if len(table) == phentsize * phnum:
            for i in range(phnum):
                offset, _, _, filesz = struct.unpack_from(order + "QQQQ", table, i * phentsize + 8)
                ends.append(offset + filesz)
    if max(ends) > size:
        raise NativeUnavailable(f"{path} is truncated ({size} bytes, its headers need {max(ends)}): reinstall medusa-trt")


def _open(path: Path) -> ctypes.CDLL:
    _check_owner(path)
    _check_elf(path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:  # a noexec mount, a missing libc symbol, another machine's file
        raise NativeUnavailable(f"cannot load {path}: {str(exc).splitlines()[0]}") from exc


def _cpu_sets(folder: Path, isas: tuple[native_isa.Isa, ...]) -> int:
    """The bits of the sets this CPU runs, asked of the lowest library (code every CPU of this type runs)."""
    lowest = _file(folder, isas[-1])
    if lowest is None:
        raise NativeUnavailable(
            f"the native step is not built in {folder}: install medusa-trt with its extension (pip install .), "
            "or run make native in a checkout"
        )
    lib = _open(lowest)
    lib.medusa_native_cpu.restype = ctypes.c_int
    return lib.medusa_native_cpu()


def choose(isas: tuple[native_isa.Isa, ...], supported: int, cap: str | None) -> native_isa.Isa:
    """The best set the CPU runs (``supported``: bits by ISAS index) at or below ``cap``."""
    names = [i.name for i in isas]
    if cap and cap not in names:
        machine = platform.machine()
        raise NativeUnavailable(f"{native_isa.CAP_VARIABLE}={cap} is not an instruction set of this {machine} CPU: use {', '.join(names)}")
    allowed = isas[names.index(cap) :] if cap else isas
    for isa in allowed:
        if supported >> native_isa.index(isa) & 1:
            return isa
    raise NativeUnavailable(f"this CPU runs none of {', '.join(i.name for i in allowed)}")


def load(cap: str | None = None) -> Library:
    """The native step's library for this CPU, at or below ``cap`` (default ``$MEDUSA_TRT_CPU_ISA``): loaded once a
    process; ``NativeUnavailable`` where it cannot be had."""
    return _load(cap or os.environ.get(native_isa.CAP_VARIABLE) or None)


@functools.cache
def _load(cap: str | None) -> Library:
    isas = native_isa.for_machine(platform.machine())
    if not isas:
        raise NativeUnavailable(f"the native step is built for x86-64 and Arm64 CPUs, not {platform.machine()}")
    folder = _folder()
    isa = choose(isas, _cpu_sets(folder, isas), cap)
    path = _file(folder, isa)
    if path is None:
        raise NativeUnavailable(f"the native step's {isa.name} library is missing from {folder}: reinstall medusa-trt (or make native)")
    lib = _open(path)
    lib.medusa_native_abi.restype = ctypes.c_int
    lib.medusa_native_source.restype = ctypes.c_char_p
    if lib.medusa_native_abi() != ABI:
        raise NativeUnavailable(f"{path} has ABI {lib.medusa_native_abi()}, this medusa-trt needs {ABI}: reinstall (or make native)")
    built_from = lib.medusa_native_source().decode()
    if all((folder / name).is_file() for name in (*native_isa.SOURCES, *native_isa.HEADERS)):
        if built_from != native_isa.source_hash(folder):
            raise NativeUnavailable(f"{path} was built from other sources than those beside it: rebuild (make native, or pip install)")
    log.info("native step: %s (%s)", isa.name, path.name)
    return Library(lib, isa.name, path)


def unavailable(cap: str | None = None) -> str | None:
    """Why the native step cannot run here, or None where it can."""
    try:
        load(cap)
    except NativeUnavailable as exc:
        return str(exc)
    return None
