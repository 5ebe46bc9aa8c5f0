"""scripts/gpu_preflight.py: the GPU check's imports, checked on CPU before a GPU machine's minutes are spent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_preflight.py"


def _module():
    return script("gpu_preflight")


def test_every_import_of_the_gpu_check_resolves_here(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--link-into", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("gpu-preflight:") and "missing" not in run.stdout
    linked = sorted(p.name for p in (tmp_path / "medusa_trt").iterdir())
    assert {"serving", "bench", "runtime", "exporter", "plugins", "training", "cli"} <= set(linked)


def test_imports_of_tells_required_from_optional(tmp_path):
    source = tmp_path / "t.py"
    source.write_text(
        "import os\nfrom medusa_trt.runtime import x\ntry:\n    import gguf\nexcept ImportError:\n    gguf = None\n"
        "import pytest\nonnx = pytest.importorskip('onnx')\n"
    )
    found = _module().imports_of(source)
    assert found == {"os": True, "medusa_trt.runtime": True, "gguf": False, "pytest": True, "onnx": False}


def test_gpu_check_links_its_package_path_with_the_preflight(tmp_path):
    """gpu_check.sh, gpu_compare.sh and the dry run build the package path one way (gpu_preflight.py, from
    pyproject.toml, through gpu_env.sh), so they cannot link different packages; --links-only imports nothing."""
    env = (SCRIPT.parent / "gpu_env.sh").read_text()
    assert 'gpu_preflight.py --link-into "$links" --links-only' in env and "ln -s" not in env
    for name in ("gpu_check.sh", "gpu_compare.sh"):
        script = (SCRIPT.parent / name).read_text()
        assert ". scripts/gpu_env.sh" in script and "gpu_env /tmp/medusa-src /tmp/medusa-site" in script and "ln -s" not in script
    assert "gpu_preflight.py --link-into" in (SCRIPT.parent / "gpu_check_dry.sh").read_text()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--link-into", str(tmp_path), "--links-only"], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0 and run.stdout == "", run.stdout + run.stderr
    import tomllib

    mapped = tomllib.loads((SCRIPT.parent.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert sorted(p.name for p in (tmp_path / "medusa_trt").iterdir()) == sorted(n.split(".", 1)[1] for n in mapped)


def test_gpu_trt_check_without_tensorrt_says_not_run_in_one_line(tmp_path):
    """make gpu-check's TensorRT step where TensorRT is absent: one line, exit 77 (not run, not failed)."""
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is importable here: the not-run path cannot be shown")
    out = tmp_path / "gpu-trt.json"
    command = [sys.executable, str(SCRIPT.parent / "gpu_trt_check.py"), "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 77, run.stdout + run.stderr
    assert run.stdout.startswith("gpu-trt: not run: tensorrt is not importable") and run.stdout.count("\n") == 1, run.stdout
    assert json.loads(out.read_text())["status"] == "not-run"
