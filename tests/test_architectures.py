"""Every decoder family in ``tests/architectures.py``, exported and proven token-identical.

Per family (one fixture row each): ``medusa-export`` on a Hugging Face folder with heads in the
FasterDecoding layout prints what it exported; the ONNX Runtime engine and the torch backend decode
greedily at batch 3 on a branching tree exactly as ``transformers`` generate() does on an
independently loaded copy of the model (past every sliding window, soft-caps active); the
int8-channel engine's drafted output equals its own plain output; our heads format and
FasterDecoding's load to the same heads. Hybrids and bad folders are refused in one line with
nothing written, and a fixture whose feature is dropped is shown to decode differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil

import pytest
import torch
from architectures import ARCHITECTURES, HYBRIDS, WINDOW, save_fixture
from conftest import STORIES, assert_greedy_identical, fitted_heads
from helpers import graph_nodes

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter import load_base_model
from medusa_trt.exporter.heads import load_heads, save_heads
from medusa_trt.exporter.interop import save_fasterdecoding
from medusa_trt.exporter.quantize import QuantizeConfig, quantize_engine
from medusa_trt.exporter.wrapper import MedusaModel, load_medusa
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import EngineFiles, read_meta
from medusa_trt.runtime.manifest import write_manifest

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # branching, three deep
PROMPTS = ["Once upon a time", "The little dog was sad because", "Lily and Tom went to the park. They saw a big tree and"]
NEW_TOKENS = 24  # prompt + output runs well past WINDOW
FIXED_BUDGET = {1: 1.0, 8: 1.2, 64: 2.0}  # drafting budget independent of wall-clock timings
HEAD_PROMPTS = ["Tim had a red ball", "The sun was hot", "Sara found a box", "A cat sat on the mat", "Mom made a cake"]


@pytest.fixture(scope="module")
def stories_tokenizer():
    return load_base_model(STORIES).tokenizer


@dataclasses.dataclass
class Family:
    """One architecture, built and exported once for the module's tests."""

    reference: object  # BaseModel, loaded on its own: transformers' default attention, never wrapped
    model: MedusaModel  # the same weights with the fitted heads, as the exporter wraps them
    engine: object  # the exported .onnx path
    printed: str  # what medusa-export printed
    heads: object  # our heads folder
    fasterdecoding: object  # the same heads in the FasterDecoding layout
    prompts: list
    moe: bool  # the row has mixture-of-experts blocks
    native: bool  # the native step runs it (Arch.runs_native)


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=lambda a: a.id)
def family(request, tmp_path_factory, stories_tokenizer):
    arch = request.param
    root = tmp_path_factory.mktemp(arch.id)
    folder = save_fixture(arch, root / "model", stories_tokenizer)
    reference = load_base_model(folder)
    prompts = [reference.tokenizer(p)["input_ids"] for p in PROMPTS]
    # fitted to the model's own continuations of the test prompts too: drafts then land, so verify steps branch and accept
    heads = fitted_heads(reference, prompts + [reference.tokenizer(p)["input_ids"] for p in HEAD_PROMPTS], num_heads=3, new_tokens=48)
    ours = save_heads(heads, root / "heads")
    theirs = save_fasterdecoding(heads, root / "heads-fd", base_model=str(folder))
    engine = root / "engine" / "model.onnx"
    engine.parent.mkdir()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = export_main(
            ["--model", str(folder), "--heads", str(theirs), "--out", str(engine), "--tree", _tree_file(root), "--max-batch", "3"]
            + ["--max-context", "128"]
        )
    assert code == 0, printed.getvalue()
    model = load_medusa(str(folder), str(ours))
    return Family(reference, model, engine, printed.getvalue(), ours, theirs, prompts, arch.moe, arch.runs_native)


def _tree_file(root) -> str:
    import json

    path = root / "tree.json"
    path.write_text(json.dumps(TREE))
    return str(path)


def _check_identical(family: Family, engine, results) -> None:
    for prompt, result in zip(family.prompts, results):
        assert len(result.token_ids) == NEW_TOKENS or result.finish_reason == "stop"
        assert_greedy_identical(family.reference, prompt, result.token_ids, NEW_TOKENS, family.reference.eos_token_ids)


def test_export_prints_what_it_exported(family):
    arch = family.model.attention.architecture
    assert f"exported {arch}: 3 layers" in family.printed, family.printed
    if family.model.attention.windows:
        assert f"sliding window {WINDOW}" in family.printed
    assert "verified against torch" in family.printed


