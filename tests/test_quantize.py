"""int4 (MatMulNBits) and per-channel int8 engines: what the graphs hold, drafted decoding equal to
the same engine's plain decoding, logits near fp32, a tied embedding, and bad options on the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STORIES, STORY_PROMPTS, medusa_model
from helpers import graph_nodes

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter.onnx_export import ExportConfig, ExportError
from medusa_trt.exporter.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeConfig
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import EngineFiles, read_meta

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")

# Loose tolerance against the fp32 engine on stories260K text (logits span about 28; its 64-wide
# layers quantize coarsely): (mean abs logit difference, share of positions with the same top-1).
# Measured: int4 0.72 / 89 % (max 7.1), int8-channel 0.11 / 99 % (max 0.66) on an earlier machine; int8-channel 0.40 on
# an AMX / AVX-512 one with ONNX Runtime 1.32, whose u8 x s8 kernel loses precision there (docs/exactness.md: s8 x s8 gives
# 0.09 but runs 8x slower): the bound holds both kernel paths and still fails a wrong weight (several units).
LOOSE = {"int4": (1.0, 0.8), "int8-channel": (0.6, 0.9)}
NEW_TOKENS = 32
PROMPTS = [*STORY_PROMPTS, "Tim had a red ball", "The sun was hot and", "Sara found a box"]
NEAR_TIE = 0.1  # logit gap within which int8 activation rounding may swap the top two tokens (seen: 0.018, logits span 31)


@pytest.fixture(scope="module")
def engines(export_engine, stories_base, stories_fitted):
    """fp32 and quantized stories260K engines with the same fitted heads and tree."""
    model = medusa_model(stories_base, stories_fitted)
    return {
        "fp32": export_engine("stories-fitted", model),
        "int4": export_engine("stories-fitted-int4", model, quantize="int4"),
        "int4-fp32-compute": export_engine("stories-fitted-int4-l1", model, quantize=QuantizeConfig("int4", accuracy_level=1)),
        "int8-channel": export_engine("stories-fitted-int8-channel", model, quantize="int8-channel"),
    }


def _graph(path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


def _float_weight_matmuls(graph) -> list[str]:
    """MatMul / Gemm nodes whose weight is a float constant: what a quantizer should have taken."""
    weights = {t.name for t in graph.initializer if t.data_type == 1}  # FLOAT
    return [n.name for n in graph_nodes(graph) if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in weights]


def test_int4_graphs_hold_matmulnbits(engines):
    files = EngineFiles.beside(engines["int4"])
    assert read_meta(engines["int4"]).quantization == "int4"
    for path in (files.step, files.heads):
        graph = _graph(path)
        nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
        assert nbits and not _float_weight_matmuls(graph), path.name
        attrs = {a.name: a.i for a in nbits[0].attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, DEFAULT_BLOCK_SIZE, DEFAULT_ACCURACY_LEVEL)
    step = _graph(files.step)
    # 7 weight matmuls per layer, Q / K / V and gate / up fused (lean.fuse_matmuls_by_input): 4 per layer; lm_head
    assert len([n for n in graph_nodes(step) if n.op_type == "MatMulNBits"]) == 5 * 4 + 1
    level1 = [n for n in _graph(EngineFiles.beside(engines["int4-fp32-compute"]).step).node if n.op_type == "MatMulNBits"]
    assert {a.i for n in level1 for a in n.attribute if a.name == "accuracy_level"} == {1}


def test_int8_channel_graphs_have_one_scale_per_output_column(engines):
    from onnx import numpy_helper

    files = EngineFiles.beside(engines["int8-channel"])
    assert read_meta(engines["int8-channel"]).quantization == "int8-channel"
    for path in (files.step, files.heads):
        graph = _graph(path)
        values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        matmuls = [n for n in graph_nodes(graph) if n.op_type == "MatMulInteger"]
        assert matmuls and not _float_weight_matmuls(graph), path.name
        distinct = []
        for node in matmuls:
            weight = values[node.input[1]]  # (K, N) int8
            assert weight.dtype == np.int8 and weight.ndim == 2
            # its scale: "<w>_scale" beside "<w>_quantized" (quantize_dynamic), "<w>_int8_scale" beside "<w>_int8" (row-scaled)
            names = {node.input[1].removesuffix("_quantized") + "_scale", node.input[1] + "_scale"}
            scales = [values[n] for n in names if n in values]
            assert len(scales) == 1 and scales[0].shape == (weight.shape[1],), node.name  # (N,): one per output column
            distinct.append(np.unique(scales[0]).size)
        assert max(distinct) > 1  # columns really scaled apart (a head's all-zero block has one scale)
    step = [n.op_type for n in graph_nodes(_graph(files.step))]
    # the row quantizers of the same rows (batch, tokens) share one zero-point tensor
    assert 1 <= step.count("ConstantOfShape") <= 2 < step.count("QuantizeLinear") == step.count("MatMulInteger")


@pytest.fixture(scope="module")
def prompts(stories_base):
    return [stories_base.tokenizer(p)["input_ids"] for p in PROMPTS]


FIXED_BUDGET = {1: 1.0, 8: 1.2, 64: 2.0}  # a learnt budget follows wall-clock step times: trees (and so roundings) would vary with load


def _decode(engine, prompts) -> tuple[list, list]:
    """Greedy results with the engine's default drafters (a fixed budget), and its plain decoding's token ids."""
    drafted = MedusaRuntime(engine, step_cost=FIXED_BUDGET).generate(prompts, max_new_tokens=NEW_TOKENS)
    plain = MedusaRuntime(engine, drafters=()).generate(prompts, max_new_tokens=NEW_TOKENS)
    return drafted, [r.token_ids for r in plain]


@pytest.mark.parametrize("kind", ["int4-fp32-compute", "int8-channel"])
def test_drafted_output_equals_the_engines_own_plain_output(engines, prompts, kind):
    """fp32 compute (int4 at accuracy level 1) or one activation scale per token row (int8-channel):
    greedy decoding with every drafter accepts only what the same engine's plain decoding picks."""
    drafted, plain = _decode(engines[kind], prompts)
    assert [r.token_ids for r in drafted] == plain
    assert max(r.stats.mean_accepted for r in drafted) > 1.2  # the drafts are taken: this is not plain decoding twice


