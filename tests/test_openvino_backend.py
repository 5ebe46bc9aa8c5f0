"""The OpenVINO backend (runtime/backends/openvino_backend.py): the same engine, the same tokens.

Tokens in, tokens out on stories260K with fitted heads: greedy drafted output on OpenVINO equals ONNX
Runtime's plain output (f32) with rows refilling (commit, relayout) at batch 1 to 3; bf16 (where the CPU
has it) equals its own plain output; the load-time probe's verdict is what the steps claim, and an
inexact engine says so. Bad option values are one typed line. Skips where openvino is not installed.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino not installed (pip install 'medusa-trt[openvino]', or make openvino-peer)")

from medusa_trt.runtime import MedusaRuntime  # noqa: E402
from medusa_trt.runtime.backends import onnx_backend_name  # noqa: E402
from medusa_trt.runtime.backends import openvino_backend as ovb  # noqa: E402
from medusa_trt.runtime.backends.host_backend import HostBackend  # noqa: E402
from medusa_trt.runtime.contract import KEY_SLOTS_INPUT, PAST_KEY  # noqa: E402
from medusa_trt.runtime.engine import EngineError  # noqa: E402
from medusa_trt.runtime.errors import MedusaError  # noqa: E402
from tests.conftest import medusa_model  # noqa: E402

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(stories_base, stories_fitted, export_engine):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with test_runtime


@pytest.fixture(scope="module")
def onnxruntime_plain(engine, stories_prompts):
    runtime = MedusaRuntime(engine, max_batch=3, max_context=256, threads=2).plain()
    return [r.token_ids for r in runtime.generate(stories_prompts[:5], max_new_tokens=NEW_TOKENS)]


@pytest.mark.parametrize("batch", [1, 3])
def test_drafted_output_equals_onnxruntime_plain_output(engine, stories_prompts, onnxruntime_plain, batch):
    """f32: 5 prompts over ``batch`` rows (rows finish and refill: commit and relayout), every drafter."""
    runtime = MedusaRuntime(engine, backend="openvino", max_batch=batch, max_context=256, threads=2)
    assert runtime.backend.name == "openvino" and runtime.backend.precision == "f32"
    assert runtime.backend.exact is True, runtime.backend.exactness  # the probe found verify steps = plain steps here
    results = runtime.generate(stories_prompts[:5], max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == onnxruntime_plain
    assert max(r.stats.mean_accepted for r in results) > 1  # drafts were accepted on the way
    plain = runtime.plain().generate(stories_prompts[:5], max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in plain] == onnxruntime_plain


def test_bf16_decodes_and_claims_no_exactness(engine, stories_prompts, caplog):
    if not ovb.cpu_has_bf16():
        pytest.skip("this CPU has neither AMX nor AVX512-BF16: openvino's bf16 precision is refused here")
    with caplog.at_level("WARNING", logger=ovb.__name__):
        runtime = MedusaRuntime(engine, backend="openvino", precision="bf16", max_batch=2, max_context=256, threads=2)
    assert "output is not the fp32 engine's" in caplog.text and "(not exact)" in caplog.text  # said at load
    # no claim: on 29 dev prompts a bf16 engine that passed the lane probe drafted other text than its own plain
    # output on one (docs/results/bench-backends.json), so bf16 never claims verify steps are plain steps
    assert runtime.backend.exact is False
    assert runtime.backend.precision == "bf16"
    drafted = runtime.generate(stories_prompts[:3], max_new_tokens=NEW_TOKENS)
    plain = runtime.plain().generate(stories_prompts[:3], max_new_tokens=NEW_TOKENS)
    assert len(drafted) == len(plain) == 3 and all(r.token_ids for r in drafted)  # it decodes; equal to rounding only


def test_verify_steps_claim_what_the_probe_found(engine):
    """A tree step's per-node ``exact`` flags come from the key slots at the probed lane count, and the
    path's logits then equal the plain steps' logits bit for bit."""
    from medusa_trt.runtime import exactness

    backend = ovb.open_openvino(engine, max_batch=1, max_context=256, threads=2)
    assert isinstance(backend, HostBackend) and backend.describe() == "openvino (CPU, f32)"
    assert backend.key_lanes in (8, 16, 32, 64)
    ids = np.random.default_rng(7).integers(0, backend.meta.vocab_size, 40, dtype=np.int64)
    path, plain = exactness.plain_steps(backend, ids, 5)
    tokens, parents, where = exactness.layouts(path, backend.meta.vocab_size)["tree"]
    exactness.prefill(backend, ids)
    backend.kernel = recorder = _Recorder(backend.kernel)
    out = backend.step(
        np.array([tokens]), (40 + np.array([0, 1, 1, 2, 3, 4]))[None], _mask(parents)[None], np.array([40])
    )  # root, sibling, path below the root
    assert out.exact is not None and out.exact[0, where].all()
    slots, past = recorder.seen[0]  # the key slots the graph read, the cache slots bound: whole KEY_BLOCKs holding them
    assert slots.min() == 40 and past % ovb.KEY_BLOCK == 0 and slots.max() < past <= slots.max() + ovb.KEY_BLOCK
    assert all(np.array_equal(out.logits()[0, i], plain[j]) for j, i in enumerate(where))
    proposals = backend.propose(out, np.array([where[-1]]), 2, roots=np.array([3]))  # (1, heads, 2) at the path's last node
    assert proposals.ids.shape[::2] == (1, 2) and proposals.logits().shape[0] == 1
    hidden = np.zeros((3, backend.meta.hidden_size), np.float32)  # a wider call on the heads graph after it (medusa-bench times one)
    backend.run_heads(hidden, np.zeros(3, np.int64) if backend.meta.reads_roots else None)


class _Recorder:
    """A step kernel that notes the key slots and the bound cache length of each call, then runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.exact, self.seen = kernel, kernel.exact, []

    def __call__(self, arrays):
        self.seen.append((arrays[KEY_SLOTS_INPUT].copy(), arrays[PAST_KEY].shape[0]))
        self.kernel(arrays)

    def describe(self) -> str:
        return self.kernel.describe()


