"""The TensorRT plan vs ONNX comparison (exporter/trt_compare.py).

Its plumbing runs everywhere with two ONNX Runtime runners (polygraphy imports without
TensorRT): the same graph twice matches exactly, a graph with one weight perturbed fails and is
named, tolerances apply per output. With TensorRT and a GPU, a built stories260K plan matches its
ONNX graph and ``--no-verify`` skips the comparison; elsewhere those tests skip and say why.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORIES, medusa_model, random_heads

onnx = pytest.importorskip("onnx")
pytest.importorskip("polygraphy", reason="polygraphy not installed (pip install 'medusa-trt[test]')")

from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: E402

from medusa_trt.exporter.trt_compare import (  # noqa: E402
    HEADS_COMPARED,
    STEP_COMPARED,
    TOLERANCES,
    PlanComparison,
    PlanMismatchError,
    Tolerance,
    compare_plan,
    compare_runners,
    heads_feeds,
    require_match,
    step_feeds,
)
from medusa_trt.runtime.engine import EngineFiles, EngineMeta, read_meta  # noqa: E402
from medusa_trt.runtime.tree import compile_tree  # noqa: E402


def _tensorrt_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"tensorrt is not installed ({type(exc).__name__}): building a plan needs TensorRT 10+ and an NVIDIA GPU"
    import torch

    return None if torch.cuda.is_available() else "tensorrt is installed but no CUDA GPU is visible"


TENSORRT_MISSING = _tensorrt_reason()
needs_tensorrt = pytest.mark.skipif(TENSORRT_MISSING is not None, reason=TENSORRT_MISSING or "")


@pytest.fixture(scope="module")
def engine(export_engine, stories_base):
    """stories260K with 3 random heads, the custom tree (7 nodes), fp32."""
    return export_engine(
        "trt-compare",
        medusa_model(stories_base, random_heads(stories_base, 3)),
        tree=CUSTOM_TREE,
        max_context=64,
        key_slots=False,
        gate_logits=False,
    )  # TensorRT builds take the appended layout and the ungated graph


@pytest.fixture(scope="module")
def perturbed(engine, tmp_path_factory):
    """The engine's step graph with its token embedding scaled by 1.05: a plan that went wrong."""
    proto = onnx.load(str(engine))
    weight = next(t for t in proto.graph.initializer if t.name.endswith("embed_tokens.weight"))
    array = onnx.numpy_helper.to_array(weight)
    weight.CopyFrom(onnx.numpy_helper.from_array((array * 1.05).astype(array.dtype), weight.name))
    out = tmp_path_factory.mktemp("perturbed") / "model.onnx"
    onnx.save(proto, str(out))
    return out


def _runners(a, b):
    return [OnnxrtRunner(SessionFromOnnx(str(a))), OnnxrtRunner(SessionFromOnnx(str(b)))]


def _tolerances(names, dtype="fp32"):
    return {name: TOLERANCES[dtype] for name in names}


# ----------------------------------------------------------------------------- feeds (pure)


def test_step_feeds_are_a_prefill_then_a_tree_step(engine):
    meta = read_meta(engine)
    prefill, step = step_feeds(meta)
    layers, hkv, dim = meta.num_layers, meta.num_kv_heads, meta.head_dim
    assert prefill["input_ids"].shape == (2, 7) and prefill["cache_lengths"].tolist() == [0, 0]
    assert prefill["past_key"].shape == (1, layers, 2, hkv, dim)  # one slot, hidden by cache_lengths 0
    assert (prefill["tree_mask"][1] == np.tril(np.ones((7, 7), dtype=bool))).all()
    tree = compile_tree(meta.tree)
    assert step["cache_lengths"].tolist() == [7, 4]  # ragged, over a 7-slot cache
    assert step["past_key"].shape == (7, layers, 2, hkv, dim) and step["past_key"].dtype == np.float32
    assert (step["tree_mask"][0] == tree.mask).all()
    assert step["position_ids"].tolist() == [(7 + tree.depth).tolist(), (4 + tree.depth).tolist()]
    for feed in (prefill, step):
        assert feed["input_ids"].max() < meta.vocab_size and feed["input_ids"].dtype == np.int64


def test_step_feeds_of_a_key_slots_graph_carry_the_slots(engine):
    import dataclasses

    for feed in step_feeds(dataclasses.replace(read_meta(engine), key_slots=True)):
        slots = feed["key_slots"]
        assert slots.shape == feed["input_ids"].shape and feed["past_key"].shape[0] > slots.max()
        assert (slots >= feed["cache_lengths"][:, None]).all()


def test_feeds_fit_small_engines_and_heads_inputs(engine):
    meta = read_meta(engine)
    small = EngineMeta(
        **(meta.__dict__ | {"max_batch": 1, "max_tokens": 4, "max_context": 6, "dtype": "fp16", "head_input": "hidden+next"})
    )
    prefill, step = step_feeds(small)
    assert prefill["input_ids"].shape == (1, 2)  # min(7, max_tokens 4, context 6 - 4 tree nodes)
    assert step["input_ids"].shape == (1, 4) and step["tree_mask"].shape == (1, 4, 4)  # the first 4 tree nodes
    assert step["past_value"].dtype == np.float16
    (heads,) = heads_feeds(small)
    assert heads["hidden"].shape == (1, meta.hidden_size) and heads["root_ids"].shape == (1,)


