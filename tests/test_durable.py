"""runtime/durable.py: a writer killed between any two of its steps leaves the old or the new, never
neither; only what is provably ours is replaced; the commands refuse a user's folder in one line."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_trt.runtime import durable
from medusa_trt.runtime.durable import NotOursError

KILLED = 9  # the exit status of a child stopped at its injected step
STEP_CALLS = ("rename", "replace", "unlink", "rmdir", "mkdir", "fsync")  # every file-system step a writer takes


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (hidden ones too) -> its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def killed_at(k: int, write) -> int:
    """Run ``write`` in a forked child that dies (``os._exit``: no except, no finally, as SIGKILL) at
    its k-th file-system step; the child's exit status: KILLED, 0 (it finished first) or 1 (it raised)."""
    pid = os.fork()
    if pid == 0:  # the child
        calls = itertools.count()

        def stop_at_k(real):
            def step(*args, **kwargs):
                if next(calls) == k:
                    os._exit(KILLED)
                return real(*args, **kwargs)

            return step

        for name in STEP_CALLS:
            setattr(os, name, stop_at_k(getattr(os, name)))
        durable._exchange = stop_at_k(durable._exchange)
        try:
            write()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def kill_at_every_step(write, check) -> int:
    """Kill ``write`` at step 0, 1, 2, ... until it finishes; ``check(finished)`` after each. Returns the steps."""
    for k in itertools.count():
        code = killed_at(k, write)
        assert code in (KILLED, 0), f"the writer raised at step {k}"
        check(code == 0)
        if code == 0:
            return k
    raise AssertionError("unreachable")


@pytest.fixture(params=["exchange", "two renames"])
def swap(request, monkeypatch):
    """Both ways a folder is swapped: the atomic exchange, and the backup renames where there is none."""
    if request.param == "two renames":
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    return request.param


OLD = {"files.json": "{}", "model.onnx": "old graph", "tok/vocab.txt": "old vocab"}
NEW = {"files.json": "{}", "model.onnx": "new graph!", "heads.onnx": "new heads"}


# ----------------------------------------------------------------------------- kills between the steps


def test_a_folder_swap_killed_at_any_step_leaves_the_old_or_the_new(tmp_path, swap):
    old = snapshot(make_tree(tmp_path / "old-ref", OLD))
    new = snapshot(make_tree(tmp_path / "new-ref", NEW))
    work = tmp_path / "w"
    work.mkdir()
    target = work / "eng"

    def write():
        with durable.staged_folder(target) as staging:
            make_tree(staging, NEW)

    def check(finished):
        found = snapshot(target) if target.is_dir() else None
        aside = [p for p in work.iterdir() if p.name.startswith(".eng.old.")]
        # before any recovery: the old or the new is in place, or (between the two renames) the old is the backup
        assert found in (old, new) or (found is None and len(aside) == 1 and snapshot(aside[0]) == old)
        durable.recover(target)  # what the next writer does first
        assert snapshot(target) in ((new,) if finished else (old, new))
        assert [p.name for p in work.iterdir()] == ["eng"], "a leftover survived the next writer"
        shutil.rmtree(target)
        make_tree(target, OLD)

    make_tree(target, OLD)
    steps = kill_at_every_step(write, check)
    assert steps >= 3


def test_a_set_of_loose_files_killed_at_any_step_is_old_or_new(tmp_path):
    names = ["m.onnx", "m.onnx.data", "m.heads.onnx", "m.tokenizer", "m.onnx.files.json"]
    old_set = {"m.onnx": "old", "m.heads.onnx": "old heads", "m.tokenizer/a.json": "a", "m.onnx.files.json": "{1}"}
    new_set = {
        "m.onnx": "new!",
        "m.onnx.data": "weights",
        "m.tokenizer/a.json": "a2",
        "m.tokenizer/b.json": "b",
        "m.onnx.files.json": "{2}",
    }
    neighbour = {"m.txt": "the user's", "other.onnx": "another engine"}
    old = snapshot(make_tree(tmp_path / "old-ref", old_set | neighbour))
    new = snapshot(make_tree(tmp_path / "new-ref", new_set | neighbour))
    work = tmp_path / "w"

    def reset():
        shutil.rmtree(work, ignore_errors=True)
        make_tree(work, old_set | neighbour)

    def write():
        staging = durable.make_staging(work / "m.onnx")
        make_tree(staging, new_set)
        durable.replace_set(staging, work, names, "m.onnx")
        shutil.rmtree(staging)

    def check(finished):
        durable.recover(work / "m.onnx")
        assert snapshot(work) in ((new,) if finished else (old, new))
        reset()

    reset()
    assert kill_at_every_step(write, check) >= 8


