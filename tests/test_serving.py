"""Serving through Triton: the model repository writer, request parsing, and a real tritonserver.

The server tests start the ``tritonserver`` bundled in nvidia-pytriton on free loopback ports
over a repository for the stories engine, then check over gRPC streams (tritonclient) and the
HTTP generate endpoint: streamed greedy output equals ``MedusaRuntime``'s; 16 concurrent
requests each get their solo output; bad requests get error responses while others are served;
the model's custom metrics move by exactly a known request's drafted and accepted tokens;
``medusa-serve ENGINE --api triton`` serves an engine without a repository of its own; stopping
by pid leaves no process and no shared-memory segment. They skip, saying why, without
nvidia-pytriton / tritonclient or when the stub's Python has numpy 2 (see serving/triton.py).
"""

from __future__ import annotations

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

import numpy as np
import pytest
from conftest import STORY_PROMPTS, medusa_model

from medusa_trt.cli.serve import main as serve_main
from medusa_trt.cli.serve import repo_main
from medusa_trt.runtime.engine import FORMAT_VERSION, META_KEY, EngineFiles, EngineMeta
from medusa_trt.runtime.sampling import SamplingError
from medusa_trt.serving.client import RequestFailed, stream_generate
from medusa_trt.serving.schema import EngineOptions, RequestError, ServeDefaults, ServeOptionsError
from medusa_trt.serving.triton import ServeConfig, ServeError, TritonServer
from medusa_trt.serving.triton_model import parse_request
from medusa_trt.serving.triton_repo import MODEL_FILE, TritonRepoConfig, TritonRepoError, write_triton_repo

# ---------------------------------------------------------------------------------- repository writer


FAKE_META = EngineMeta(
    format_version=FORMAT_VERSION,
    model="fake",
    architecture="llama",
    dtype="fp32",
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    num_heads=4,
    top_k=10,
    tree=[[0], [1], [0, 0]],
    tree_name="fake",
    max_batch=4,
    max_context=256,
    max_tokens=64,
    eos_token_ids=[2],
    is_chat=False,
)


def _pb(field: int, data: bytes) -> bytes:
    """A length-delimited protobuf field (lengths below 2**14 here)."""
    n = len(data)
    length = bytes([n]) if n < 128 else bytes([n & 0x7F | 0x80, n >> 7])
    return bytes([field << 3 | 2]) + length + data


def write_fake_engine(folder: Path, meta: EngineMeta = FAKE_META) -> Path:
    """An .onnx whose only content is the medusa_trt metadata (ModelProto field 14), its heads
    graph and tokenizer: what the writer reads (it never opens the graph)."""
    engine = folder / "model.onnx"
    (folder / "model.tokenizer").mkdir(parents=True)
    (folder / "model.tokenizer" / "tokenizer.json").write_text("{}")
    model = b"\x08\x08" + _pb(14, _pb(1, META_KEY.encode()) + _pb(2, meta.to_json().encode()))  # ir_version 8, metadata_props
    engine.write_bytes(model)
    EngineFiles.beside(engine).heads.write_bytes(model)
    return engine


@pytest.fixture
def fake_engine(tmp_path) -> Path:
    return write_fake_engine(tmp_path / "eng")


def test_metadata_is_read_without_loading_the_graph(engine, fake_engine):
    from medusa_trt.runtime.engine import engine_meta as read_engine_meta
    from medusa_trt.runtime.engine import read_meta

    assert read_engine_meta(fake_engine) == FAKE_META
    assert read_engine_meta(Path(engine)) == read_meta(engine)  # the same as ONNX Runtime reads it


