"""TensorRT: engine build and backend.

Without TensorRT (every machine here) the tests that need it skip and say so; what is pure logic
runs anyway: the optimization profile from the export limits, precision checks, the graph
preparation for TensorRT's parser, the metadata sidecar, and ``--out engine.plan`` writing the
ONNX graph, then stopping with one line saying what to install, no .plan left behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORIES, medusa_model, random_heads

onnx = pytest.importorskip("onnx")

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter.onnx_export import ExportError
from medusa_trt.exporter.tensorrt_build import (
    TensorRTBuildError,
    TensorRTConfig,
    TensorRTUnavailableError,
    check_precision,
    check_tensorrt_version,
    graph_precisions,
    heads_profile,
    onnx_beside,
    prepare_for_tensorrt,
    step_profile,
)
from medusa_trt.exporter.tensorrt_ops import OP_MIN_TENSORRT, graph_ops, required_tensorrt
from medusa_trt.plugins.tree_attention.aot import TRT_PLUGIN_VERSION
from medusa_trt.plugins.tree_attention.onnx_fallback import fallback_function
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION as SPEC
from medusa_trt.runtime import EngineError, EngineMeta, MedusaRuntime
from medusa_trt.runtime.engine import FORMAT_VERSION, EngineFiles


def _tensorrt_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"tensorrt is not installed ({type(exc).__name__}): these tests need TensorRT 10+ and an NVIDIA GPU"
    import torch

    if not torch.cuda.is_available():
        return "tensorrt is installed but no CUDA GPU is visible"
    return None


TENSORRT_MISSING = _tensorrt_reason()
needs_tensorrt = pytest.mark.skipif(TENSORRT_MISSING is not None, reason=TENSORRT_MISSING or "")


def _meta(**overrides) -> EngineMeta:
    fields = {
        "format_version": FORMAT_VERSION,
        "model": "stories260K",
        "architecture": "llama",
        "dtype": "fp16",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_layers": 5,
        "num_kv_heads": 4,
        "head_dim": 8,
        "num_heads": 3,
        "top_k": 2,
        "tree": [list(p) for p in CUSTOM_TREE],
        "tree_name": "custom",
        "max_batch": 4,
        "max_context": 256,
        "max_tokens": 64,
        "eos_token_ids": [2],
        "is_chat": False,
    }
    return EngineMeta(**(fields | overrides))


# ----------------------------------------------------------------------------- pure logic, no TensorRT


@pytest.mark.parametrize("attention,opt_slots", [("onnx", 128), ("plugin", 256)])
def test_step_profile_covers_the_export_limits(attention, opt_slots):
    profile = step_profile(_meta(attention=attention))
    assert set(profile) == {"input_ids", "position_ids", "tree_mask", "cache_lengths", "past_key", "past_value"}
    nodes = len(CUSTOM_TREE) + 1  # opt: a verify step of the default tree
    assert (profile["input_ids"].min, profile["input_ids"].opt, profile["input_ids"].max) == ((1, 1), (4, nodes), (4, 64))
    assert profile["position_ids"] == profile["input_ids"]
    assert (profile["tree_mask"].min, profile["tree_mask"].opt, profile["tree_mask"].max) == ((1, 1, 1), (4, nodes, nodes), (4, 64, 64))
    assert (profile["cache_lengths"].min, profile["cache_lengths"].max) == ((1,), (4,))
    cache = profile["past_key"]  # (S, layers, B, Hkv, D): context 0..max_context
    assert (cache.min, cache.opt, cache.max) == ((0, 5, 1, 4, 8), (opt_slots, 5, 4, 4, 8), (256, 5, 4, 4, 8))
    assert profile["past_value"] == cache
    for shapes in profile.values():
        assert all(lo <= op <= hi for lo, op, hi in zip(shapes.min, shapes.opt, shapes.max))
    heads = heads_profile(_meta())["hidden"]
    assert (heads.min, heads.opt, heads.max) == ((1, 64), (4, 64), (4, 64))


def test_step_shapes_are_the_profile_and_the_backends_shapes():
    """contract.step_shapes is the one home of the step inputs' shapes: the profile's min / opt / max are it."""
    from medusa_trt.runtime.contract import STEP_INPUTS, step_shapes

    shapes = step_shapes(4, 7, 100, (5, 4, 8))
    assert tuple(shapes) == STEP_INPUTS
    assert shapes == {
        "input_ids": (4, 7),
        "position_ids": (4, 7),
        "tree_mask": (4, 7, 7),
        "cache_lengths": (4,),
        "past_key": (100, 5, 4, 4, 8),  # (S, layers, B, Hkv, D)
        "past_value": (100, 5, 4, 4, 8),
    }
    meta = _meta(attention="plugin")
    profile = step_profile(meta)
    kv = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
    assert {n: r.max for n, r in profile.items()} == step_shapes(meta.max_batch, meta.max_tokens, meta.max_context, kv)
    assert {n: r.min for n, r in profile.items()} == step_shapes(1, 1, 0, kv)
    assert {n: r.opt for n, r in profile.items()} == step_shapes(meta.max_batch, len(CUSTOM_TREE) + 1, meta.max_context, kv)


def test_precision_checks():
    check_precision("fp16", (7, 5), "10.0.1")
    check_precision("bf16", (8, 0), "10.3.0")
    check_precision("fp8", (9, 0), "10.8.0")
    with pytest.raises(TensorRTBuildError, match="bf16 needs a GPU of compute capability 8.0"):
        check_precision("bf16", (7, 5), "10.3.0")
    with pytest.raises(TensorRTBuildError, match="fp8 needs .* 8.9"):
        check_precision("fp8", (8, 6), "10.3.0")
    with pytest.raises(TensorRTUnavailableError, match="TensorRT 8.6.1 is too old"):
        check_precision("fp16", (9, 0), "8.6.1")


def test_graph_precisions_follow_qdq_nodes():
    helper, tp = onnx.helper, onnx.TensorProto

    def graph(zero_type):
        zero = helper.make_tensor("zero", zero_type, [], [0])
        scale = helper.make_tensor("scale", tp.FLOAT, [], [0.1])
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
        ]
        g = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", tp.FLOAT, [2])],
            [helper.make_tensor_value_info("y", tp.FLOAT, [2])],
            initializer=[zero, scale],
        )
        return helper.make_model(g)

    assert graph_precisions(graph(tp.INT8), "fp16") == ["fp16", "int8"]
    assert graph_precisions(graph(tp.FLOAT8E4M3FN), "bf16") == ["bf16", "fp8"]
    empty = helper.make_model(helper.make_graph([], "g", [], []))
    assert graph_precisions(empty, "fp32") == ["fp32"]


def test_prepare_for_tensorrt_strips_fallback_and_tags_nodes():
    helper = onnx.helper
    attrs = [dict(layer=0, scale=0.5, window=0, softcap=0.0), dict(layer=1, scale=0.5, window=4096, softcap=30.0)]
    nodes = [helper.make_node(SPEC.op_type, list(SPEC.inputs), [f"out{i}"], domain=SPEC.domain, **attrs[i]) for i in range(2)]
    graph = helper.make_graph(nodes, "g", [], [])
    other = helper.make_function("other", "Keep", ["x"], ["y"], [helper.make_node("Identity", ["x"], ["y"])], [helper.make_opsetid("", 23)])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(SPEC.domain, SPEC.version)],
        functions=[fallback_function(23), other],
    )
    assert prepare_for_tensorrt(model) == 2
    assert [(f.domain, f.name) for f in model.functions] == [("other", "Keep")]  # only the fallback goes
    for i, node in enumerate(model.graph.node):
        got = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        # the parser looks the creator up by these; tensorrt.plugin registers every creator as version "1"
        assert got == attrs[i] | {"plugin_namespace": SPEC.domain.encode(), "plugin_version": TRT_PLUGIN_VERSION.encode()}
    assert prepare_for_tensorrt(model) == 2 and len(model.graph.node[0].attribute) == 6  # idempotent


def test_prepare_for_tensorrt_lets_attention_decompose():
    helper = onnx.helper
    node = helper.make_node("Attention", ["q", "k", "v"], ["o"], scale=0.5)
    model = helper.make_model(helper.make_graph([node], "g", [], []), opset_imports=[helper.make_opsetid("", 23)])
    assert prepare_for_tensorrt(model) == 0
    got = {a.name: onnx.helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert got == {"scale": 0.5, "TRT_decomposable": 1}


def _graph(*ops):
    helper = onnx.helper
    nodes = [helper.make_node(op, [], [f"o{i}"], domain=domain) for i, (domain, op) in enumerate(ops)]
    return helper.make_model(helper.make_graph(nodes, "g", [], []))


def test_required_tensorrt_follows_the_graphs_ops():
    assert required_tensorrt(_graph(("", "MatMul"), ("", "Add"))).version == (10, 0)
    need = required_tensorrt(_graph(("", "MatMul"), ("", "Attention")), _graph(("", "RMSNormalization"), ("", "RotaryEmbedding")))
    assert need.version == (10, 15) and need.because == ("RMSNormalization", "RotaryEmbedding")
    plugin = required_tensorrt(_graph(("", "MatMul"), (SPEC.domain, SPEC.op_type)))
    assert plugin.version == (10, 9) and plugin.because == (SPEC.qualified_name,)
    assert required_tensorrt(_graph(("", "NoSuchOp"))).unknown == ("NoSuchOp",)
    check_tensorrt_version("10.15.1.29", _graph(("", "RMSNormalization")))
    with pytest.raises(TensorRTUnavailableError) as error:
        check_tensorrt_version("10.14.1.48", _graph(("", "Attention"), ("", "RMSNormalization")))
    message = str(error.value)
    assert "TensorRT 10.14.1.48 cannot parse this graph: it needs TensorRT 10.15 (for RMSNormalization)" in message and "\n" not in message


def _stand_in_tensorrt(monkeypatch, version: str) -> None:
    """A ``tensorrt`` module of this version: only its version is read before the CUDA check."""
    import types

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version, __name__="tensorrt"))


class _PastTheVersionCheck(Exception):
    pass


@pytest.mark.parametrize(
    "recorded,version,refused",
    [("10.15", "10.14.1.48", True), ("10.15", "10.15.1.29", False), ("10.9", "10.9.0", False), (None, "10.0.1", False)],
    ids=["older", "same", "plugin-form", "recorded-before-the-field"],
)
def test_the_backend_refuses_a_tensorrt_older_than_the_plan_needs(tmp_path, monkeypatch, recorded, version, refused):
    """The build records the graph's minimum TensorRT (EngineMeta.min_tensorrt); loading the plan under an older one is
    one line. A plan whose metadata predates the field loads as needing the baseline (10.0)."""
    from medusa_trt.runtime.backends import tensorrt_backend

    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"serialized engine")
    raw = json.loads(_meta(attention="plugin", min_tensorrt=recorded).to_json())
    if recorded is None:
        del raw["min_tensorrt"]  # written before the field existed
    EngineFiles.beside(plan).sidecar.write_text(json.dumps(raw))
    _stand_in_tensorrt(monkeypatch, version)

    def past():
        raise _PastTheVersionCheck

    monkeypatch.setattr(tensorrt_backend, "_require_cuda", past)
    if refused:
        with pytest.raises(EngineError) as error:
            tensorrt_backend.TensorRTBackend(plan)
        message = str(error.value)
        assert f"needs TensorRT 10.15 or newer (its graph's ops), this is TensorRT {version}" in message and "\n" not in message
    else:
        with pytest.raises(_PastTheVersionCheck):
            tensorrt_backend.TensorRTBackend(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.plan", "engine.plan.json"]  # nothing written


def test_medusa_run_on_a_plan_needing_a_newer_tensorrt_is_one_line(tmp_path, monkeypatch, capsys):
    from medusa_trt.cli.run import main as run_main

    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"serialized engine")
    EngineFiles.beside(plan).sidecar.write_text(_meta(min_tensorrt="10.15").to_json())
    _stand_in_tensorrt(monkeypatch, "10.14.1.48")
    assert run_main(["--engine", str(plan), "--prompt", "Hello", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("medusa-run: error: ") and "needs TensorRT 10.15 or newer" in err and "\n" not in err, err


def test_min_tensorrt_is_metadata_of_the_build_not_of_the_graph():
    """A built folder's config.json records it, its ONNX graphs do not: the two still describe one engine."""
    meta = _meta()
    built = EngineMeta.from_json(_meta(min_tensorrt="10.15").to_json(), source="config.json")
    assert built.min_tensorrt == "10.15" and built.tensorrt_floor == (10, 15)
    assert built == meta and meta.tensorrt_floor == (10, 0)