def _mask(parents: list[int]) -> np.ndarray:
    mask = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def test_an_inexact_engine_claims_nothing_and_warns(engine, stories_prompts, monkeypatch, caplog):
    from medusa_trt.runtime import exactness

    monkeypatch.setattr(ovb, "_PROBED", {})
    monkeypatch.setattr(exactness, "verify_diffs", lambda *args: [0.5])  # what a backend whose verify steps drift measures
    with caplog.at_level(logging.WARNING):
        backend = ovb.open_openvino(engine, max_batch=1, max_context=256, threads=2)
    assert backend.exact is False and backend.key_lanes is None and backend.exactness.max_diff == 0.5
    assert any("not exact" in r.getMessage() for r in caplog.records)
    tree = np.tri(3, dtype=bool)
    tree[2, 1] = False  # a sibling of node 1
    assert backend.step(np.array([[5, 6, 7]]), np.array([[0, 1, 1]]), tree[None], np.array([0])).exact is None


def test_engine_folder_chooses_the_backend(stories_base, stories_fitted, engine, tmp_path):
    """A folder whose config.json says openvino runs on it; ``backend=`` overrides the folder; a loose
    .onnx runs on onnxruntime unless asked."""
    import dataclasses

    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.engine_folder import read_folder_config, write_folder_config
    from medusa_trt.runtime.manifest import write_manifest

    assert onnx_backend_name(engine, None) == "onnxruntime" and onnx_backend_name(engine, "openvino") == "openvino"
    folder = tmp_path / "stories"
    config = ExportConfig(out=folder, tree="chain-2", max_batch=2, max_context=128, backend="onnxruntime")
    export_onnx(medusa_model(stories_base, stories_fitted), config)
    assert onnx_backend_name(folder, None) == "onnxruntime"
    write_folder_config(folder, dataclasses.replace(read_folder_config(folder), backend="openvino"))
    write_manifest(EngineFiles.in_folder(folder))  # the export's manifest recorded the old config.json
    assert MedusaRuntime(folder, threads=2).backend.name == "openvino"
    assert MedusaRuntime(folder, backend="onnxruntime", threads=2).backend.name == "onnxruntime"