def _parse_config(text: str):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_repo_layout_and_config(fake_engine, tmp_path):
    folder = write_triton_repo(
        TritonRepoConfig(
            engine=EngineOptions(fake_engine, tree="chain-2", max_batch=2),
            repo=tmp_path / "repo",
            defaults=ServeDefaults(max_tokens=64, temperature=0.5, top_p=0.9),
        )
    )
    assert folder == (tmp_path / "repo" / "medusa").resolve()
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["1", "1/model.py", "config.pbtxt"]
    assert (folder / "1" / "model.py").read_text() == MODEL_FILE.read_text()
    config = _parse_config((folder / "config.pbtxt").read_text())  # a valid ModelConfig for Triton
    assert (config.name, config.backend, config.max_batch_size) == ("medusa", "python", 0)
    assert config.model_transaction_policy.decoupled
    assert [(i.name, i.optional) for i in config.input] == [
        ("text_input", False),
        ("max_tokens", True),
        ("temperature", True),
        ("top_p", True),
        ("top_k", True),
        ("stop", True),
        ("seed", True),
        ("stream", True),
        ("timeout_s", True),
    ]
    types = {i.name: (i.data_type, list(i.dims)) for i in [*config.input, *config.output]}
    pb = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    assert types["text_input"] == (pb.TYPE_STRING, [1]) and types["stop"] == (pb.TYPE_STRING, [-1])
    assert types["seed"] == (pb.TYPE_UINT64, [1]) and types["stream"] == (pb.TYPE_BOOL, [1])
    assert types["text_output"] == (pb.TYPE_STRING, [-1]) and types["token_ids"] == (pb.TYPE_INT64, [-1])
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert (
        params["engine"] == os.path.relpath(fake_engine.resolve(), folder) == "../../eng/model.onnx"
    )  # the repository and engine move together
    assert params | {"engine": ""} == {
        "engine": "",
        "tree": "chain-2",
        "drafters": "",
        "max_batch": "2",
        "max_context": "",
        "backend": "",
        "threads": "",
        "default_max_tokens": "64",
        "max_tokens_limit": "256",
        "request_timeout": "0.0",
        "default_temperature": "0.5",
        "default_top_p": "0.9",
        "chat_template": "auto",
    }


def test_repo_drafters(fake_engine, tmp_path, capsys):
    """--draft names the drafters the served model merges (none: plain decoding); unknown ones are refused."""

    def drafters(folder):
        return {k: v.string_value for k, v in _parse_config((folder / "config.pbtxt").read_text()).parameters.items()}["drafters"]

    both = EngineOptions(fake_engine, drafters=("heads", "lookup"))
    assert drafters(write_triton_repo(TritonRepoConfig(engine=both, repo=tmp_path / "a"))) == "heads,lookup"
    assert drafters(write_triton_repo(TritonRepoConfig(engine=EngineOptions(fake_engine, drafters=()), repo=tmp_path / "b"))) == "none"
    with pytest.raises(TritonRepoError, match="unknown drafter 'ngram'"):
        write_triton_repo(TritonRepoConfig(engine=EngineOptions(fake_engine, drafters=("ngram",)), repo=tmp_path / "c"))
    assert repo_main(["--engine", str(fake_engine), "--out", str(tmp_path / "d"), "--draft", "none"]) == 0
    assert drafters(tmp_path / "d" / "medusa") == "none"
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:  # a usage error: one line, exit 2
        repo_main(["--engine", str(fake_engine), "--out", str(tmp_path / "e"), "--draft", "heads,ngram"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and err.count("\n") == 1 and "unknown drafter 'ngram'" in err


def test_repo_write_is_atomic(fake_engine, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "other" / "1").mkdir(parents=True)  # another model in the repository is left alone
    write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=repo))
    with pytest.raises(TritonRepoError, match="exists"):
        write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=repo))
    write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=repo, defaults=ServeDefaults(max_tokens=7), overwrite=True))
    assert 'default_max_tokens" value: { string_value: "7"' in (repo / "medusa" / "config.pbtxt").read_text()

    def broken(*_):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copyfile", broken)  # fails half-way: the old model stays, nothing else appears
    with pytest.raises(OSError, match="disk full"):
        write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=repo, defaults=ServeDefaults(max_tokens=9), overwrite=True))
    assert sorted(p.name for p in repo.iterdir()) == ["medusa", "other"]
    assert '"7"' in (repo / "medusa" / "config.pbtxt").read_text()
    with pytest.raises(OSError):
        write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()  # a new repository is built beside its place, then renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng", "repo"]


