"""``medusa-train`` on bad input: one line on stderr, a non-zero exit, no traceback, nothing written.

Every case would otherwise have failed late (after generation), with a traceback, or left
``<out>`` / ``<out>.work`` behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORIES

# (case id, arguments replacing or adding to the good ones, a fragment of the expected message)
CASES = [
    ("epochs-0", ["--epochs", "0"], "--epochs 0 must be a whole number >= 1"),
    ("epochs-negative", ["--epochs", "-2"], "--epochs -2 must be"),
    ("batch-size-0", ["--batch-size", "0"], "--batch-size 0 must be"),
    ("checkpoint-every-0", ["--checkpoint-every", "0"], "--checkpoint-every 0 must be"),
    ("heads-0", ["--heads", "0"], "--heads 0 must be"),
    ("layers-0", ["--layers", "0"], "--layers 0 must be"),
    ("num-prompts-0", ["--num-prompts", "0"], "--num-prompts 0 must be"),
    ("new-tokens-0", ["--new-tokens", "0"], "--new-tokens 0 must be"),
    ("new-tokens-past-the-context", ["--new-tokens", "100000"], "--new-tokens 100000 leaves no room for the prompt"),
    ("lr-0", ["--lr", "0"], "--lr 0.0 must be a positive number"),
    ("lr-negative", ["--lr", "-0.001"], "--lr -0.001 must be a positive number"),
    ("lr-nan", ["--lr", "nan"], "--lr nan must be a positive number"),
    ("lr-inf", ["--lr", "inf"], "--lr inf must be a positive number"),
    ("decay-0", ["--decay", "0"], "--decay 0.0 must be in (0, 1]"),
    ("decay-above-1", ["--decay", "1.5"], "--decay 1.5 must be in (0, 1]"),
    ("decay-nan", ["--decay", "nan"], "--decay nan must be in (0, 1]"),
    ("seed-negative", ["--seed", "-1"], "--seed -1 must be"),
    ("seed-too-large", ["--seed", str(2**40)], "must be at most"),
    ("head-layer-negative", ["--head-layer", "-1"], "--head-layer -1 must be a decoder layer index"),
    ("head-layer-past-the-model", ["--head-layer", "99"], "--head-layer 99 is out of range"),
    ("teacher-forced-without-data", ["--teacher-forced", "--data", None], "--teacher-forced needs --data"),
    ("data-missing", ["--data", "{tmp}/none.txt"], "none.txt does not exist"),
    ("data-a-folder", ["--data", "{tmp}"], "is not a file"),
    ("data-empty", ["--data", "{tmp}/empty.txt"], "holds no prompts"),
    ("data-not-utf8-txt", ["--data", "{tmp}/latin1.txt"], "latin1.txt line 2 is not UTF-8 text"),
    ("data-not-utf8-jsonl", ["--data", "{tmp}/latin1.jsonl"], "latin1.jsonl line 2 is not UTF-8 text"),
    ("data-not-json", ["--data", "{tmp}/broken.jsonl"], "broken.jsonl line 2 is not JSON"),
    ("data-not-an-object", ["--data", "{tmp}/list.jsonl"], "list.jsonl line 1 is not a JSON object"),
    ("data-no-prompt-field", ["--data", "{tmp}/fields.jsonl"], "fields.jsonl line 1 has no turns, prompt or text field"),
    ("data-prompt-not-text", ["--data", "{tmp}/number.jsonl"], "number.jsonl line 1: the prompt"),
    ("data-evaluation-set", ["--data", "{tmp}/spec_bench.jsonl"], "is the evaluation set"),
    ("out-folder-missing", ["--out", "{tmp}/no/heads"], "folder"),
    ("out-a-file", ["--out", "{tmp}/empty.txt"], "is a file"),
    ("work-folder-a-file", ["--out", "{tmp}/blocked"], "blocked.work (the work folder of --out"),
    ("model-missing", ["--model", "{tmp}/none.gguf"], "not found"),
    ("model-not-gguf", ["--model", "{tmp}/stories.txt"], "is not a .gguf file"),
    ("generate-engine-missing", ["--generate-engine", "{tmp}/none.onnx"], "--generate-engine"),
]


def _files(tmp_path: Path) -> None:
    (tmp_path / "stories.txt").write_text("Once upon a time\nTom and his dog\nLily found a\nThe cat saw a\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("Once upon a time\nLily went to the caf\u00e9\n".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "hi"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "no end\n')
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "fields.jsonl").write_text('{"question": "hi"}\n')
    (tmp_path / "number.jsonl").write_text('{"prompt": 3}\n')
    (tmp_path / "spec_bench.jsonl").write_text('{"turns": ["hi"]}\n')
    (tmp_path / "blocked.work").write_text("not a folder")


def _argv(tmp_path: Path, extra: list[str | None]) -> list[str]:
    good = {
        "--model": str(STORIES),
        "--out": str(tmp_path / "heads"),
        "--data": str(tmp_path / "stories.txt"),
        "--num-prompts": "4",
        "--new-tokens": "8",
        "--epochs": "1",
        "--batch-size": "64",
    }
    flags: list[str] = []
    i = 0
    while i < len(extra):
        flag = extra[i]
        if flag == "--teacher-forced":
            flags.append(flag)
            i += 1
            continue
        value = extra[i + 1]
        if value is None:
            good.pop(flag)
        elif flag in good:
            good[flag] = value.format(tmp=tmp_path)
        else:
            flags += [flag, value.format(tmp=tmp_path)]
        i += 2
    return [part for pair in good.items() for part in pair] + flags


def _without_progress_bars(err: str) -> str:
    """stderr less the lines a progress bar redraws with carriage returns (transformers' GGUF
    conversion bar shows while the model loads)."""
    return "\n".join(line for line in err.split("\n") if "\r" not in line)


def _tree(tmp_path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tmp_path)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(tmp_path.rglob("*"))}


@pytest.mark.parametrize("extra, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, extra, message):
    from medusa_trt.cli.train import main

    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    _files(tmp_path)
    before = _tree(tmp_path)
    code = main(_argv(tmp_path, extra))
    out, err = capsys.readouterr()
    err = _without_progress_bars(err)
    assert code != 0
    assert err.startswith("medusa-train: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err and out == ""
    assert _tree(tmp_path) == before, "a failed run left files behind"
    assert not (tmp_path / "heads").exists() and not (tmp_path / "heads.work").exists()


def test_non_utf8_data_from_the_command_line(tmp_path):
    """The installed entry point itself: a prompts file in Latin-1 (with a Latin-1 name) is one
    line naming the file and line, exit 2, no traceback, nothing written."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    name = os.fsdecode(b"caf\xe9.txt")  # not UTF-8 either: the name reaches us with a surrogate escape
    (tmp_path / name).write_bytes(b"Once upon a time\nTom went to the caf\xe9\n")
    argv = ["--model", str(STORIES), "--out", str(tmp_path / "heads"), "--data", str(tmp_path / name)]
    proc = subprocess.run([sys.executable, "-m", "medusa_trt.cli.train", *argv], capture_output=True, timeout=300)
    err = proc.stderr.decode("utf-8", "backslashreplace")
    assert proc.returncode == 2, err
    assert err.startswith("medusa-train: error: --data ") and err.count("\n") == 1, err
    assert "line 2 is not UTF-8 text" in err and "save the file as UTF-8" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
