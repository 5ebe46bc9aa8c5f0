"""Checkpoints of real size, on a tiny Llama: sharded safetensors in, weights in external data files
out (the size threshold forced low: the graphs a 1.5B model gives go past protobuf's 2 GiB), an
engine folder that moves as a whole, quantization that keeps the external data, and fp16 / bf16
exports verified against torch in their own dtype (bf16 in ONNX's reference evaluator)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from conftest import STORIES, STORY_PROMPTS, _tiny_config, assert_greedy_identical, random_heads

from medusa_trt.exporter import MedusaModel, load_base_model
from medusa_trt.exporter import onnx_export as export
from medusa_trt.exporter.external_data import has_external_data
from medusa_trt.exporter.quantize import QuantizeConfig, quantize_engine
from medusa_trt.exporter.verify import VerificationError, verify_engine
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import EngineFiles
from medusa_trt.runtime.engine_folder import read_folder_config
from medusa_trt.runtime.manifest import check_manifest, write_manifest
from medusa_trt.runtime.tree import load_tree

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")

SMALL_BYTES = 1024  # the external-data threshold, forced low: every weight matrix of the tiny model lies above it
FIXED_BUDGET = {1: 1.0, 8: 1.2, 64: 2.0}  # drafting budget of the test engines: no step timing at export
NEW_TOKENS = 16
GRAPH_FILES = ["heads.onnx", "heads.onnx.data", "model.onnx", "model.onnx.data"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, stories_base):
    """A tiny random Llama saved in several safetensors shards (model.safetensors.index.json), and its weights."""
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_tiny_config("llama"))
    folder = tmp_path_factory.mktemp("sharded-llama")
    model.save_pretrained(folder, max_shard_size="100KB")
    stories_base.tokenizer.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def prompts(stories_base):
    return [stories_base.tokenizer(p)["input_ids"] for p in STORY_PROMPTS[:3]]


def _export(folder, out, **overrides):
    """The sharded model with two random heads, exported with every weight matrix in external data."""
    base = load_base_model(folder, dtype=export.DTYPES[overrides.get("dtype", "fp32")])  # as medusa-export loads it
    model = MedusaModel(base, random_heads(base, 2))
    config = dict(out=out, tree="chain-2", max_batch=3, max_context=128, step_cost=FIXED_BUDGET, backend="onnxruntime") | overrides
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "EXTERNAL_DATA_BYTES", SMALL_BYTES)
        result = export.export_onnx(model, export.ExportConfig(**config))
    return base, model, result


@pytest.fixture(scope="module")
def engine(sharded, tmp_path_factory):
    """An engine folder of the sharded model whose graphs keep their weights in .data files."""
    out = tmp_path_factory.mktemp("external") / "engine"
    base, _, _ = _export(sharded[0], out)
    return base, out


def test_a_sharded_checkpoint_loads_whole(sharded):
    folder, weights = sharded
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 2
    loaded = load_base_model(folder).model.state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_external_data_engine_is_greedy_identical(engine, prompts):
    base, out = engine
    files = EngineFiles.locate(out)
    assert has_external_data(files.step) and has_external_data(files.heads)
    listed = read_manifest_names(out)
    assert set(GRAPH_FILES) <= listed, listed
    results = MedusaRuntime(out, step_cost=FIXED_BUDGET).generate(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, result in zip(prompts, results):
        assert_greedy_identical(base, prompt, result.token_ids, NEW_TOKENS)


def read_manifest_names(folder) -> set[str]:
    import json

    return set(json.loads((folder / "files.json").read_text())["files"])


def test_an_engine_folder_moves_and_copies_as_a_whole(engine, prompts, tmp_path):
    _, out = engine
    expected = [r.token_ids for r in MedusaRuntime(out, step_cost=FIXED_BUDGET).generate(prompts, max_new_tokens=NEW_TOKENS)]
    copy = tmp_path / "copied"
    shutil.copytree(out, copy)
    moved = shutil.move(copy, tmp_path / "elsewhere" / "moved")
    assert check_manifest(EngineFiles.locate(moved), checksums=True)
    got = MedusaRuntime(moved, step_cost=FIXED_BUDGET).generate(prompts, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in got] == expected


@pytest.mark.parametrize("mode", ["int8-channel", "int4", "int8"])
def test_quantizing_keeps_the_external_data(engine, prompts, tmp_path, mode):
    """The quantizers load each graph with its weights and write it again: the weights stay in the
    graph's own .data file (no other file left), and the engine loads and decodes."""
    from medusa_trt.exporter.engine_folder import folder_config
    from medusa_trt.runtime.engine_folder import write_folder_config

    _, out = engine
    folder = shutil.copytree(out, tmp_path / mode)
    files = EngineFiles.in_folder(folder)
    meta = dataclasses.replace(read_folder_config(folder).meta, quantization=mode)
    before = sorted(p.name for p in folder.iterdir())
    quantize_engine(files, meta, QuantizeConfig(mode))  # as export_onnx does on its staged folder
    write_folder_config(folder, folder_config(folder, meta, "onnxruntime"))
    write_manifest(files)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert has_external_data(files.step) and has_external_data(files.heads)
    drafted = MedusaRuntime(folder, step_cost=FIXED_BUDGET).generate(prompts, max_new_tokens=NEW_TOKENS)
    plain = MedusaRuntime(folder, drafters=()).generate(prompts, max_new_tokens=NEW_TOKENS)
    assert all(len(r.token_ids) == NEW_TOKENS for r in drafted)
    if mode != "int8":  # per-row activation scales: a verify step gives each token its plain-step logits
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_exports_verify_in_their_own_dtype(sharded, tmp_path, dtype):
    """The graph runs in its dtype (ONNX Runtime for fp16, ONNX's reference evaluator for bf16) against
    torch in the same dtype, held to the dtype's tolerance; a wrong weight fails it."""
    _, model, result = _export(sharded[0], tmp_path / "half.onnx", dtype=dtype)
    assert {"prefill logits", "tree logits", "tree hidden", "head logits"} <= set(result.diffs)
    assert 0 < max(result.diffs.values()) <= export.TOLERANCE[dtype] == result.tolerance
    files = EngineFiles.beside(tmp_path / "half.onnx")
    assert has_external_data(files.step)
    assert model.base.lm_head.weight.dtype == export.DTYPES[dtype]
    with torch.no_grad():
        model.base.lm_head.weight[7] += 1.0  # one token's logit moves by about its hidden state's sum: far past the tolerance
    with pytest.raises(VerificationError, match="disagrees with torch"):
        verify_engine(model, files, load_tree("chain-2"), strict=True, tolerance=export.TOLERANCE[dtype], max_tokens=64)


def test_a_half_precision_export_leaves_the_callers_model_as_it_was(sharded, tmp_path):
    """export_onnx converts a copy: a session's fp32 model (a shared fixture, a user's) stays fp32."""
    base = load_base_model(sharded[0])
    model = MedusaModel(base, random_heads(base, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export.export_onnx(model, export.ExportConfig(out=tmp_path / "half.onnx", tree="chain-2", max_batch=1, max_context=64, dtype="fp16"))
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
