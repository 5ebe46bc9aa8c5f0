"""scripts/prefill_share.py: each row's end-to-end time split into its prompt and its decoding, on a real engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORY_PROMPTS, medusa_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prefill_share.py"


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


def _prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in STORY_PROMPTS[:3]))
    return path


@pytest.mark.parametrize("plain", [False, True])
def test_every_row_is_split_into_prompt_and_decoding(engine, tmp_path, plain):
    out = tmp_path / "share.json"
    args = ["--engine", str(engine), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "24", "--threads", "1", "--out", str(out)]
    args += ["--plain"] if plain else []
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    row = report["rows"][str(engine)]
    assert report["prompts"] == 3 and row["mode"] == ("plain" if plain else "default drafting")
    assert 0 < row["prefill_s"] < row["total_s"] and 0 < row["prefill_share"] < 1
    assert row["prompt_tokens"] > 3 and 3 <= row["new_tokens"] <= 3 * 24  # a story may end before 24 tokens
    assert row["decode_tok_s"] > 0 and row["end_to_end_tok_s"] > 0
    assert "| row | prefill ms / prompt token |" in done.stderr


def test_bad_input_is_one_line_and_exit_2(engine, tmp_path):
    cases = [
        (["--engine", str(tmp_path / "none"), "--prompts", str(_prompts(tmp_path))], "does not exist"),
        (["--engine", str(engine), "--prompts", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--engine", str(engine), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "100000"], "lower it"),
        (["--engine", str(engine), "--prompts", str(_prompts(tmp_path)), "--peer", "nosuch:x"], "--peer"),
    ]
    for args, says in cases:
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and says in last and "Traceback" not in done.stderr, (args, done.stderr[-800:])