def test_int8_activations_make_drafted_output_differ_only_at_near_ties(engines, prompts):
    """int4 at the default accuracy level rounds activations to int8 per block: a verify step and a
    plain step see the same token's activations differ in the last float bits, which can flip a
    rounding and, where the top two logits nearly tie, the greedy pick. Every divergence is such a tie."""
    engine = engines["int4"]
    drafted, plain = _decode(engine, prompts)
    differ = 0
    for prompt, got, want in zip(prompts, (r.token_ids for r in drafted), plain):
        if got == want:
            continue
        differ += 1
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        logits = _prefill_logits(engine, np.array([prompt + want[:i]], dtype=np.int64))[0, -1]  # (V,) before token i
        assert abs(logits[got[i]] - logits[want[i]]) < NEAR_TIE and logits.max() - logits[want[i]] < NEAR_TIE, (
            f"token {i}: drafted {got[i]} vs plain {want[i]} is no near tie (logits {logits[got[i]]:.4f} / {logits[want[i]]:.4f})"
        )
    assert differ <= len(prompts) // 2, f"{differ} of {len(prompts)} prompts differ"
    assert max(r.stats.mean_accepted for r in drafted) > 1.2


def _prefill_logits(path, ids: np.ndarray) -> np.ndarray:
    """Logits (B, T, V) of one prefill over ``ids`` (B, T) on an empty cache."""
    import onnxruntime as ort

    from medusa_trt.runtime.backends.onnx_backend import with_gate

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = read_meta(path)
    batch, tokens = ids.shape
    slots = tokens if meta.key_slots else 0  # a key-slots graph scatters the new keys into the view: give it room
    empty = np.zeros((slots, meta.num_layers, batch, meta.num_kv_heads, meta.head_dim), dtype=np.float32)
    positions = np.broadcast_to(np.arange(tokens), ids.shape).astype(np.int64)
    feeds = dict(
        input_ids=ids,
        position_ids=positions,
        tree_mask=np.broadcast_to(np.tril(np.ones((tokens, tokens), dtype=bool)), (batch, tokens, tokens)).copy(),
        cache_lengths=np.zeros(batch, dtype=np.int64),
        past_key=empty,
        past_value=empty,
    )
    if meta.key_slots:
        feeds["key_slots"] = positions
    return session.run(["logits"], with_gate(session, feeds))[0]


