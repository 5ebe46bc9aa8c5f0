"""The lean step graph (``exporter/lean.py``): fewer ops, the same outputs bit for bit.

On the stories260K model (Llama, 5 layers): the graph exported as traced (``lean=False``) and the
default lean one give the same step outputs bit for bit on a prefill and a branching tree step,
the lean one holds one rotary table pair and 4 weight matmuls a layer, and its verify steps equal
its plain steps (the exporter's exactness probe). Greedy identity of the default (lean) engines
against ``transformers`` is ``test_greedy_identity.py``'s and ``test_architectures.py``'s.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import STORIES, medusa_model
from helpers import graph_nodes, script, step_feeds

from medusa_trt.exporter.lean import op_counts, share_identical
from medusa_trt.runtime.engine import EngineFiles, read_meta

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")


@pytest.fixture(scope="module")
def engines(export_engine, stories_base, stories_fitted):
    model = medusa_model(stories_base, stories_fitted)
    return {lean: export_engine(f"stories-lean-{lean}", model, lean=lean) for lean in (False, True)}


def _graph(path):
    import onnx

    return onnx.load(str(EngineFiles.beside(path).step), load_external_data=False).graph


def _weight_matmuls(graph) -> int:
    weights = {t.name for t in graph.initializer if len(t.dims) == 2}
    nodes = graph_nodes(graph)  # the lm_head sits in the logits gate's then branch
    producers = {o: n for n in nodes for o in n.output}
    count = 0
    for node in nodes:
        if node.op_type != "MatMul":
            continue
        source = producers.get(node.input[1])  # the tied lm_head reads its weight through a Transpose
        count += node.input[1] in weights or (source is not None and source.op_type == "Transpose" and source.input[0] in weights)
    return count


def test_one_rotary_table_pair_and_four_weight_matmuls_a_layer(engines):
    layers = read_meta(engines[True]).num_layers
    before, after = (_graph(engines[lean]) for lean in (False, True))
    counts = op_counts(after)
    assert op_counts(before)["Cos"] == op_counts(before)["RotaryEmbedding"] > 1  # what the trace writes: a pair per node
    assert counts["Cos"] == counts["Sin"] == 1, counts
    assert counts["RotaryEmbedding"] == 2 * layers  # queries and keys of every layer, one table
    assert (_weight_matmuls(before), _weight_matmuls(after)) == (7 * layers + 1, 4 * layers + 1)  # Q K V O gate up down; + lm_head
    assert counts["Split"] == 2 * layers  # Q / K / V and gate / up back apart
    assert sum(counts.values()) < sum(op_counts(before).values())


def _run(path, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    from medusa_trt.runtime.backends.onnx_backend import STEP_DISABLED_OPTIMIZERS, with_gate

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    step = EngineFiles.beside(path).step
    session = ort.InferenceSession(str(step), options, ["CPUExecutionProvider"], disabled_optimizers=STEP_DISABLED_OPTIMIZERS)
    return session.run(None, with_gate(session, feeds))


@pytest.mark.parametrize("tokens,tree", [(12, False), (6, True)], ids=["prefill", "tree"])
def test_lean_graph_gives_the_traced_graphs_outputs_bit_for_bit(engines, tokens, tree):
    meta = read_meta(engines[True])
    feeds = step_feeds(meta, tokens, tree=tree, seed=1)
    before, after = (_run(engines[lean], feeds) for lean in (False, True))
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"output {i} differs: max {np.abs(a.astype(float) - b).max()}"


def test_lean_engine_verify_step_equals_plain_step(engines):
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.exactness import probe

    result = probe(OnnxBackend(engines[True], max_batch=1, threads=2))
    assert result.exact, result


def test_share_identical_merges_repeats_only():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("y", "c3")]
    nodes = [
        helper.make_node("Cos", ["x"], ["c1"]),
        helper.make_node("Cos", ["x"], ["c2"]),  # repeats c1
        helper.make_node("Sin", ["x"], ["s1"]),  # another op
        helper.make_node("Mul", ["c1", "s1"], ["m1"]),
        helper.make_node("Mul", ["c2", "s1"], ["m2"]),  # repeats m1 once c2 reads c1
        helper.make_node("Cos", ["x"], ["c3"]),  # a graph output: stays
        helper.make_node("Dropout", ["m1"], ["d1"]),
        helper.make_node("Dropout", ["m1"], ["d2"]),  # impure: stays
        helper.make_node("Add", ["d1", "d2"], ["a"]),
        helper.make_node("Add", ["a", "m2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], outs)
    assert share_identical(graph) == 2
    assert [n.output[0] for n in graph.node] == ["c1", "s1", "m1", "c3", "d1", "d2", "a", "y"]
    assert list(graph.node[-1].input) == ["a", "m1"]


def test_step_profile_streamed_bytes_leave_out_row_lookups(tmp_path):
    from onnx import TensorProto, helper, numpy_helper, save

    table = numpy_helper.from_array(np.zeros((50, 8), np.float32), "table")  # read by Gather only: one row a token
    weight = numpy_helper.from_array(np.zeros((8, 6), np.float32), "weight")  # read whole by a MatMul
    tied = numpy_helper.from_array(np.zeros((8, 3), np.float32), "tied")  # a Gather and a MatMul: read whole
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("Gather", ["tied", "ids"], ["unused"]),
        helper.make_node("MatMul", ["rows", "weight"], ["y"]),
        helper.make_node("MatMul", ["rows", "tied"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
        [table, weight, tied],
    )
    path = tmp_path / "model.onnx"
    save(helper.make_model(graph), str(path), save_as_external_data=True, size_threshold=0)
    assert script("step_profile").streamed_bytes(path) == (8 * 6 + 8 * 3) * 4


def test_step_profile_splits_a_traced_step_into_kinds(engines, tmp_path, capsys):
    profile = script("step_profile")
    out = tmp_path / "profile.json"
    argv = ["--engine", str(engines[True]), "--context", "20", "--tokens", "1", "--tokens", "4", "--rounds", "3", "--bandwidth", "10"]
    assert profile.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())["engines"][str(engines[True])]
    for tokens, trace in report["trace"].items():
        kinds = trace["kinds_ms"]
        assert set(kinds) == set(profile.ORDER)
        assert kinds["weight matmuls"] > 0 and kinds["attention"] > 0 and kinds["cache and layout copies"] > 0, (tokens, kinds)
        assert sum(kinds.values()) == pytest.approx(trace["run_ms"], rel=1e-6)  # every traced microsecond in one kind
        assert trace["nodes"] > 10 * read_meta(engines[True]).num_layers
        assert sum(trace["kind_nodes"].values()) == trace["nodes"]  # every node in one kind
    assert report["floor_ms"] == pytest.approx(report["streamed_bytes"] / 10e9 * 1e3)
    printed = capsys.readouterr().out
    assert "one-token step" in printed and "weight matmuls" in printed


def test_engine_step_ab_times_engines_side_by_side(engines, tmp_path, capsys):
    """scripts/engine_step_ab.py: the lean and the unrewritten engine give the same outputs at every size (the lean
    rewrite is exact), each size timed on both, the figures written as JSON."""
    ab = script("engine_step_ab")
    out = tmp_path / "ab.json"
    argv = ["--engine", f"before={engines[False]}", "--engine", f"after={engines[True]}", "--context", "20"]
    assert ab.main([*argv, "--tokens", "1", "--tokens", "4", "--rounds", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_outputs"] == {"1": True, "4": True}
    assert set(report["steps"]) == {"1", "4"} and all(len(s["median_ms"]) == 2 for s in report["steps"].values())
    assert report["nodes"]["after"] < report["nodes"]["before"]  # the lean graph shares and fuses nodes
    assert "same outputs bit for bit at every size: yes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine", "only=x"], "pass two or more --engine"),
        (["--engine", "a=/no/such", "--engine", "b=/no/such/2"], "does not exist"),
        (["--engine", "nameless"], "is not NAME=PATH"),
        (["--engine", "a=x@tensorrt"], "backend 'tensorrt' is not one of onnxruntime, native"),
    ],
)
def test_engine_step_ab_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        script("engine_step_ab").main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
