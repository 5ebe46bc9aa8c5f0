"""Build hooks: the native step's libraries, and the published Medusa tree presets as package data.

The native step (``runtime/native_step.c`` with ``runtime/host_attention.c``) is built here, once per instruction
set of this machine type (``runtime/native_isa.py``), into the package as plain shared libraries that
``runtime/native_library.py`` loads with ctypes: a wheel carries them and needs no compiler where it is installed;
an editable install builds them beside the sources (``make native`` rebuilds them after an edit).

Their source is ``shared/trees/medusa_choices.json`` beside the checkout (or the folder named by
``MEDUSA_TRT_SHARED``); a wheel or sdist built from the checkout carries them as
``medusa_trt/runtime/presets/medusa_choices.json``, so a wheel install resolves every preset name
with no environment variable. An editable install reads the source file in place
(``runtime/tree.py``). Everything else about the build is in pyproject.toml.
"""

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PRESETS = Path("runtime") / "presets" / "medusa_choices.json"  # in the source tree (an sdist carries it there)
PACKAGED = Path("medusa_trt") / "runtime" / "presets" / "medusa_choices.json"  # in the wheel


def presets_source() -> Path:
    """The presets file to package: one already in the tree (an sdist), else the shared folder's."""
    if (HERE / PRESETS).is_file():
        return HERE / PRESETS
    shared = Path(os.environ.get("MEDUSA_TRT_SHARED") or HERE.parent / "shared")
    source = shared / "trees" / "medusa_choices.json"
    if not source.is_file():
        raise SystemExit(
            f"medusa-trt build: the tree presets {source} are missing: lay shared/ beside the checkout "
            "or set MEDUSA_TRT_SHARED to the folder holding trees/medusa_choices.json"
        )
    return source


class BuildPyWithPresets(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the presets where they are
        target = Path(self.build_lib) / PACKAGED
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(presets_source(), target)


class SdistWithPresets(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / PRESETS
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(presets_source(), target)


def _native_isa():
    spec = importlib.util.spec_from_file_location("native_isa", HERE / "runtime" / "native_isa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def native_extensions() -> list[Extension]:
    """One library per instruction set this machine type has (none on others: the native backend then says so)."""
    isa = _native_isa()
    runtime = Path("runtime")
    return [
        Extension(
            f"medusa_trt.runtime.{isa.library_stem(each)}",
            sources=[str(runtime / name) for name in isa.SOURCES],
            depends=[str(runtime / name) for name in isa.HEADERS],
            extra_compile_args=[*isa.COMPILE, *each.flags, *isa.defines(each, HERE / "runtime")],
            extra_link_args=list(isa.LINK),
        )
        for each in isa.for_machine(platform.machine())
    ]


class BuildNative(build_ext):
    """Each library's objects in a folder of its own: the same sources compile once per instruction set."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base

    def get_export_symbols(self, ext):
        return []  # plain C libraries loaded with ctypes, not Python modules (no PyInit_)


setup(
    ext_modules=native_extensions(),
    cmdclass={"build_py": BuildPyWithPresets, "sdist": SdistWithPresets, "build_ext": BuildNative},
)
