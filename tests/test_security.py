"""Serving security and robustness, against real tritonserver processes.

The model-repository API is closed (load / unload refused over HTTP and gRPC, ``medusa`` stays
loaded); only loopback is bound unless --allow-remote; a killed medusa-serve leaves no process,
port, shared memory or run folder; a same-size corrupted engine file stops the load; requests
are capped (max_tokens limit, deadlines); a stop string spanning tokens is never sent; bad input
to medusa-serve and medusa-triton-repo is one line on stderr with nothing left on disk.
Skips like tests/test_serving.py without nvidia-pytriton / tritonclient or a numpy<2 stub env.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import STORY_PROMPTS, medusa_model
from triton_step_clock_model import install_step_clock

from medusa_trt.runtime.engine import EngineFiles
from medusa_trt.serving.client import RequestFailed, stream_generate
from medusa_trt.serving.schema import ServeDefaults
from medusa_trt.serving.triton import ServeConfig, ServeError, TritonServer
from medusa_trt.serving.triton_repo import TritonRepoConfig, write_triton_repo

LIMIT = 200  # the security server's max_tokens_limit
CAP_TIMEOUT = 30.0  # its request_timeout: the longest deadline a request may ask for
# The deadline tests' servers run the served model with a step clock (tests/triton_step_clock_model.py): a request's
# deadline passes after a known number of engine steps, whatever the machine's speed (CAP_TIMEOUT: 10,000 steps, never)


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # the same engine as test_serving


@pytest.fixture(scope="module")
def runtime(engine):
    from medusa_trt.runtime import MedusaRuntime

    return MedusaRuntime(str(engine))


@pytest.fixture(scope="module")
def server(serving, engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("security-repo")
    install_step_clock(
        write_triton_repo(
            TritonRepoConfig(
                engine=engine, repo=repo, defaults=ServeDefaults(max_tokens=16, max_tokens_limit=LIMIT, request_timeout=CAP_TIMEOUT)
            )
        )
    )
    log_file = tmp_path_factory.mktemp("security-log") / "tritonserver.log"  # not test_serving's log
    server = TritonServer(ServeConfig(repo=repo, exit_timeout=10, log_file=log_file)).start()
    yield server
    server.stop()


def _text(server, prompt, **kw):
    chunks = list(stream_generate(server.grpc_address, prompt, **kw))
    return chunks, "".join(c.text for c in chunks)


def _post(url: str, body: dict, timeout: float = 60):
    """(status, JSON answer) of a POST, never through a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# ---------------------------------------------------------------------------------- sockets and processes


def _listening() -> dict[int, tuple[str, int]]:
    """socket inode -> (address, port) of every listening TCP socket on this machine."""
    found = {}
    for table, size in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if size == 8:  # IPv4, little-endian
                host = ipaddress.ip_address(raw[::-1])
            else:  # IPv6: four little-endian 32-bit words; an IPv4-mapped one as its IPv4 address
                host = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                host = host.ipv4_mapped or host
            found[int(fields[9])] = (str(host), int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.is_dir() else []:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                found.append(int(entry.name))
    return found


def _mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _shm(prefix: str) -> list[str]:
    return sorted(s for s in os.listdir("/dev/shm") if s.startswith(prefix)) if os.path.isdir("/dev/shm") else []


# ---------------------------------------------------------------------------------- the repository API is closed


def test_model_repository_api_is_refused(server, runtime):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--model-control-mode=none" in cmdline and not any(a.startswith(b"--load-model") for a in cmdline)

    evil = {
        "parameters": {
            "config": json.dumps({"name": "evil", "backend": "python"}),
            "file:1/model.py": "aW1wb3J0IG9zOyBvcy5zeXN0ZW0oJ3RvdWNoIC90bXAvcHduZWQnKQ==",
        }
    }  # base64 of os.system(...)
    for path, body in [
        ("/v2/repository/models/evil/load", evil),
        ("/v2/repository/models/medusa/unload", {}),
        ("/v2/repository/models/medusa/load", {}),
    ]:
        status, answer = _post(server.http_url + path, body)
        assert status >= 400 and "error" in answer, (path, status, answer)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException):
            client.load_model("evil", config=json.dumps({"name": "evil", "backend": "python"}), files={"file:1/model.py": b"import os"})
        with pytest.raises(InferenceServerException):
            client.unload_model("medusa")
        with pytest.raises(InferenceServerException):  # shared memory registration: restricted too
            client.register_system_shared_memory("probe", "/medusa_probe", 64)
        assert client.is_model_ready("medusa") and not client.is_model_ready("evil")
    finally:
        client.close()
    want = runtime.generate(STORY_PROMPTS[0], max_new_tokens=12, chat_template=False)
    assert _text(server, STORY_PROMPTS[0], max_tokens=12)[1] == want.text  # still serving


