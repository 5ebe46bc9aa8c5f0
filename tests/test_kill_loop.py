"""kill -9 at random points of medusa-export (an engine folder and a loose .onnx engine) and medusa-train (a heads
folder): every earlier version stays whole and loadable, and the next writer clears what a killed one left
(``scripts/kill_loop.py``, which runs 20 kills by hand; a few here)."""

from __future__ import annotations

import pytest
from conftest import STORIES
from helpers import script

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")


@pytest.mark.slow
def test_no_kill_leaves_a_target_half_written(tmp_path, capsys):
    kill_loop = script("kill_loop")
    assert kill_loop.MODEL.resolve() == STORIES.resolve()
    assert kill_loop.main(["--kills", "6", "--seed", "3", "--work", str(tmp_path / "work")]) == 0  # 1: leftovers stayed
    printed = capsys.readouterr().out
    assert "6 kills:" in printed and "every target whole and loadable" in printed and "leftovers none" in printed, printed
