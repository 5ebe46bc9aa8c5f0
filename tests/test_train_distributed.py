"""Head training across processes and from a teacher server, on the CPU with stories260K.

* ``torchrun --standalone --nproc-per-node 2`` (gloo) gives the heads of one process with the same
  global batch (max relative difference under 1e-3), its data split by rank;
* kill -9 of one rank mid-training, then a resume on one process, gives the heads of an uninterrupted run;
* ``--teacher`` against ``medusa-serve`` (started here on 127.0.0.1 and a free port, stopped by pid)
  gives the data and heads of ``--generate-engine`` on the same engine;
* ``--fsdp`` on two processes (the frozen base sharded) gives the heads of one process;
* one-line errors: an unreachable teacher, a teacher of another model, ``--device cuda`` without CUDA.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import STORIES, medusa_model
from helpers import STORY_STARTS

STARTS = STORY_STARTS[:8]
ROOT = Path(__file__).resolve().parents[1]

# medusa-train with a step clock: each optimizer step takes 50 ms more, so a rank can be killed mid-training
SLOW_TRAIN = """import sys, time, torch
step = torch.optim.AdamW.step
torch.optim.AdamW.step = lambda self, *a, **k: (time.sleep(0.05), step(self, *a, **k))[1]
from medusa_trt.cli.train import main
sys.exit(main())
"""


def _args(tmp_path: Path, out: str, *extra: str) -> list[str]:
    prompts = tmp_path / "stories.txt"
    prompts.write_text("\n".join(STARTS))
    return [
        "--model", str(STORIES), "--out", str(tmp_path / out), "--data", str(prompts), "--num-prompts", "8",
        "--new-tokens", "40", "--epochs", "3", "--batch-size", "32", "--lr", "1e-2", "--checkpoint-every", "4",
        "--generate-batch", "4", "--device", "cpu", *extra,
    ]  # fmt: skip


def _env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(nproc: int, *argv: str, script: list[str] | None = None) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return launch + (script or ["-m", "medusa_trt.cli.train"]) + list(argv)


def _train(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _heads(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "heads.safetensors"))


def _max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def _records(work: Path) -> dict:
    """Every record of a work folder (all ranks' files) by key, as (ids, start)."""
    from medusa_trt.training.data import read_sequences

    return {k: (r["ids"], r["start"]) for k, r in read_sequences(work, repair=False).items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted one-process run the others are compared with."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    tmp = tmp_path_factory.mktemp("one")
    started = time.perf_counter()
    _train([sys.executable, "-m", "medusa_trt.cli.train", *_args(tmp, "heads")])
    return tmp, time.perf_counter() - started


def test_two_processes_give_the_heads_of_one(one_process, tmp_path):
    one, _ = one_process
    proc = _train(_torchrun(2, *_args(tmp_path, "heads")))
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # rank 0 alone reports (and writes)
    work = tmp_path / "heads.work"
    assert (work / "sequences.rank1.jsonl").is_file() and any((work / "hidden").glob("*-r1.safetensors"))  # data split by rank
    assert _records(work) == _records(one / "heads.work")  # the same data
    metrics = json.loads((tmp_path / "heads" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == json.loads((one / "heads" / "metrics.json").read_text())["steps"]
    assert _max_relative_difference(_heads(one / "heads"), _heads(tmp_path / "heads")) < 1e-3


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e[5:] for e in environ if e.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def test_kill_9_of_one_rank_then_a_resume_on_one_process_gives_the_same_heads(one_process, tmp_path):
    one, _ = one_process
    slow = tmp_path / "slow_train.py"
    slow.write_text(SLOW_TRAIN)
    argv = _args(tmp_path, "heads")
    launcher = subprocess.Popen(
        _torchrun(2, *argv, script=[str(slow)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    checkpoint = tmp_path / "heads.work" / "checkpoint.pt"
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.is_file():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        time.sleep(0.3)  # some steps past the checkpoint
        ranks = {_rank_of(p): p for p in _children(launcher.pid)}
        os.kill(ranks[1], signal.SIGKILL)
        launcher.wait(120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0
    assert not (tmp_path / "heads").exists()
    stopped_at = torch.load(checkpoint, weights_only=False)["step"]
    total = json.loads((one / "heads" / "metrics.json").read_text())["total_steps"]
    assert 0 < stopped_at < total
    _train([sys.executable, "-m", "medusa_trt.cli.train", *argv])  # world size 1 now
    assert _max_relative_difference(_heads(one / "heads"), _heads(tmp_path / "heads")) < 1e-3


# ----------------------------------------------------------------------------- the teacher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"medusa-serve did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def teacher_engine(stories_base, stories_fitted, export_engine):
    return export_engine("teacher", medusa_model(stories_base, stories_fitted), max_context=512)


@pytest.fixture(scope="module")
def short_engine(stories_base, stories_fitted, export_engine):
    """The teacher's engine with a context of 48 positions (stories260K has 2048): 40 new tokens leave room for
    prompts of 8 tokens, which keeps 5 of STARTS (5 to 12 tokens) and skips 3."""
    return export_engine("teacher-short", medusa_model(stories_base, stories_fitted), max_context=48, tree="chain-2")


def test_teacher_medusa_serve_gives_the_data_and_heads_of_generate_engine(short_engine, tmp_path):
    """--teacher against medusa-serve of an engine whose context (48) is shorter than the model's: the client reads
    the server's max_model_len and skips the prompts that do not fit, as --generate-engine on that engine does (before,
    the first overlong prompt stopped the run with an HTTP 400); the same records, then the same heads."""
    port = _free_port()
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "medusa_trt.cli.serve", str(short_engine), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),  # noqa: SIM115
        env=_env(),
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log)
        taught_run = _train(
            [sys.executable, "-m", "medusa_trt.cli.train", *_args(tmp_path, "taught"), "--teacher", url, "--teacher-concurrency", "4"]
        )
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(60)
    _train(
        [
            sys.executable,
            "-m",
            "medusa_trt.cli.train",
            *_args(tmp_path, "engine"),
            "--generate-engine",
            str(short_engine),
            "--generate-only",
        ]
    )
    assert "3 prompts leave no room for 40 new tokens in 48 positions (the server's max_model_len): skipped" in taught_run.stderr
    taught, engine = _records(tmp_path / "taught.work"), _records(tmp_path / "engine.work")
    assert len(taught) == 5 and taught == engine  # the same prompts kept, the same token ids
    # the same data gives the same heads: the engine's recorded states aside, both train on one forward pass
    for shard in (tmp_path / "engine.work" / "hidden").iterdir():
        shard.unlink()
    _train([sys.executable, "-m", "medusa_trt.cli.train", *_args(tmp_path, "engine"), "--generate-engine", str(short_engine)])
    a, b = _heads(tmp_path / "taught"), _heads(tmp_path / "engine")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_on_two_processes_gives_the_heads_of_one(teacher_engine, tmp_path):
    """``--fsdp`` shards the frozen base's decoder layers over the two gloo processes (FSDP2's
    ``fully_shard`` on CPU); the heads equal a one-process run's on the same engine's data."""
    _train([sys.executable, "-m", "medusa_trt.cli.train", *_args(tmp_path, "one"), "--generate-engine", str(teacher_engine)])
    proc = _train(_torchrun(2, *_args(tmp_path, "fsdp"), "--fsdp", "--generate-engine", str(teacher_engine)))
    assert proc.stdout.count("wrote ") == 1, proc.stdout
    assert json.loads((tmp_path / "fsdp" / "metrics.json").read_text())["world_size"] == 2
    assert _max_relative_difference(_heads(tmp_path / "one"), _heads(tmp_path / "fsdp")) < 1e-3


class _FakeTeacher(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server of another model: its tokenizer makes 3 tokens of any text."""

    def log_message(self, *args):
        pass

    def _send(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(
            {"choices": [{"index": 0, "text": " x", "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        )


def _one_line_error(capsys, argv: list[str]) -> str:
    from medusa_trt.cli.train import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    err = "\n".join(line for line in err.split("\n") if "\r" not in line)  # less progress bars
    assert err.startswith("medusa-train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_one_line_errors_unreachable_teacher_other_model_and_no_cuda(capsys, tmp_path):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    err = _one_line_error(capsys, _args(tmp_path, "h") + ["--teacher", f"http://127.0.0.1:{_free_port()}"])
    assert "GET /models failed" in err and "start the server" in err
    assert "is not an http(s) URL" in _one_line_error(capsys, _args(tmp_path, "h") + ["--teacher", "localhost:8000"])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeTeacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        err = _one_line_error(capsys, _args(tmp_path, "h") + ["--teacher", f"http://127.0.0.1:{server.server_port}/v1"])
    finally:
        server.shutdown()
    assert "serves another model (other-model)" in err and "3 tokens of a probe text" in err
    if not torch.cuda.is_available():
        argv = [a for a in _args(tmp_path, "h") if a != "cpu"]
        argv[argv.index("--device") + 1 : argv.index("--device") + 1] = ["cuda"]
        assert "torch sees no CUDA GPU" in _one_line_error(capsys, argv)
        argv[argv.index("--device") + 1] = "tpu"
        assert "pass cpu, cuda or cuda:N" in _one_line_error(capsys, argv)
    assert not (tmp_path / "h").exists() and not (tmp_path / "h.work").exists()


def test_teacher_text_is_tokenized_again_and_what_does_not_round_trip_is_dropped(stories_base):
    """A server without token ids: its text is tokenized again, kept only when it round-trips."""
    from medusa_trt.training.teacher import retokenized

    ids = stories_base.tokenizer("Once upon a time there was a cat", add_special_tokens=False)["input_ids"]
    text = stories_base.tokenizer.decode(ids)
    assert retokenized(stories_base, {"text": text, "usage": {"completion_tokens": len(ids)}}) == ids
    eos = stories_base.eos_token_ids[0]
    stopped = {"text": text, "finish_reason": "stop", "usage": {"completion_tokens": len(ids) + 1}}
    assert retokenized(stories_base, stopped) == ids + [eos]
    assert retokenized(stories_base, {"text": text, "usage": {"completion_tokens": len(ids) + 3}}) is None  # the counts disagree