def test_only_loopback_is_bound(server):
    sockets = _listening()
    pids = [server.pid, *_group(server.pid)]
    bound = {sockets[i] for pid in set(pids) for i in _socket_inodes(pid) if i in sockets}
    ports = {server.config.grpc_port, server.config.http_port, server.config.metrics_port}
    assert {port for _, port in bound} >= ports, (bound, ports)
    assert {host for host, _ in bound} == {"127.0.0.1"}, bound  # gRPC's IPv6 socket holds ::ffff:127.0.0.1


def test_non_loopback_host_needs_allow_remote(tmp_path, capsys):
    from medusa_trt.cli.serve import main as serve_main

    (tmp_path / "repo").mkdir()
    assert serve_main([str(tmp_path / "repo"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith("medusa-serve: error: --host 0.0.0.0 is not a loopback address") and "--allow-remote" in err
    )
    with pytest.raises(ServeError, match="not a loopback address"):
        ServeConfig(repo=tmp_path, host="myhost.example")
    assert ServeConfig(repo=tmp_path, host="0.0.0.0", allow_remote=True).host == "0.0.0.0"  # on purpose
    assert ServeConfig(repo=tmp_path, host="127.0.0.2").host == "127.0.0.2"  # all of 127/8 is loopback


# ---------------------------------------------------------------------------------- a killed medusa-serve


def test_kill_9_of_medusa_serve_leaves_nothing(serving, engine, tmp_path):
    """medusa-serve killed with SIGKILL mid-generation: its watchdog kills tritonserver's group
    (server and busy stub) and removes the shared memory and the run folder."""
    from tritonclient.utils import InferenceServerException

    repo = tmp_path / "repo"
    write_triton_repo(TritonRepoConfig(engine=engine, repo=repo))
    cmd = [
        sys.executable,
        "-m",
        "medusa_trt.cli.serve",
        str(repo),
        "--port-grpc",
        "0",
        "--port-http",
        "0",
        "--port-metrics",
        "0",
        "--log-file",
        str(tmp_path / "tritonserver.log"),
    ]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = [serve.stdout.readline() for _ in range(3)]
        assert "serving" in banner[0], (banner, serve.stderr.read() if serve.poll() is not None else "")
        triton = int(re.search(r"tritonserver pid (\d+)", banner[0]).group(1))
        grpc_address = banner[1].split()[-1]
        prefix = f"medusa_trt_{serve.pid}_"
        run_dir = Path(
            re.search(rb"--backend-directory=(\S+?)/backends", Path(f"/proc/{triton}/cmdline").read_bytes().replace(b"\0", b" "))
            .group(1)
            .decode()
        )
        ports = {port for inode, (_, port) in _listening().items() if inode in _socket_inodes(triton)}
        assert len(ports) == 3 and run_dir.is_dir() and _mentioning(prefix), (ports, run_dir)
        # sixteen 240-token streams on four rows, about 1 s of work here: requests are still in
        # flight when the kill lands, even where one stream alone (about 0.2 s) could finish first
        generating, ends = threading.Event(), []

        def client(prompt):
            try:
                for _ in stream_generate(grpc_address, prompt, max_tokens=240):
                    generating.set()
                ends.append("finished")
            except RequestFailed:
                ends.append("cut off")  # the stream broke mid-request
            except InferenceServerException:
                ends.append("not sent")  # the server was gone before the request went out

        clients = [threading.Thread(target=client, args=(STORY_PROMPTS[i % 4],)) for i in range(16)]
        for thread in clients:
            thread.start()
        assert generating.wait(60)  # the stub is generating
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (_group(triton) or _mentioning(prefix) or _shm(prefix) or run_dir.exists()):
            time.sleep(0.1)
        for thread in clients:
            thread.join(60)
        assert len(ends) == 16 and "cut off" in ends, ends
        assert _group(triton) == [] and _mentioning(prefix) == [], "tritonserver or its stub outlived medusa-serve"
        assert not {port for _, port in _listening().values()} & ports, "a port is still listening"
        assert _shm(prefix) == [] and not run_dir.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


# ---------------------------------------------------------------------------------- a corrupted engine


def test_same_size_corrupted_engine_file_is_refused_at_load(serving, engine, tmp_path):
    from medusa_trt.runtime.manifest import manifest_path, write_manifest

    source = EngineFiles.beside(engine)
    copy = tmp_path / "eng" / "model.onnx"
    copy.parent.mkdir()
    for path in (source.step, source.heads, source.tokenizer, manifest_path(source)):
        if path.is_dir():
            shutil.copytree(path, copy.parent / path.name)
        elif path.is_file():
            shutil.copy(path, copy.parent / path.name)
    files = EngineFiles.beside(copy)
    if not manifest_path(files).is_file():  # engines exported before medusa-export wrote manifests
        write_manifest(files)
    data = bytearray(files.heads.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped in place: the size is unchanged
    files.heads.write_bytes(bytes(data))
    write_triton_repo(TritonRepoConfig(engine=copy, repo=tmp_path / "repo"))  # sizes check out: the writer accepts it
    with pytest.raises(ServeError, match=rf"while loading medusa: .*{re.escape(str(files.heads))} does not match its recorded sha256"):
        TritonServer(ServeConfig(repo=tmp_path / "repo", log_file=tmp_path / "tritonserver.log")).start()


# ---------------------------------------------------------------------------------- per-request limits


def test_max_tokens_above_the_limit_is_refused(server, runtime):
    running = {}
    worker = threading.Thread(target=lambda: running.update(out=_text(server, STORY_PROMPTS[1], max_tokens=40)))
    worker.start()
    for asked in (LIMIT + 1, 2**31 - 1):
        with pytest.raises(RequestFailed, match=f"max_tokens {asked} exceeds this server's limit of {LIMIT} new tokens per request"):
            list(stream_generate(server.grpc_address, "Hi", max_tokens=asked))
    worker.join(timeout=120)
    assert running["out"][1] == runtime.generate(STORY_PROMPTS[1], max_new_tokens=40, chat_template=False).text
    assert _text(server, STORY_PROMPTS[0], max_tokens=LIMIT)[0][-1].finish_reason in ("length", "stop")  # the limit itself is served


def _assert_sent_steps(chunks, text: str, full, steps: int, stream: bool) -> None:
    """A request that timed out sent the first ``steps`` engine steps of the full generation and no more:
    a response per step then the empty "timeout" one (stream), or one "timeout" response with their text."""
    assert [c.finish_reason for c in chunks] == ([""] * steps if stream else []) + ["timeout"]
    if stream:  # the past-deadline step's tokens are not sent
        assert (chunks[-1].text, chunks[-1].token_ids) == ("", [])
    ids = [t for c in chunks for t in c.token_ids]
    assert steps <= len(ids) < len(full.token_ids) and ids == full.token_ids[: len(ids)]  # at least a token per step
    assert len(text) < len(full.text) and full.text.startswith(text)  # what it sent before the deadline, no more


@pytest.mark.parametrize("stream", [True, False])
def test_request_deadline_ends_with_timeout(server, runtime, stream):
    full = runtime.generate(STORY_PROMPTS[0], max_new_tokens=LIMIT, chat_template=False)
    # 10 ms at 3 ms a step (triton_step_clock_model.STEP_S): steps 1-3 (9 ms) are sent, step 4 (12 ms) is past the
    # deadline; checked at every step (the watchdog alone polls every 0.2 s)
    chunks, text = _text(server, STORY_PROMPTS[0], max_tokens=LIMIT, timeout_s=0.01, stream=stream)
    _assert_sent_steps(chunks, text, full, 3, stream)
    with pytest.raises(RequestFailed, match=f"timeout_s 60 exceeds this server's request_timeout of {CAP_TIMEOUT:g} s"):
        list(stream_generate(server.grpc_address, "Hi", timeout_s=60.0, stream=stream))


def test_server_default_deadline(serving, engine, runtime, tmp_path):
    install_step_clock(
        write_triton_repo(
            TritonRepoConfig(engine=engine, repo=tmp_path / "repo", defaults=ServeDefaults(max_tokens=240, request_timeout=0.05))
        )
    )
    full = runtime.generate(STORY_PROMPTS[0], max_new_tokens=240, chat_template=False)
    with TritonServer(ServeConfig(repo=tmp_path / "repo", log_file=tmp_path / "tritonserver.log")) as server:
        chunks, text = _text(server, STORY_PROMPTS[0])  # no timeout_s: the server's deadline
    _assert_sent_steps(chunks, text, full, 16, stream=True)  # 50 ms at 3 ms a step: 16 steps (48 ms), step 17 (51 ms) is past it


def test_deadline_clocks(tmp_path, monkeypatch):
    """A deadline reads the wall clock from the request's arrival; the tests' step clock counts the steps that
    reached the model instead (test_serving checks config.pbtxt's parameters: no clock among them)."""
    from triton_step_clock_model import StepClockLive

    from medusa_trt.serving import triton_model
    from medusa_trt.serving.triton_model import LiveRequest

    events = [SimpleNamespace(finish_reason=None)] * 3 + [SimpleNamespace(finish_reason="cancelled")]
    wall, stepped = LiveRequest(None, None, None, 100.0, 0.01), StepClockLive(None, iter(events), None, 100.0, 0.01)
    assert len(list(stepped.handle)) == 4 and stepped.steps == 3  # a cancellation is no step
    for now, steps, past in ((100.009, 3, (False, False)), (100.01, 4, (True, True)), (1e9, 0, (True, False))):
        monkeypatch.setattr(triton_model, "time", SimpleNamespace(monotonic=lambda now=now: now))  # the model's clock only
        stepped.steps = steps
        assert (wall.past_deadline(), stepped.past_deadline()) == past, (now, steps)
    assert not StepClockLive(None, iter(()), None, 100.0, None).past_deadline()  # no deadline


def test_bad_parameters_get_errors_while_a_good_request_finishes(server, runtime):
    bad = [
        ({"top_k": -1}, "top_k must be a non-negative integer"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"timeout_s": -1.0}, "timeout_s must be a number of seconds > 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ]
    extreme = [{"temperature": 1e-30, "seed": 2**64 - 1}, {"temperature": 0.5, "top_k": 2**31 - 1}, {"temperature": 1e30, "top_p": 1e-30}]
    running, odd = {}, {}
    worker = threading.Thread(target=lambda: running.update(out=_text(server, STORY_PROMPTS[2], max_tokens=60)))
    worker.start()
    odd_workers = [
        threading.Thread(target=lambda i=i, kw=kw: odd.update({i: _text(server, "Hi", max_tokens=12, **kw)[0]}))
        for i, kw in enumerate(extreme)
    ]  # valid but extreme: served beside the good request
    for t in odd_workers:
        t.start()
    for inputs, message in bad:
        with pytest.raises(RequestFailed) as info:
            list(stream_generate(server.grpc_address, "Hi", **inputs))
        assert message in str(info.value), (inputs, str(info.value))
    for t in [worker, *odd_workers]:
        t.join(timeout=120)
    assert running["out"][1] == runtime.generate(STORY_PROMPTS[2], max_new_tokens=60, chat_template=False).text
    assert sorted(odd) == [0, 1, 2] and all(chunks[-1].finish_reason in ("length", "stop") for chunks in odd.values())


# ---------------------------------------------------------------------------------- stop strings


def _spanning_stop(runtime, prompt: str, n: int) -> tuple[str, str]:
    """A stop string of the prompt's greedy output that begins two characters before the end of
    an engine step (so that step's text ends with the stop's first half, which must be held
    back) and ends inside the next token; and the text before it."""
    tokens, step_ends = [], []
    for event in runtime.stream(prompt, max_new_tokens=n, chat_template=False):
        tokens += event.token_ids
        step_ends.append(len(tokens))
    text = runtime.codec.decode(tokens)
    for end in step_ends[1:-1]:
        a, b = len(runtime.codec.decode(tokens[:end])), len(runtime.codec.decode(tokens[: end + 1]))
        stop = text[a - 2 : a + 2]
        if b - a >= 2 and stop[:2].strip() and text.find(stop) == a - 2:
            return stop, text[: a - 2]
    pytest.skip(f"no stop string spanning an engine step in {text!r}")


def test_stop_string_spanning_tokens_is_never_sent(server, runtime):
    prompt = STORY_PROMPTS[2]
    stop, before = _spanning_stop(runtime, prompt, 40)
    want = runtime.generate(prompt, max_new_tokens=40, stop=stop, chat_template=False)
    assert want.text == before and want.finish_reason == "stop"
    chunks, streamed = _text(server, prompt, max_tokens=40, stop=stop)
    (only,) = list(stream_generate(server.grpc_address, prompt, max_tokens=40, stop=stop, stream=False))
    assert streamed == only.text == want.text, (stop, streamed, only.text)
    assert all(stop not in c.text for c in chunks) and chunks[-1].finish_reason == only.finish_reason == "stop"
    sent = ""
    for c in chunks:  # no response carries any part of the stop string past what generate() returns
        sent += c.text
        assert want.text.startswith(sent), (stop, sent)


# ---------------------------------------------------------------------------------- bad CLI input


def _fake_engine(folder: Path, **changes) -> Path:
    import dataclasses

    from test_serving import FAKE_META, write_fake_engine

    return write_fake_engine(folder, dataclasses.replace(FAKE_META, **changes))


REPO_CASES = {
    "max-batch above the engine's": (["--max-batch", "99"], "asks for max_batch 99 / max_context 256 but the engine was exported for 4"),
    "max-context above the engine's": (["--max-context", "100000"], "max_context 100000 but the engine was exported for 4 / 256"),
    "tree needs more proposals": (["--tree", "mc_sim_7b_63"], "needs top-10 proposals per head but the engine's heads give top-2"),
    "tree deeper than the heads": (["--tree", "chain-9"], "heads"),
    "heads file missing": (["@no-heads"], "model.heads.onnx is missing: the engine has 4 heads"),
    "out is a file": (["@out-file"], "exists and is not a folder"),
    "out parent missing": (["@deep-out"], "does not exist; create it first"),
    "limit above the context": (["--max-tokens-limit", "5000"], "--max-tokens-limit 5000 exceeds the context of 256"),
    "default above the limit": (["--max-tokens", "300", "--max-tokens-limit", "200"], "exceeds the per-request limit 200"),
    "negative timeout": (["--request-timeout", "-1"], "request_timeout must be a number of seconds >= 0"),
    "max-batch not a number": (["--max-batch", "x"], "expected a whole number"),
    "missing engine": (["@missing-engine"], "does not exist: export one with medusa-export"),
    "engine truncated": (["@truncated"], "truncated"),
    "engine not ONNX": (["@garbage"], "is not an ONNX file"),
}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from medusa_trt.cli import serve; sys.exit(getattr(serve, sys.argv.pop(1))())", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def _snapshot(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", list(REPO_CASES))
def test_triton_repo_bad_input_is_one_line(case, tmp_path):
    extra, message = REPO_CASES[case]
    engine = _fake_engine(tmp_path / "eng", top_k=2)
    out = tmp_path / "repo"
    if extra == ["@no-heads"]:
        EngineFiles.beside(engine).heads.unlink()
    elif extra == ["@out-file"]:
        out.write_text("not a folder")
    elif extra == ["@deep-out"]:
        out = tmp_path / "nonexistent" / "deep" / "repo"
    elif extra == ["@missing-engine"]:
        engine = tmp_path / "eng" / "gone.onnx"
    elif extra == ["@truncated"]:
        engine.write_bytes(engine.read_bytes()[:40])
    elif extra == ["@garbage"]:
        engine.write_bytes(b"\x07" * 64)
    extra = [] if extra[0].startswith("@") else extra
    before = _snapshot(tmp_path)
    done = _run(["repo_main", "--engine", str(engine), "--out", str(out), *extra], tmp_path)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("medusa-triton-repo: error: "), done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert _snapshot(tmp_path) == before  # nothing half-written


SERVE_CASES = {
    "remote host without --allow-remote": (["@repo", "--host", "0.0.0.0"], "is not a loopback address"),
    "missing repository": (["@missing"], "does not exist: pass an engine"),
    "empty repository": (["@repo"], "no model in"),
    "port out of range": (["@repo", "--port-http", "70000"], "a port is at most 65535"),
    "model name with a path": (["@repo", "--model", "../x"], "must be a plain folder name"),
    "no repository": ([], "the model repository is required"),
}


@pytest.mark.parametrize("case", list(SERVE_CASES))
def test_serve_bad_input_is_one_line(case, tmp_path):
    args, message = SERVE_CASES[case]
    (tmp_path / "repo").mkdir()
    args = [str(tmp_path / "repo") if a == "@repo" else str(tmp_path / "missing") if a == "@missing" else a for a in args]
    before = _snapshot(tmp_path)
    done = _run(["main", *args], tmp_path)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("medusa-serve: error: "), done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert _snapshot(tmp_path) == before