# ----------------------------------------------------------------------------- two ONNX Runtime runners


def test_same_graph_matches_exactly(engine):
    meta = read_meta(engine)
    result = compare_runners(_runners(engine, engine), step_feeds(meta), _tolerances(STEP_COMPARED), graph="step")
    assert result.passed and result.failed == ()
    assert set(result.max_abs) == set(STEP_COMPARED) and max(result.max_abs.values()) == 0.0
    assert require_match(result, engine) is result
    assert result.summary().startswith(
        "step plan verified against ONNX Runtime: max abs difference 0.00e+00 (atol 0.001 rtol 0.001; logits"
    )

    heads = EngineFiles.beside(engine).heads
    result = compare_runners(_runners(heads, heads), heads_feeds(meta), _tolerances(HEADS_COMPARED), graph="heads")
    assert result.passed and result.max_abs == {"head_logits": 0.0}


def test_perturbed_weight_fails_and_names_the_outputs(engine, perturbed):
    meta = read_meta(engine)
    result = compare_runners(_runners(engine, perturbed), step_feeds(meta), _tolerances(STEP_COMPARED), graph="step")
    assert not result.passed and "logits" in result.failed and "hidden" in result.failed
    assert result.max_abs["logits"] > 1e-2
    assert "DIFFERS from ONNX Runtime in logits" in result.summary()
    with pytest.raises(
        PlanMismatchError, match=r"engine.plan disagrees with its ONNX graph beyond tolerance in logits [0-9.e-]+ \(atol 0.001"
    ):
        require_match(result, engine.with_name("engine.plan"))


def test_tolerances_are_per_output(engine, perturbed):
    meta = read_meta(engine)
    strict = compare_runners(_runners(engine, perturbed), step_feeds(meta), _tolerances(STEP_COMPARED), graph="step")
    loose = {name: Tolerance(atol=10 * strict.max_abs[name], rtol=0.0) for name in STEP_COMPARED} | {"logits": Tolerance(1e-6, 0.0)}
    result = compare_runners(_runners(engine, perturbed), step_feeds(meta), loose, graph="step")
    assert result.failed == ("logits",)
    only_logits = compare_runners(_runners(engine, perturbed), step_feeds(meta), {"logits": Tolerance(1e-6, 0.0)}, graph="step")
    assert set(only_logits.max_abs) == {"logits"}  # outputs without a tolerance (ids, the rest) are not compared


def test_bf16_plans_are_skipped_with_a_reason(engine, tmp_path):
    meta = EngineMeta(**(read_meta(engine).__dict__ | {"dtype": "bf16"}))
    result = compare_plan(tmp_path / "engine.plan", engine, meta, graph="step")  # returns before any TensorRT import
    assert isinstance(result, PlanComparison) and result.passed and result.max_abs == {}
    assert result.summary().startswith("step plan not compared against ONNX Runtime: bf16 has no numpy type")


def test_polygraphy_imports_without_tensorrt():
    code = (
        "import sys; from polygraphy.comparator import Comparator; from polygraphy.backend.trt import TrtRunner, EngineFromBytes; "
        "import medusa_trt.exporter.trt_compare; print('tensorrt' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ----------------------------------------------------------------------------- with TensorRT and a GPU


@needs_tensorrt
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_built_plan_matches_its_onnx_graph(tmp_path, stories_base, dtype):
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.exporter.tensorrt_build import TensorRTConfig, build_engines

    onnx_path = tmp_path / "engine.onnx"
    export_onnx(
        medusa_model(stories_base, random_heads(stories_base, 3)),
        ExportConfig(out=onnx_path, tree=CUSTOM_TREE, max_context=64, dtype=dtype, verify=False, gate_logits=False),
    )
    compared = []
    files = build_engines(onnx_path, TensorRTConfig(plan=tmp_path / "engine.plan", report=compared.append))
    assert files.step.is_file() and [c.graph for c in compared] == ["step", "heads"]
    assert all(c.passed and c.skipped is None for c in compared), [c.summary() for c in compared]
    assert max(compared[0].max_abs.values()) < TOLERANCES[dtype].atol * 10


@needs_tensorrt
@pytest.mark.gpu
def test_cli_prints_the_comparison_and_no_verify_skips_it(tmp_path, capsys):
    from medusa_trt.cli.export import main as export_main

    common = ["--model", str(STORIES), "--untrained-heads", "2", "--tree", "chain-2", "--max-context", "64"]
    assert export_main([*common, "--out", str(tmp_path / "a.plan")]) == 0
    out = capsys.readouterr().out
    assert "step plan verified against ONNX Runtime: max abs difference" in out and "heads plan verified" in out
    assert export_main([*common, "--out", str(tmp_path / "b.plan"), "--no-verify"]) == 0
    assert "against ONNX Runtime" not in capsys.readouterr().out
