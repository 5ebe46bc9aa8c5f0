"""The native backend (runtime/native_step.c behind runtime/backends/native_backend.py): verify steps are plain
steps bit for bit (fp32 and int8-channel engines), a row's numbers do not depend on the rows beside it, its logits
are ONNX Runtime's to float rounding, an int8-channel matmul is ONNX Runtime's bit for bit, and graphs that are not
the pattern it computes are refused by name. Greedy identity against transformers on every tree, batch, heads kind
and tiny architecture is in test_greedy_identity.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import medusa_model

from medusa_trt.runtime import MedusaRuntime, exactness, native_graph, native_step, native_weights
from medusa_trt.runtime.backends.native_backend import open_native
from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
from medusa_trt.runtime.engine import EngineError


@pytest.fixture(scope="module")
def engine(stories_base, stories_fitted, export_engine):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with test_runtime


@pytest.fixture(scope="module")
def native(engine):
    return open_native(engine, max_batch=4, max_context=256, threads=2)


@pytest.fixture(scope="module")
def int8_engine(stories_base, stories_fitted, export_engine):
    return export_engine("stories-fitted-int8-channel", medusa_model(stories_base, stories_fitted), quantize="int8-channel")


def _chain(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


@pytest.mark.parametrize("context", [1, 24, 45, 61])
def test_verify_steps_are_plain_steps_bit_for_bit(native, context):
    """A chain and a tree with a sibling before the path re-score the plain steps' tokens with their plain logits, bit for
    bit, without key slots, at every cache length (the lanes of any vector width land differently at each)."""
    rng = np.random.default_rng(context)
    ids = rng.integers(0, native.meta.vocab_size, context, dtype=np.int64)
    path, plain = exactness.plain_steps(native, ids, 5)
    for name, layout in exactness.layouts(path, native.meta.vocab_size).items():
        assert exactness.verify_diffs(native, ids, layout, plain) == [0.0] * len(path), name
    assert native.exact is True


def test_a_row_does_not_depend_on_the_rows_beside_it(native):
    """Row 0 alone, then beside three other rows of other lengths and widths: the same logits and keys, bit for bit."""
    rng = np.random.default_rng(1)
    vocab, width = native.meta.vocab_size, 6
    prompts = [rng.integers(0, vocab, n, dtype=np.int64) for n in (30, 11, 52, 7)]
    tree = _chain(width)
    tree[3, 1:3] = False  # node 3 a sibling branch from node 0

    # batch 1: prefill then a tree step
    p0 = prompts[0]
    out = native.step(p0[None], np.arange(len(p0))[None], _chain(len(p0))[None], np.array([0]))
    native.commit(out, np.arange(len(p0))[None], np.array([len(p0)]), np.array([0]))
    nodes = rng.integers(0, vocab, width, dtype=np.int64)
    depth = tree.sum(-1) - 1
    alone = native.step(nodes[None], (len(p0) + depth)[None], tree[None], np.array([len(p0)]))
    alone_logits, alone_key = alone.logits()[0].copy(), native.buffers._views["new_key"][:, :, 0].copy()
    # batch 4: the same prefills, row by row in one prefill step of padded chains, then the same tree on row 0
    lengths = np.array([len(p) for p in prompts])
    longest = int(lengths.max())
    ids = np.zeros((4, longest), dtype=np.int64)
    mask = np.zeros((4, longest, longest), dtype=bool)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
        mask[b, : len(p), : len(p)] = _chain(len(p))
        mask[b, len(p) :, len(p) :] = np.eye(longest - len(p), dtype=bool)  # padding sees itself only, never committed
    out = native.step(ids, np.tile(np.arange(longest), (4, 1)), mask, np.zeros(4, dtype=np.int64))
    native.commit(out, np.tile(np.arange(longest), (4, 1)), lengths, np.zeros(4, dtype=np.int64))
    batch_nodes = rng.integers(0, vocab, (4, width), dtype=np.int64)
    batch_nodes[0] = nodes
    positions = lengths[:, None] + depth[None]
    out = native.step(batch_nodes, positions, np.broadcast_to(tree, (4, width, width)).copy(), lengths)
    assert np.array_equal(out.logits()[0], alone_logits)
    assert np.array_equal(native.buffers._views["new_key"][:, :, 0], alone_key)


def test_logits_are_onnxruntimes_to_float_rounding(engine, native):
    """The same model: a 20-token prompt's logits within float rounding of ONNX Runtime's, the same top tokens."""
    ids = np.random.default_rng(2).integers(0, native.meta.vocab_size, (1, 20), dtype=np.int64)
    args = (ids, np.arange(20)[None], _chain(20)[None], np.array([0]))
    ours = native.step(*args)
    ours_logits, ours_top = ours.logits().copy(), ours.topk.copy()
    ort = OnnxBackend(engine, max_batch=1, max_context=256, threads=2).step(*args)
    assert np.abs(ours_logits - ort.logits()).max() < 1e-3 * max(1.0, np.abs(ort.logits()).max())
    assert np.array_equal(ours.argmax, ort.argmax) and np.array_equal(ours_top[..., :3], ort.topk[..., :3])


@pytest.mark.parametrize("context", [1, 37])
def test_int8_channel_verify_steps_are_plain_steps_bit_for_bit(int8_engine, context):
    """int8-channel: each row quantized on its own, integer sums exact, so a tree re-scores plain steps bit for bit."""
    backend = open_native(int8_engine, max_batch=1, max_context=256, threads=2)
    ids = np.random.default_rng(context).integers(0, backend.meta.vocab_size, context, dtype=np.int64)
    path, plain = exactness.plain_steps(backend, ids, 5)
    for name, layout in exactness.layouts(path, backend.meta.vocab_size).items():
        assert exactness.verify_diffs(backend, ids, layout, plain) == [0.0] * len(path), name


@pytest.fixture(scope="module")
def int4_engine(stories_base, stories_fitted, export_engine):
    return export_engine("stories-fitted-int4", medusa_model(stories_base, stories_fitted), quantize="int4")


@pytest.mark.parametrize("context", [1, 37])
def test_int4_verify_steps_are_plain_steps_bit_for_bit(int4_engine, context):
    """int4 (MatMulNBits, block 32, int8 activations a block at a time): a tree re-scores plain steps bit for bit, and
    drafted output equals plain output."""
    backend = open_native(int4_engine, max_batch=1, max_context=256, threads=2)
    assert backend.kernel.bits == 4
    ids = np.random.default_rng(context).integers(0, backend.meta.vocab_size, context, dtype=np.int64)
    path, plain = exactness.plain_steps(backend, ids, 5)
    for name, layout in exactness.layouts(path, backend.meta.vocab_size).items():
        assert exactness.verify_diffs(backend, ids, layout, plain) == [0.0] * len(path), name


def test_int4_drafted_output_equals_its_plain_output(int4_engine, stories_prompts):
    drafted = MedusaRuntime(str(int4_engine), backend="native", max_batch=4).generate(stories_prompts, max_new_tokens=48)
    plain = MedusaRuntime(str(int4_engine), backend="native", drafters=()).generate(stories_prompts, max_new_tokens=48)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert max(r.stats.mean_accepted for r in drafted) > 1


@pytest.mark.parametrize("bits,k,n,block", [(4, 576, 960, 32), (4, 70, 50, 16), (8, 64, 172, 32), (4, 200, 33, 64)])
def test_an_nbits_matmul_is_onnxruntimes_to_float_rounding(tmp_path, bits, k, n, block):
    """MatMulNBits at accuracy level 4 read from its graph and computed by the C kernel: ONNX Runtime's outputs to float
    rounding (both quantize each row a block at a time), K off a whole block and N off a whole group included; each row
    alone the same bit for bit as among others."""
    import onnxruntime as ort

    from tests.helpers import nbits_model

    path = nbits_model(tmp_path / "nbits.onnx", k, n, bits, block, seed=k)
    graph = native_graph.Graph(path)
    linear = native_graph.read_nbits(graph, next(node for node in graph.nodes if node.op_type == "MatMulNBits"))
    assert (linear.bits, linear.block, linear.shape) == (bits, block, (k, n))
    x = (np.random.default_rng(n).standard_normal((1, 11, k)) * 2).astype(np.float32)
    ours = native_step.run_linear(linear, x)
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, np.abs(theirs).max()), np.abs(ours - theirs).max()
    for i in (0, 6, 10):
        assert np.array_equal(native_step.run_linear(linear, x[:, i : i + 1])[0, 0], ours[0, i])


def test_nbits_at_another_accuracy_level_is_refused_by_name(tmp_path):
    from tests.helpers import nbits_model

    path = nbits_model(tmp_path / "nbits.onnx", 64, 32, 4, 32, seed=1, accuracy_level=1)
    graph = native_graph.Graph(path)
    with pytest.raises(native_weights.NativeCannotRun, match="MatMulNBits at accuracy level 1 \\(native computes level 4"):
        native_graph.read_nbits(graph, next(node for node in graph.nodes if node.op_type == "MatMulNBits"))


@pytest.mark.parametrize("shape", [(576, 960), (64, 172), (30, 17)])
def test_an_int8_channel_matmul_is_onnxruntimes_bit_for_bit(shape):
    """One row-quantized int8 matmul (exporter/quantize.py's rows_int8_graph) through the C kernel and through ONNX Runtime:
    the same floats, whatever K and N (padded to the kernel's blocks) and however many rows."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from tests.helpers import row_int8_model

    k, n = shape
    model, reference = row_int8_model(k, n, seed=k)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    linear = native_weights.Linear(init["w_int8"], init["w_int8_scale"], float(init["rowq_tiny"]), float(init["rowq_127"]))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(n)
    for rows in (1, 3, 13):
        x = (rng.standard_normal((1, rows, k)) * rng.uniform(0.01, 10)).astype(np.float32)
        x[0, 0, : k // 3] = 0.0  # a row with zeros, and (rows 1) one all zero below
        if rows > 1:
            x[0, 1] = 0.0
        ours = native_step.run_linear(linear, x)
        assert np.array_equal(ours, session.run(None, {"x": x})[0]), (shape, rows)
        assert np.array_equal(ours, reference(x))


def test_an_fp32_matmul_is_one_chain_a_output():
    """An fp32 weight matmul: the product to float rounding, and each row's outputs the same alone or among others."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 50)).astype(np.float32)
    x = rng.standard_normal((11, 70)).astype(np.float32)
    ours = native_step.run_linear(native_weights.Linear(w), x)
    assert np.abs(ours - x @ w).max() < 1e-4
    assert all(np.array_equal(native_step.run_linear(native_weights.Linear(w), x[i : i + 1])[0], ours[i]) for i in range(11))


def test_a_linear_run_keeps_its_pool_between_calls():
    """native_step.LinearRun: repeated calls on one pool give run_linear's bits, into ``out`` where given; more rows
    than it was sized for, or a call after close, is an EngineError naming the problem."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((70, 50)).astype(np.float32)
    x = rng.standard_normal((5, 70)).astype(np.float32)
    linear = native_weights.Linear(w)
    run = native_step.LinearRun(linear, rows=5, threads=2)
    out = np.zeros((5, 50), dtype=np.float32)
    for rows in (5, 2, 5):
        assert np.array_equal(run(x[:rows]), native_step.run_linear(linear, x[:rows]))
    assert run(x, out) is not None and np.array_equal(out, native_step.run_linear(linear, x))
    with pytest.raises(EngineError, match="6 rows through a linear run sized for 5"):
        run(np.zeros((6, 70), dtype=np.float32))
    run.close()
    with pytest.raises(EngineError, match="closed"):
        run(x)


def test_sums_floor_prints_each_steps_floor_beside_it(engine, tmp_path, capsys):
    """scripts/sums_floor.py: the engine's steps, the kernel's in-cache rate at each row count, and each size's floor
    (every linear's multiply-adds at that rate), in one run; a missing engine is one line, exit 2."""
    from tests.helpers import script

    out = tmp_path / "floor.json"
    argv = ["--engine", str(engine), "--context", "12", "--tokens", "1", "--tokens", "3", "--seconds", "0.05"]
    assert script("sums_floor").main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    weights = native_weights.read_weights(engine, "llama")  # the step graph itself
    linears = [m for g in (weights.qkv, weights.o, weights.gate_up, weights.down) for m in g if m is not None] + [weights.lm_head]
    assert report["macs_per_token"] == sum(m.shape[0] * m.shape[1] for m in linears)
    assert [r["tokens"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert r["step_ms"] > 0 and r["kernel_ms"] > 0
        assert r["floor_ms"] == pytest.approx(report["macs_per_token"] * r["tokens"] / (r["gmac_s"] * 1e9) * 1e3)
    printed = capsys.readouterr().out
    assert "| 3 |" in printed and "multiply-adds a token" in printed
    with pytest.raises(SystemExit) as exc:
        script("sums_floor").main(["--engine", str(tmp_path / "none")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_drafted_output_equals_its_plain_output(engine, stories_prompts):
    """Every drafter, 5 prompts over 3 rows (rows finish and refill): drafted = plain, with drafts accepted."""
    runtime = MedusaRuntime(engine, backend="native", max_batch=3, max_context=256, threads=2)
    assert runtime.backend.name == "native"
    drafted = runtime.generate(stories_prompts[:5], max_new_tokens=32)
    plain = runtime.plain().generate(stories_prompts[:5], max_new_tokens=32)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert max(r.stats.mean_accepted for r in drafted) > 1


def test_heads_on_named_arrays_propose_what_they_give_on_given_hidden_states(native):
    """``propose`` (the heads on the buffers' arrays at the chosen nodes) and ``run_heads`` (the same callable on arrays of
    its own, what medusa-bench times) on the same hidden states: the same top-k and logits."""
    from medusa_trt.runtime.contract import HEAD_LOGITS, HEAD_TOPK

    ids = np.arange(3, 9, dtype=np.int64)[None]  # (1, 6)
    out = native.step(ids, np.arange(6)[None], _chain(6)[None], np.array([0]))
    roots = np.array([int(out.argmax[0, 4])])  # (1,) the token after node 4
    hidden = out.hidden_rows(np.array([0]), np.array([4]))  # (1, H), read before propose (it reads the same buffers)
    proposals = native.propose(out, np.array([4]), 2, roots)
    ids_at_4, logits_at_4 = proposals.ids.copy(), proposals.logits().copy()  # (1, n, 2), (1, n, Vd)
    got = native.run_heads(hidden, roots if native.meta.reads_roots else None)
    assert ids_at_4.shape == (1, native.meta.proposal_rows, 2) and logits_at_4.shape[-1] == native.meta.heads_vocab
    assert np.array_equal(got[HEAD_TOPK][..., :2], ids_at_4) and np.array_equal(got[HEAD_LOGITS], logits_at_4)
    with pytest.raises(EngineError, match="heads return top-"):
        native.propose(out, np.array([4]), native.meta.top_k + 1, roots)


def test_the_lm_head_is_skipped_when_no_logits_are_read(native):
    ids = np.arange(1, 9, dtype=np.int64)[None]
    out = native.step(ids, np.arange(8)[None], _chain(8)[None], np.array([0]), logits=False)
    assert out.argmax.shape == (1, 0)
    with pytest.raises(RuntimeError, match="logits=False"):
        out.logits()
    assert out.hidden_rows(np.array([0]), np.array([7])).shape == (1, native.meta.hidden_size)


def test_pack_lays_out_blocks_of_32_then_16():
    """A (K, N) weight packed: block b of 32 outputs holds rows k = 0..K-1 of its 32 columns; then blocks of 16, the
    last zero-padded."""
    k, n = 3, 64 + 20
    w = np.arange(k * n, dtype=np.float32).reshape(k, n)
    packed = native_step.pack(w)
    assert native_step.BLOCK == 32 and packed.size == 2 * k * 32 + 2 * k * 16
    blocks = packed[: 2 * k * 32].reshape(2, k, 32)
    assert np.array_equal(blocks[0], w[:, :32]) and np.array_equal(blocks[1], w[:, 32:64])
    tail = packed[2 * k * 32 :].reshape(2, k, 16)
    assert np.array_equal(tail[0], w[:, 64:80]) and np.array_equal(tail[1, :, :4], w[:, 80:]) and not tail[1, :, 4:].any()


def test_int8_channel_drafted_output_equals_its_plain_output(int8_engine, stories_prompts):
    runtime = MedusaRuntime(int8_engine, backend="native", max_batch=2, max_context=256, threads=2)
    drafted = runtime.generate(stories_prompts[:3], max_new_tokens=32)
    plain = runtime.plain().generate(stories_prompts[:3], max_new_tokens=32)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert max(r.stats.mean_accepted for r in drafted) > 1


def test_other_graphs_are_refused_by_name(tiny_model_dir, export_engine, stories_base, stories_fitted, monkeypatch):
    """Layer norms (GPT-NeoX's graph, read as if it were a Llama), other quantizers, a model type off native's list
    (Helium, taken off it here): one line each."""
    from medusa_trt.exporter import load_base_model
    from tests.conftest import off_native_list, random_heads

    neox = load_base_model(tiny_model_dir("gpt_neox"))
    path = export_engine("tiny-gpt_neox-random", medusa_model(neox, random_heads(neox)))
    with pytest.raises(EngineError, match=r"backend native cannot run .*: its step graph has .*LayerNormalization"):
        native_weights.read_weights(path, "llama")
    helium = load_base_model(tiny_model_dir("helium"))
    other = export_engine("tiny-helium-random", medusa_model(helium, random_heads(helium)))
    off_native_list(monkeypatch)
    types = ", ".join(native_weights.MODEL_TYPES)
    with pytest.raises(EngineError, match=f"model type 'helium' is not one of {types}; use backend onnxruntime"):
        open_native(other)
    quantized = export_engine("stories-fitted-int8", medusa_model(stories_base, stories_fitted), quantize="int8")
    with pytest.raises(EngineError, match=r"its step graph has .*DynamicQuantizeLinear.* nodes") as info:
        open_native(quantized)
    assert "\n" not in str(info.value)


def test_medusa_run_on_native(engine, export_engine, stories_base, stories_fitted, capsys):
    """``medusa-run --backend native`` decodes what ONNX Runtime decodes here; a graph it cannot run is one line, exit 2."""
    from medusa_trt.cli.run import main

    common = ["--prompt", "Once upon a time", "--max-new-tokens", "12", "--json"]
    decoded = []
    for backend in (["--backend", "native"], []):
        assert main(["--engine", str(engine), *common, *backend]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        decoded.append(record["token_ids"])
    assert decoded[0] == decoded[1] and decoded[0]
    quantized = export_engine("stories-fitted-int8", medusa_model(stories_base, stories_fitted), quantize="int8")  # one scale a call
    assert main(["--engine", str(quantized), *common, "--backend", "native"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend native cannot run" in err[0] and "use backend onnxruntime" in err[0]


def test_engine_step_ab_times_both_backends_against_the_floor(engine, tmp_path, capsys):
    """scripts/engine_step_ab.py ``NAME=PATH@native`` beside ONNX Runtime on the same engine, with the floor."""
    from tests.helpers import script

    out = tmp_path / "ab.json"
    argv = ["--engine", f"ort={engine}", "--engine", f"native={engine}@native", "--context", "20", "--tokens", "1", "--tokens", "4"]
    assert script("engine_step_ab").main([*argv, "--rounds", "2", "--floor", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == {"ort": f"{engine}@onnxruntime", "native": f"{engine}@native"}
    assert set(report["steps"]) == {"1", "4"} and all(set(s["median_ms"]) == {"ort", "native"} for s in report["steps"].values())
    assert report["floor"]["weight_bytes"] > 0 and report["floor"]["ms"] > 0
    assert "one-token step / floor (median): ort " in capsys.readouterr().out


def test_native_build_ab_times_two_builds_in_processes_of_their_own(engine, tmp_path, capsys):
    """scripts/native_build_ab.py: two folders of the package's own libraries, each stepped in its own processes
    (MEDUSA_TRT_NATIVE_DIR), turns alternating: the same bits, a median per build and size; a missing build is one
    line, exit 2."""
    from medusa_trt.runtime import native_library
    from tests.helpers import script

    libraries = sorted(native_library.load().path.parent.glob("_native_*"))  # one a set: the lowest says what the CPU runs
    builds = []
    for name in ("before", "after"):
        folder = tmp_path / name
        folder.mkdir()
        for library in libraries:
            shutil.copy2(library, folder / library.name)
        builds += ["--build", f"{name}={folder}"]
    out = tmp_path / "ab.json"
    argv = ["--engine", str(engine), *builds, "--context", "12", "--tokens", "1", "--tokens", "3", "--rounds", "2", "--seconds", "0.05"]
    assert script("native_build_ab").main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_outputs"] == {"1": True, "3": True}
    assert set(report["median_ms"]) == {"before", "after"} and all(set(v) == {"1", "3"} for v in report["median_ms"].values())
    assert report["isa"] == {"before": [native_library.load().isa], "after": [native_library.load().isa]}
    assert "same logits, hidden, next ids and top-k bit for bit in every turn: yes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        script("native_build_ab").main(["--engine", str(engine), "--build", f"a={tmp_path / 'none'}", *builds[:2]])
    assert exc.value.code == 2 and "build one with scripts/build_native.py" in capsys.readouterr().err


def test_an_engine_folder_exported_for_native(stories_base, stories_fitted, tmp_path):
    """``--backend native``: config.json says native, drafting.json's step cost and exactness were measured on it, and
    MedusaRuntime(DIR) runs it; on another backend the folder's table is not that backend's, which learns its own."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.engine_folder import read_drafting, read_folder_config

    folder = tmp_path / "stories-native"
    export_onnx(
        medusa_model(stories_base, stories_fitted), ExportConfig(out=folder, tree="chain-2", max_batch=2, max_context=128, backend="native")
    )
    assert read_folder_config(folder).backend == "native"
    drafting = read_drafting(folder)
    assert drafting["exactness"]["verify_equals_plain"] is True and drafting["step_cost"]["1"] == 1.0
    runtime = MedusaRuntime(folder, threads=2)
    assert runtime.backend.name == "native" and runtime._folder_step_cost is not None
    assert MedusaRuntime(folder, backend="onnxruntime", threads=2)._folder_step_cost is None


def test_export_refuses_native_with_another_quantizer(tmp_path, capsys):
    from medusa_trt.cli.export import main
    from tests.conftest import STORIES

    out = tmp_path / "engine"
    assert main(["--model", str(STORIES), "--out", str(out), "--backend", "native", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "--backend native runs fp32 step graphs, plain or quantized int8-channel, int4 or int8-block, not --quantize int8:" in err[0]
    )
    assert "--dtype" not in err[0]  # only what is wrong is named
    assert main(["--model", str(STORIES), "--out", str(out), "--backend", "native", "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not --dtype fp16: drop it" in err[0] and "--quantize none" not in err[0], err
    assert main(["--model", str(STORIES), "--out", str(out), "--backend", "native", "--quantize", "int4", "--accuracy-level", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "computes MatMulNBits at accuracy level 4 (int8 activations), not --accuracy-level 1" in err[0]
    assert not out.exists()


def test_without_the_onnx_package_the_fix_is_named(engine, monkeypatch):
    """The lean install (ONNX Runtime only) has no onnx package to read weights with: one line naming the extra."""
    import sys

    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(EngineError, match=r"pip install 'medusa-trt\[native\]'") as info:
        open_native(engine)
    assert "\n" not in str(info.value)


def _isas() -> list[str]:
    import platform

    from medusa_trt.runtime import native_isa

    return [i.name for i in native_isa.for_machine(platform.machine())]


def _at(isa: str) -> str:
    """Skip unless this CPU runs ``isa`` (MEDUSA_TRT_CPU_ISA=isa would fall back to a lower set)."""
    from medusa_trt.runtime import native_library

    loaded = native_library.load(isa).isa
    if loaded != isa:
        pytest.skip(f"this CPU does not run {isa} (capped there, it runs {loaded})")
    return isa


@pytest.mark.parametrize("isa", _isas())
def test_every_instruction_set_is_exact(engine, int8_engine, int4_engine, isa):
    """At every instruction set this CPU runs (as MEDUSA_TRT_CPU_ISA caps it): a chain and a tree re-score plain steps
    bit for bit, fp32, int8-channel and int4, and the library loaded is the one asked for."""
    _at(isa)
    for path, context in ((engine, 45), (int8_engine, 37), (int4_engine, 21)):
        backend = open_native(path, max_batch=1, max_context=128, threads=2, isa=isa)
        assert backend.kernel.isa == isa
        ids = np.random.default_rng(context).integers(0, backend.meta.vocab_size, context, dtype=np.int64)
        path_ids, plain = exactness.plain_steps(backend, ids, 4)
        for name, layout in exactness.layouts(path_ids, backend.meta.vocab_size).items():
            assert exactness.verify_diffs(backend, ids, layout, plain) == [0.0] * len(path_ids), (isa, path.name, name)


@pytest.mark.parametrize("isa", _isas())
def test_every_instruction_set_computes_the_same_matmuls(isa):
    """fp32: each row alone = among others, within float rounding of numpy, for widths off every block size; int8:
    ONNX Runtime's row-quantized matmul bit for bit."""
    from tests.helpers import row_int8_model

    _at(isa)
    rng = np.random.default_rng(4)
    for k, n in ((70, 50), (64, 576 + 20), (9, 7)):
        w = rng.standard_normal((k, n)).astype(np.float32)
        x = rng.standard_normal((13, k)).astype(np.float32)
        ours = native_step.run_linear(native_weights.Linear(w), x, isa=isa)
        assert np.abs(ours - x @ w).max() < 1e-4 * max(1.0, np.abs(x @ w).max()), (isa, k, n)
        for i in (0, 5, 12):
            assert np.array_equal(native_step.run_linear(native_weights.Linear(w), x[i : i + 1], isa=isa)[0], ours[i]), (isa, k, n, i)
    from onnx import numpy_helper

    for k in (64, 73):  # whole vectors of the row quantizer, and a tail
        model, reference = row_int8_model(k, 172, seed=3)
        init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        linear = native_weights.Linear(init["w_int8"], init["w_int8_scale"], float(init["rowq_tiny"]), float(init["rowq_127"]))
        x = (rng.standard_normal((1, 9, k)) * 3).astype(np.float32)
        x[0, 0] = np.resize(np.arange(-127.0, 127.5, 0.5), k)[::-1]  # a scale of 1 and a tie in every other value
        x[0, 0, 0] = 127.0
        x[0, 1, : k // 2] = 0.0  # half a row of zeros, and a row of tiny values
        x[0, 2] *= 1e-30
        assert np.array_equal(native_step.run_linear(linear, x, isa=isa), reference(x)), (isa, k)
    # nbits: integer block sums and one FMA a block, the same bits at every instruction set
    rng = np.random.default_rng(5)
    # block 512: a block's row sum passes int16 (127 x 512), so the zero point's product takes the 32-bit multiply
    for bits, block, k in ((4, 32, 80), (8, 16, 80), (4, 512, 600)):
        n = 45
        weight = rng.integers(0, 1 << bits, (k, n), dtype=np.uint8)
        blocks = -(-k // block)
        scale = rng.random((blocks, n), dtype=np.float32) * 0.1
        zero = rng.integers(0, 1 << bits, (blocks, n), dtype=np.uint8)
        nb = native_weights.Linear.nbits_of(weight, scale, zero, block, bits)
        for rows in (1, 2, 3, 5, 7, 8, 11, 16):  # every tile height and remainder
            x = rng.standard_normal((rows, k)).astype(np.float32)
            x[0] = np.resize(np.arange(-127.0, 127.5, 0.5), k)  # ties in the row quantizer (block scale 1 where 127 is in)
            x[0, :block:2] = 127.0
            x[-1] = 1.0 if rows > 1 else x[-1]  # a row of one value: every block's quantized sum 127 x its width
            assert np.array_equal(native_step.run_linear(nb, x, isa=isa), native_step.run_linear(nb, x, isa="baseline")), (isa, bits, rows)
        # the largest products: every weight at its top value, every activation at +-127 (AVX2's 4-bit pairs stay in int16)
        top = native_weights.Linear.nbits_of(np.full((k, n), (1 << bits) - 1, np.uint8), scale, np.zeros_like(zero), block, bits)
        x = np.where(rng.random((3, k)) < 0.5, -1.0, 1.0).astype(np.float32)
        want = native_step.run_linear(top, x, isa="baseline")
        assert np.array_equal(native_step.run_linear(top, x, isa=isa), want), (isa, bits, "top")


def test_a_cap_that_is_not_a_set_of_this_cpu_is_one_line():
    from medusa_trt.runtime import native_library

    with pytest.raises(native_library.NativeUnavailable, match="MEDUSA_TRT_CPU_ISA=sse9 is not an instruction set") as info:
        native_library.load("sse9")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "writable by others"])
def test_a_damaged_library_is_one_line_exit_2(engine, tmp_path, damage):
    """A library folder (MEDUSA_TRT_NATIVE_DIR) whose best library is cut short, or that others may write: medusa-run
    --backend native says so in one line, exit 2, before mapping it (a truncated file would be a SIGBUS)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from medusa_trt.runtime import native_library

    best = native_library.load().path
    for library in best.parent.glob("_native_*.so"):
        shutil.copyfile(library, tmp_path / (library.name.split(".")[0] + ".so"))
    target = tmp_path / (best.name.split(".")[0] + ".so")
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:20000])
    else:
        target.chmod(0o666)
    run = [sys.executable, "-m", "medusa_trt.cli.run", "--engine", str(engine), "--backend", "native", "--prompt", "Once"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, env=os.environ | {"MEDUSA_TRT_NATIVE_DIR": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert str(Path(target)) in lines[0] and ("truncated" if damage == "truncated" else "writable by other users") in lines[0]


def test_export_refuses_native_for_a_model_type_it_never_runs_before_any_work(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--backend native on a model type off native's list (Helium, taken off it here): one line naming the user's --out,
    before anything is traced, nothing written."""
    from medusa_trt.cli.export import main
    from medusa_trt.exporter import onnx_export
    from tests.conftest import off_native_list

    off_native_list(monkeypatch)
    monkeypatch.setattr(onnx_export, "_export_step", lambda *a, **k: pytest.fail("traced before the refusal"))
    out = tmp_path / "engine"
    assert main(["--model", str(tiny_model_dir("helium")), "--out", str(out), "--backend", "native", "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"backend native cannot run {out}: model type 'helium'" in err[0], err
    assert not out.exists()


def test_export_refuses_native_for_a_graph_it_cannot_run_naming_the_out_folder(tmp_path, capsys, stories_base):
    """A Llama whose MLP has biases (a model type native runs, a graph it does not): one line naming the
    user's --out and the graph's feature, never the staging folder; nothing written."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.cli.export import main

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, mlp_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    model_dir = tmp_path / "llama-o-bias"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    stories_base.tokenizer.save_pretrained(model_dir)
    capsys.readouterr()  # the save's progress bars
    out = tmp_path / "engine"
    assert main(["--model", str(model_dir), "--out", str(out), "--backend", "native", "--no-verify", "--max-context", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"backend native cannot run {out}: layer 0's MLP gate is ['Add'], not SiLU or GELU" in err[0], err
    assert "use --backend onnxruntime" in err[0] and not out.exists()


def test_native_runs_attention_biases(tmp_path, capsys, stories_base):
    """A Llama with q/k/v and o_proj biases (``attention_bias``, nonzero): exported for native, its prefill logits are
    transformers' to float rounding, and a verify step is a plain step bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.cli.export import main

    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    model_dir = tmp_path / "llama-attention-bias"
    model.save_pretrained(model_dir)
    stories_base.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "engine"
    assert main(["--model", str(model_dir), "--out", str(out), "--backend", "native", "--max-context", "64"]) == 0
    capsys.readouterr()
    weights = native_weights.read_weights(out / "model.onnx", "llama")
    assert all(b is not None for b in weights.o_bias) and all(b is not None for b in weights.qkv_bias)
    ids = [5, 17, 301, 42, 9, 120, 77, 3, 250, 64]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    backend = open_native(out / "model.onnx", max_batch=1, max_context=64, threads=2)
    t = len(ids)
    got = backend.step(np.array([ids]), np.arange(t)[None], np.tri(t, dtype=bool)[None], np.array([0])).logits()[0]
    assert np.abs(got - want).max() < 1e-3
    assert exactness.probe(backend).exact
