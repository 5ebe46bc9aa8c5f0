"""medusa-bench --peer in processes of their own: a peer that dies (a segfault in llama.cpp's
decode on some CPUs) costs its row only, and the row says how it died; the new --peer kinds
(llama.cpp-norepack, openvino, openvino-default, +lookup) parse, and bad ones are one line.

The crashing peer is a test double (tests/peer_doubles.py, enabled by MEDUSA_TRT_PEER_KINDS) that
kills its own process with SIGSEGV, as llama.cpp did: no llama.cpp needed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys
import types

import pytest
from conftest import medusa_model

from medusa_trt.bench.peer_process import PeerDied, PeerProcess
from medusa_trt.bench.peers import KINDS, PeerError, parse_peer
from medusa_trt.cli.bench import main

PROMPTS = ["Once upon a time", "The dog was", "Lily saw a bird. The bird"]


@pytest.fixture
def doubles(monkeypatch):
    monkeypatch.setenv("MEDUSA_TRT_PEER_KINDS", "peer_doubles")


def _script(tmp_path, name: str, **script) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"tokens": [5, 6, 7, 8], "vocab_size": 512} | script))
    return f"scripted:{path}"


# ----------------------------------------------------------------- the worker on its own


def test_a_peer_answers_from_its_own_process(doubles, tmp_path):
    peer = PeerProcess(parse_peer(_script(tmp_path, "ok")), threads=2, context=64, vocab_size=512)
    try:
        assert peer.mode == "scripted, 2 threads"
        assert peer.generate([1, 2, 3], 3, frozenset()) == ([5, 6, 7], 0.01)
        assert peer._proc.pid != os.getpid() and peer._proc.is_alive()
    finally:
        peer.close()
    assert not peer._proc.is_alive()


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGABRT", "SIGKILL"])
def test_a_dead_worker_is_named_by_its_signal(doubles, tmp_path, sig):
    peer = PeerProcess(parse_peer(_script(tmp_path, "dies", die_on_call=2, signal=sig)), threads=1, context=64)
    assert peer.generate([1], 2, frozenset()) == ([5, 6], 0.01)
    number = int(signal.Signals[sig])
    with pytest.raises(PeerDied, match=re.escape(f"killed by {sig} (signal {number})")):
        peer.generate([1], 2, frozenset())
    peer.close()  # twice is fine
    peer.close()


def test_a_peer_that_raises_or_dies_loading(doubles, tmp_path):
    with pytest.raises(PeerDied, match=re.escape("killed by SIGSEGV (signal 11) while loading")):
        PeerProcess(parse_peer(_script(tmp_path, "load", die_loading=True)), threads=1, context=64)
    peer = PeerProcess(parse_peer(_script(tmp_path, "raises", raise_on_call=1)), threads=1, context=64)
    with pytest.raises(PeerDied, match="RuntimeError: the scripted engine failed"):
        peer.generate([1], 2, frozenset())


def test_a_peer_of_another_vocabulary_is_refused_and_ended(doubles, tmp_path):
    spec = parse_peer(_script(tmp_path, "vocab", vocab_size=1000))
    with pytest.raises(PeerError, match="has a vocabulary of 1000 tokens, the engine 512: pass a script of the engine's model"):
        PeerProcess(spec, threads=1, context=64, vocab_size=512)


# ----------------------------------------------------------------- in the benchmark


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


def test_a_crashing_peer_costs_its_row_only(doubles, engine, tmp_path, capsys):
    """A peer segfaulting on the second prompt: the benchmark finishes; every other row has all prompts;
    the dead row keeps its first prompt and says it was killed by SIGSEGV, where."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in PROMPTS))
    out = tmp_path / "bench.json"
    argv = ["--engine", str(engine), "--prompts", str(prompts), "--max-new-tokens", "8", "--no-hf", "--threads", "1", "--out", str(out)]
    argv += ["--peer", _script(tmp_path, "crashes", die_on_call=3), "--peer", _script(tmp_path, "steady")]  # call 1 warms up
    argv += ["--peer", _script(tmp_path, "early", die_on_call=1, signal="SIGBUS")]
    assert main(argv) == 0, capsys.readouterr().err
    methods = json.loads(out.read_text())["methods"]
    crashed, steady, early = methods["scripted[crashes]"], methods["scripted[steady]"], methods["scripted[early]"]
    assert crashed["failure"] == "killed by SIGSEGV (signal 11) on prompt 2 of 3"
    assert crashed["prompts_done"] == "1/3" and crashed["new_tokens"] == 4
    assert early["failure"] == "killed by SIGBUS (signal 7) while warming up" and early["new_tokens"] == 0
    assert "failure" not in steady and steady["new_tokens"] == 12 and steady["mode"] == "scripted, 1 threads"
    assert methods["plain[model]"]["new_tokens"] > 0 and "failure" not in methods["plain[model]"]
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if line.startswith("scripted[crashes]"))
    assert "DIED killed by SIGSEGV (signal 11) on prompt 2 of 3 (1/3 prompts)" in line
    assert "scripted, 1 threads" in next(line for line in table.splitlines() if line.startswith("scripted[steady]"))


# ----------------------------------------------------------------- the kinds and bad input