def test_a_file_write_killed_at_any_step_is_old_or_new(tmp_path):
    target = tmp_path / "report.json"

    def check(finished):
        durable.recover(target)
        assert target.read_text() in (('{"new": 1}',) if finished else ('{"old": 1}', '{"new": 1}'))
        assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
        target.write_text('{"old": 1}')

    target.write_text('{"old": 1}')
    kill_at_every_step(lambda: durable.write_text(target, '{"new": 1}'), check)


@pytest.mark.parametrize("k", range(4))
def test_a_failed_step_keeps_the_old_folder_and_leaves_nothing(tmp_path, swap, monkeypatch, k):
    target = make_tree(tmp_path / "eng", OLD)
    old, new = snapshot(target), snapshot(make_tree(tmp_path / "ref", NEW))
    shutil.rmtree(tmp_path / "ref")
    calls = itertools.count()

    def fails_at_k(real):
        def step(*args, **kwargs):
            if next(calls) == k:
                raise OSError(28, "No space left on device")
            return real(*args, **kwargs)

        return step

    monkeypatch.setattr(os, "rename", fails_at_k(os.rename))
    monkeypatch.setattr(durable, "_exchange", fails_at_k(durable._exchange))
    try:
        with durable.staged_folder(target) as staging:
            make_tree(staging, NEW)
        failed = False
    except OSError:
        failed = True
    monkeypatch.undo()
    assert snapshot(target) == (old if failed else new)
    assert [p.name for p in tmp_path.iterdir()] == ["eng"], "a staging or backup folder was left"


def test_a_failed_set_write_rolls_back(tmp_path, monkeypatch):
    make_tree(tmp_path, {"m.onnx": "old", "m.tokenizer/a": "a", "m.onnx.files.json": "{}"})
    before = snapshot(tmp_path)
    staging = durable.make_staging(tmp_path / "m.onnx")
    make_tree(staging, {"m.onnx": "new", "m.onnx.data": "w", "m.tokenizer/a": "a2"})
    real, calls = os.rename, itertools.count()

    def rename(a, b):
        if next(calls) == 4:  # three set aside, one moved in
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        durable.replace_set(staging, tmp_path, ["m.onnx", "m.onnx.data", "m.tokenizer", "m.onnx.files.json"], "m.onnx")
    monkeypatch.undo()
    shutil.rmtree(staging)
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- leftovers


def test_recover_touches_only_leftovers_of_exited_writers_of_this_host(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    target = tmp_path / "eng"
    names = {
        "exited": f".eng.new.{gone.pid}.0@{host}",
        "running": f".eng.new.{os.getpid()}.0@{host}",
        "other host": f".eng.new.{gone.pid}.0@elsewhere.example",
        "other target": f".engine.new.{gone.pid}.0@{host}",
        "not ours": ".eng.notes",
        "backup": f".eng.old.{gone.pid}.1@{host}",
    }
    for name in names.values():
        make_tree(tmp_path / name, {"x": name})
    handled = durable.recover(target)
    assert handled == sorted([tmp_path / names["backup"], tmp_path / names["exited"]])
    assert (target / "x").read_text() == names["backup"], "a backup whose target is gone is put back"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["eng"] + [v for k, v in names.items() if k not in ("exited", "backup")])


def test_legacy_staging_folders_of_exited_exports_are_swept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    legacy = make_tree(tmp_path / ".m.onnx.abc123", {durable.LEGACY_OWNER: f"{gone.pid} {socket.gethostname()}"})
    kept = make_tree(tmp_path / ".m.onnx.def456", {"x": "no owner file: not provably ours"})
    assert durable.recover(tmp_path / "m.onnx") == [legacy]
    assert not legacy.exists() and kept.exists()


# ----------------------------------------------------------------------------- what is ours


def listed(folder: Path, kind: str = "engine", skip: tuple[str, ...] = ()) -> Path:
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size}
        for p in folder.rglob("*")
        if p.is_file() and p.name != "files.json" and p.name not in skip
    }
    (folder / "files.json").write_text(json.dumps({"version": 1, "kind": kind, "files": files}))
    return folder


