"""The Medusa heads on the native step's threads (``native_step.NativeHeads``, ``medusa_native_heads`` in C): heads of
the pattern it computes (one residual SiLU block a head, fused into one linear, a shared projection to the draft
vocabulary; fp32, int8 rows or int4 blocks; reading hidden, or hidden and the next token) give ONNX Runtime's heads graph's top-k
ids and its logits to float rounding; drafted output stays the plain output; heads of another pattern run on ONNX
Runtime beside the native step, said at info level."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STORY_PROMPTS, medusa_model

from medusa_trt.exporter import HeadsConfig, init_heads
from medusa_trt.runtime import MedusaRuntime, native_step, native_weights
from medusa_trt.runtime.backends.native_backend import open_native
from medusa_trt.runtime.backends.onnx_backend import OrtHeads, heads_session_options, open_heads
from medusa_trt.runtime.contract import HEAD_CONFIDENCE, HEAD_LOGITS, HEAD_TOPK, HIDDEN, NEXT_INPUT
from medusa_trt.runtime.native_graph import Linear

KINDS = {  # name: (head_input, quantize)
    "hidden-int8": ("hidden", "heads-int8"),
    "next-int8": ("hidden+next", "heads-int8"),
    "next-fp32": ("hidden+next", None),
    "next-int4": ("hidden+next", "int4"),  # MatMulNBits blocks, the step's too
    "next-int8-channel": ("hidden+next", "int8-channel"),  # int8 rows, the step's too: the heads project with its lm_head
}


@pytest.fixture(scope="module", params=list(KINDS))
def shared_engine(request, stories_base, export_engine):
    head_input, quantize = KINDS[request.param]
    cfg = stories_base.model.config
    config = HeadsConfig(num_heads=4, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, shared_lm_head=True,
                         head_input=head_input)  # fmt: skip
    embed = stories_base.model.get_input_embeddings() if head_input != "hidden" else None
    heads = init_heads(config, stories_base.model.lm_head, seed=3, random=True, embed=embed)
    overrides = {"draft_vocab": 256} | ({"quantize": quantize} if quantize else {})
    return export_engine(f"stories-shared-{request.param}", medusa_model(stories_base, heads), **overrides)


@pytest.mark.parametrize("batch", [1, 3])
def test_native_heads_give_onnxruntimes_proposals(shared_engine, batch):
    backend = open_native(shared_engine, max_batch=4, max_context=128, threads=2)
    assert isinstance(backend.heads, native_step.NativeHeads)
    rng = np.random.default_rng(batch)
    hidden = (3 * rng.standard_normal((batch, backend.meta.hidden_size))).astype(np.float32)
    roots = rng.integers(0, backend.meta.vocab_size, batch) if backend.meta.reads_roots else None
    got = backend.run_heads(hidden, roots)
    ort = OrtHeads(open_heads(backend.files, backend.meta, heads_session_options(2), ["CPUExecutionProvider"]))
    confidence = got.pop(HEAD_CONFIDENCE)
    want = {k: np.empty_like(v) for k, v in got.items()}
    ort({HIDDEN: hidden, **want} | ({NEXT_INPUT: roots} if roots is not None else {}))
    np.testing.assert_allclose(got[HEAD_LOGITS], want[HEAD_LOGITS], rtol=1e-4, atol=1e-4)
    assert np.array_equal(got[HEAD_TOPK], want[HEAD_TOPK])
    np.testing.assert_allclose(confidence, _softmax_at(got[HEAD_LOGITS], got[HEAD_TOPK]), rtol=2e-6)


def _softmax_at(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each of ids' (..., K) softmax probability over logits (..., V), in float64."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return np.take_along_axis(z, ids, axis=-1) / z.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("isa", ["avx512_vnni", "avx512", "avx2_vnni", "avx2", "baseline", "neon"])
def test_native_heads_confidence_at_every_instruction_set(shared_engine, isa):
    """HEAD_CONFIDENCE (each top-k id's softmax probability, computed in C while the logits are in cache, a vector
    exp at every set) is the float64 softmax's to 2e-6 at every instruction set this CPU runs, for logits spread over
    the whole exp range, and HEAD_LOGITS and HEAD_TOPK stay the set's own."""
    from medusa_trt.runtime import native_library

    if native_library.unavailable(isa) or native_library.load(isa).isa != isa:
        pytest.skip(f"this CPU does not run {isa}")
    backend = open_native(shared_engine, max_batch=4, max_context=64, threads=2, isa=isa)
    assert backend.heads.confidence
    rng = np.random.default_rng(5)
    for scale in (0.1, 3.0, 60.0):  # peaked softmaxes too: logits 100+ apart, past e^-87
        hidden = (scale * rng.standard_normal((3, backend.meta.hidden_size))).astype(np.float32)
        roots = rng.integers(0, backend.meta.vocab_size, 3) if backend.meta.reads_roots else None
        got = backend.run_heads(hidden, roots)
        np.testing.assert_allclose(got[HEAD_CONFIDENCE], _softmax_at(got[HEAD_LOGITS], got[HEAD_TOPK]), rtol=2e-6, atol=1e-30)


