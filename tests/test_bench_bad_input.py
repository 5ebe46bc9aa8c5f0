"""medusa-bench on bad input: one ``medusa-bench: error: ...`` line, a non-zero exit, no traceback,
nothing left on disk; checked before any engine loads (the engine given here does not exist, so a
check that came too late would name the engine instead)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import medusa_model

from medusa_trt.bench import report as bench_report
from medusa_trt.bench.files import staged
from medusa_trt.cli.bench import main

GOOD = "".join(json.dumps({"turns": [p]}) + "\n" for p in ["Once upon a time", "The dog"])

# name -> bytes of the prompts file
PROMPT_FILES = {
    "good": GOOD.encode(),
    "latin1": GOOD.encode() + '{"turns": ["caf\u00e9"]}\n'.encode("latin-1"),
    "malformed": GOOD.encode() + b'{"turns": ["unclosed"\n',
    "no-turns": b'{"question": "hi"}\n',
    "turns-not-list": b'{"turns": "hi"}\n',
    "turns-empty": b'{"turns": []}\n',
    "turn-not-text": b'{"turns": [42]}\n',
    "turn-blank": b'{"turns": ["  "]}\n',
    "not-object": b'["hi"]\n',
    "empty": b"",
    "blank-lines": b"\n  \n\n",
}

CASES = [  # (extra argv, fragment of the one line); {tmp} is the test's folder, {cwd} the cwd
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--limit", "0"], "argument --limit: must be >= 1, got 0"),
    (["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
    (["--every", "-2"], "argument --every: must be >= 1, got -2"),
    (["--every", "0"], "argument --every: must be >= 1, got 0"),
    (["--threads", "-3"], "argument --threads: must be >= 1, got -3"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "ten"], "argument --max-new-tokens: expected a whole number, got 'ten'"),
    (["--lookup-tokens", "0"], "argument --lookup-tokens: must be >= 1, got 0"),
    (["--temperature", "0.7", "--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1]"),
    # --out: a folder, a missing / non-folder / unwritable parent, a wrong suffix, a folder where the plot goes
    (["--out", "{tmp}/outdir/"], "--out {tmp}/outdir/ is a folder: name the file to write"),
    (["--out", "{tmp}/outdir"], "--out {tmp}/outdir is a folder"),
    (["--out", "{tmp}/new/"], "--out {tmp}/new/ is a folder"),
    (["--out", "{tmp}/missing/bench.json"], "folder {tmp}/missing does not exist"),
    (["--out", "{tmp}/p-good.jsonl/bench.json"], "{tmp}/p-good.jsonl is not a folder"),
    (["--out", "/sys/medusa-bench.json"], "folder /sys is not writable"),
    (["--out", "bench.txt"], "--out bench.txt must end in .json"),
    (["--out", "{tmp}/plotdir.json"], "cannot write {tmp}/plotdir.png beside --out {tmp}/plotdir.json: it is a folder"),
    # options that would be silently ignored, rows that would collide
    (["--model", "stories260K"], "--model applies to the transformers rows, which --no-hf skips"),
    (["--lookup-tokens", "4"], "--lookup-tokens applies to the transformers rows, which --no-hf skips"),
    (["--top-p", "0.9"], "--top-p applies when sampling: add --temperature"),
    (["--top-k", "5", "--seed", "1"], "--top-k / --seed apply when sampling"),
    (["--temperature", "0", "--acceptance", "typical"], "--acceptance applies when sampling"),
    (["--engine", "{tmp}/b/model.onnx"], "--engine model is given twice"),
    (["--tree", "chain-1", "--tree", "chain-1"], "--tree chain-1 is given twice"),
    (["--temperature", "0.7", "--acceptance", "typical", "--acceptance", "typical"], "--acceptance typical is given twice"),
    (["--backend", "tensorrt"], "--backend 'tensorrt': use one of onnxruntime, openvino"),
    (["--backend", "onnxruntime:bf16"], "with :PRECISION (f32, bf16) for openvino only"),
    (["--backend", "openvino", "--backend", "openvino"], "--backend openvino is given twice"),
    # prompt files
    (["--prompts", "{tmp}/p-latin1.jsonl"], "{tmp}/p-latin1.jsonl:3: not UTF-8 text (byte 0xe9 at column 16): save the file as UTF-8"),
    (["--prompts", "{tmp}/p-malformed.jsonl"], "{tmp}/p-malformed.jsonl:3: not a JSON record"),
    (["--prompts", "{tmp}/p-no-turns.jsonl"], "{tmp}/p-no-turns.jsonl:1: not a Spec-Bench record with turns[0]"),
    (["--prompts", "{tmp}/p-turns-not-list.jsonl"], "p-turns-not-list.jsonl:1: not a Spec-Bench record"),
    (["--prompts", "{tmp}/p-turns-empty.jsonl"], "p-turns-empty.jsonl:1: not a Spec-Bench record"),
    (["--prompts", "{tmp}/p-turn-not-text.jsonl"], "p-turn-not-text.jsonl:1: not a Spec-Bench record"),
    (["--prompts", "{tmp}/p-turn-blank.jsonl"], "p-turn-blank.jsonl:1: not a Spec-Bench record"),
    (["--prompts", "{tmp}/p-not-object.jsonl"], "p-not-object.jsonl:1: not a Spec-Bench record"),
    (["--prompts", "{tmp}/p-empty.jsonl"], "{tmp}/p-empty.jsonl holds no prompts"),
    (["--prompts", "{tmp}/p-blank-lines.jsonl"], "p-blank-lines.jsonl holds no prompts"),
    (["--prompts", "{tmp}/outdir"], "prompts file {tmp}/outdir is a folder"),
    (["--prompts", "{tmp}/absent.jsonl"], "prompts file {tmp}/absent.jsonl does not exist"),
    (["--max-new-tokens", "4"], "engine file {tmp}/a/model.onnx does not exist"),  # all else fine: the engine is the first work
]


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """tmp_path with the prompt files, an ``outdir`` folder, a ``plotdir.png`` folder and an empty cwd."""
    for name, data in PROMPT_FILES.items():
        (tmp_path / f"p-{name}.jsonl").write_bytes(data)
    for sub in ("outdir", "plotdir.png", "cwd"):
        (tmp_path / sub).mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # usage errors (cli.common.Parser: one line, exit 2)
        return exc.code


def assert_one_line(err: str, prog: str, fragment: str) -> None:
    """stderr is one line, starting with ``<prog>: error:`` and holding ``fragment``."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and fragment in lines[0], err