def test_only_a_folder_whose_manifest_lists_every_file_is_ours(tmp_path):
    durable.check_folder_ours(tmp_path / "absent", kind="engine")
    (tmp_path / "empty").mkdir()
    durable.check_folder_ours(tmp_path / "empty", kind="engine")
    ours = listed(make_tree(tmp_path / "ours", {"model.onnx": "g", "config.json": "{}", "sub/t.json": "t"}))
    durable.check_folder_ours(ours, kind="engine")
    with pytest.raises(NotOursError, match="holds medusa-trt engine files, not heads files"):
        durable.check_folder_ours(ours, kind="heads")
    mine = make_tree(tmp_path / "mine", {"config.json": '{"my": "settings"}', "notes.txt": "n", "src/main.py": "print()"})
    with pytest.raises(
        NotOursError, match=r"mine/config\.json is not a file medusa-trt wrote \(the folder has no medusa-trt files\.json\)"
    ):
        durable.check_folder_ours(mine, kind="engine")
    (ours / "notes.txt").write_text("added by the user")
    with pytest.raises(NotOursError, match=r"ours/notes\.txt is not a file medusa-trt wrote \(not listed in files\.json\)"):
        durable.check_folder_ours(ours, kind="engine")
    durable.check_folder_ours(ours, kind="engine", keep=("notes.txt",))  # a file the writer carries over
    (ours / "notes.txt").unlink()
    (ours / ".DS_Store").write_bytes(b"\0")
    with pytest.raises(NotOursError, match=r"\.DS_Store is not a file medusa-trt wrote"):
        durable.check_folder_ours(ours, kind="engine")
    (ours / ".DS_Store").unlink()
    (ours / "model.onnx").write_text("edited by hand")
    with pytest.raises(NotOursError, match=r"model\.onnx was changed after medusa-trt wrote it"):
        durable.check_folder_ours(ours, kind="engine")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOursError, match="it is a file or a link"):
        durable.check_folder_ours(tmp_path / "file", kind="engine")


def test_a_loose_set_is_ours_only_where_its_manifest_lists_it(tmp_path):
    names = ["m.onnx", "m.onnx.data", "m.tokenizer", "m.onnx.files.json"]
    durable.check_set_ours(tmp_path, names, "m.onnx.files.json")  # nothing there yet
    (tmp_path / "m.onnx").write_text("the user's own graph")
    with pytest.raises(NotOursError, match=r"m\.onnx is not a file medusa-trt wrote \(there is no medusa-trt m\.onnx\.files\.json"):
        durable.check_set_ours(tmp_path, names, "m.onnx.files.json")
    (tmp_path / "m.onnx.files.json").write_text(json.dumps({"version": 1, "files": {"m.onnx": {"size": 20}}}))
    durable.check_set_ours(tmp_path, names, "m.onnx.files.json")  # an engine manifest of earlier versions: no kind
    make_tree(tmp_path, {"m.tokenizer/tokenizer.json": "{}"})
    with pytest.raises(NotOursError, match=r"m\.tokenizer/tokenizer\.json is not a file medusa-trt wrote"):
        durable.check_set_ours(tmp_path, names, "m.onnx.files.json")


# ----------------------------------------------------------------------------- the commands


def _export(*argv) -> subprocess.CompletedProcess:
    from conftest import STORIES

    args = ["--model", str(STORIES), "--untrained-heads", "2", "--max-context", "64", "--no-verify", *map(str, argv)]
    return subprocess.run([sys.executable, "-m", "medusa_trt.cli.export", *args], capture_output=True, text=True, timeout=600)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_refuses_a_users_folder_with_a_config_json_of_its_own(tmp_path):
    mine = make_tree(tmp_path / "mine", {"config.json": '{"my": "settings"}', "notes.txt": "keep me", "src/main.py": "print('hi')\n"})
    before = snapshot(mine)
    proc = _export("--out", mine)
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert line.startswith(f"medusa-export: error: --out {mine} would be replaced, but {mine}/config.json is not a file medusa-trt wrote")
    assert "choose another --out, or move or remove it yourself" in line
    assert snapshot(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_export_into_a_hugging_face_model_folder_is_refused(tmp_path, tiny_model_dir):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_model_dir("llama"), hf)
    (hf / "README.md").write_text("hi\n")
    before = snapshot(hf)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "medusa_trt.cli.export",
            "--model",
            str(hf),
            "--untrained-heads",
            "2",
            "--max-context",
            "64",
            "--out",
            str(hf),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "is not a file medusa-trt wrote" in _one_line(proc.stderr)
    assert snapshot(hf) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_to_a_loose_onnx_never_overwrites_a_users_file_and_replaces_its_own(tmp_path):
    from medusa_trt.runtime.engine import EngineFiles, read_meta
    from medusa_trt.runtime.manifest import check_manifest

    out = tmp_path / "m.onnx"
    out.write_bytes(b"the user's own graph")
    proc = _export("--out", out)
    assert proc.returncode == 2 and "m.onnx is not a file medusa-trt wrote" in _one_line(proc.stderr)
    assert out.read_bytes() == b"the user's own graph" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    out.unlink()
    proc = _export("--out", out, "--tree", "chain-2", "-v")
    assert proc.returncode == 0, proc.stderr
    assert "m.onnx.data, m.heads.onnx, m.heads.onnx.data, m.tokenizer, m.onnx.files.json" in proc.stderr  # says what it writes beside
    assert read_meta(out).tree_name == "chain-2"
    proc = _export("--out", out, "--tree", "chain-1")  # an earlier export of ours: replaced
    assert proc.returncode == 0, proc.stderr
    assert read_meta(out).tree_name == "chain-1" and check_manifest(EngineFiles.beside(out), checksums=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    (tmp_path / "m.tokenizer" / "mine.txt").write_text("a file of the user's inside the tokenizer folder")
    proc = _export("--out", out)
    assert proc.returncode == 2 and "m.tokenizer/mine.txt is not a file medusa-trt wrote" in _one_line(proc.stderr)
    assert (tmp_path / "m.tokenizer" / "mine.txt").is_file() and read_meta(out).tree_name == "chain-1"


def test_train_refuses_a_users_out_and_work_folder_before_any_work(tmp_path):
    from medusa_trt.training.checks import check_inputs
    from medusa_trt.training.config import TrainConfig, TrainError
    from medusa_trt.training.workdir import discard_workdir

    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n")
    mine = make_tree(tmp_path / "mine", {"config.json": '{"my": "settings"}', "notes.txt": "keep"})
    with pytest.raises(NotOursError, match=r"mine/config\.json is not a file medusa-trt wrote"):
        check_inputs(TrainConfig(out=str(mine), data=str(prompts)))
    work = make_tree(tmp_path / "work", {"fingerprint.json": "{}", "thesis.tex": "years of it"})
    config = TrainConfig(out=str(tmp_path / "heads"), data=str(prompts), work=str(work))
    with pytest.raises(TrainError, match=r"work/thesis\.tex, which medusa-train did not write"):
        discard_workdir(work, config)
    assert (work / "thesis.tex").read_text() == "years of it"
    make_tree(tmp_path / "run.work", {"fingerprint.json": "{}", "checkpoint.pt": "c", "hidden/0000000.safetensors": "h"})
    discard_workdir(tmp_path / "run.work", config)  # a work folder of ours: discarded (--restart)
    assert not (tmp_path / "run.work").exists()


def test_save_heads_over_earlier_heads_keeps_them_when_the_swap_fails(tmp_path, monkeypatch, swap):
    torch = pytest.importorskip("torch")
    from medusa_trt.exporter.heads import HeadsConfig, init_heads, load_heads, save_heads
    from medusa_trt.runtime.manifest import check_folder_manifest

    config = HeadsConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=16, shared_lm_head=False)
    folder = save_heads(init_heads(config, None, seed=1, random=True), tmp_path / "heads")
    (folder / "export.json").write_text(json.dumps({"version": 1, "tree": "template.json"}))
    (folder / "template.json").write_text("[[0], [1]]")
    before = snapshot(folder)
    real = os.rename

    def rename(a, b):
        if Path(b) == folder and ".heads.new." in Path(a).name:  # the new heads' rename into place
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(durable, "_exchange", lambda a, b: False)  # the swap by renames, whose second one fails
    with pytest.raises(OSError, match="No space"):
        save_heads(init_heads(config, None, seed=2, random=True), folder)
    monkeypatch.undo()
    assert snapshot(folder) == before and [p.name for p in tmp_path.iterdir()] == ["heads"]
    newer = init_heads(config, None, seed=3, random=True)
    save_heads(newer, folder)  # and a write that succeeds carries export.json and its tree
    assert check_folder_manifest(folder) and (folder / "template.json").read_text() == "[[0], [1]]"
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(load_heads(folder, hidden_size=8, vocab_size=16, lm_head=None)(x), newer(x), rtol=0, atol=0)


def test_a_plan_never_overwrites_a_users_plan_and_is_refused_before_any_work(tmp_path):
    from medusa_trt.exporter.builder import BuildConfig, plan

    (tmp_path / "engine.plan").write_bytes(b"a plan built elsewhere")
    with pytest.raises(NotOursError, match=r"engine\.plan is not a file medusa-trt wrote"):
        plan(BuildConfig(model="stories", out=tmp_path / "engine.plan"))
    (tmp_path / "engine.plan").unlink()
    (tmp_path / "engine.plan.json").write_text("{}")  # a sibling the plan's set would replace
    with pytest.raises(NotOursError, match=r"engine\.plan\.json is not a file medusa-trt wrote"):
        plan(BuildConfig(model="stories", out=tmp_path / "engine.plan"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.plan.json"]
