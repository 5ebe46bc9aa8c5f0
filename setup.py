"""Build hook: the published Medusa tree presets ship inside the package as data.

Their source is ``shared/trees/medusa_choices.json`` beside the checkout (or the folder named by
``MEDUSA_TRT_SHARED``); a wheel or sdist built from the checkout carries them as
``medusa_trt/runtime/presets/medusa_choices.json``, so a wheel install resolves every preset name
with no environment variable. An editable install reads the source file in place
(``runtime/tree.py``). Everything else about the build is in pyproject.toml.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
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


setup(cmdclass={"build_py": BuildPyWithPresets, "sdist": SdistWithPresets})
