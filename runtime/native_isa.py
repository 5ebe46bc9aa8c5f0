"""The instruction sets the native step is built for, one shared library each, as numpy builds its kernels.

``setup.py`` builds ``native_step.c`` + ``host_attention.c`` once per set this machine type has (five on x86-64,
one on Arm) into the package, as ``_native_<set>`` libraries; ``native_library.load`` picks the best one the CPU
runs at run time, capped by ``$MEDUSA_TRT_CPU_ISA`` (as oneDNN's ``ONEDNN_MAX_CPU_ISA`` caps its kernels).
``scripts/build_native.py`` builds the same libraries elsewhere (the sanitizer build, the Arm cross-compile).

Standard library only: ``setup.py`` loads this file by path, before the package is installed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CAP_VARIABLE = "MEDUSA_TRT_CPU_ISA"  # caps the instruction set: one of ISAS' names
DIR_VARIABLE = "MEDUSA_TRT_NATIVE_DIR"  # a folder of libraries built by scripts/build_native.py, instead of the package's
HERE = Path(__file__).resolve().parent
SOURCES = ("native_step.c", "host_attention.c", "native_pool.c")  # compiled together into one library
HEADERS = ("native_simd.h", "native_pool.h")
# -ffp-contract=off: the compiler never fuses a multiply and an add on its own; native_simd.h's vf_fma says where
# they are fused, the same in every inlined copy of a kernel (the batch-invariance promise). Never -ffast-math.
COMPILE = ("-O3", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wno-psabi", "-Wno-unused-function")
LINK = ("-pthread", "-lm")


@dataclass(frozen=True)
class Isa:
    name: str
    machine: str  # the platform.machine() it builds on
    flags: tuple[str, ...]  # what the compiler targets


# best first; a library's index here is its MEDUSA_ISA and its bit in medusa_native_cpu()
ISAS = (
    Isa("avx512_vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic")),
    Isa("avx512", "x86_64", ("-march=x86-64-v4", "-mtune=generic")),
    Isa("avx2_vnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic")),  # AVX2 + AVX-VNNI (VEX)
    Isa("avx2", "x86_64", ("-march=x86-64-v3", "-mtune=generic")),
    Isa("baseline", "x86_64", ("-march=x86-64", "-mtune=generic")),
    Isa("neon", "aarch64", ("-march=armv8-a",)),
)
MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def for_machine(machine: str) -> tuple[Isa, ...]:
    """The sets built for a machine type (``platform.machine()``), best first; none for others."""
    arch = MACHINES.get(machine.lower())
    return tuple(i for i in ISAS if i.machine == arch)


def index(isa: Isa) -> int:
    return ISAS.index(isa)


def library_stem(isa: Isa) -> str:
    return f"_native_{isa.name}"


def source_hash(folder: Path = HERE) -> str:
    """What a library is built from (its sources and header), compiled into it and checked at load."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:16]


def defines(isa: Isa, folder: Path = HERE) -> tuple[str, ...]:
    return (f"-DMEDUSA_ISA={index(isa)}", f'-DMEDUSA_SOURCE="{source_hash(folder)}"')
