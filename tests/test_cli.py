"""medusa-run end to end, and bad input as one clear line with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import STORIES

from medusa_trt.cli.run import main
from medusa_trt.exporter import HeadsConfig, ModelLoadError, init_heads, load_base_model, save_heads


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generates_and_summarises(capsys, stories_base, monkeypatch):
    from medusa_trt.runtime import MedusaRuntime

    calls = []  # (drafters, max_new_tokens) of every generate call
    generate = MedusaRuntime.generate
    monkeypatch.setattr(
        MedusaRuntime, "generate", lambda self, *a, **k: calls.append((self.drafting.names, k["max_new_tokens"])) or generate(self, *a, **k)
    )
    code, out, err = _run(
        capsys,
        "--model",
        str(STORIES),
        "--untrained-heads",
        "3",
        "--tree",
        "chain-3",
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "20",
        "--compare-plain",
    )
    assert code == 0, err
    lines = out.strip().splitlines()
    assert "there was" in lines[0]
    assert (
        lines[1].startswith("medusa (drafters heads,lookup,recycle, heads template chain-3): 20 tokens,")
        and "accepted/step" in lines[1]
        and "tokens/s" in lines[1]
    )
    assert lines[2].startswith("plain decoding (same engine): 20 tokens, 19 steps, 1.00 accepted/step")
    assert lines[3].startswith("speedup over plain decoding: ")
    drafters = ("heads", "lookup", "recycle")
    assert calls == [(drafters, 4), ((), 4), (drafters, 20), ((), 20)]  # both warmed up untimed, as medusa-bench does


def test_saved_heads_batch_and_stream(capsys, stories_base, tmp_path):
    cfg = stories_base.model.config
    heads = init_heads(HeadsConfig(2, 1, cfg.hidden_size, cfg.vocab_size, shared_lm_head=False), stories_base.model.lm_head, random=True)
    save_heads(heads, tmp_path / "heads")
    code, out, err = _run(
        capsys,
        "--model",
        str(STORIES),
        "--heads",
        str(tmp_path / "heads"),
        "--prompt",
        "One day",
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "10",
    )
    assert code == 0, err
    assert out.count("--- prompt") == 2 and "medusa (drafters heads,lookup,recycle, heads template chain-2): 20 tokens" in out
    code, out, err = _run(
        capsys,
        "--model",
        str(STORIES),
        "--heads",
        str(tmp_path / "heads"),
        "--prompt",
        "One day",
        "--max-new-tokens",
        "10",
        "--stream",
        "--stop",
        "xyzzy",
    )
    assert code == 0, err
    assert "heads template chain-2): 10 tokens" in out


@pytest.fixture
def wrong_heads(tmp_path, stories_base):
    cfg = stories_base.model.config
    heads = init_heads(HeadsConfig(2, 1, cfg.hidden_size * 2, cfg.vocab_size, shared_lm_head=False), None, random=True)
    return save_heads(heads, tmp_path / "wrong")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/model.gguf"], "not found"),
        (["--model", str(STORIES), "--untrained-heads", "2", "--tree", "chain-3"], "needs 3 heads"),
        (["--model", str(STORIES), "--tree", "no-such-tree"], "unknown tree"),
        (["--model", str(STORIES), "--max-context", "4"], "max_context is 4"),
        (["--model", str(STORIES), "--heads", "/nonexistent/heads"], "does not exist"),
    ],
)
def test_bad_input_is_one_line(capsys, stories_base, args, message):
    if "--prompt" not in args:
        args = args + ["--prompt", "Once upon a time there was a dog"]
    code, out, err = _run(capsys, *args)
    assert code == 2
    lines = [line.split("\r")[-1] for line in err.split("\n")]  # \r: the GGUF loader's progress bar
    lines = [line for line in lines if line.strip() and "GGUF tensors" not in line]
    assert len(lines) == 1 and lines[0].startswith("medusa-run: error: ") and message in lines[0].lower(), err
    assert "Traceback" not in err


def test_heads_for_another_model(capsys, stories_base, wrong_heads):
    code, _, err = _run(capsys, "--model", str(STORIES), "--heads", str(wrong_heads), "--prompt", "hi")
    assert code == 2 and "hidden size 128" in err and "another model" in err


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported: supported are llama, mistral, qwen2"):
        load_base_model(tmp_path)


def test_model_path_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_base_model(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_base_model(tmp_path)
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        load_base_model("no-such-model")


def test_entry_point_without_traceback(tmp_path):
    """The installed console script: exit 2 and one line for a bad tree file."""
    bad = tmp_path / "tree.json"
    bad.write_text(json.dumps([[0], [0, 0, 0]]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "medusa_trt.cli.run",
            "--model",
            str(STORIES),
            "--untrained-heads",
            "3",
            "--tree",
            str(bad),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [line for line in errors if line.startswith("medusa-run: error: ")] and len(errors) == 1, proc.stderr
    assert "[0, 0, 0]" in errors[0] and "Traceback" not in proc.stderr


def test_json_output(capsys, stories_base):
    code, out, err = _run(
        capsys,
        "--model",
        str(STORIES),
        "--untrained-heads",
        "2",
        "--prompt",
        "One day",
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "8",
        "--json",
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert len(records) == 2 and all(len(r["token_ids"]) == 8 and r["finish_reason"] == "length" for r in records)
    assert stories_base.tokenizer.decode(records[0]["token_ids"], skip_special_tokens=True).strip() == records[0]["text"].strip()


def test_model_without_the_export_extra_is_one_line(capsys, monkeypatch):
    """In the lean install (no torch), --model says which extra to install instead of a traceback."""
    monkeypatch.setitem(sys.modules, "medusa_trt.exporter", None)  # import fails as it does without torch
    code, out, err = _run(capsys, "--model", str(STORIES), "--prompt", "Hi")
    assert code == 2 and err.startswith("medusa-run: error: --model needs torch and transformers") and "medusa-trt[export]" in err