def test_the_kinds(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "ov").mkdir()
    (tmp_path / "ov" / "openvino_model.xml").write_text("<net/>")
    for kind, options in [
        ("llama.cpp", {}),
        ("llama.cpp+lookup", {"lookup": True}),
        ("llama.cpp-norepack", {"extra_bufts": False}),
        ("llama.cpp-norepack+lookup", {"extra_bufts": False, "lookup": True}),
    ]:
        spec = parse_peer(f"{kind}:{gguf}")
        assert spec.kind is KINDS[kind] and spec.kind.options == options and spec.name == f"{kind}[m]"
    for kind, options in [
        ("openvino", {}),
        ("openvino+lookup", {"lookup": True}),
        ("openvino-default", {"precision": None}),
        ("openvino-default+lookup", {"precision": None, "lookup": True}),
    ]:
        spec = parse_peer(f"{kind}:{tmp_path / 'ov'}")
        assert spec.kind.runtime.name == "openvino" and spec.kind.options == options and spec.name == f"{kind}[ov]"


def test_scripted_kind_is_for_tests_only(tmp_path, monkeypatch):
    monkeypatch.delenv("MEDUSA_TRT_PEER_KINDS", raising=False)
    with pytest.raises(PeerError, match="write KIND:FILE.gguf"):
        parse_peer(_script(tmp_path, "x"))


BAD = [  # (--peer, fragment of the one line); {tmp}: the test's folder
    (
        "bogus:x",
        "write KIND:FILE.gguf with KIND one of llama.cpp, llama.cpp+lookup, llama.cpp-norepack, llama.cpp-norepack+lookup; "
        "or KIND:DIR with KIND one of openvino, openvino+lookup, openvino-default, openvino-default+lookup",
    ),
    ("openvino+lookup:", "write KIND:FILE.gguf"),
    ("openvino", "write KIND:FILE.gguf"),
    ("openvino:{tmp}/absent", "--peer openvino:{tmp}/absent: {tmp}/absent is not a folder: pass an OpenVINO model folder"),
    ("openvino-default:{tmp}/p.jsonl", "{tmp}/p.jsonl is not a folder"),
    ("openvino:{tmp}/empty", "{tmp}/empty holds no openvino_model.xml: pass a folder optimum-cli export openvino wrote"),
    ("llama.cpp-norepack:{tmp}/p.jsonl", "{tmp}/p.jsonl is not a .gguf file: llama.cpp reads GGUF models"),
    ("llama.cpp-norepack+lookup:{tmp}/absent.gguf", "{tmp}/absent.gguf does not exist: pass a GGUF file of the engine's model"),
]


@pytest.mark.parametrize("peer,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_peers_are_one_line(tmp_path, capsys, peer, fragment):
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": ["Once upon a time"]}))
    (tmp_path / "empty").mkdir()
    argv = ["--engine", str(tmp_path / "missing"), "--prompts", str(tmp_path / "p.jsonl"), "--no-hf", "--peer", peer.format(tmp=tmp_path)]
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, fragment.format(tmp=tmp_path))


def test_openvino_not_installed_is_one_line_with_the_install_command(tmp_path, capsys, monkeypatch):
    """Where OpenVINO GenAI cannot be imported, --peer openvino:DIR says so and names the install, before any engine loads."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": ["Once upon a time"]}))
    (tmp_path / "ov").mkdir()
    (tmp_path / "ov" / "openvino_model.xml").write_text("<net/>")
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # import openvino_genai raises ImportError
    argv = ["--engine", str(tmp_path / "missing"), "--prompts", str(tmp_path / "p.jsonl"), "--no-hf"]
    assert main(argv + ["--peer", f"openvino:{tmp_path / 'ov'}"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "OpenVINO GenAI is not importable (")
    assert err.rstrip().endswith("pip install -c constraints.txt '.[openvino]' (make openvino-peer)"), err


def _one_line(err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("medusa-bench: error: ") and fragment in lines[0], err


# ----------------------------------------------------------------- llama.cpp's extra buffer types


def _fake_binding(monkeypatch, fields: list[tuple[str, type]]) -> types.ModuleType:
    """A stand-in for llama-cpp-python's ctypes module: its model parameters with ``fields``."""

    class Params(ctypes.Structure):
        _fields_ = fields

    def defaults():
        params = Params()
        for name, _ in fields:
            setattr(params, name, True)
        return params

    package, native = types.ModuleType("llama_cpp"), types.ModuleType("llama_cpp.llama_cpp")
    native.llama_model_params, native.llama_model_default_params = Params, defaults
    package.llama_cpp = native
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", native)
    return native


def test_norepack_turns_the_extra_buffer_types_off_while_loading(monkeypatch):
    from medusa_trt.bench.peers import NoExtraBuffers

    native = _fake_binding(monkeypatch, [("use_mmap", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool)])
    original = native.llama_model_default_params
    with NoExtraBuffers("llama.cpp-norepack:m.gguf"):
        params = native.llama_model_default_params()  # what Llama() reads when it loads the model
        assert params.use_extra_bufts is False and params.use_mmap is True
    assert native.llama_model_default_params is original and original().use_extra_bufts is True


def test_norepack_on_a_binding_without_the_parameter_is_one_line(monkeypatch):
    from medusa_trt.bench.peers import NoExtraBuffers

    _fake_binding(monkeypatch, [("use_mmap", ctypes.c_bool)])
    with pytest.raises(PeerError, match="this llama-cpp-python has no use_extra_bufts model parameter"):
        NoExtraBuffers("llama.cpp-norepack:m.gguf")