def test_a_folder_exported_for_openvino_says_so(stories_base, stories_fitted, tmp_path):
    """``--backend openvino``: config.json names it (it used to say onnxruntime), MedusaRuntime(DIR) runs on it, and
    the step cost recorded beside it was measured there (the runtime uses it on openvino only)."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.engine_folder import read_drafting, read_folder_config

    folder = tmp_path / "stories-openvino"
    config = ExportConfig(out=folder, tree="chain-2", max_batch=2, max_context=128, backend="openvino")
    export_onnx(medusa_model(stories_base, stories_fitted), config)
    assert read_folder_config(folder).backend == "openvino" and read_drafting(folder)["step_cost"]
    runtime = MedusaRuntime(folder, threads=2)
    assert runtime.backend.name == "openvino" and runtime._folder_step_cost is not None
    assert MedusaRuntime(folder, backend="onnxruntime", threads=2)._folder_step_cost is None


def test_bad_options_are_one_typed_line(engine, monkeypatch):
    cases = [
        (dict(backend="openvino", precision="fp8"), EngineError, "precision 'fp8' is not one of f32, bf16"),
        (dict(backend="openvin"), MedusaError, "backend must be one of"),
        (dict(precision="bf16"), EngineError, "is an openvino option"),
        (dict(backend="tensorrt"), EngineError, "tensorrt runs .plan engines"),
    ]
    for options, kind, message in cases:
        with pytest.raises(kind, match=message) as info:
            MedusaRuntime(engine, max_batch=1, max_context=64, **options)
        assert "\n" not in str(info.value)
    with pytest.raises(EngineError, match="device 'TPU' is not one of"):
        ovb.open_openvino(engine, device="TPU")
    monkeypatch.setattr(ovb, "cpu_has_bf16", lambda: False)
    with pytest.raises(EngineError, match="needs a CPU with AMX or AVX512-BF16"):
        MedusaRuntime(engine, backend="openvino", precision="bf16", max_batch=1, max_context=64)


def test_bf16_flags_are_read_from_cpuinfo():
    assert ovb.cpu_has_bf16("processor : 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n")
    assert ovb.cpu_has_bf16("flags : fpu amx_bf16 amx_tile\n")
    assert not ovb.cpu_has_bf16("flags : fpu sse avx2 avx512f\nbugs : avx512_bf16\n")


def test_bench_runs_each_engine_on_each_backend(engine, tmp_path):
    """``medusa-bench --backend onnxruntime --backend openvino``: one set of rows per backend, named
    ENGINE@BACKEND, in one interleaved run; every row agrees with the first engine's plain output."""
    from tests.helpers import run_bench

    report = run_bench(
        tmp_path, [engine], ["Once upon a time", "Lily saw a bird"], "--no-hf", "--backend", "onnxruntime", "--backend", "openvino"
    )
    methods = report["methods"]
    stem = engine.stem if engine.suffix else engine.name
    assert set(methods) == {f"{kind}[{stem}@{b}]" for kind in ("plain", "medusa") for b in ("onnxruntime", "openvino")}
    assert all(m["identical_to_reference"] == 1.0 for m in methods.values()), methods


