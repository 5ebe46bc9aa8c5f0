"""Malformed engines on the native backend: one weight initializer of a real export given another shape or dtype, the
engine's manifest rewritten to match (so only the native shape checks stand between the file and the C step). Each
is refused at load with one line naming the layer and the array, never a traceback, never a step that reads or
writes past an array."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import medusa_model

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper

from medusa_trt.runtime import native_weights
from medusa_trt.runtime.backends.native_backend import open_native
from medusa_trt.runtime.engine import EngineError, EngineFiles
from medusa_trt.runtime.manifest import write_manifest


@pytest.fixture(scope="module")
def engines(stories_base, stories_fitted, export_engine):
    """The fp32 and the int8-channel export of stories260K (5 layers, H 64, I 172; shared with test_native_backend)."""
    model = medusa_model(stories_base, stories_fitted)
    return {
        "fp32": export_engine("stories-fitted", model),
        "int8": export_engine("stories-fitted-int8-channel", model, quantize="int8-channel"),
        "int4": export_engine("stories-fitted-int4", model, quantize="int4"),
    }


def _roles(model) -> dict[str, str]:
    """Initializer names by role (embed, inv_freq, norm_in.3, norm_post.3, norm_final, qkv.3, o.3, gate_up.3, down.3,
    lm_head, and an int8 linear's ``o.3.scale``), found by their place in the graph the way read_weights finds them."""
    graph = model.graph
    branches = [a.g.node for n in graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch"]
    nodes = [*graph.node, *(n for branch in branches for n in branch)]
    init = {t.name for t in graph.initializer}
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    norms = [n.input[1] for n in nodes if n.op_type == "RMSNormalization"]
    layers = len(norms) // 2
    roles = {
        "embed": next(n.input[0] for n in nodes if n.op_type == "Gather" and n.input[1] == "input_ids"),
        "inv_freq": producer[next(n for n in nodes if n.op_type == "Cos").input[0]].input[1],
        "norm_final": norms[-1],
    }
    for layer in range(layers):
        roles[f"norm_in.{layer}"], roles[f"norm_post.{layer}"] = norms[2 * layer], norms[2 * layer + 1]
    matmuls = [n for n in nodes if n.op_type in ("MatMul", "MatMulInteger") and n.input[1] in init]
    names = [f"{kind}.{layer}" for layer in range(layers) for kind in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    assert len(matmuls) == len(names), [n.input[1] for n in matmuls]
    for role, matmul in zip(names, matmuls):
        roles[role] = matmul.input[1]
        if matmul.op_type == "MatMulInteger":  # int8 columns: MatMulInteger, Cast, Mul (row scales), Mul (column scales)
            row = consumers[consumers[matmul.output[0]][0].output[0]][0]
            column = consumers[row.output[0]][0]
            roles[f"{role}.scale"] = next(name for name in column.input if name != row.output[0])
    return roles


def _mutated(engine: Path, folder: Path, role, change) -> Path:
    """A copy of ``engine``'s files in ``folder`` with one initializer replaced by ``change(array)`` and the manifest
    rewritten to the new files. ``role``: a role of ``_roles``, or a function of the model giving the initializer's
    name."""
    shutil.copytree(engine.parent, folder)
    step = folder / engine.name
    model = onnx.load(str(step))
    name = role(model) if callable(role) else _roles(model)[role]
    tensor = next(t for t in model.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(np.asarray(change(numpy_helper.to_array(tensor))), name))
    onnx.save(model, str(step))
    write_manifest(EngineFiles.locate(step))
    return step


def _layer_1(suffix: str):
    """A ``_mutated`` role: the initializer of layer 1 whose name ends in ``suffix``."""
    return lambda model: next(t.name for t in model.graph.initializer if t.name.endswith(f"layers.1.{suffix}"))


def _refused_in_one_line(step: Path, capsys, named: str) -> None:
    """``medusa-run --backend native`` on ``step``: exit 2, one stderr line naming ``named``, no traceback."""
    from medusa_trt.cli.run import main

    argv = ["--engine", str(step), "--prompt", "Once upon a time", "--max-new-tokens", "4", "--backend", "native"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend native cannot run" in err[0] and "Traceback" not in err[0], err
    assert named in err[0], err[0]


def _nbits(index: int, operand: int):
    """A ``_mutated`` role: operand ``operand`` of the graph's ``index``-th MatMulNBits (1: its bytes, 2: its scales)."""
    return lambda model: [n for n in model.graph.node if n.op_type == "MatMulNBits"][index].input[operand]


more_rows = lambda a: np.concatenate([a, a[:1]], axis=0)
more_columns = lambda a: np.concatenate([a, a[:, :1]], axis=1)
shorter = lambda a: a[:-1]
narrower = lambda a: a[:, :-1]

# id: engine, role, change, what the one line says (stories260K: 5 layers, H 64, Hq 8, Hkv 4, D 8, I 172, V 512)
MUTATIONS = {
    "last-input-norm-length-1": ("fp32", "norm_in.4", lambda a: a[:1], "layer 4's input norm has shape (1,), not (64,)"),
    "middle-post-norm-longer": ("fp32", "norm_post.2", more_rows, "layer 2's post-attention norm has shape (65,), not (64,)"),
    "o-proj-one-more-column": ("fp32", "o.1", more_columns, "layer 1's o_proj has shape (64, 65), not (64, 64)"),
    "down-proj-wider": ("fp32", "down.2", more_rows, "layer 2's down_proj has shape (173, 64), not (172, 64)"),
    "gate-up-narrower": ("fp32", "gate_up.3", lambda a: a[:, :-2], "layer 3's gate/up_proj has shape (64, 342), not (64, 344)"),
    "qkv-wider": ("fp32", "qkv.1", more_columns, "layer 1's q/k/v_proj has shape (64, 129), not (64, 128)"),
    "final-norm-shorter": ("fp32", "norm_final", shorter, "the final norm has shape (63,), not (64,)"),
    # hidden is read from the embedding: the first array of width 64 is named, with the dims and where they come from
    "embedding-narrower": ("fp32", "embed", narrower, "has shape (64,), not (63,) (hidden 63 and vocab 512 read from the embedding"),
    "inv-freq-longer": ("fp32", "inv_freq", more_rows, "the rotary inv_freq has shape (5,), not (4,)"),
    "layer-0-o-proj-one-more-row": ("fp32", "o.0", more_rows, "layer 0's o_proj has shape (65, 64), not (64, 64)"),  # head_dim's source
    "layer-0-down-proj-wider": ("fp32", "down.0", more_rows, "layer 0's gate/up_proj has shape (64, 344), not (64, 346)"),  # inter's source
    "fp32-weight-float64": ("fp32", "down.3", lambda a: a.astype(np.float64), "layer 3's down_proj has dtype float64, not float32 or int8"),
    "int8-column-scale-short": ("int8", "down.2.scale", shorter, "layer 2's down_proj's column-scale vector has shape (63,), not (64,)"),
    "int8-weight-int16": ("int8", "o.1", lambda a: a.astype(np.int16), "int8 matmul is not int8 columns"),
    "int8-weight-float64": ("int8", "gate_up.2", lambda a: a.astype(np.float64), "int8 matmul is not int8 columns"),
    # int4: MatMulNBits' bytes (N, blocks, 16) kept packed; its K and N come from the node, the bytes must match them
    "int4-bytes-one-more-output": ("int4", _nbits(5, 1), more_rows, "with data uint8 (65, 2, 16)"),
    "int4-bytes-one-block-short": ("int4", _nbits(2, 1), lambda a: a[:, :1], "with data uint8 (344, 1, 16)"),
    "int4-bytes-int8": ("int4", _nbits(7, 1), lambda a: a.view(np.int8), "with data int8"),
    "int4-scales-short": ("int4", _nbits(1, 2), shorter, "K 64, N 64 with data uint8 (64, 2, 16) and 126 scales"),
}


@pytest.mark.parametrize("kind, role, change, named", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_a_malformed_engine_is_one_line_exit_2(engines, tmp_path, capsys, kind, role, change, named):
    """``medusa-run --backend native`` on the mutated engine: exit 2, one stderr line naming the array, no traceback."""
    _refused_in_one_line(_mutated(engines[kind], tmp_path / "engine", role, change), capsys, named)


def test_the_backend_refuses_a_malformed_engine_in_one_line(engines, tmp_path):
    """NativeBackend itself: an EngineError whose message is one line naming the layer, the array and both shapes."""
    step = _mutated(engines["fp32"], tmp_path / "engine", "norm_post.3", lambda a: a[:1])
    with pytest.raises(EngineError, match="backend native cannot run") as info:
        open_native(step, max_batch=1, max_context=64, threads=1)
    assert "layer 3's post-attention norm has shape (1,), not (64,)" in str(info.value) and "\n" not in str(info.value)


DIMS = [
    pytest.param({"heads": 6}, "heads", id="heads-not-a-multiple-of-kv-heads"),
    pytest.param({"kv_heads": 0}, "kv heads", id="no-kv-heads"),
    pytest.param({"eps": float("nan")}, "epsilon", id="eps-nan"),
    pytest.param({"scale": 0.0}, "score scale", id="scale-zero"),
]


@pytest.mark.parametrize("change, named", DIMS)
def test_dims_that_do_not_fit_are_refused(engines, change, named):
    """check_weights on the real weights with one dim changed (these come from node attributes, not initializers)."""
    step = engines["fp32"]
    weights = native_weights.read_weights(step, "llama")
    bad = dataclasses.replace(weights, dims=dataclasses.replace(weights.dims, **change))
    with pytest.raises(EngineError, match=named):
        native_weights.check_weights(bad, step)


def test_int8_quantizer_scalars_are_checked(engines):
    step = engines["int8"]
    weights = native_weights.read_weights(step, "llama")
    for field, value in (("tiny", 0.0), ("divisor", float("inf"))):
        bad = dataclasses.replace(weights, o=[dataclasses.replace(weights.o[0], **{field: value}), *weights.o[1:]])
        with pytest.raises(EngineError, match=f"layer 0's o_proj row quantizer {field}"):
            native_weights.check_weights(bad, step)


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """A tiny Qwen2-MoE (4 experts, 2 a token, a shared expert)."""
    return _exported(tmp_path_factory, "qwen2_moe")


# id: the expert initializer (in layer 1, its name's end), its change (weights (out, in), read transposed), what the one line says
MOE_MUTATIONS = {
    "expert-down-one-more-output": (
        "mlp.experts._medusa_split.down2",
        more_rows,
        "layer 1's expert 2's down_proj has shape (32, 65), not (32, 64)",
    ),
    "expert-gate-up-narrower": (
        "mlp.experts._medusa_split.up3",
        lambda a: a[:-2],
        "layer 1's expert 3's gate/up_proj has shape (64, 62), not (64, 64)",
    ),
    "expert-gate-up-odd": (
        "mlp.experts._medusa_split.up1",
        shorter,
        "layer 1's experts: expert 1's gate/up matmul is not split into gate and up halves",
    ),
    "router-one-more-expert": ("mlp.gate.weight", more_rows, "experts [0, 1, 2, 3] for a router of 5 outputs"),
    # the shared expert's width is read from its down_proj: its gate/up is named
    "shared-down-wider": (
        "mlp.shared_expert.down_proj.weight",
        more_columns,
        "shared expert's gate/up_proj has shape (64, 128), not (64, 130)",
    ),
}


@pytest.mark.parametrize("name, change, named", list(MOE_MUTATIONS.values()), ids=list(MOE_MUTATIONS))
def test_a_malformed_experts_engine_is_one_line_exit_2(moe_engine, tmp_path, capsys, name, change, named):
    """Routed and shared experts' weights are checked like every other array: one line naming the layer, the expert and
    both shapes, exit 2, before anything reaches the C step."""
    _refused_in_one_line(_mutated(moe_engine, tmp_path / "engine", _layer_1(name), change), capsys, named)


def test_experts_that_do_not_fit_are_refused(moe_engine):
    """check_weights on the real experts with one field changed: more experts chosen than there are, a shared expert
    without its gate."""
    weights = native_weights.read_weights(moe_engine, "qwen2_moe")
    for change, named in (({"top_k": 5}, "4 experts choosing 5"), ({"shared_gate": None}, "a shared expert without")):
        experts = (dataclasses.replace(weights.experts[0], **change), *weights.experts[1:])
        with pytest.raises(EngineError, match=named):
            native_weights.check_weights(dataclasses.replace(weights, experts=experts), moe_engine)


def _exported(tmp_path_factory, model_type: str, **overrides) -> Path:
    """The architecture table's tiny ``model_type`` (noisy norms and biases; its config with ``overrides``) exported
    fp32 with two untrained heads."""
    from architectures import ARCHITECTURES, Arch, save_fixture
    from conftest import STORIES

    from medusa_trt.cli.export import main as export_main
    from medusa_trt.exporter import load_base_model

    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    root = tmp_path_factory.mktemp(model_type)
    arch = next((a for a in ARCHITECTURES if a.model_type == model_type), Arch(model_type))
    arch = dataclasses.replace(arch, overrides=arch.overrides | overrides)
    folder = save_fixture(arch, root / "model", load_base_model(STORIES).tokenizer)
    step = root / "engine" / "model.onnx"
    step.parent.mkdir()
    argv = ["--model", str(folder), "--untrained-heads", "2", "--out", str(step), "--max-context", "64"]
    assert export_main(argv) == 0
    return step


@pytest.fixture(scope="module")
def gpt_oss_engine(tmp_path_factory):
    """A tiny gpt-oss (sinks, o_proj and expert biases, 4 experts, 2 a token)."""
    return _exported(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="module")
def gpt_neox_engine(tmp_path_factory):
    """A tiny GPT-NeoX (a parallel residual, per-head q/k/v, MLP biases)."""
    return _exported(tmp_path_factory, "gpt_neox")


def _sinks_of_layer(model, layer: int) -> str:
    """The initializer layer ``layer``'s sinks are expanded from (exported without their parameter's name)."""
    constants = {t.name for t in model.graph.initializer}
    shifted = {n.input[0] for n in model.graph.node if n.op_type == "ReduceMax"}  # the scores joined to their sinks
    concats = [n for n in model.graph.node if n.op_type == "Concat" and n.output[0] in shifted]
    producer = {o: n for n in model.graph.node for o in n.output}
    tensor = concats[layer].input[1]
    while tensor not in constants:  # back through the Reshape and Expand
        tensor = producer[tensor].input[0]
    return tensor


# id: the initializer in layer 1 (its name's end, or a finder of any), its change, what the one line says (H 64, Hq 4,
# 4 experts)
GPT_OSS_MUTATIONS = {
    "sinks-one-more": (lambda m: _sinks_of_layer(m, 1), lambda a: np.concatenate([a, a[:, :, :1]], axis=2),
                       "layer 1's attention sinks has shape (6,), not (4,)"),
    "o-proj-bias-longer": ("self_attn.o_proj.bias", more_rows, "layer 1's o_proj bias has shape (65,), not (64,)"),
    "router-bias-shorter": ("mlp.router.bias", shorter, "layer 1's experts' router bias of shape (3,) for 4 experts"),
    # the fixture's expert biases are equal, so the export keeps one initializer for them all: every expert reads it
    "expert-down-bias-longer": (lambda m: next(t.name for t in m.graph.initializer if "_medusa_split.down_bias" in t.name),
                                more_rows, "down bias of shape (65,) for 64 outputs"),
}  # fmt: skip


@pytest.mark.parametrize("name, change, named", list(GPT_OSS_MUTATIONS.values()), ids=list(GPT_OSS_MUTATIONS))
def test_a_malformed_gpt_oss_engine_is_one_line_exit_2(gpt_oss_engine, tmp_path, capsys, name, change, named):
    """gpt-oss's sinks, o_proj bias, router bias and expert biases are checked against the dims: one line naming the
    layer and both shapes, exit 2, before anything reaches the C step."""
    role = name if callable(name) else _layer_1(name)
    _refused_in_one_line(_mutated(gpt_oss_engine, tmp_path / "engine", role, change), capsys, named)


@pytest.mark.parametrize(
    "name, named",
    [
        ("mlp.dense_h_to_4h.bias", "layer 1's up_proj bias has shape (129,), not (128,)"),
        ("attention.dense.bias", "layer 1's o_proj bias has shape (65,), not (64,)"),
    ],
    ids=["up-bias-longer", "o-bias-longer"],
)
def test_a_malformed_gpt_neox_engine_is_one_line_exit_2(gpt_neox_engine, tmp_path, capsys, name, named):
    """A GPT-NeoX's MLP and attention output biases are checked against the dims: one line, exit 2."""
    _refused_in_one_line(_mutated(gpt_neox_engine, tmp_path / "engine", _layer_1(name), more_rows), capsys, named)


@pytest.fixture(scope="module")
def stablelm_12b_engine(tmp_path_factory):
    """A tiny StableLM-2 in its 12B form: per-head q/k LayerNorms, one input norm for the attention and the MLP."""
    return _exported(tmp_path_factory, "stablelm", qk_layernorm=True, use_parallel_residual=True)


def test_a_malformed_stablelm_head_norm_is_one_line_exit_2(stablelm_12b_engine, tmp_path, capsys):
    """A per-head q norm one longer: Split and Concat still fit in ONNX, so native's own check must say it."""
    step = _mutated(stablelm_12b_engine, tmp_path / "engine", _layer_1("self_attn.q_layernorm.norms.2.weight"), more_rows)
    _refused_in_one_line(step, capsys, "layer 1's query norm has shape (65,), not (64,)")


def test_an_mlp_reading_the_input_norm_beside_its_own_norm_is_refused(stablelm_12b_engine):
    weights = native_weights.read_weights(stablelm_12b_engine, "stablelm")
    assert weights.shared_norm and weights.qk_norm_span == "each" and weights.qk_layer_norm
    post = dataclasses.replace(weights, norm_post=list(weights.norm_in))
    with pytest.raises(EngineError, match="an MLP reading the input norm beside a norm of its own"):
        native_weights.check_weights(post, stablelm_12b_engine)
    with pytest.raises(EngineError, match="q/k norms spanning 'rows'"):
        native_weights.check_weights(dataclasses.replace(weights, qk_norm_span="rows"), stablelm_12b_engine)
