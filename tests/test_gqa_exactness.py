"""scripts/gqa_exactness.py: ONNX Runtime's GroupQueryAttention checked against a float64 reference, and its
verify-vs-plain comparison counted per node."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gqa_exactness.py"


def test_gqa_matches_the_reference_and_counts_exact_nodes(tmp_path):
    out = tmp_path / "gqa.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--context", "0", "--context", "37", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    cases = {(c["layout"], c["context"]): c for c in report["cases"]}
    assert set(cases) == {(layout, n) for layout in ("chain", "tree") for n in (0, 37)}
    for c in cases.values():
        assert c["appended_in_place"]  # present shares past's buffer: the step's keys land in the caller's cache
        assert c["max_abs_error_vs_float64"] < 1e-5  # the tree's bias masks exactly what the reference masks
        assert 0 <= c["equal_one_row_plain"] <= c["nodes"] and 0 <= c["equal_two_row_plain"] <= c["nodes"]
    assert "| tree | 37 |" in done.stderr  # the table, logged


@pytest.mark.parametrize("tree", ["0,0", "-1,2,0", "-1,x"])
def test_a_bad_tree_is_one_line_and_exit_2(tree):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tree", tree], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tree" in done.stderr.splitlines()[-1] and "Traceback" not in done.stderr