def test_medusa_run_on_openvino(engine, capsys):
    """``medusa-run --backend openvino`` decodes what ONNX Runtime decodes; --backend with --model is one line."""
    from medusa_trt.cli.run import main

    common = ["--engine", str(engine), "--prompt", "Once upon a time", "--max-new-tokens", "12", "--json"]
    decoded = []
    for backend in (["--backend", "openvino"], []):
        assert main([*common, *backend]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        decoded.append((record["text"], record["token_ids"]))
    assert decoded[0] == decoded[1] and decoded[0][1]
    assert main(["--model", "stories260K", "--prompt", "x", "--backend", "openvino"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend / --precision go with --engine" in err[0]


def _ov_compile(model):
    """``model`` (an ONNX ModelProto) read and compiled as the backend reads an engine's graphs (f32)."""
    import openvino as ov
    from openvino.frontend.onnx import ConversionExtension

    core = ov.Core()
    core.add_extension(ConversionExtension("QuantizeLinear", ovb._quantize_linear))
    return core.compile_model(core.read_model(model.SerializeToString()), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


@pytest.mark.parametrize("k", [37, 576])
def test_row_quantizers_compile_to_onnxruntimes_integers(k):
    """The int8 row quantizer of int8-channel and heads-int8 graphs (one QuantizeLinear a row, a block as wide as the
    row, which OpenVINO's ONNX reader refuses on its own) runs on OpenVINO f32: the quantized row and the integer
    product are ONNX Runtime's bytes; the output is within float rounding of them (OpenVINO multiplies the two scales
    in another order where nothing reads between them, as it did before the QuantizeLinear)."""
    import onnxruntime as ort
    from helpers import row_int8_model
    from onnx import TensorProto, helper

    model, reference = row_int8_model(k, 24, seed=k)
    for name, kind in (("mm_rowq_xq", TensorProto.UINT8), ("mm_rowq_acc", TensorProto.INT32)):
        model.graph.output.append(helper.make_tensor_value_info(name, kind, None))
    x = (np.random.default_rng(2).standard_normal((2, 7, k)) * 3).astype(np.float32)
    x[1, 3] = 0.0
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.array_equal(want[0], reference(x))
    got = {port.get_any_name(): value for port, value in _ov_compile(model)({"x": x}).items()}
    assert np.array_equal(got["mm_rowq_xq"], want[1]) and np.array_equal(got["mm_rowq_acc"], want[2])
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-6, atol=0)


def _quantize_model(x_shape, scale, zero_point, **attrs):
    """One QuantizeLinear over x (``zero_point`` None: without one, its output type from ``output_dtype``)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(scale, "scale")] + ([] if zero_point is None else [numpy_helper.from_array(zero_point, "zero")])
    node = helper.make_node("QuantizeLinear", ["x", "scale"] + ([] if zero_point is None else ["zero"]), ["y"], **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    kind = helper.np_dtype_to_tensor_dtype(zero_point.dtype) if zero_point is not None else attrs.get("output_dtype", TensorProto.UINT8)
    outputs = [helper.make_tensor_value_info("y", kind, None)]
    graph = helper.make_graph([node], "q", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("form", ["per tensor", "per axis 0", "per axis 1", "int8 zero point", "int8, no zero point"])
def test_other_quantize_linear_forms_translate_as_onnx_says(form):
    """The translation replaces OpenVINO's own for every QuantizeLinear: per-tensor and per-axis scales keep their
    meaning, and int8 outputs saturate at -128 / 127 (the values span far past both ranges)."""
    import onnxruntime as ort

    x = (np.random.default_rng(3).standard_normal((4, 6)) * 60).astype(np.float32)
    rng = np.random.default_rng(4)
    scale, zero, attrs = {
        "per tensor": (np.float32(0.3), np.uint8(100), {}),
        "per axis 0": (rng.uniform(0.1, 1, 4).astype(np.float32), rng.integers(0, 255, 4).astype(np.uint8), {"axis": 0}),
        "per axis 1": (rng.uniform(0.1, 1, 6).astype(np.float32), rng.integers(0, 255, 6).astype(np.uint8), {"axis": 1}),
        "int8 zero point": (np.float32(0.5), np.int8(-3), {}),
        "int8, no zero point": (np.float32(0.5), None, {"output_dtype": 3}),
    }[form]
    model = _quantize_model([4, 6], np.asarray(scale), None if zero is None else np.asarray(zero), **attrs)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = _ov_compile(model)({"x": x})[0]
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert want.min() in (0, -128) and want.max() in (255, 127)  # saturated both ways


def test_wider_quantize_linear_outputs_are_refused():
    model = _quantize_model([4, 6], np.asarray(np.float32(0.5)), np.asarray(np.int16(0)))
    with pytest.raises(RuntimeError, match="QuantizeLinear to i16: not translated"):
        _ov_compile(model)


def test_blocks_smaller_than_their_axis_are_refused():
    model = _quantize_model([4, 6], np.ones((4, 2), np.float32), np.zeros((4, 2), np.uint8), axis=1, block_size=3)
    with pytest.raises(RuntimeError, match="blocks of 3 along an axis of 6"):
        _ov_compile(model)