@pytest.mark.parametrize("extra,fragment", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line(folder, capsys, extra, fragment):
    before = _snapshot(folder)
    argv = ["--engine", str(folder / "a" / "model.onnx"), "--prompts", str(folder / "p-good.jsonl"), "--no-hf"]
    code = _run(argv + [x.format(tmp=folder) for x in extra])
    assert code not in (0, None)
    assert_one_line(capsys.readouterr().err, "medusa-bench", fragment.format(tmp=folder))
    assert _snapshot(folder) == before  # nothing written, nothing left behind, in the out folder or the cwd


def test_bad_input_subprocess(folder):
    """The installed command, not main(): a non-UTF-8 prompts file is one line on a real stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "medusa_trt.cli.bench", "--engine", "m.onnx", "--no-hf", "--prompts", str(folder / "p-latin1.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert_one_line(proc.stderr, "medusa-bench", "p-latin1.jsonl:3: not UTF-8 text")
    assert not any((folder / "cwd").iterdir())


def test_staged_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "r.json"
    with pytest.raises(OSError):
        with staged(target, target.with_suffix(".png")) as (tmp_json, _):
            assert tmp_json.parent == tmp_path and tmp_json.suffix == ".json"  # beside the target, same suffix
            tmp_json.write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []
    with staged(target, target.with_suffix(".png")) as (tmp_json, _):
        tmp_json.write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the plot was never written: no file for it


# ----------------------------------------------------------------- on a real engine


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


def test_default_writes_nothing(folder, capsys, engine):
    """Without --out the table is printed and no file is written, wherever the command runs."""
    before = _snapshot(folder)
    code = main(["--engine", str(engine), "--prompts", str(folder / "p-good.jsonl"), "--no-hf", "--max-new-tokens", "8", "--limit", "1"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "plain[model]" in printed.out and "wrote" not in printed.out
    assert _snapshot(folder) == before


def test_write_failure_leaves_nothing(folder, capsys, engine, monkeypatch):
    """A write that fails after the benchmark (a full disk) is one line and leaves no half file or temp."""

    def full_disk(report, path):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench_report, "plot", full_disk)
    before = _snapshot(folder)
    code = main(
        [
            "--engine",
            str(engine),
            "--prompts",
            str(folder / "p-good.jsonl"),
            "--no-hf",
            "--max-new-tokens",
            "8",
            "--limit",
            "1",
            "--out",
            str(folder / "outdir" / "bench.json"),
        ]
    )
    assert code == 2
    assert_one_line(capsys.readouterr().err, "medusa-bench", f"cannot write {folder}/outdir/bench.json: No space left on device")
    assert _snapshot(folder) == before


def test_closed_pipe_is_quiet(folder, engine):
    """``medusa-bench ... | head -1``: the reader goes away before the table is printed; no traceback, exit 141."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "medusa_trt.cli.bench",
            "--engine",
            str(engine),
            "--no-hf",
            "--prompts",
            str(folder / "p-good.jsonl"),
            "--max-new-tokens",
            "8",
            "--limit",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=folder / "cwd",
    )
    proc.stdout.close()  # like head after its first line, but before the first write: no race
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not any((folder / "cwd").iterdir())