def test_repo_bad_input(fake_engine, tmp_path, capsys):
    with pytest.raises(TritonRepoError, match="does not exist: export one with medusa-export"):
        write_triton_repo(TritonRepoConfig(engine=tmp_path / "missing.onnx", repo=tmp_path / "repo"))
    shutil.rmtree(fake_engine.with_name("model.tokenizer"))
    with pytest.raises(TritonRepoError, match="no tokenizer"):
        write_triton_repo(TritonRepoConfig(engine=fake_engine, repo=tmp_path / "repo"))
    with pytest.raises(ServeOptionsError, match="max_batch must be >= 1"):
        TritonRepoConfig(engine=EngineOptions(fake_engine, max_batch=0), repo=tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    code = repo_main(["--engine", str(tmp_path / "missing.onnx"), "--out", str(tmp_path / "repo")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("medusa-triton-repo: error: ") and "does not exist" in err


# ---------------------------------------------------------------------------------- request parsing


def _inputs(text="Hello", **fields):
    out = {"text_input": np.array([text.encode()], dtype=object)}
    for name, value in fields.items():
        out[name] = value if isinstance(value, np.ndarray) else np.array([value])
    return out


def test_parse_request_defaults_and_fields():
    defaults = ServeDefaults(max_tokens=33, temperature=0.0, top_p=1.0)
    parsed = parse_request(_inputs(), {}, defaults)
    request = parsed.request
    assert (request.prompt, request.max_new_tokens, request.sampling.temperature, request.stop, parsed.stream) == (
        "Hello",
        33,
        0.0,
        None,
        False,
    )
    assert parsed.timeout is None
    parsed = parse_request(
        _inputs(
            "Hi",
            max_tokens=np.array([5], dtype=np.int32),
            temperature=np.array([0.7], dtype=np.float32),
            top_p=np.array([0.9], dtype=np.float32),
            top_k=np.array([4], dtype=np.int32),
            seed=np.array([7], dtype=np.uint64),
            stream=np.array([True]),
            timeout_s=np.array([2.5], dtype=np.float32),
            stop=np.array([b"\n\n", b"The end"], dtype=object),
        ),
        {},
        defaults,
    )
    request = parsed.request
    assert request.max_new_tokens == 5 and request.stop == ("\n\n", "The end") and parsed.stream and parsed.timeout == 2.5
    limited = ServeDefaults(max_tokens=16, max_tokens_limit=64, request_timeout=10.0)
    assert parse_request(_inputs(max_tokens=np.array([64], dtype=np.int32)), {}, limited).request.max_new_tokens == 64
    assert parse_request(_inputs(), {}, limited).timeout == 10.0  # the server's deadline when the request sets none
    with pytest.raises(RequestError, match="timeout_s 20 exceeds this server's request_timeout of 10 s"):
        parse_request(_inputs(timeout_s=np.array([20.0], dtype=np.float32)), {}, limited)
    assert (request.sampling.top_k, request.sampling.seed) == (4, 7) and abs(request.sampling.temperature - 0.7) < 1e-6


@pytest.mark.parametrize(
    "inputs,params,error,message",
    [
        (_inputs(""), {}, RequestError, "text_input is empty"),
        (_inputs(max_tokens=np.array([-3], dtype=np.int32)), {}, RequestError, "max_tokens must be >= 1, got -3"),
        (_inputs(temperature=np.array([-1.0], dtype=np.float32)), {}, SamplingError, "temperature must be >= 0"),
        (_inputs(top_p=np.array([1.5], dtype=np.float32)), {}, SamplingError, "top_p must be in"),
        (_inputs(stop=np.array([b""], dtype=object)), {}, RequestError, "empty string"),
        (_inputs(), {"frequency_penalty": 1}, RequestError, "unknown request parameter(s) ['frequency_penalty']"),
        (
            _inputs(max_tokens=np.array([2**31 - 1], dtype=np.int32)),
            {},
            RequestError,
            "max_tokens 2147483647 exceeds this server's limit of 1024",
        ),
        (_inputs(timeout_s=np.array([-1.0], dtype=np.float32)), {}, RequestError, "timeout_s must be a number of seconds > 0, got -1.0"),
        (_inputs(timeout_s=np.array([np.nan], dtype=np.float32)), {}, RequestError, "timeout_s must be a number of seconds > 0"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, {}, RequestError, "not valid UTF-8"),
        ({}, {}, RequestError, "text_input is required"),
    ],
)
def test_parse_request_rejects(inputs, params, error, message):
    with pytest.raises(error) as info:
        parse_request(inputs, params, ServeDefaults())
    assert message in str(info.value)


def test_serve_bad_repository(tmp_path, capsys):
    with pytest.raises(ServeError, match="does not exist: write one with medusa-triton-repo"):
        TritonServer(ServeConfig(repo=tmp_path / "nope")).start()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServeError, match="no model in"):
        TritonServer(ServeConfig(repo=tmp_path / "empty")).start()
    assert serve_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("medusa-serve: error: no model in")


def test_export_writes_the_repository_too(engine, tmp_path, capsys):
    from medusa_trt.cli.export import triton_repo_option

    assert triton_repo_option(str(tmp_path / "repo"), Path(engine)) == 0
    assert triton_repo_option(str(tmp_path / "repo"), Path(engine)) == 0  # exporting again replaces it
    assert capsys.readouterr().out.count("serve it with medusa-serve") == 2
    reference = os.path.relpath(Path(engine).resolve(), (tmp_path / "repo" / "medusa").resolve())
    assert f'string_value: "{reference}"' in (tmp_path / "repo" / "medusa" / "config.pbtxt").read_text()


# ---------------------------------------------------------------------------------- the real server

PROMPTS = STORY_PROMPTS + [
    "Sam saw a frog",
    "The sky was blue and",
    "Mia had a kite. It was red and",
    "Bob",
    "Anna wanted a puppy",
    "The rain fell on the",
    "A big bear",
    "Tom and his mom baked",
    "The moon was bright",
    "Kim found a shiny",
    "There was a little car",
    "The fish swam",
]
LENGTHS = [40, 7, 25, 33, 12, 48, 3, 20, 30, 16, 44, 9, 27, 5, 38, 21]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


@pytest.fixture(scope="module")
def runtime(engine):
    from medusa_trt.runtime import MedusaRuntime

    return MedusaRuntime(str(engine))


def solo(runtime, prompt, n):
    return runtime.generate(prompt, max_new_tokens=n, chat_template=False)


@pytest.fixture(scope="module")
def server(serving, engine, stories_chat_engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton-repo")
    write_triton_repo(TritonRepoConfig(engine=engine, repo=repo, defaults=ServeDefaults(max_tokens=16)))
    write_triton_repo(
        TritonRepoConfig(
            engine=EngineOptions(engine, drafters=()), repo=repo, model_name="medusa-plain", defaults=ServeDefaults(max_tokens=16)
        )
    )
    # an engine folder with a fixed drafting budget: its trees, and so its drafted-token counts, are the runtime's
    write_triton_repo(
        TritonRepoConfig(engine=stories_chat_engine, repo=repo, model_name="medusa-folder", defaults=ServeDefaults(max_tokens=16))
    )
    before = _shm()
    server = TritonServer(ServeConfig(repo=repo, exit_timeout=10, log_file=repo.parent / "tritonserver.log"))
    server.start()
    server.shm_before = before
    yield server
    server.stop()


def test_missing_engine_fails_the_start_with_the_reason(server, engine, tmp_path):
    repo = tmp_path / "repo"
    folder = write_triton_repo(TritonRepoConfig(engine=engine, repo=repo))
    config = folder / "config.pbtxt"
    moved = re.sub(r'(key: "engine" value: \{ string_value: )"[^"]*"', rf'\1"{tmp_path / "moved.onnx"}"', config.read_text())
    assert str(tmp_path / "moved.onnx") in moved
    config.write_text(moved)
    with pytest.raises(ServeError, match=r"exited with status \d+ while loading medusa: .*moved.onnx .*does not exist"):
        TritonServer(ServeConfig(repo=repo)).start()


def test_a_killed_server_leaves_nothing_behind(server, engine, tmp_path):
    """A server killed with SIGKILL mid-generation: its stub may run on, busy, on its own; stop()
    ends the process group and removes the shared memory the stub held."""
    import signal

    write_triton_repo(TritonRepoConfig(engine=engine, repo=tmp_path / "repo"))
    doomed = TritonServer(ServeConfig(repo=tmp_path / "repo")).start()
    chunks = stream_generate(doomed.grpc_address, PROMPTS[0], max_tokens=240)
    next(chunks)  # generating
    os.kill(doomed.pid, signal.SIGKILL)
    with pytest.raises(RequestFailed):
        list(chunks)
    doomed.stop()
    for _ in range(50):  # SIGKILL is delivered at once, the exit takes a moment
        if not _processes_mentioning(doomed.shm_prefix):
            break
        threading.Event().wait(0.1)
    assert _processes_mentioning(doomed.shm_prefix) == [], doomed.leftovers
    assert not any(s.startswith(doomed.shm_prefix) for s in _shm()), doomed.leftovers


def _generate(server, prompt, n, **kw):
    chunks = list(stream_generate(server.grpc_address, prompt, max_tokens=n, **kw))
    return chunks, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def test_streamed_generation_equals_runtime(server, runtime):
    prompt = STORY_PROMPTS[2]
    chunks, tokens, text = _generate(server, prompt, 40)
    want = solo(runtime, prompt, 40)
    assert tokens == want.token_ids and text == want.text
    assert len(chunks) > 1 and len(chunks) < 40  # streamed, one response per engine step, several tokens per step
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1) and chunks[-1].finish_reason == want.finish_reason
    # one response with stream=false; and max_tokens from config.pbtxt when the request sends none
    (only,) = list(stream_generate(server.grpc_address, prompt, max_tokens=40, stream=False))
    assert only.token_ids == want.token_ids and only.text == want.text
    assert [t for c in stream_generate(server.grpc_address, prompt) for t in c.token_ids] == solo(runtime, prompt, 16).token_ids


def test_drafters_of_the_served_model_follow_its_repository(server, runtime):
    """The same engine served twice, with every drafter and with none: the same tokens, and each
    model says at load which drafters it merges."""
    prompt = STORY_PROMPTS[1]
    drafted = [t for c in stream_generate(server.grpc_address, prompt, max_tokens=32) for t in c.token_ids]
    plain_chunks = list(stream_generate(server.grpc_address, prompt, model="medusa-plain", max_tokens=32))
    assert [t for c in plain_chunks for t in c.token_ids] == drafted == solo(runtime, prompt, 32).token_ids
    assert len(plain_chunks) == 32  # plain decoding: one token per step, one response each
    log = server.log_path.read_text()
    assert "drafters none;" in log and "drafters heads,lookup,recycle;" in log


def test_sixteen_concurrent_requests_each_get_their_solo_output(server, runtime):
    results, errors = {}, []

    def client(i):
        try:
            results[i] = _generate(server, PROMPTS[i], LENGTHS[i])
        except Exception as exc:  # noqa: BLE001 - reported below with the request's index
            errors.append((i, exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i, prompt in enumerate(PROMPTS):  # 16 requests over the engine's 4 rows: most waited for a free one
        want = solo(runtime, prompt, LENGTHS[i])
        assert results[i][1] == want.token_ids, f"request {i} ({prompt!r}, {LENGTHS[i]} tokens) differs from its solo run"
        assert results[i][2] == want.text


def test_bad_requests_get_errors_while_others_are_served(server, runtime):
    import tritonclient.grpc as grpcclient

    long_prompt = "Once upon a time there was a big dog. " * 40  # over the engine's 256-token context
    unknown = grpcclient.InferInput("frequency_penalty", [1], "FP32")
    unknown.set_data_from_numpy(np.array([0.5], dtype=np.float32))
    bad = [
        ({"text": ""}, "text_input is empty"),
        ({"text": long_prompt}, "max_context is 256"),
        ({"text": "Hi", "max_tokens": -4}, "max_tokens must be >= 1, got -4"),
        ({"text": "Hi", "temperature": -1.0}, "temperature must be >= 0"),
        ({"text": "Hi", "extra_inputs": [unknown]}, "unexpected inference input 'frequency_penalty'"),  # refused by Triton
        ({"text": "Hi", "parameters": {"frequency_penalty": 0.5}}, "unknown request parameter(s) ['frequency_penalty']"),
    ]
    running = {}
    worker = threading.Thread(target=lambda: running.update(out=_generate(server, PROMPTS[5], 48)))
    worker.start()  # a good request streams while the bad ones come and go
    for kwargs, message in bad:
        text = kwargs.pop("text")
        with pytest.raises(RequestFailed) as info:
            list(stream_generate(server.grpc_address, text, **kwargs))
        assert message in str(info.value)
    worker.join(timeout=120)
    assert running["out"][1] == solo(runtime, PROMPTS[5], 48).token_ids
    assert _generate(server, PROMPTS[0], 12)[1] == solo(runtime, PROMPTS[0], 12).token_ids

    # Triton's HTTP generate endpoint: JSON fields that name no input arrive as parameters -> refused
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(body):
        request = urllib.request.Request(f"{server.http_url}/v2/models/medusa/generate", data=json.dumps(body).encode(), method="POST")
        try:
            with opener.open(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    assert "unknown request parameter(s) ['presence_penalty']" in post({"text_input": "Hi", "presence_penalty": 1})["error"]
    answer = post({"text_input": PROMPTS[1], "max_tokens": 10})
    want = solo(runtime, PROMPTS[1], 10)
    assert answer["text_output"] == want.text and answer["token_ids"] == want.token_ids and answer["finish_reason"] == want.finish_reason


def test_cancelled_stream_frees_its_row(server, runtime):
    """Four clients fill the engine's rows with long generations and go away: a fifth request,
    which needs a free row, is served at once. Each forwarder sees its client's cancellation at
    its next step (four 240-token streams take about 0.5 s here): the watchdog's poll alone, every
    CANCEL_POLL_S, once missed streams that finished between two polls."""
    streams = [stream_generate(server.grpc_address, prompt, max_tokens=240) for prompt in PROMPTS[:4]]
    for chunks in streams:
        next(chunks)  # generating
    for chunks in streams:
        chunks.close()  # the client goes away mid-generation: its stream is cancelled
    started = time.monotonic()
    assert _generate(server, PROMPTS[4], 20)[1] == solo(runtime, PROMPTS[4], 20).token_ids
    assert time.monotonic() - started < 30
    for _ in range(100):  # the forwarder saw the cancellation (or, where Triton refused a send to the gone client first,
        if "its row is freed" in server.log_text():  # the send's failure): either way the row went back
            break
        threading.Event().wait(0.1)
    assert "its row is freed" in server.log_text(), server.log_text()[-3000:]


def _scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples: {'name{labels}': value}."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines if line and not line.startswith("#"))}


def _total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name and all(w in k for w in want))


def test_custom_metrics_move_by_exactly_the_drafted_and_accepted_tokens(server, stories_chat_engine):
    """Triton's metrics endpoint carries the model's acceptance counters (serving.metrics' names,
    a model label): a known greedy request moves them by its drafted and accepted tokens as the
    runtime counts them (serving.metrics documents the terms)."""
    from medusa_trt.runtime import MedusaRuntime

    prompt, n = PROMPTS[2], 40
    want = MedusaRuntime(str(stories_chat_engine)).generate(prompt, max_new_tokens=n, chat_template=False)
    assert want.stats.accepted_tokens > 0
    before = _scrape(server.metrics_url)
    assert _generate(server, prompt, n, model="medusa-folder")[1] == want.token_ids

    def delta(name, **labels):
        return _total(after, name, model="medusa-folder", **labels) - _total(before, name, model="medusa-folder", **labels)

    deadline = time.monotonic() + 10  # the model sends its updates every CANCEL_POLL_S
    while True:
        after = _scrape(server.metrics_url)
        if delta("medusa:requests_finished_total") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta("medusa:requests_finished_total", finish_reason=want.finish_reason) == 1
    assert delta("medusa:spec_decode_num_drafts_total") == sum(1 for d in want.stats.drafts if d.drafted)
    assert delta("medusa:spec_decode_num_draft_tokens_total") == want.stats.drafted_tokens
    assert delta("medusa:spec_decode_num_accepted_tokens_total") == want.stats.accepted_tokens
    heads = [(drafted, accepted) for d in want.stats.drafts for name, drafted, accepted in d.by_drafter if name == "heads"]
    assert delta("medusa:spec_decode_num_accepted_tokens_total", drafter="heads") == sum(a for _, a in heads)
    assert delta("medusa:generation_tokens_total") == len(want.token_ids)
    assert _total(after, "medusa:spec_decode_num_drafts_total", model="medusa-plain") == 0  # plain decoding drafts nothing
    assert 'medusa:num_requests_running{model="medusa-folder"}' in after and "metrics update failed" not in server.log_text()


def test_medusa_serve_an_engine_with_triton(serving, stories_chat_engine, tmp_path):
    """``medusa-serve ENGINE --api triton``: the repository is written into the server's run folder
    (gone after SIGTERM), the model is served under --model-name with the engine options given."""
    from medusa_trt.runtime import MedusaRuntime

    cmd = [
        sys.executable,
        "-m",
        "medusa_trt.cli.serve",
        str(stories_chat_engine),
        "--api",
        "triton",
        "--model-name",
        "plain",
        "--draft",
        "none",
        "--max-tokens",
        "12",
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
        banner = [serve.stdout.readline() for _ in range(4)]
        assert "serving" in banner[0], (banner, serve.stderr.read() if serve.poll() is not None else "")
        triton = int(re.search(r"tritonserver pid (\d+)", banner[0]).group(1))
        run_dir = Path(
            re.search(rb"--backend-directory=(\S+?)/backends", Path(f"/proc/{triton}/cmdline").read_bytes().replace(b"\0", b" "))
            .group(1)
            .decode()
        )
        assert (run_dir / "repository" / "plain" / "config.pbtxt").is_file()
        chunks = list(stream_generate(banner[1].split()[-1], PROMPTS[1], model="plain"))  # max_tokens 12: the --max-tokens default
        want = MedusaRuntime(str(stories_chat_engine), drafters=()).generate(PROMPTS[1], max_new_tokens=12, chat_template=False)
        assert [t for c in chunks for t in c.token_ids] == want.token_ids and len(chunks) == 12  # plain: one token per response
        os.kill(serve.pid, signal.SIGTERM)
        assert serve.wait(60) == 0, serve.stderr.read()
        assert not run_dir.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_stop_by_pid_leaves_nothing_behind(server):
    pid, prefix = server.pid, server.shm_prefix
    assert _processes_mentioning(prefix), "the Python backend stub runs with the server's shared-memory prefix"
    code = server.stop()  # SIGTERM to the pid; Triton unloads the model, the stub frees its shared memory
    assert code == 0, server.log_text()[-3000:]
    assert server.leftovers == [], "stop() had to kill the server or remove shared memory it left"
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert _processes_mentioning(prefix) == [], "a tritonserver or stub process is still running"
    assert [s for s in _shm() - server.shm_before if s.startswith(prefix)] == []
    assert not server.run_dir.exists()