@pytest.mark.parametrize("kind", ["int4", "int8-channel"])
def test_logits_stay_close_to_fp32(engines, prompts, kind):
    """On text (the prompts and the fp32 engine's greedy continuations) the quantized step graph's
    logits stay within the loose tolerance of fp32's and pick the same top-1 token almost everywhere."""
    continued = MedusaRuntime(engines["fp32"], drafters=()).generate(prompts, max_new_tokens=24)
    tokens = min(len(p) + len(r.token_ids) for p, r in zip(prompts, continued))
    ids = np.array([(p + r.token_ids)[:tokens] for p, r in zip(prompts, continued)], dtype=np.int64)  # (7, T)
    reference, quantized = _prefill_logits(engines["fp32"], ids), _prefill_logits(engines[kind], ids)  # (7, T, V)
    mean, top1 = np.abs(reference - quantized).mean(), (reference.argmax(-1) == quantized.argmax(-1)).mean()
    assert 0 < mean < LOOSE[kind][0], f"{kind}: mean abs logit difference {mean:.3g} (loose tolerance {LOOSE[kind][0]})"
    assert top1 >= LOOSE[kind][1], f"{kind}: top-1 kept on {top1:.0%} of positions"


def test_tied_embedding_keeps_its_gather_and_quantizes_lm_head(tmp_path, stories_base):
    """A model whose lm_head is its embedding: the step graph's lm_head reads the embedding through a
    Transpose, folded so it becomes MatMulNBits, while the token lookup keeps the float embedding."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.exporter import load_medusa
    from medusa_trt.exporter.onnx_export import export_onnx

    torch.manual_seed(4)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    folder = tmp_path / "tied"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    stories_base.tokenizer.save_pretrained(folder)
    model = load_medusa(str(folder), untrained_heads=2)
    outs = {}
    for mode in (None, "int4"):
        outs[mode] = tmp_path / f"{mode or 'fp32'}.onnx"
        export_onnx(model, ExportConfig(out=outs[mode], tree="chain-2", max_context=64, quantize=mode))
    graph = _graph(outs["int4"])
    floats = {t.name for t in graph.initializer if t.data_type == 1}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert len(gathers) == 1 and gathers[0].input[0] in floats  # the embedding lookup: float rows
    assert not [n for n in graph.node if n.op_type == "Transpose" and n.input[0] == gathers[0].input[0]]  # folded away
    # 7 weight matmuls a layer, 4 once Q / K / V and gate / up are fused; the lm_head
    assert len([n for n in graph_nodes(graph) if n.op_type == "MatMulNBits"]) == 2 * 4 + 1 and not _float_weight_matmuls(graph)
    ids = np.array([[5, 17, 42, 99]], dtype=np.int64)
    assert np.abs(_prefill_logits(outs[None], ids) - _prefill_logits(outs["int4"], ids)).mean() < LOOSE["int4"][0]
    # a fixed drafting budget: a learnt one follows wall-clock step times, and int4's drafted output can differ from its plain
    # output (docs/benchmarks.md), so on a loaded machine other trees could reach EOS (id 2 of this random model) before 8 tokens
    runtime = MedusaRuntime(outs["int4"], step_cost=FIXED_BUDGET)
    assert len(runtime.generate("Once upon a time", max_new_tokens=8).token_ids) == 8


def test_quantize_config_defaults_and_validation():
    assert QuantizeConfig("int4") == QuantizeConfig("int4", DEFAULT_BLOCK_SIZE, DEFAULT_ACCURACY_LEVEL)
    assert ExportConfig(out="m.onnx", quantize="int4").quantize.block_size == DEFAULT_BLOCK_SIZE
    assert ExportConfig(out="m.onnx", quantize="int8-channel").quantize == QuantizeConfig("int8-channel", None, None)
    assert QuantizeConfig.from_options(None) is None
    with pytest.raises(ExportError, match="--quantize int5 is not supported"):
        ExportConfig(out="m.onnx", quantize="int5")
    with pytest.raises(ExportError, match="--block-size 48 is not a power of two >= 16"):
        QuantizeConfig("int4", block_size=48)


def _messages(err: str) -> list[str]:
    """stderr without progress bars (tqdm redraws them after a carriage return)."""
    return [line for line in err.split("\n") if line.strip() and "\r" not in line]


BAD_OPTIONS = {
    "block size not a power of two": (["--quantize", "int4", "--block-size", "24"], "--block-size 24 is not a power of two >= 16"),
    "block size too small": (["--quantize", "int4", "--block-size", "8"], "--block-size 8 is not a power of two >= 16"),
    "accuracy level above 4": (["--quantize", "int4", "--accuracy-level", "5"], "--accuracy-level 5 is out of range: pass 0..4"),
    "accuracy level negative": (["--quantize", "int4", "--accuracy-level", "-1"], "--accuracy-level -1 is out of range"),
    "block size without --quantize": (
        ["--block-size", "64"],
        "--block-size applies to --quantize int4 / int8-block only: add --quantize int4",
    ),
    "accuracy level with int8": (
        ["--quantize", "int8-channel", "--accuracy-level", "1"],
        "--accuracy-level applies to --quantize int4 / int8-block only",
    ),
    "int4 with the plugin": (["--quantize", "int4", "--attention", "plugin"], "--quantize int4 quantizes the standard graph"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_quantize_options_are_one_line(case, tmp_path, capsys):
    extra, message = BAD_OPTIONS[case]
    code = export_main(["--model", str(STORIES), "--untrained-heads", "2", *extra, "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    lines = _messages(err)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("medusa-export: error: ") and "Traceback" not in err, err
    assert message in lines[0], err
    assert list(tmp_path.iterdir()) == [], "files left behind"


def test_matmuls_reading_one_input_fuse_into_one():
    """Q / K / V (and gate / up) read the same input: one MatMul over their weights side by side
    and a Split give the same outputs, and the float weights are not kept twice."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from medusa_trt.exporter.lean import fuse_matmuls_by_input

    rng = np.random.default_rng(0)
    w = {name: rng.normal(size=(8, n)).astype(np.float32) for name, n in (("wq", 8), ("wk", 4), ("wv", 4), ("wo", 8))}
    nodes = [helper.make_node("MatMul", ["x", n], [f"y_{n}"]) for n in ("wq", "wk", "wv")]
    nodes.append(helper.make_node("MatMul", ["y_wq", "wo"], ["y_wo"]))  # another input: left alone
    outputs = [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, [3, w[n].shape[1]]) for n in ("wq", "wk", "wv", "wo")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        outputs,
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    x = rng.normal(size=(3, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    assert fuse_matmuls_by_input(model.graph) == 2
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Split", "MatMul"]
    assert {t.name for t in model.graph.initializer} >= {"wo"} and not {"wq", "wk", "wv"} & {t.name for t in model.graph.initializer}
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [37, 576])
def test_row_quantizer_is_its_formula_bit_for_bit(k):
    """The int8 row quantizer (one QuantizeLinear a row, since it replaced Div / Round / Add / Cast) gives the
    bytes of its formula: max|x| / 127 a row, round half to even, offset 128, the integer product, the two scales.
    Rows of ties (x / s exactly n + 0.5), an all-zero row, batch rows, odd widths."""
    import onnxruntime as ort
    from helpers import row_int8_model

    model, reference = row_int8_model(k, 24, seed=k)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 5, k)) * 4).astype(np.float32)  # (B, T, k)
    x[0, 1] = 0.0  # no division by zero: the scale's floor
    x[1, 2, :3] = [127.0, 2.5, -0.5]  # scale 1: 2.5 and -0.5 are ties (to 2 and -0)
    x[1, 2, 3:] = np.clip(x[1, 2, 3:], -100, 100)
    nodes = [n.op_type for n in model.graph.node]
    assert "QuantizeLinear" in nodes and "Round" not in nodes
    for rows in (x, x[:1, :1], x[:, :0]):  # every size: a plain step, a batch, an empty chunk
        got = session.run(None, {"x": rows})[0]
        assert got.shape == rows.shape[:2] + (24,) and np.array_equal(got, reference(rows)), rows.shape