def test_onnx_runtime_is_greedy_identical_at_batch_3_on_a_branching_tree(family):
    runtime = MedusaRuntime(str(family.engine), tree=TREE, max_batch=3, max_context=128, step_cost=FIXED_BUDGET, backend="onnxruntime")
    results = runtime.generate(family.prompts, max_new_tokens=NEW_TOKENS)
    _check_identical(family, family.engine, results)
    assert max(r.stats.mean_accepted for r in results) > 1.0  # the tree's drafts are taken: not plain decoding


def _native(family: Family) -> str | None:
    """Why native refuses the family's engine (None: it runs it), checked against the table of what it runs."""
    from medusa_trt.runtime.backends.native_backend import open_native
    from medusa_trt.runtime.native_weights import NativeCannotRun

    try:
        open_native(family.engine, max_batch=1, max_context=128, threads=2)
    except NativeCannotRun as exc:
        assert not family.native, f"native refuses a family it runs: {exc}"
        assert "\n" not in str(exc) and "use backend onnxruntime" in str(exc)
        return exc.what
    assert family.native, "native runs a family the table says it refuses"
    return None


def test_native_is_greedy_identical_at_batch_3_on_a_branching_tree(family):
    """The native column: identical to transformers where native runs the family (biases, q/k norms, sliding windows
    past the window, Phi-3's sliced q/k/v), else refused by name at load (its default then onnxruntime)."""
    if (why := _native(family)) is not None:
        assert why, "a refusal names what native cannot run"
        return
    runtime = MedusaRuntime(str(family.engine), tree=TREE, max_batch=3, max_context=128, step_cost=FIXED_BUDGET, backend="native")
    assert runtime.backend.name == "native"
    results = runtime.generate(family.prompts, max_new_tokens=NEW_TOKENS)
    _check_identical(family, family.engine, results)
    assert max(r.stats.mean_accepted for r in results) > 1.0


@pytest.mark.parametrize("context", [5, 37])  # before and past the window
def test_native_verify_steps_are_plain_steps_bit_for_bit(family, context):
    from medusa_trt.runtime import exactness
    from medusa_trt.runtime.backends.native_backend import open_native

    if _native(family) is not None:
        pytest.skip("native refuses this family (test_native_is_greedy_identical_at_batch_3_on_a_branching_tree proves it)")
    backend = open_native(family.engine, max_batch=1, max_context=128, threads=2)
    ids = torch.randint(0, backend.meta.vocab_size, (context,), generator=torch.Generator().manual_seed(context)).numpy()
    path, plain = exactness.plain_steps(backend, ids, 5)
    for name, layout in exactness.layouts(path, backend.meta.vocab_size).items():
        assert exactness.verify_diffs(backend, ids, layout, plain) == [0.0] * len(path), name