@pytest.fixture(scope="module")
def exported_graphs(tmp_path_factory, stories_base):
    """The stories model exported as the .plan path exports it, in both attention forms and every dtype."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    folder = tmp_path_factory.mktemp("op-table")
    graphs = {}
    for attention in ("onnx", "plugin"):
        for dtype in ("fp32", "fp16", "bf16"):
            path = folder / f"{attention}-{dtype}.onnx"
            model = medusa_model(stories_base, random_heads(stories_base, 3))
            config = ExportConfig(
                out=path,
                tree=CUSTOM_TREE,
                max_context=64,
                attention=attention,
                dtype=dtype,
                key_slots=False,
                gate_logits=False,
                verify=False,
                measure_cost=False,
            )
            export_onnx(model, config)
            graphs[attention, dtype] = [path, path.with_name(f"{attention}-{dtype}.heads.onnx")]
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["onnx", "plugin"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_every_exported_op_is_in_the_parser_table(exported_graphs, attention, dtype):
    """Each op TensorRT's parser would see (the plugin form's fallback stripped) has its minimum release in the
    table, and the requirement is what the table says: RMSNormalization (RotaryEmbedding) 10.15, above Attention's 10.14."""
    protos = []
    for path in exported_graphs[attention, dtype]:
        proto = onnx.load(str(path), load_external_data=False)
        prepare_for_tensorrt(proto)
        protos.append(proto)
    ops = set().union(*(graph_ops(p) for p in protos))
    missing = sorted(op for op in ops if op not in OP_MIN_TENSORRT)
    assert not missing, f"{attention} {dtype}: ops not in exporter/tensorrt_ops.py: {missing}"
    need = required_tensorrt(*protos)
    assert need.version == (10, 15) and "RMSNormalization" in need.because, need  # fp16 graphs compute rotary in plain ops
    assert ((SPEC.domain, SPEC.op_type) in ops) == (attention == "plugin") and (("", "Attention") in ops) == (attention == "onnx")


