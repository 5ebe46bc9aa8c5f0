"""The lm_head behind a gate (``exporter/logits_gate.py``): prompt chunks whose logits no one reads skip it.

On the stories260K model (fp32, int8-channel, int4): the gated graph (the export's default) gives the
ungated graph's outputs bit for bit with its ``logits_wanted`` input True, and the same hidden states
and K/V with ``False`` (the logits outputs then empty); the scheduler asks for no
logits on a prompt's chunks before its last, and generation is token for token the ungated engine's.
Old engines (no gate) take ``logits=False`` and compute everything as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STORIES, medusa_model
from helpers import step_feeds

from medusa_trt.exporter.logits_gate import GATED_OUTPUTS, gate_logits
from medusa_trt.runtime.contract import LOGITS_WANTED_INPUT
from medusa_trt.runtime.engine import EngineFiles, read_meta

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")

MODES = ("fp32", "int8-channel", "int4")
# the export_engine keys other modules use for the same engines (gated: the default), so each is exported once a session
GATED_KEYS = {"fp32": "stories-fitted", "int8-channel": "stories-fitted-int8-channel", "int4": "stories-fitted-int4"}


@pytest.fixture(scope="module")
def engines(export_engine, stories_base, stories_fitted):
    model = medusa_model(stories_base, stories_fitted)
    made = {}
    for mode in MODES:
        quantize = {} if mode == "fp32" else {"quantize": mode}
        made[mode, True] = export_engine(GATED_KEYS[mode], model, **quantize)
        made[mode, False] = export_engine(f"stories-fitted-{mode}-ungated", model, gate_logits=False, **quantize)
    return made


def _graph(path):
    import onnx

    return onnx.load(str(EngineFiles.beside(path).step), load_external_data=False).graph


def _session(path):
    import onnxruntime as ort

    from medusa_trt.runtime.backends.onnx_backend import STEP_DISABLED_OPTIMIZERS, session_options

    step, options = str(EngineFiles.beside(path).step), session_options(2, spin=True)
    return ort.InferenceSession(step, options, ["CPUExecutionProvider"], disabled_optimizers=STEP_DISABLED_OPTIMIZERS)


@pytest.mark.parametrize("mode", MODES)
def test_only_the_logits_tail_moves_behind_the_gate(engines, mode):
    graph, before = _graph(engines[mode, True]), _graph(engines[mode, False])
    gates = [n for n in graph.node if n.op_type == "If"]
    assert len(gates) == 1 and list(gates[0].input) == [LOGITS_WANTED_INPUT]
    assert list(gates[0].output) == [o for o in GATED_OUTPUTS if o in {x.name for x in graph.output}]
    assert LOGITS_WANTED_INPUT in {i.name for i in graph.input} and LOGITS_WANTED_INPUT not in {t.name for t in graph.initializer}
    branch = {a.name: a.g for a in gates[0].attribute}
    moved = [n.op_type for n in branch["then_branch"].node]
    assert {"ArgMax", "TopK"} <= set(moved) and {"MatMul", "MatMulInteger", "MatMulNBits"} & set(moved), moved
    aliases = [n for n in graph.node if n.op_type == "Identity" and n.output[0].endswith("_gate_in")]  # hidden, as the branch reads it
    assert [n.input[0] for n in aliases] == ["hidden"]
    assert len(graph.node) - 1 - len(aliases) + len(moved) == len(before.node)  # nothing else moved, nothing dropped
    again = [n.op_type for n in branch["else_branch"].node if n.op_type not in ("Constant", "Slice")]
    assert again == moved  # the tail again, on zero rows: empty outputs of every type and rank


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,tree", [(12, False), (6, True)], ids=["chunk", "tree"])
def test_gated_graph_gives_the_ungated_outputs_bit_for_bit(engines, mode, tokens, tree):
    meta = read_meta(engines[mode, True])
    feeds = step_feeds(meta, tokens, tree=tree, seed=3)
    gated, ungated = _session(engines[mode, True]), _session(engines[mode, False])
    names = [o.name for o in ungated.get_outputs()]
    want = dict(zip(names, ungated.run(None, feeds)))
    names = [o.name for o in gated.get_outputs()]
    got = dict(zip(names, gated.run(None, feeds | {LOGITS_WANTED_INPUT: np.array(True)})))
    skipped = dict(zip(names, gated.run(None, feeds | {LOGITS_WANTED_INPUT: np.array(False)})))
    assert set(want) == set(got)
    for name, array in want.items():
        assert array.dtype == got[name].dtype and np.array_equal(array, got[name]), name
        if name in GATED_OUTPUTS:
            assert skipped[name].size == 0 and skipped[name].dtype == array.dtype, (name, skipped[name].shape)
        else:
            assert np.array_equal(array, skipped[name]), name


@pytest.mark.parametrize("buffers", ["host", "device"])  # device: ort_buffers.DeviceBuffers' code path, on the CPU provider
def test_backend_step_without_logits_keeps_the_cache_bit_for_bit(engines, buffers):
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    engine = engines["int8-channel", True]
    backends = [OnnxBackend(engine, max_batch=2, threads=2, buffers=buffers) for _ in range(2)]
    assert all(b.gated for b in backends)
    ids = np.random.default_rng(0).integers(0, read_meta(engine).vocab_size, (2, 10))
    positions, mask = np.broadcast_to(np.arange(10), (2, 10)).copy(), np.broadcast_to(np.tri(10, dtype=bool), (2, 10, 10)).copy()
    call = (ids, positions, mask, np.zeros(2, np.int64))
    full, bare = backends[0].step(*call), backends[1].step(*call, logits=False)
    assert full.argmax.shape == (2, 10) and bare.argmax.shape == (2, 0) and bare.topk is None
    with pytest.raises(RuntimeError, match="logits=False"):
        bare.logits()
    with pytest.raises(RuntimeError, match="logits=False"):
        bare.logits_rows([0], [9])
    assert np.array_equal(full.hidden_rows([0, 1], [9, 3]), bare.hidden_rows([0, 1], [9, 3]))
    for b, out in zip(backends, (full, bare)):
        b.commit(out, np.broadcast_to(np.arange(10), (2, 10)).copy(), np.array([10, 7]), np.zeros(2, np.int64))
    for cache in ("key", "value"):
        a, b = (getattr(backend.buffers, cache) for backend in backends)
        assert np.array_equal(*(x.numpy() if hasattr(x, "numpy") else x for x in (a, b))), cache
    nxt = (ids[:, :1], np.array([[10], [7]]), np.ones((2, 1, 1), bool), np.array([10, 7]))
    assert np.array_equal(backends[0].step(*nxt).logits(), backends[1].step(*nxt).logits())  # the next step reads the same cache


def test_an_ungated_engine_computes_its_logits_whatever_is_asked(engines):
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    backend = OnnxBackend(engines["fp32", False], max_batch=1, threads=2)
    assert not backend.gated
    out = backend.step(np.array([[5, 6, 7]]), np.arange(3)[None], np.tri(3, dtype=bool)[None], np.array([0]), logits=False)
    assert out.argmax.shape == (1, 3) and out.logits().shape[:2] == (1, 3)


@pytest.mark.parametrize("mode", ["fp32", "int4"])
def test_generation_asks_no_logits_before_the_last_chunk_and_is_the_ungated_engines(engines, stories_base, mode):
    from medusa_trt.runtime import MedusaRuntime, RuntimeConfig

    prompts = [stories_base.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")] * 2
    prompts[1] = prompts[1][:5]  # one chunk: its only chunk is its last
    outputs, asked = {}, []
    for gated in (True, False):
        runtime = MedusaRuntime(str(engines[mode, gated]), RuntimeConfig(prefill_chunk=4, threads=2))
        step = runtime.backend.step

        def spy(*args, logits=True, step=step):
            asked.append(logits)
            return step(*args, logits=logits)

        runtime.backend.step = spy
        asked.clear()
        outputs[gated] = [r.token_ids for r in runtime.generate(prompts[:1], max_new_tokens=24)]
        chunks = -(-len(prompts[0]) // 4)
        assert asked[:chunks] == [False] * (chunks - 1) + [True], asked[:chunks]
        assert all(asked[chunks:]), "a decode step without logits"
        asked.clear()
        outputs[gated] += [r.token_ids for r in runtime.generate(prompts[1:], max_new_tokens=24)]
        assert asked[:2] == [False, True]
        plain = MedusaRuntime(str(engines[mode, gated]), RuntimeConfig(prefill_chunk=4, threads=2, drafters=()))
        assert outputs[gated] == [r.token_ids for r in plain.generate(prompts, max_new_tokens=24)]  # drafted = plain
    assert outputs[True] == outputs[False]


def _tiny(outputs=("logits", "hidden")):
    from onnx import TensorProto, helper

    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", 4])
    nodes = [
        helper.make_node("Relu", ["h"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["next_ids"], axis=-1, keepdims=0),
    ]
    outs = {
        "logits": helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3]),
        "hidden": helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", 4]),
        "next_ids": helper.make_tensor_value_info("next_ids", TensorProto.INT64, ["b"]),
    }
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32))
    graph = helper.make_graph(nodes, "tiny", [h], [outs[o] for o in outputs], initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_gate_is_idempotent_and_leaves_graphs_without_logits_alone():
    import onnx
    import onnxruntime as ort

    model = _tiny(("logits", "hidden", "next_ids"))
    assert gate_logits(model).gated == 2
    onnx.checker.check_model(model)
    assert gate_logits(model).gated == 0  # gated already
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    h = np.array([[1, -2, 3, 4]], np.float32)
    logits, hidden, ids = session.run(None, {"h": h, LOGITS_WANTED_INPUT: np.array(True)})
    assert np.array_equal(logits, np.maximum(h, 0) @ np.arange(12, dtype=np.float32).reshape(4, 3)) and ids.tolist() == [2]
    logits, hidden, ids = session.run(None, {"h": h, LOGITS_WANTED_INPUT: np.array(False)})
    assert logits.size == ids.size == 0 and np.array_equal(hidden, np.maximum(h, 0))
    plain = _tiny(("hidden",))
    assert gate_logits(plain).gated == 0 and len(plain.graph.node) == 3
    passthrough = _tiny(("logits", "hidden"))  # logits read by another output's node too: what is kept stays outside
    passthrough.graph.node[0].input[0] = "h"
    passthrough.graph.node.append(onnx.helper.make_node("Identity", ["logits"], ["hidden2"]))
    passthrough.graph.output.append(onnx.helper.make_tensor_value_info("hidden2", onnx.TensorProto.FLOAT, ["b", 3]))
    assert gate_logits(passthrough).gated == 0


def test_a_plan_build_and_no_logits_gate_export_the_ungated_graph(tmp_path):
    from medusa_trt.cli.export import build_config, build_parser
    from medusa_trt.exporter.builder import BuildPlan, export_config
    from medusa_trt.exporter.export_defaults import ExportDefaults

    for tensorrt, flags, gated in ((None, [], True), (None, ["--no-logits-gate"], False), (object(), [], False)):
        config = build_config(build_parser().parse_args(["--model", "m", "--out", str(tmp_path / "e.onnx"), *flags]))
        plan = BuildPlan(tmp_path / "e.onnx", tensorrt, ExportDefaults(), {}, None)
        assert export_config(config, plan).gate_logits is gated, (tensorrt, flags)


def test_openvino_runs_a_gated_engine_with_its_gate_inlined(engines, stories_base):
    """OpenVINO compiles the If's then branch in its place (openvino_backend._inline_logits_gate): with the If, its
    bf16 CPU plugin returned garbage token ids on some runs. Its output is ONNX Runtime's, token for token."""
    pytest.importorskip("openvino", reason="openvino not installed (pip install '.[openvino]')")
    from medusa_trt.runtime import MedusaRuntime, RuntimeConfig

    engine = str(engines["fp32", True])
    runtime = MedusaRuntime(engine, RuntimeConfig(backend="openvino", threads=2, max_batch=1))
    compiled = runtime.backend.kernel.compiled
    assert LOGITS_WANTED_INPUT not in runtime.backend.kernel.inputs and not runtime.backend.gated
    assert "If" not in {op.get_type_name() for op in compiled.get_runtime_model().get_ordered_ops()}
    prompt = stories_base.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")
    onnx = MedusaRuntime(engine, RuntimeConfig(threads=2, max_batch=1, prefill_chunk=4)).generate([prompt], max_new_tokens=24)
    assert [r.token_ids for r in runtime.generate([prompt], max_new_tokens=24)] == [r.token_ids for r in onnx]


@pytest.mark.parametrize("mode", MODES)
def test_ungate_gives_back_the_ungated_graph(engines, mode):
    """``ungate_logits`` (what quantize_engine runs before quantizing a gated engine, then gating it again)."""
    import onnx

    from medusa_trt.exporter.lean import op_counts
    from medusa_trt.exporter.logits_gate import ungate_logits

    gated, ungated = _graph(engines[mode, True]), _graph(engines[mode, False])
    wrapper = onnx.ModelProto()
    wrapper.graph.CopyFrom(gated)
    assert ungate_logits(wrapper) and not ungate_logits(wrapper)  # once: then nothing is gated
    assert op_counts(wrapper.graph) == op_counts(ungated)
    assert [i.name for i in wrapper.graph.input] == [i.name for i in ungated.input]
    assert sorted((n.op_type, *n.input, *n.output) for n in wrapper.graph.node) == sorted(
        (n.op_type, *n.input, *n.output) for n in ungated.node
    )
    assert gate_logits(wrapper).gated and op_counts(wrapper.graph) == op_counts(gated)