def test_drafting_with_native_heads_is_plain_decoding(shared_engine, stories_prompts):
    runtime = MedusaRuntime(shared_engine, backend="native", max_batch=2, max_context=128, threads=2)
    assert isinstance(runtime.backend.heads, native_step.NativeHeads)
    drafted = runtime.generate(stories_prompts[:3], max_new_tokens=24)
    plain = runtime.plain().generate(stories_prompts[:3], max_new_tokens=24)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


def test_heads_with_a_projection_each_run_on_onnxruntime(stories_base, stories_fitted, export_engine, caplog):
    """stories_fitted's heads project with one matrix each (not the pattern): ONNX Runtime's heads, said why."""
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with test_runtime
    with caplog.at_level("INFO", logger="medusa_trt.runtime.backends.native_backend"):
        backend = open_native(engine, max_batch=1, max_context=128, threads=2)
    assert isinstance(backend.heads, OrtHeads)
    assert "heads on onnxruntime: native cannot run" in caplog.text


def test_bad_root_ids_are_one_line(shared_engine):
    backend = open_native(shared_engine, max_batch=1, max_context=128, threads=2)
    if not backend.meta.reads_roots:
        pytest.skip("these heads do not read the next token")
    hidden = np.zeros((1, backend.meta.hidden_size), dtype=np.float32)
    with pytest.raises(Exception, match="outside the vocabulary"):
        backend.run_heads(hidden, np.array([backend.meta.vocab_size]))


def test_read_heads_names_what_it_refuses(stories_base, stories_fitted, export_engine):
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    with pytest.raises(native_weights.NativeCannotRun, match="stack is read by Gather, Gather, Gather, Gather"):  # a projection each
        native_weights.read_heads(engine.with_name(engine.stem + ".heads.onnx"))


def test_heads_in_loop_ab_times_both_heads_after_a_step(shared_engine, tmp_path, capsys):
    """scripts/heads_in_loop_ab.py: a step alone, then followed by the native heads (also not read ahead) and by ONNX
    Runtime's, with the busy machine flag of engine_step_ab beside it (--busy 1 starts and stops one spinning
    process)."""
    import json

    from tests.helpers import script

    out = tmp_path / "heads.json"
    argv = ["--engine", str(shared_engine), "--context", "20", "--tokens", "4", "--rounds", "1", "--out", str(out)]
    ab = script("heads_in_loop_ab")
    assert ab.main(argv) == 0
    report = json.loads(out.read_text())
    native = open_native(shared_engine, max_batch=1, max_context=64, threads=2).heads
    heads = {"step + native heads", "step + onnxruntime heads"} | ({ab.OWN_COPY} if native.shares_lm_head else set())
    heads |= {ab.NO_READ_AHEAD} if native.reads_ahead else set()  # and the same heads, not read ahead
    assert set(report["median_ms"]) == {"step alone"} | heads and set(report["heads_ms"]) == heads
    assert set(report["heads_call_ms"]) == set(report["heads_ms"]) and min(report["heads_call_ms"].values()) > 0
    assert "| step + native heads |" in capsys.readouterr().out
    busy = ["--engine", f"native={shared_engine}@native", "--engine", f"ort={shared_engine}", "--context", "20", "--tokens", "1"]
    assert script("engine_step_ab").main([*busy, "--rounds", "1", "--busy", "1", "--out", str(tmp_path / "busy.json")]) == 0
    assert json.loads((tmp_path / "busy.json").read_text())["busy"] == 1
    assert "beside 1 busy process" in capsys.readouterr().out