@pytest.mark.slow
def test_a_plan_build_records_the_minimum_tensorrt_in_its_sidecar(exported_graphs, tmp_path, monkeypatch):
    """build_engines (the builder itself replaced: no TensorRT here) writes the graph's minimum into the plan's
    metadata, where the backend reads it; an installed TensorRT older than it is refused before anything is built."""
    import shutil

    from medusa_trt.exporter import tensorrt_build
    from medusa_trt.runtime.engine import engine_meta

    source = exported_graphs["plugin", "fp16"][0]
    for path in source.parent.glob("plugin-fp16*"):
        (shutil.copytree if path.is_dir() else shutil.copy)(path, tmp_path / path.name)
    onnx_path = tmp_path / source.name

    class Trt:
        __version__ = "10.14.1.48"

    monkeypatch.setattr(tensorrt_build, "require_tensorrt", lambda path=None: Trt)
    monkeypatch.setattr(tensorrt_build, "_register_plugin", lambda: None)
    monkeypatch.setattr(tensorrt_build, "_build_one", lambda trt, src, target, *rest: target.write_bytes(b"plan"))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TensorRTUnavailableError, match="it needs TensorRT 10.15 \\(for RMSNormalization"):
        tensorrt_build.build_engines(onnx_path, TensorRTConfig(plan=tmp_path / "engine.plan"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    Trt.__version__ = "10.16.1.11"
    files = tensorrt_build.build_engines(onnx_path, TensorRTConfig(plan=tmp_path / "engine.plan", verify=False))
    assert engine_meta(files.step).min_tensorrt == "10.15" and engine_meta(onnx_path).min_tensorrt is None


def test_plan_config_and_paths(tmp_path):
    config = TensorRTConfig(plan=tmp_path / "engine.plan")
    assert config.cache_path == tmp_path / "timing.cache"
    assert TensorRTConfig(plan=tmp_path / "e.plan", timing_cache=tmp_path / "c").cache_path == tmp_path / "c"
    with pytest.raises(ExportError, match="must end in .plan"):
        TensorRTConfig(plan=tmp_path / "engine.onnx")
    files = EngineFiles.beside(tmp_path / "engine.plan")
    assert (files.heads.name, files.tokenizer.name, files.sidecar.name) == ("engine.heads.plan", "engine.tokenizer", "engine.plan.json")
    assert EngineFiles.beside(tmp_path / "model.onnx").heads.name == "model.heads.onnx"
    assert onnx_beside(tmp_path / "engine.plan") == tmp_path / "engine.onnx"


def test_sidecar_round_trip(tmp_path):
    from medusa_trt.runtime.backends.tensorrt_backend import read_plan_meta

    plan = tmp_path / "engine.plan"
    with pytest.raises(EngineError, match="does not exist"):
        read_plan_meta(plan)
    plan.write_bytes(b"serialized engine")
    with pytest.raises(EngineError, match="engine.plan.json is missing"):
        read_plan_meta(plan)
    meta = _meta(attention="plugin")
    EngineFiles.beside(plan).sidecar.write_text(meta.to_json())
    assert read_plan_meta(plan) == meta
    old = json.loads(meta.to_json())
    del old["attention"]  # metadata written before the field existed reads as the standard form
    EngineFiles.beside(plan).sidecar.write_text(json.dumps(old))
    assert read_plan_meta(plan).attention == "onnx"


@pytest.mark.skipif(TENSORRT_MISSING is None, reason="tensorrt is installed: the missing-TensorRT path cannot be shown")
def test_runtime_on_a_plan_without_tensorrt_says_what_to_install(tmp_path):
    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"serialized engine")
    EngineFiles.beside(plan).sidecar.write_text(_meta().to_json())
    with pytest.raises(EngineError, match="pip install tensorrt"):
        MedusaRuntime(plan)


def test_lean_runtime_never_imports_tensorrt():
    code = "import sys, medusa_trt.runtime; print(sorted(m for m in sys.modules if 'tensorrt' in m))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = export_main([str(a) for a in args])
    lines = [line.split("\r")[-1] for line in err.getvalue().split("\n")]
    return code, out.getvalue(), "\n".join(line for line in lines if "medusa-export:" in line)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--out", "OUT/m.onnx", "--dtype", "bf16"], "--dtype bf16 is for TensorRT engines"),
        (["--out", "OUT/e.plan", "--quantize", "int8"], "TensorRT does not build"),
    ],
)
def test_plan_only_options(tmp_path, extra, message):
    code, _, err = _cli("--model", STORIES, *[a.replace("OUT", str(tmp_path)) for a in extra])
    assert code == 2 and message in err and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(TENSORRT_MISSING is None, reason="tensorrt is installed: the missing-TensorRT path cannot be shown")
