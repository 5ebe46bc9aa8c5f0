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
    assert lines[1].startswith("medusa on torch (") and "; drafters heads,lookup,recycle, heads template chain-3: 20 tokens," in lines[1]
    assert "accepted/step" in lines[1] and "tokens/s" in lines[1] and lines[1].endswith("; finished: length")
    assert lines[2].startswith("plain decoding (same engine): 20 tokens, 19 steps, 1.00 accepted/step")
    assert lines[3].startswith("drafted = plain: ")  # token for token, whichever way it went
    assert lines[4].startswith("speedup over plain decoding: ") and "medusa-bench" in lines[4]
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
    assert out.count("--- prompt") == 2 and "; drafters heads,lookup,recycle, heads template chain-2: 20 tokens" in out
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
    assert "heads template chain-2: 10 tokens" in out and out.rstrip().endswith("finished: length")


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
        (["--model", str(STORIES), "--no-verify"], "--no-verify skips an --engine's sha256 check"),
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


def test_an_engine_file_corrupted_in_place_is_refused(stories_chat_engine, tmp_path):
    """One bit of one weight of heads.onnx flipped (the same size, still a valid graph): medusa-run
    checks every engine file's sha256 against the export's manifest, as medusa-serve does, and
    refuses it in one line with exit 2; --no-verify skips the sums for speed, says so, and runs."""
    import shutil

    import onnx

    engine = tmp_path / "engine"
    shutil.copytree(stories_chat_engine, engine)
    heads = engine / "heads.onnx"
    data = bytearray(heads.read_bytes())
    weights = max(onnx.load(heads).graph.initializer, key=lambda t: len(t.raw_data)).raw_data
    data[data.find(weights) + len(weights) // 2] ^= 0x01
    heads.write_bytes(bytes(data))

    def run(*args):
        command = ["-m", "medusa_trt.cli.run", "--engine", str(engine), "--prompt", "Once upon a time", "--max-new-tokens", "4"]
        return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, timeout=300)

    refused = run()
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("medusa-run: error: engine file ")
    assert "heads.onnx does not match its recorded sha256" in refused.stderr
    unchecked = run("--no-verify")
    assert unchecked.returncode == 0 and "tokens" in unchecked.stdout, unchecked.stderr
    assert unchecked.stderr.count("\n") == 1 and "--no-verify: the sha256 sums of" in unchecked.stderr, unchecked.stderr


def test_heads_for_another_model(capsys, stories_base, wrong_heads):
    code, _, err = _run(capsys, "--model", str(STORIES), "--heads", str(wrong_heads), "--prompt", "hi")
    assert code == 2 and "hidden size 128" in err and "another model" in err


def test_a_model_without_attention_layers_is_refused(tmp_path, stories_base):
    """A recurrent causal LM (Mamba) loads in transformers but has no attention for the tree
    mask: its config's layer types refuse it at load, and the exporter's probe refuses it too
    where a config does not say (tests/test_architectures.py covers the families that export)."""
    from transformers import MambaConfig, MambaForCausalLM

    from medusa_trt.exporter.architecture import UnsupportedModelError
    from medusa_trt.exporter.models import BaseModel
    from medusa_trt.exporter.wrapper import MedusaModel

    model = MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=512, state_size=4))
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'mamba' has 'linear_attention' layers .* cannot verify"):
        load_base_model(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'mamba' has no layer that attends through transformers' attention interface"):
        MedusaModel(BaseModel(model.eval(), stories_base.tokenizer, "mamba", (2,), False), None)


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


@pytest.mark.parametrize(
    ("dtype", "quantization", "named"),
    [
        ("fp32", "none", "fp32"),
        ("fp32", "int8-channel", "int8-channel"),
        ("fp32", "int4", "int4"),
        ("fp32", "heads-int8", "fp32, int8 heads"),
    ],
)
def test_the_precision_an_output_names(dtype, quantization, named):
    """What medusa-run's summary, the servers' banner and the export's last line call an engine's precision: the
    heads-only quantization keeps the step's dtype in the name (its text is the fp32 model's)."""
    from medusa_trt.runtime.engine_meta import precision_name

    assert precision_name(dtype, quantization) == named