def test_native_heads_on_more_rows_than_the_batch_take_turns(shared_engine):
    """The heads on every node of a tree (what medusa-bench's heads cost times) on a backend sized for one row: turns of
    one row each, ONNX Runtime's heads graph's logits on all rows at once to float rounding, and each row's proposals
    what it gets alone."""
    from medusa_trt.bench.heads_cost import heads_cost

    runtime = MedusaRuntime(shared_engine, backend="native", max_batch=1, max_context=256, threads=2)
    backend = runtime.backend
    assert isinstance(backend.heads, native_step.NativeHeads) and backend.max_batch == 1
    rng = np.random.default_rng(7)
    hidden = (3 * rng.standard_normal((7, backend.meta.hidden_size))).astype(np.float32)
    roots = rng.integers(0, backend.meta.vocab_size, 7) if backend.meta.reads_roots else None
    got = backend.run_heads(hidden, roots)
    ort = OrtHeads(open_heads(backend.files, backend.meta, heads_session_options(2), ["CPUExecutionProvider"]))
    want = {k: np.empty_like(v) for k, v in got.items() if k != HEAD_CONFIDENCE}
    ort({HIDDEN: hidden, **want} | ({NEXT_INPUT: roots} if roots is not None else {}))
    np.testing.assert_allclose(got[HEAD_LOGITS], want[HEAD_LOGITS], rtol=1e-4, atol=1e-4)
    for row in (0, 3, 6):
        alone = backend.run_heads(hidden[row : row + 1], None if roots is None else roots[row : row + 1])
        assert np.array_equal(alone[HEAD_TOPK][0], got[HEAD_TOPK][row]) and np.array_equal(alone[HEAD_LOGITS][0], got[HEAD_LOGITS][row])
        assert np.array_equal(alone[HEAD_CONFIDENCE][0], got[HEAD_CONFIDENCE][row])
    cost = heads_cost(runtime)
    assert cost["tree_nodes"] == runtime.tree.num_nodes > 1 and cost["heads_all_nodes_ms"] > 0


def test_int8_channel_heads_project_with_the_steps_lm_head_rows(shared_engine):
    """An int8-channel engine's heads project with the base lm_head's draft-vocabulary rows, quantized as the step's
    are: the heads read the step's packed rows (no copy, and in cache after a step, whose lm_head reads its first
    outputs last), with the proposals and logits of their own copy bit for bit. Other engines keep their own."""
    backend = open_native(shared_engine, max_batch=4, max_context=128, threads=2)
    kernel = backend.kernel
    assert backend.heads.shares_lm_head == (kernel.int8 and not kernel.bits)
    if not backend.heads.shares_lm_head:
        return
    weights = native_weights.read_heads(backend.files.heads)
    meta = backend.meta
    own = native_step.NativeHeads.of(weights, kernel, meta, 4, share_lm_head=False)
    assert not own.shares_lm_head
    rng = np.random.default_rng(11)
    hidden = (3 * rng.standard_normal((3, meta.hidden_size))).astype(np.float32)
    roots = rng.integers(0, meta.vocab_size, 3)
    shared = backend.run_heads(hidden, roots)
    backend.heads = own
    mine = backend.run_heads(hidden, roots)
    assert np.array_equal(shared[HEAD_TOPK], mine[HEAD_TOPK]) and np.array_equal(shared[HEAD_LOGITS], mine[HEAD_LOGITS])
    lm = weights.lm  # a linear other than the lm_head's first rows is not shared
    assert kernel.lm_prefix(Linear(lm.weight[:, ::-1].copy(), lm.scale[::-1].copy(), lm.tiny, lm.divisor), []) is None
    assert kernel.lm_prefix(Linear(lm.weight, lm.scale, lm.tiny, lm.divisor + 1), []) is None
    assert kernel.lm_prefix(lm.outputs(slice(0, 31)), []) is None
    assert kernel.lm_prefix(lm.outputs(slice(0, 32)), []) is not None