def test_native_honours_each_feature_it_reads(family, monkeypatch):
    """The native step's prefill logits past the window are transformers' to float rounding, and with the biases,
    q/k norms and sliding windows it read dropped they are far from them (so the identity above proves each counts)."""
    import dataclasses as dc

    import numpy as np

    from medusa_trt.runtime import native_weights
    from medusa_trt.runtime.backends.native_backend import open_native

    if _native(family) is not None:
        pytest.skip("native refuses this family (test_native_is_greedy_identical_at_batch_3_on_a_branching_tree proves it)")
    ids = family.prompts[2]
    assert len(ids) > 2 * WINDOW
    with torch.no_grad():
        want = family.reference.model(torch.tensor([ids])).logits[0].numpy()  # (T, V)

    def prefill_logits() -> np.ndarray:
        backend = open_native(family.engine, max_batch=1, max_context=128, threads=2)
        t = len(ids)
        out = backend.step(np.array([ids]), np.arange(t)[None], np.tril(np.ones((t, t), dtype=bool))[None], np.array([0]))
        return out.logits()[0].copy()

    assert np.abs(prefill_logits() - want).max() < 1e-3
    read = native_weights.read_weights
    weights = read(family.engine, family.model.attention.architecture)
    layers = weights.dims.layers
    none = [None] * layers
    gelu = weights.act in ("gelu", "gelu_tanh")  # a gated MLP's GELU is dropped for SiLU (an ungated one keeps its activation)
    dropped = dict(qkv_bias=none, q_norm=none, k_norm=none, windows=(0,) * layers, rope_of=(0,) * layers, attn_out_norm=none,
                   mlp_out_norm=none, act="silu" if gelu else weights.act, embed_scale=1.0, residual_scale=1.0, logit_divisor=1.0,
                   attn_softcap=0.0, final_softcap=0.0, layer_norm=False, norm_in_bias=none, norm_post_bias=none,
                   norm_final_bias=None, o_bias=(), sinks=(), rope_factor=1.0, gate_up_bias=(), down_bias=(),
                   parallel_residual=False, rope_interleaved=False, shared_norm=False)  # fmt: skip
    found = {"biases": weights.qkv_bias, "q/k norms": weights.q_norm, "windows": [w or None for w in weights.windows],
             "rotary tables": [r or None for r in weights.rope_of], "output norms": weights.attn_out_norm + weights.mlp_out_norm,
             "GELU": [weights.act if gelu else None],
             "embedding scale": [None if weights.embed_scale == 1 else weights.embed_scale],
             "residual and logit scales": [None if (weights.residual_scale, weights.logit_divisor) == (1, 1) else 1],
             "normalized routing": [e.normalize or None for e in weights.experts if e is not None],
             "shared experts": [e.shared_down for e in weights.experts if e is not None],
             "soft-caps": [weights.attn_softcap or None, weights.final_softcap or None],
             "layer norms": [weights.layer_norm or None],
             "attention sinks": list(weights.sinks), "o_proj biases": list(weights.o_bias),
             "rotary factor": [None if weights.rope_factor == 1 else weights.rope_factor],
             "MLP biases": list(weights.gate_up_bias) + list(weights.down_bias),
             "parallel residual": [weights.parallel_residual or None],
             "interleaved rotary": [weights.rope_interleaved or None],
             "MLP reading the input norm": [weights.shared_norm or None],
             "expert biases": [e.router_bias for e in weights.experts if e is not None] + [
                 b for e in weights.experts if e is not None for b in e.gate_up_bias + e.down_bias]}  # fmt: skip
    features = [name for name, per_layer in found.items() if any(x is not None for x in per_layer)]
    if not features:
        pytest.skip(f"{family.model.attention.architecture}: the Llama pattern alone (no bias, q/k norm or window to drop)")
    plain = dict(normalize=False, shared_gate_up=None, shared_down=None, shared_gate=None,  # routing as the softmax gives it
                 router_bias=None, gate_up_bias=(), down_bias=())  # fmt: skip
    dropped["experts"] = tuple(e and dc.replace(e, **plain) for e in weights.experts)
    monkeypatch.setattr(native_weights, "read_weights", lambda *a: dc.replace(read(*a), **dropped))
    moved = float(np.abs(prefill_logits() - want).max())
    assert moved > 0.1, f"dropping {features} moved the logits by only {moved:.3g}"