def test_plan_export_without_tensorrt_keeps_the_onnx_and_writes_no_plan(tmp_path):
    plan = tmp_path / "engine.plan"
    code, stdout, err = _cli(
        "--model",
        STORIES,
        "--untrained-heads",
        "2",
        "--tree",
        "chain-2",
        "--out",
        plan,
        "--attention",
        "plugin",
        "--max-context",
        "64",
        "--no-verify",
    )
    assert code == 2, err
    assert err.startswith("medusa-export: error: TensorRT is not installed") and "\n" not in err
    assert "pip install tensorrt" in err and f"the ONNX graph is written to {tmp_path / 'engine.onnx'}" in err
    assert any(line.startswith(f"wrote {tmp_path / 'engine.onnx'}") for line in stdout.splitlines())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["engine.heads.onnx", "engine.onnx", "engine.onnx.files.json", "engine.tokenizer"], (
        names
    )  # no .plan, no sidecar, no temp folder


# ----------------------------------------------------------------------------- with TensorRT and a GPU


@pytest.fixture(scope="module")
def built_plans(tmp_path_factory, stories_base, stories_fitted):
    """The stories model with fitted heads built as fp32 plans, standard and plugin form."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.exporter.tensorrt_build import build_engines

    plans = {}
    folder = tmp_path_factory.mktemp("plans")
    for attention in ("onnx", "plugin"):
        onnx_path = folder / f"{attention}.onnx"
        export_onnx(
            medusa_model(stories_base, stories_fitted),
            ExportConfig(out=onnx_path, tree=CUSTOM_TREE, max_context=256, attention=attention, key_slots=False, gate_logits=False),
        )
        plans[attention] = build_engines(onnx_path, TensorRTConfig(plan=folder / f"{attention}.plan")).step
    return plans


@needs_tensorrt
@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["onnx", "plugin"])
@pytest.mark.parametrize("batch", [1, 4])
def test_tensorrt_tokens_match_onnxruntime(built_plans, stories_prompts, attention, batch):
    plan = built_plans[attention]
    got = MedusaRuntime(plan, tree=CUSTOM_TREE).generate(stories_prompts[:batch], max_new_tokens=24)
    expected = MedusaRuntime(plan.with_suffix(".onnx"), tree=CUSTOM_TREE).generate(stories_prompts[:batch], max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


@needs_tensorrt
@pytest.mark.gpu
def test_tensorrt_backend_binds_by_name_and_never_reallocates(built_plans, stories_prompts):
    from medusa_trt.runtime.contract import STEP_INPUTS, STEP_OUTPUTS, SUCCESSORS_OUTPUT

    runtime = MedusaRuntime(built_plans["plugin"], tree=CUSTOM_TREE)
    backend = runtime.backend
    successors = {SUCCESSORS_OUTPUT} if backend.meta.successors else set()  # next_topk: the default export has it
    assert set(backend.step_engine.buffers) == set(STEP_INPUTS) | set(STEP_OUTPUTS) | successors
    before = {n: b.data_ptr() for n, b in backend.step_engine.buffers.items()}
    runtime.generate(stories_prompts, max_new_tokens=16)
    assert {n: b.data_ptr() for n, b in backend.step_engine.buffers.items()} == before
    one = np.zeros((1, 1), dtype=np.int64)
    out = backend.step(one, one, np.ones((1, 1, 1), dtype=bool), np.zeros(1, dtype=np.int64))
    proposals = backend.propose(out, np.zeros(1, dtype=np.int64), 1)
    assert tuple(proposals.logits().shape)[1:] == (backend.meta.num_heads, backend.meta.vocab_size)


@needs_tensorrt
@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_same_tokens(built_plans, stories_prompts):
    from medusa_trt.runtime.backends.tensorrt_backend import TensorRTBackend

    plain = MedusaRuntime(built_plans["plugin"], tree=CUSTOM_TREE)
    graphed = MedusaRuntime(built_plans["plugin"], tree=CUSTOM_TREE)
    graphed.backend = TensorRTBackend(built_plans["plugin"], cuda_graph=True)
    want = plain.generate(stories_prompts, max_new_tokens=24)
    got = graphed.generate(stories_prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert graphed.backend._graph.key is not None, "no verify step was captured"


@pytest.mark.parametrize(
    "version,extra,message",
    [
        ("10.8.0", [], "TensorRT 10.8.0 is older than the 10.15 this export's graph needs (opset 23, --attention onnx)"),
        ("10.12.0", ["--attention", "plugin"], "or export with --opset 22"),
        ("10.16.0", ["--attention", "plugin"], "Python plugin API's AOT implementations"),  # a tensorrt without tensorrt.plugin
        ("10.14.1", ["--backend", "tensorrt"], "TensorRT 10.14.1 is older than the 10.15"),  # an engine folder for TensorRT
        ("10.16.0", ["--backend", "tensorrt", "--attention", "plugin"], "Python plugin API's AOT implementations"),
    ],
    ids=["too-old", "too-old-plugin", "no-aot-plugin", "folder-too-old", "folder-no-aot-plugin"],
)
def test_an_installed_tensorrt_that_cannot_build_the_graph_is_one_line_with_nothing_written(version, extra, message, tmp_path, monkeypatch):
    """Checked before the export (exporter.tensorrt_build.preflight): a user with an old TensorRT, or one whose
    tensorrt.plugin has no AOT implementations, gets one line and no ONNX graph left behind."""
    import types

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version, __name__="tensorrt"))
    monkeypatch.delitem(sys.modules, "tensorrt.plugin", raising=False)
    monkeypatch.delitem(sys.modules, "medusa_trt.plugins.tree_attention.trt_plugin", raising=False)
    out = tmp_path / ("engine" if "--backend" in extra else "engine.plan")  # --backend tensorrt: an engine folder
    code, _, err = _cli("--model", STORIES, "--untrained-heads", "2", "--out", out, "--max-context", "64", *extra)
    assert code == 2 and message in err and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []
