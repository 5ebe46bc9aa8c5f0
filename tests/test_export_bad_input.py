"""medusa-export on bad input and interruption: one line, non-zero exit, nothing left on disk.

Also what an export must leave for the runtime's integrity checks (the file manifest), the
context default when a model has fewer positions than 1024, and small --max-tokens engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import STORIES, medusa_model, random_heads

from medusa_trt.cli.export import main as export_main
from medusa_trt.runtime import EngineError, MedusaRuntime
from medusa_trt.runtime.engine import read_meta

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, tiny_model_dir):
    """Model files that do not load: garbage and truncated GGUF, corrupt and truncated safetensors."""
    import shutil

    folder = tmp_path_factory.mktemp("bad-models")
    (folder / "garbage.gguf").write_bytes(b"GGUF" + b"\x00junk" * 8)
    (folder / "truncated.gguf").write_bytes(STORIES.read_bytes()[:1_000_000])
    made = {"garbage.gguf": folder / "garbage.gguf", "truncated.gguf": folder / "truncated.gguf"}
    for name, corrupt in (("header", lambda b: b"\x10" + b"\x00" * 7 + b"{not json}" + b[18:]), ("truncated", lambda b: b[: len(b) // 2])):
        target = folder / f"safetensors-{name}"
        shutil.copytree(tiny_model_dir("llama"), target)
        weights = target / "model.safetensors"
        weights.write_bytes(corrupt(weights.read_bytes()))
        made[target.name] = target
    return made


def _run(capsys, *args) -> tuple[int, str, str]:
    code = export_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _messages(err: str) -> list[str]:
    """stderr without progress bars (tqdm redraws them after a carriage return)."""
    return [line for line in err.split("\n") if line.strip() and "\r" not in line]


CASES = {
    "garbage gguf": (["--model", "BAD/garbage.gguf"], "garbage.gguf is not a valid GGUF file"),
    "truncated gguf": (["--model", "BAD/truncated.gguf"], "truncated.gguf is not a valid GGUF file"),
    "corrupt safetensors": (["--model", "BAD/safetensors-header"], "safetensors-header/model.safetensors is not a valid safetensors file"),
    "truncated safetensors": (
        ["--model", "BAD/safetensors-truncated"],
        "safetensors-truncated/model.safetensors is not a valid safetensors file",
    ),
    "max-context 1": (["--max-context", "1"], "--max-context 1 is too small: it must be >= 2"),
    "max-context 0": (["--max-context", "0"], "--max-context 0 is too small"),
    "max-context above the model's": (["--model", "TINY", "--max-context", "1024"], "--max-context 1024 exceeds the model's 512 positions"),
    "max-batch 0": (["--max-batch", "0"], "--max-batch 0 is too small: it must be >= 1"),
    "max-batch -3": (["--max-batch", "-3"], "--max-batch -3 is too small"),
    "max-tokens 0": (["--max-tokens", "0"], "--max-tokens 0 is too small: it must be >= 1"),
    "untrained-heads -1": (["--untrained-heads", "-1"], "--untrained-heads -1 is negative"),
    "head-layer past the last": (
        ["--untrained-heads", "2", "--head-layer", "99"],
        "--head-layer 99 is not a decoder layer of the model: pass 0..4",
    ),
    "head-layer negative": (["--untrained-heads", "2", "--head-layer", "-1"], "--head-layer -1 is not a decoder layer"),
    "opset too old": (["--opset", "5"], "--opset 5 is not supported: use 18..23"),
    "opset unknown": (["--opset", "99"], "--opset 99 is not supported"),
    "tree larger than max-tokens": (["--untrained-heads", "2", "--tree", "chain-2", "--max-tokens", "2"], "--max-tokens is 2"),
    "draft-vocab 0": (["--untrained-heads", "2", "--draft-vocab", "0"], "--draft-vocab 0 must be a whole number >= 1"),
    "draft-vocab past the vocabulary": (
        ["--untrained-heads", "2", "--draft-vocab", "600"],
        "--draft-vocab 600 must lie between the tree's top-1 and the model's vocabulary of 512 tokens",
    ),
    "draft-vocab under the tree's top-k": (
        ["--untrained-heads", "4", "--tree", "mc_sim_7b_63", "--draft-vocab", "4"],
        "--draft-vocab 4 must lie between the tree's top-10",
    ),
    "triton repo under a missing folder": (
        ["--triton-repo", "/nonexistent/deep/repo"],
        "its parent folder /nonexistent/deep does not exist",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(case, tmp_path, capsys, bad_models, tiny_model_dir):
    extra, message = CASES[case]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [a.replace("BAD", str(next(iter(bad_models.values())).parent)).replace("TINY", str(tiny_model_dir("llama"))) for a in extra]
    if "--model" not in args:
        args = ["--model", str(STORIES), *args]
    code, _, err = _run(capsys, *args, "--out", out_dir / "m.onnx")
    assert code == 2, err
    lines = _messages(err)
    assert len(lines) == 1 and lines[0].startswith("medusa-export: error: ") and "Traceback" not in err, err
    assert message in lines[0], err
    assert list(out_dir.iterdir()) == [], "files left behind"


def test_default_context_fits_a_model_with_fewer_positions(tmp_path, capsys, tiny_model_dir):
    """No --max-context on a 512-position model: the engine gets 512 (1024 is only the default ceiling)."""
    out = tmp_path / "tiny.onnx"
    code, stdout, err = _run(capsys, "--model", tiny_model_dir("llama"), "--untrained-heads", "2", "--tree", "chain-2", "--out", out)
    assert code == 0, err
    assert read_meta(out).max_context == 512


def test_small_max_tokens_engine_is_verified_and_runs(tmp_path, capsys):
    """--max-tokens under the checked prefill (7 tokens): the check uses steps the engine takes."""
    out = tmp_path / "small.onnx"
    code, stdout, err = _run(
        capsys, "--model", STORIES, "--untrained-heads", "2", "--tree", "chain-2", "--max-tokens", "4", "--max-context", "128", "--out", out
    )
    assert code == 0, err
    assert "verified against torch" in stdout
    assert read_meta(out).max_tokens == 4
    result = MedusaRuntime(out).generate("Once upon a time there was", max_new_tokens=10)  # the default chunk fits: min(64, 4)
    assert len(result.token_ids) == 10


def test_a_lossy_quantization_reports_its_error_and_is_never_called_verified(tmp_path, capsys):
    """int4 changes the numbers past the fp32 tolerance: the export says so with the measured figures (its logit
    difference, how often the top-1 token stays), never "verified"; its last line names the precision and backend."""
    out = tmp_path / "int4"
    code, stdout, err = _run(
        capsys,
        "--model",
        STORIES,
        "--untrained-heads",
        "2",
        "--max-context",
        "64",
        "--quantize",
        "int4",
        "--backend",
        "onnxruntime",
        "--out",
        out,
    )
    assert code == 0, err
    lines = stdout.strip().splitlines()
    assert "verified" not in stdout
    measured = next(line for line in lines if line.startswith("int4 changes the model's numbers: max logit difference "))
    assert "the same top-1 token at " in measured and "% of the checked positions" in measured
    assert lines[-1].startswith(f"engine: int4, backend onnxruntime (medusa-run --engine {out} runs it;"), lines[-1]


# ----------------------------------------------------------------------------- file manifest


@pytest.fixture
def external_engine(tmp_path, monkeypatch, stories_base):
    """An engine whose weights sit in .data files beside both graphs."""
    import medusa_trt.exporter.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "m.onnx"
    onnx_export.export_onnx(
        medusa_model(stories_base, random_heads(stories_base, 2)),
        onnx_export.ExportConfig(out=out, tree="chain-2", max_context=64, verify=False),
    )
    return out


def test_export_writes_the_manifest(external_engine):
    import json

    manifest = json.loads((external_engine.parent / "m.onnx.files.json").read_text())["files"]
    assert {"m.onnx", "m.onnx.data", "m.heads.onnx", "m.heads.onnx.data", "m.tokenizer/tokenizer.json"} <= set(manifest)
    for name, entry in manifest.items():
        assert (external_engine.parent / name).stat().st_size == entry["size"], name
    assert not any(p.name.startswith(".") for p in external_engine.parent.iterdir()), "staging files left behind"


@pytest.mark.parametrize("name", ["m.onnx.data", "m.onnx"])
def test_corrupted_in_place_is_refused_with_checksums(external_engine, name):
    target = external_engine.parent / name
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    target.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=f"{name} does not match its recorded sha256"):
        MedusaRuntime(external_engine, verify_checksums=True)


def test_truncated_data_is_refused_at_every_load(external_engine):
    data = external_engine.parent / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(EngineError, match="m.onnx.data has .* bytes but the export wrote"):
        MedusaRuntime(external_engine)


# ----------------------------------------------------------------------------- interrupted exports


def test_sweep_removes_only_folders_of_exited_exports(tmp_path):
    import socket

    from medusa_trt.exporter.onnx_export import STAGING_OWNER, sweep_stale_staging

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folders = {}
    for key, owner in {
        "exited": f"{gone.pid} {socket.gethostname()}",
        "running": f"{os.getpid()} {socket.gethostname()}",
        "other host": f"{gone.pid} elsewhere.example",
        "no owner": None,
    }.items():
        folders[key] = tmp_path / f".m.onnx.{key.replace(' ', '_')}"
        folders[key].mkdir()
        if owner is not None:
            (folders[key] / STAGING_OWNER).write_text(owner)
    other_name = tmp_path / ".other.onnx.x"
    other_name.mkdir()
    (other_name / STAGING_OWNER).write_text(f"{gone.pid} {socket.gethostname()}")
    assert sweep_stale_staging(tmp_path / "m.onnx") == [folders["exited"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other_name.name] + [f.name for k, f in folders.items() if k != "exited"])


def _start_export(out: Path) -> subprocess.Popen:
    args = ["--model", str(STORIES), "--untrained-heads", "2", "--tree", "chain-2", "--max-context", "64", "--out", str(out)]
    return subprocess.Popen(
        [sys.executable, "-m", "medusa_trt.cli.export", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_staging(proc: subprocess.Popen, out: Path, timeout: float = 240) -> Path:
    from medusa_trt.runtime.durable import parse_leftover

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # runtime/durable.py names a staging folder .NAME.new.PID.N@HOST
        found = [p for p in out.parent.glob(f".{out.name}.new.*") if parse_leftover(p, out) is not None and any(p.iterdir())]
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.kill()
    pytest.fail("the export never staged its files")


@pytest.mark.parametrize(
    "sig,code,line", [(signal.SIGTERM, 143, "medusa-export: terminated"), (signal.SIGINT, 130, "medusa-export: interrupted")]
)
def test_terminated_export_cleans_up(tmp_path, sig, code, line):
    out = tmp_path / "m.onnx"
    proc = _start_export(out)
    _wait_for_staging(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    lines = _messages(err)
    assert proc.returncode == code, err
    assert "Traceback" not in err and lines[-1:] == [line], err
    assert list(tmp_path.iterdir()) == [], "files left behind"


def test_killed_export_is_swept_by_the_next(tmp_path, capsys):
    out = tmp_path / "m.onnx"
    proc = _start_export(out)
    staging = _wait_for_staging(proc, out)
    proc.kill()  # SIGKILL: no cleanup can run
    proc.communicate(timeout=60)
    assert staging.is_dir()
    code, _, err = _run(
        capsys, "--model", STORIES, "--untrained-heads", "2", "--tree", "chain-2", "--max-context", "64", "--no-verify", "--out", out
    )
    assert code == 0, err
    assert not staging.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert read_meta(out).max_context == 64


def test_an_interrupt_swallowed_on_the_way_still_commits_nothing():
    """Python drops an exception raised in a weakref callback or ``__del__`` ("Exception ignored
    in ..."): a Ctrl-C landing there must still stop the export before its files move into place."""
    from medusa_trt.exporter.cancel import Cancelled, checkpoint, signals_unwind

    checkpoint()  # outside the context: nothing pending, nothing raised
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup
    with pytest.raises(Cancelled) as raised:
        with signals_unwind():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here
            except Cancelled:
                pass  # swallowed, as an ignored callback would
            with pytest.raises(Cancelled) as again:
                checkpoint()
            assert again.value.code == 130 and again.value.word == "interrupted"
        # leaving the context checks once more
    assert raised.value.code == 130
    assert signal.getsignal(signal.SIGINT) == before  # handlers restored
    checkpoint()  # and nothing pending afterwards