def test_a_read_ahead_changes_no_number_and_outlives_its_callers(shared_engine):
    """``NativeStep.read_ahead``: after each step that follows a heads call, the pool's workers load the heads' fused
    weights while the caller is away, and the next call takes them back. Every step and heads call, each with a
    read-ahead in flight, gives the numbers of a backend that reads nothing ahead, bit for bit. A region is held by the
    step object (its caller may drop it), and the step object may be dropped while its workers read ahead."""
    import gc

    native = open_native(shared_engine, max_batch=4, max_context=256, threads=2)
    assert isinstance(native.heads, native_step.NativeHeads) and native.heads.reads_ahead
    plain = open_native(shared_engine, max_batch=4, max_context=256, threads=2)
    assert plain.kernel.read_ahead(None) is False  # nothing read ahead
    ids = np.arange(3, 9, dtype=np.int64)[None]  # (1, 6)
    step = (ids, np.arange(6)[None], np.tri(6, dtype=bool)[None], np.array([0]))
    roots = np.array([5])
    want = plain.step(*step)
    want_logits, want_props = want.logits().copy(), plain.propose(want, np.array([5]), 2, roots)
    want_ids, want_head_logits = want_props.ids.copy(), want_props.logits().copy()
    for _ in range(20):  # from the second on, each step posts a read-ahead, and each heads call takes the workers back
        got = native.step(*step)
        assert np.array_equal(got.logits(), want_logits)
        props = native.propose(got, np.array([5]), 2, roots)
        assert np.array_equal(props.ids, want_ids) and np.array_equal(props.logits(), want_head_logits)
    one = open_native(shared_engine, max_batch=1, max_context=64, threads=1)
    assert one.heads.reads_ahead is False  # one thread: no worker to read ahead
    kernel = plain.kernel
    assert kernel.read_ahead(np.zeros((8 << 20) + 1, dtype=np.uint8)) is False  # past what a read-ahead takes
    region = np.arange(3 << 20, dtype=np.uint8) % 251  # the caller's only reference goes: the step holds it
    assert kernel.read_ahead(region) is True
    del region
    gc.collect()
    for _ in range(5):
        got = plain.step(*step)
        plain.run_heads(got.hidden_rows(np.array([0]), np.array([5])), roots if plain.meta.reads_roots else None)
    assert np.array_equal(plain.step(*step).logits(), want_logits)  # a read-ahead of the region is now in flight
    del native, plain, kernel, got, want, props
    gc.collect()  # the step object goes while its workers may still read ahead: they stop before the region is freed


def test_host_phases_times_the_loops_phases_and_puts_them_back(shared_engine, tmp_path, capsys):
    """scripts/host_phases.py: greedy generation with the loop's phases timed, the heads call among them and no
    confidence computed in the loop on native heads (they compute it); the loop's methods are its own again after."""
    import json

    from medusa_trt.runtime import scheduler
    from tests.helpers import script

    before = {name: getattr(scheduler.Scheduler, name) for name in ("_draft", "_observe")}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in STORY_PROMPTS[:2]))
    out = tmp_path / "phases.json"
    argv = ["--engine", str(shared_engine), "--backend", "native", "--prompts", str(prompts), "--every", "1", "--limit", "2"]
    argv += ["--max-new-tokens", "12"]
    assert script("host_phases").main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ms = report["ms_a_step"]
    assert report["steps"] > 2 and ms["backend.step"] > 0 and ms["backend.propose (the heads call)"] > 0
    assert "head_confidence (in the loop)" not in ms and report["host_ms_a_step"] > 0 and report["backend"] == "native"
    assert "| _observe |" in capsys.readouterr().out
    assert {name: getattr(scheduler.Scheduler, name) for name in before} == before