def test_torch_backend_is_greedy_identical(family):
    runtime = MedusaRuntime(family.model, tree=TREE, max_batch=3, max_context=128, step_cost=FIXED_BUDGET)
    _check_identical(family, family.model, runtime.generate(family.prompts, max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("mode", ["int8-channel", "int4", "int8-channel-native", "int4-native"])
def test_quantized_drafted_output_equals_its_own_plain_output(family, mode, tmp_path):
    """The fp32 engine's graphs quantized as ``--quantize MODE`` quantizes them (experts included):
    int8-channel on every row, int4 (block 32, exact) on the mixture-of-experts rows; int8-channel and int4 on native
    where native runs the family."""
    if mode == "int4" and not family.moe:
        pytest.skip("int4 is checked on the mixture-of-experts rows (its dense path is tests/test_quantize.py's)")
    backend = "onnxruntime"
    if mode.endswith("-native"):
        if _native(family) is not None:
            pytest.skip("native refuses this family (test_native_is_greedy_identical_at_batch_3_on_a_branching_tree proves it)")
        mode, backend = mode.removesuffix("-native"), "native"
    folder = tmp_path / mode
    shutil.copytree(family.engine.parent, folder)
    files = EngineFiles.locate(folder / family.engine.name)
    meta = dataclasses.replace(read_meta(files.step), quantization=mode)
    quantize_engine(files, meta, QuantizeConfig(mode, block_size=32) if mode == "int4" else QuantizeConfig(mode))
    write_manifest(files)
    drafting = MedusaRuntime(str(files.step), tree=TREE, step_cost=FIXED_BUDGET, backend=backend)
    assert drafting.backend.name == backend
    drafted = drafting.generate(family.prompts, max_new_tokens=NEW_TOKENS)
    plain = MedusaRuntime(str(files.step), drafters=(), backend=backend).generate(family.prompts, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    _assert_weights_quantized(files.step)


def _assert_weights_quantized(path) -> None:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer if len(i.dims) == 2}
    fp32 = [n.name for n in graph_nodes(graph) if n.op_type in ("MatMul", "Gemm") and any(x in weights for x in n.input)]
    assert not fp32, f"weight matmuls left in fp32: {fp32[:5]}"


def test_the_wrapped_model_still_runs_as_transformers_runs_it(family):
    """Plain transformers use of the wrapped model (training reads hidden states that way) keeps the
    attention and the mask it was loaded with: eager models (Gemma-2, gpt-oss) get their additive mask."""
    ids = torch.tensor([family.prompts[1]])
    with torch.no_grad():
        got, want = family.model.base(ids).logits, family.reference.model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # experts run another (exported) implementation: rounding only


def test_our_heads_and_fasterdecodings_load_to_the_same_heads(family):
    cfg = family.reference.model.config
    kwargs = dict(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=family.reference.model.get_output_embeddings())
    ours, theirs = load_heads(family.heads, **kwargs), load_heads(family.fasterdecoding, **kwargs)
    hidden = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(hidden), theirs(hidden), rtol=0, atol=0)


# --------------------------------------------------------------------- features that must count


def _prefill_logits(model: MedusaModel, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of one prefill step of ``ids`` through the step contract (an empty cache, a chain mask)."""
    spec, t = model.kv_spec, len(ids)
    cache = torch.zeros(0, spec.num_layers, 1, spec.num_kv_heads, spec.head_dim)
    chain = torch.tril(torch.ones(t, t, dtype=torch.bool))[None]
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(t)[None], chain, torch.tensor([0]), cache, cache)[0][0]


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gemma3_text", "gpt_oss"])
def test_a_dropped_feature_changes_the_output(model_type, tmp_path, stories_tokenizer, monkeypatch):
    """The fixtures make each feature count: the step's logits over a prompt past the window equal
    transformers', and with the sliding window, soft-cap and sinks dropped from the tree attention
    they are far from them. (So the identity tests above prove the features are honoured.)"""
    from medusa_trt.exporter import wrapper

    arch = next(a for a in ARCHITECTURES if a.model_type == model_type)
    folder = save_fixture(arch, tmp_path / "model", stories_tokenizer)
    reference = load_base_model(folder)
    model = MedusaModel(load_base_model(folder), None)
    ids = reference.tokenizer(PROMPTS[2])["input_ids"]
    assert len(ids) > 2 * WINDOW
    with torch.no_grad():
        want = reference.model(torch.tensor([ids])).logits[0]  # (T, V)
    torch.testing.assert_close(_prefill_logits(model, ids), want, rtol=0, atol=1e-4)
    original = wrapper.tree_attention
    monkeypatch.setattr(wrapper._StepKV, "windowed", lambda self, bias, window: bias)
    monkeypatch.setattr(wrapper, "tree_attention", lambda *a, **k: original(*a[:8]))  # softcap and sinks dropped
    dropped = (_prefill_logits(model, ids) - want).abs().max().item()
    assert dropped > 0.1, f"{model_type}: dropping its attention features moved the logits by only {dropped:.3g}"


# --------------------------------------------------------------------- refused in one line


def _export_cli(capsys, model, out) -> tuple[int, str]:
    capsys.readouterr()  # what building the fixture printed
    code = export_main(["--model", str(model), "--untrained-heads", "2", "--max-context", "64", "--out", str(out)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("arch", HYBRIDS, ids=lambda a: a.model_type)
def test_a_hybrid_is_refused_in_one_line_with_nothing_written(arch, tmp_path, stories_tokenizer, capsys):
    folder = save_fixture(arch, tmp_path / "model", stories_tokenizer)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = _export_cli(capsys, folder, tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"model architecture {arch.model_type!r} has" in err and "cannot verify" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, not even a staging folder


def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "no-such-family", "hidden_size": 8}')
    code, err = _export_cli(capsys, tmp_path / "model", tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model_type 'no-such-family' is not known to transformers" in err
    assert not (tmp_path / "engine").exists()


def test_a_folder_without_config_json_is_one_line(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"x")
    code, err = _export_cli(capsys, tmp_path / "model", tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "has no config.json" in err, err
    assert not (tmp_path / "engine").exists()


def test_an_encoder_decoder_is_refused(tmp_path, capsys):
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(tmp_path / "model")
    code, err = _export_cli(capsys, tmp_path / "model", tmp_path / "engine")
    assert code == 2 and "encoder-decoder" in err and len(err.strip().splitlines()) == 1, err
