"""scripts/gpu_preflight.py: the GPU check's imports, checked on CPU before a GPU machine's minutes are spent."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_preflight.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_preflight", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
