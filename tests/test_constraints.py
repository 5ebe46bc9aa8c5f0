"""Pinned dependencies: pyproject.toml caps the libraries whose releases change what the
exporter writes below their next minor release, and ``make`` installs exactly ``constraints.txt``.

The second check reads this environment: after ``make install`` every package the constraints name
is installed at that version. It skips only where the environment says newer releases are being tried
on purpose (``make install CONSTRAINTS=`` exports MEDUSA_TRT_CONSTRAINTS empty).
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CAPPED = ("transformers", "tokenizers", "onnx", "onnxruntime", "torch")  # each below its next minor release


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.]+", version), f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        found += [Requirement(r) for r in extra if not r.startswith("medusa-trt")]
    return found


def test_fast_moving_libraries_are_capped_below_their_next_minor_release():
    pins = _constraints()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name not in CAPPED:
            continue
        tested = Version(pins[name])
        assert tested in req.specifier, f"pyproject.toml's {req} does not admit the tested {name} {tested}"
        next_minor = Version(f"{tested.major}.{tested.minor + 1}")
        assert next_minor not in req.specifier, f"pyproject.toml's {req} admits {name} {next_minor}, a release the suite never ran on"


def test_every_range_admits_the_constrained_version():
    pins = _constraints()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in pins:
            assert Version(pins[name]) in req.specifier, f"pyproject.toml's {req} excludes constraints.txt's {name}=={pins[name]}"


def test_this_environment_holds_the_constrained_versions():
    if os.environ.get("MEDUSA_TRT_CONSTRAINTS", "constraints.txt") == "":
        pytest.skip("make install CONSTRAINTS= (newer releases on purpose): nothing to compare")
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {
        name: (want, installed.get(name))
        for name, want in _constraints().items()
        if installed.get(name) is None or Version(installed[name]).public != Version(want).public
    }
    assert not wrong, f"installed versions differ from constraints.txt (name: (constrained, installed)): {wrong}; run make install"
