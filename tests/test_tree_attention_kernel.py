"""The Triton tree-attention kernel against the torch reference, on CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` is set below, before the kernels are first loaded (Triton reads it when the
``@triton.jit`` functions are defined, i.e. when ``triton_kernels`` is imported), and
``test_interpreter_is_active`` proves it took effect. Where CUDA is present the variable is left
alone and the kernel tests skip: the CUDA sweep is ``tests/test_gpu_kernel.py``.

The interpreter is slow, so shapes are small (D=16, two KV heads, three sequences); the sweep
still covers T in {1, 4, 16, 64} x context in {0, 1, 37, 300} x GQA ratio in {1, 3, 4}, ragged
lengths with an empty sequence, random trees and causal masks, layer 2 of a 3-layer cache, the
split-context path (forced and chosen by the heuristic) and fp16. bf16 is left to the GPU tests
(the interpreter computes through numpy, which has no bfloat16).

The layer features (sliding window, logit soft-capping, sinks) have their own sweep over GQA
ratios 1, 2, 4 and MQA, with windows shorter than the trees' depth (tree keys past the window) and
the cache; each feature is shown to change the output, so a kernel that dropped it would fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from medusa_trt.plugins.tree_attention import aot, dispatch, kernel, launch
from medusa_trt.plugins.tree_attention.cases import make_case
from medusa_trt.plugins.tree_attention.errors import (
    TensorRTUnavailableError,
    TreeAttentionInputError,
    TritonUnavailableError,
)
from medusa_trt.plugins.tree_attention.kernel import reference_from_spec, tree_attention_triton
from medusa_trt.runtime.errors import MedusaError

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (pip install 'medusa-trt[kernel]')")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=1e-2)}


@pytest.fixture
def interpreted():
    """Kernel tests need the interpreter (CPU tensors); skip where the kernels were compiled for a GPU."""
    if not kernel.interpreter_active():
        pytest.skip("Triton kernels were loaded without TRITON_INTERPRET=1 (CUDA present): see tests/test_gpu_kernel.py")


def lengths_for(context: int) -> list[int]:
    """Ragged batch: the full context, part of it, and an empty sequence."""
    return [context, context // 3, 0]


def assert_matches(case, *, num_splits=None, tol=None):
    """Kernel vs reference (in fp32 for half-precision cases); the message names the case."""
    got = tree_attention_triton(*case.inputs, **case.attributes, num_splits=num_splits)
    ref_case = case.to(torch.float32)
    want = reference_from_spec(*ref_case.inputs, **case.attributes)
    assert got.dtype == case.query.dtype and got.shape == case.query.shape, case.name
    err = (got.float() - want).abs()
    tol = tol or TOL[case.query.dtype]
    bad = err > tol["atol"] + tol["rtol"] * want.abs()
    where = tuple(int(i) for i in (bad.nonzero()[0] if bad.any() else ()))
    assert not bad.any(), (
        f"kernel != reference for {case.name} num_splits={num_splits}: {int(bad.sum())} of {bad.numel()} elements off, "
        f"max abs err {err.max().item():.3g}, first at [b, hq, t, d] = {where}"
    )


# --------------------------------------------------------------- the sweep


@needs_triton
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("context", [0, 1, 37, 300])
@pytest.mark.parametrize("num_new", [1, 4, 16, 64])
def test_kernel_matches_reference_fp32(interpreted, num_new, context, ratio):
    masks = ["causal"] if num_new == 1 else ["tree", "causal"]  # one node: both masks are [[True]]
    for i, mask in enumerate(masks):
        case = make_case(
            cache_lengths=lengths_for(context),
            num_new=num_new,
            num_q_heads=2 * ratio,
            num_kv_heads=2,
            head_dim=16,
            mask=mask,
            seed=num_new * 1000 + context * 10 + ratio + i,
        )
        assert_matches(case)


@needs_triton
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("context", [37, 300])
@pytest.mark.parametrize("num_new", [1, 16])
def test_kernel_matches_reference_fp16(interpreted, num_new, context, ratio):
    case = make_case(
        cache_lengths=lengths_for(context),
        num_new=num_new,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        seed=7 + num_new + context + ratio,
    )
    assert_matches(case)


@needs_triton
@pytest.mark.parametrize(
    "num_new, context, ratio, num_splits, dtype",
    [
        (1, 300, 4, 2, torch.float32),
        (4, 300, 3, 5, torch.float32),
        (16, 300, 1, 3, torch.float32),
        (4, 37, 4, 3, torch.float32),
        (1, 1, 1, 4, torch.float32),
        (64, 300, 1, 2, torch.float32),
        (16, 300, 3, 4, torch.float16),
    ],
)
def test_split_context_matches_reference(interpreted, num_new, context, ratio, num_splits, dtype):
    """Forced splits: several splits sharing a context, splits left empty (short or empty
    sequences), and the log-sum-exp combine."""
    case = make_case(
        cache_lengths=lengths_for(context),
        num_new=num_new,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        seed=11 + num_splits,
    )
    assert_matches(case, num_splits=num_splits)


@needs_triton
def test_heuristic_splits_long_context(interpreted):
    """A cache of 700 slots with few programs: the heuristic picks the split path by itself."""
    case = make_case(cache_lengths=[690, 250], num_new=4, num_q_heads=3, num_kv_heads=1, head_dim=16, spare_slots=10, seed=3)
    plan = launch.plan_launch(batch=2, num_q_heads=3, num_kv_heads=1, num_new=4, head_dim=16, cache_slots=700)
    assert plan.num_splits > 1
    assert_matches(case)


@needs_triton
@pytest.mark.parametrize("head_dim, ratio", [(24, 3), (64, 1)])
def test_other_head_dims(interpreted, head_dim, ratio):
    """A head_dim that is not a power of two (padded to 32 and masked) and a real one (64)."""
    case = make_case(cache_lengths=[37, 5], num_new=4, num_q_heads=ratio, num_kv_heads=1, head_dim=head_dim, seed=5)
    assert_matches(case)


@needs_triton
def test_layer_zero_and_layer_choice(interpreted):
    """Each layer of the cache gives that layer's answer (layer 0 here; the sweep reads layer 2)."""
    case = make_case(cache_lengths=[37, 12], num_new=4, num_q_heads=4, num_kv_heads=2, head_dim=16, layer=0, seed=9)
    assert_matches(case)
    other = tree_attention_triton(*case.inputs, layer=1, scale=case.scale)
    assert not torch.allclose(other, tree_attention_triton(*case.inputs, layer=0, scale=case.scale))


# --------------------------------------------------------------- layer features: window, soft-capping, sinks

# (Hq, Hkv): GQA ratios 1, 2, 4 and multi-query attention
HEADS = {"ratio1": (2, 2), "ratio2": (4, 2), "ratio4": (8, 2), "mqa": (4, 1)}
# the windows are shorter than the trees (random trees of 16 or 64 nodes reach depth 3 or more,
# chains depth T - 1) and than the cache, so both committed slots and tree keys fall outside them
FEATURES = {
    "window": dict(window=3),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=5, softcap=1.5, sinks=True),
}


def dropped(case):
    """The case's inputs and attributes with each of its features dropped: {feature: (inputs, attributes)}."""
    inputs, attrs = case.inputs, case.attributes
    out = {}
    if case.window:
        out["window"] = (inputs, attrs | dict(window=0))
    if case.softcap:
        out["softcap"] = (inputs, attrs | dict(softcap=0.0))
    if case.sinks is not None:
        out["sinks"] = ((*inputs[:7], None), attrs)
    return out


@needs_triton
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("num_new, context", [(1, 300), (16, 37), (64, 5)])
def test_kernel_features_match_reference(interpreted, features, heads, num_new, context):
    num_q_heads, num_kv_heads = HEADS[heads]
    masks = ["causal"] if num_new == 1 else ["tree", "causal"]
    for i, mask in enumerate(masks):
        case = make_case(
            cache_lengths=lengths_for(context),
            num_new=num_new,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            mask=mask,
            seed=num_new * 100 + context + num_q_heads * 7 + i,
            **FEATURES[features],
        )
        assert_matches(case)


@needs_triton
@pytest.mark.parametrize(
    "num_new, context, heads, num_splits, dtype",
    [
        (4, 300, "ratio4", 3, torch.float32),
        (16, 300, "mqa", 5, torch.float32),
        (1, 37, "ratio1", 2, torch.float32),
        (16, 300, "ratio2", 4, torch.float16),
    ],
)
def test_split_context_with_features(interpreted, num_new, context, heads, num_splits, dtype):
    """Forced splits with every feature: the window's first visible slot moves where the splits
    start, split 0 alone folds the sinks in, and the combine keeps them."""
    num_q_heads, num_kv_heads = HEADS[heads]
    for window in (5, 100):  # far shorter than the cache; longer than some sequences
        case = make_case(
            cache_lengths=lengths_for(context),
            num_new=num_new,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            dtype=dtype,
            seed=window + num_splits,
            window=window,
            softcap=1.5,
            sinks=True,
        )
        assert_matches(case, num_splits=num_splits)


@needs_triton
@pytest.mark.parametrize("features", ["window", "softcap", "sinks"])
def test_dropping_a_feature_fails(interpreted, features):
    """Each feature changes the output on these cases: a kernel that ignored it (the same kernel
    with the feature dropped) is far from the reference, so the sweep above proves something."""
    case = make_case(cache_lengths=[37, 12], num_new=16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=3, **FEATURES[features])
    want = reference_from_spec(*case.inputs, **case.attributes)
    (inputs, attrs) = dropped(case)[features]
    without = tree_attention_triton(*inputs, **attrs)
    assert (without - want).abs().max() > 0.02, f"dropping {features} left {case.name} unchanged: the case does not test it"
    torch.testing.assert_close(tree_attention_triton(*case.inputs, **case.attributes), want, atol=2e-5, rtol=2e-5)


@needs_triton
def test_no_sink_is_minus_infinity(interpreted):
    """The node's "no sinks" (-inf for every head) is plain attention, to rounding."""
    case = make_case(cache_lengths=[37, 12], num_new=16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=4, window=5, softcap=2.0)
    none = torch.full((4,), float("-inf"))
    plain = tree_attention_triton(*case.inputs, **case.attributes)
    torch.testing.assert_close(tree_attention_triton(*case.inputs[:7], none, **case.attributes), plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(reference_from_spec(*case.inputs[:7], none, **case.attributes), plain, atol=2e-5, rtol=2e-5)


def test_reference_window_uses_the_step_positions():
    """The op's reference (positions from cache_lengths + depth) equals the standard form's
    (positions given as position_ids, ``reference.window_bias``) on a tree deeper than the window."""
    from medusa_trt.plugins.tree_attention.reference import key_positions, tree_attention, visibility_bias, window_bias

    case = make_case(cache_lengths=[9, 4], num_new=16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=6, window=4, mask="causal")
    positions = case.cache_lengths[:, None] + torch.arange(16)  # a chain: depth = index
    bias = visibility_bias(case.cache_lengths, case.tree_mask, case.past_key.shape[0], torch.float32)
    bias = window_bias(bias, positions, key_positions(case.cache_lengths, positions, case.past_key.shape[0]), case.window)
    past_k, past_v = (t[:, case.layer].permute(1, 2, 0, 3) for t in (case.past_key, case.past_value))
    want = tree_attention(case.query, case.key, case.value, past_k, past_v, bias, case.scale)
    torch.testing.assert_close(reference_from_spec(*case.inputs, **case.attributes), want, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------- launcher behaviour


@needs_triton
def test_interpreter_is_active():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels compile for the GPU")
    assert kernel.interpreter_active(), "TRITON_INTERPRET=1 did not take effect before the kernels were loaded"


@needs_triton
def test_out_is_written_in_place(interpreted):
    case = make_case(cache_lengths=[37, 0], num_new=4, num_q_heads=2, num_kv_heads=2, head_dim=16, seed=1)
    out = torch.full_like(case.query, float("nan"))
    got = tree_attention_triton(*case.inputs, layer=case.layer, scale=case.scale, out=out)
    assert got is out
    torch.testing.assert_close(out, reference_from_spec(*case.inputs, layer=case.layer, scale=case.scale), atol=2e-5, rtol=2e-5)


@needs_triton
def test_strided_inputs_int_mask_and_lengths(interpreted):
    """Query/key/value as the [B, T, H, D] -> [B, H, T, D] transposed views the model produces,
    an int32 mask and int32 lengths, and a length past the cache's capacity (clamped to S)."""
    case = make_case(cache_lengths=[37, 3], num_new=4, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    q, k, v = (
        t.transpose(1, 2).contiguous().transpose(1, 2) for t in (case.query, case.key, case.value)
    )  # (B, H, T, D) views of (B, T, H, D)
    assert not q.is_contiguous()
    lengths = torch.tensor([case.past_key.shape[0] + 10, 3], dtype=torch.int32)
    got = tree_attention_triton(
        q, k, v, case.past_key, case.past_value, case.tree_mask.to(torch.int32), lengths, layer=case.layer, scale=case.scale
    )
    want = reference_from_spec(q, k, v, case.past_key, case.past_value, case.tree_mask, lengths.long(), layer=case.layer, scale=case.scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_input_errors_are_typed_and_say_what_is_wrong():
    case = make_case(cache_lengths=[5, 2], num_new=4, num_q_heads=4, num_kv_heads=2, head_dim=16)
    q, k, v, pk, pv, mask, lengths, _ = case.inputs
    bad = [
        ((q, k, v, pk, pv, mask, lengths, torch.zeros(2)), dict(layer=2), "sinks must be a float vector of the 4 query heads"),
        ((q, k, v, pk, pv, mask, lengths, torch.zeros(4, dtype=torch.int64)), dict(layer=2), "sinks must be a float vector"),
        ((q, k, v, pk, pv, mask, lengths), dict(layer=2, window=-1), "window and softcap must be >= 0"),
        ((q, k, v[:, :, :3], pk, pv, mask, lengths), dict(layer=2), "value has shape"),
        ((q[:, :3], k, v, pk, pv, mask, lengths), dict(layer=2), "not a multiple"),
        ((q, k, v, pk, pv, mask, lengths), dict(layer=3), "layer 3"),
        ((q.half(), k, v, pk, pv, mask, lengths), dict(layer=2), "share one of"),
        ((q, k, v, pk, pv, mask.float(), lengths), dict(layer=2), "tree_mask must be bool/int"),
        ((q, k, v, pk, pv, mask[:, :2], lengths), dict(layer=2), "tree_mask has shape"),
        ((q, k, v, pk, pv, mask, lengths[:1]), dict(layer=2), "cache_lengths has shape"),
        ((q[0], k, v, pk, pv, mask, lengths), dict(layer=2), "query must have 4 dimensions"),
    ]
    for args, attrs, message in bad:
        with pytest.raises(TreeAttentionInputError, match=message) as info:
            tree_attention_triton(*args, scale=0.25, **attrs)
        assert isinstance(info.value, MedusaError)


def test_missing_triton_raises_typed_error(monkeypatch):
    """Without triton the package imports, the reference runs, and asking for the kernel says what to install."""
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.delitem(sys.modules, "medusa_trt.plugins.tree_attention.triton_kernels", raising=False)
    monkeypatch.delattr(importlib.import_module("medusa_trt.plugins.tree_attention"), "triton_kernels", raising=False)
    kernel.load_kernels.cache_clear()
    try:
        with pytest.raises(TritonUnavailableError, match="pip install"):
            kernel.load_kernels()
        assert not kernel.triton_importable()
        case = make_case(cache_lengths=[3], num_new=2, num_q_heads=2, num_kv_heads=1, head_dim=16)
        with pytest.raises(TritonUnavailableError):
            dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale, impl="triton")
        out = dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale)  # CPU: the reference, no triton needed
        assert torch.equal(out, reference_from_spec(*case.inputs, layer=case.layer, scale=case.scale))
    finally:
        kernel.load_kernels.cache_clear()  # the next caller loads the real module again


# --------------------------------------------------------------- dispatch


def test_attend_uses_reference_on_cpu():
    case = make_case(cache_lengths=[37, 0, 4], num_new=4, num_q_heads=6, num_kv_heads=2, head_dim=16, seed=4)
    assert dispatch.choose_impl(case.query) == "reference"
    got = dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale)
    assert torch.equal(got, reference_from_spec(*case.inputs, layer=case.layer, scale=case.scale))
    with pytest.raises(TreeAttentionInputError, match="impl must be one of"):
        dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale, impl="cuda")


@needs_triton
@pytest.mark.parametrize("features", ["none", "all"])
def test_attend_forced_triton_matches_reference(interpreted, features):
    extra = FEATURES.get(features, {})
    case = make_case(cache_lengths=[37, 0, 4], num_new=4, num_q_heads=6, num_kv_heads=2, head_dim=16, seed=4, **extra)
    got = dispatch.attend(*case.inputs, **case.attributes, impl="triton")
    want = dispatch.attend(*case.inputs, **case.attributes, impl="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------- launch geometry (pure)


def test_plan_block_sizes():
    plan = launch.plan_launch(batch=1, num_q_heads=9, num_kv_heads=3, num_new=1, head_dim=64, cache_slots=256)
    assert (plan.block_m, plan.block_n, plan.block_d, plan.num_splits) == (16, 64, 64, 1)  # 3 rows padded to tl.dot's 16
    plan = launch.plan_launch(batch=1, num_q_heads=9, num_kv_heads=3, num_new=16, head_dim=64, cache_slots=256)
    assert plan.block_m == 64  # 48 rows -> one block of 64
    plan = launch.plan_launch(batch=1, num_q_heads=32, num_kv_heads=4, num_new=64, head_dim=128, cache_slots=256)
    assert (plan.block_m, plan.block_n, plan.block_d) == (64, 32, 128)
    assert launch.plan_launch(batch=1, num_q_heads=4, num_kv_heads=4, num_new=None, head_dim=24, cache_slots=0).block_m == 64
    assert launch.plan_launch(batch=1, num_q_heads=4, num_kv_heads=4, num_new=3, head_dim=24, cache_slots=0).block_d == 32
    with pytest.raises(ValueError):
        launch.plan_launch(batch=1, num_q_heads=9, num_kv_heads=4, num_new=1, head_dim=64, cache_slots=0)


def test_split_heuristic():
    def splits(**kw):
        shape = dict(batch=1, num_q_heads=32, num_kv_heads=4, num_new=1, head_dim=64, num_sms=132) | kw
        return launch.plan_launch(**shape).num_splits

    assert splits(cache_slots=256) == 1  # short context: one pass
    assert splits(cache_slots=4096) == 16  # 4 programs on 132 SMs: split as far as allowed
    assert splits(cache_slots=1024) == 4  # at least 256 slots per split
    assert splits(cache_slots=4096, batch=64, num_new=64) == 1  # plenty of programs already
    assert 1 < splits(cache_slots=4096, batch=4, num_new=16) < 16
    assert splits(cache_slots=4096, num_splits=3) == 3  # forced


def test_launch_grid_ints_and_symbols():
    sympy = pytest.importorskip("sympy")
    plan = launch.plan_launch(batch=2, num_q_heads=9, num_kv_heads=3, num_new=16, head_dim=64, cache_slots=4096, num_sms=132)
    assert launch.launch_grid(plan, batch=2, num_kv_heads=3, rows=48) == (6, 1, plan.num_splits)
    assert launch.combine_grid(plan, batch=2, num_kv_heads=3, rows=200) == (6, 4)
    # symbolic shapes (as TensorRT hands them to aot_impl): the same grid once the symbols are bound
    batch, num_new = sympy.symbols("B T", positive=True, integer=True)
    grid = launch.launch_grid(plan, batch=batch, num_kv_heads=3, rows=num_new * 3, cdiv=lambda a, b: sympy.ceiling(a / b))
    for b, t in [(1, 1), (3, 21), (8, 64)]:
        bound = tuple(int(sympy.sympify(g).subs({batch: b, num_new: t})) for g in grid)
        assert bound == launch.launch_grid(plan, batch=b, num_kv_heads=3, rows=3 * t)


# --------------------------------------------------------------- ahead-of-time (TensorRT) pieces


def test_aot_scalar_arguments_match_the_launcher():
    """The int32 scalars TensorRT passes (from shapes) equal what the Python launcher passes
    (from the dense tensors' strides), ints and symbols alike."""
    sympy = pytest.importorskip("sympy")
    case = make_case(cache_lengths=[5, 2], num_new=4, num_q_heads=6, num_kv_heads=2, head_dim=16)
    q, k, v, pk, pv, mask, _, _ = case.inputs
    from_tensors = [
        4,
        pk.shape[0],
        case.layer,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *pk.stride()[:4],
        *pv.stride()[:4],
        *mask.stride(),
        *q.stride()[:3],
    ]
    assert aot.scalar_arguments(q.shape, k.shape, pk.shape, layer=case.layer) == from_tensors
    dims = sympy.symbols("B T S", positive=True, integer=True)
    batch, num_new, slots = dims
    symbolic = aot.scalar_arguments((batch, 6, num_new, 16), (batch, 2, num_new, 16), (slots, 3, batch, 2, 16), layer=case.layer)
    bind = {batch: 2, num_new: 4, slots: pk.shape[0]}
    assert [int(sympy.sympify(e).subs(bind)) for e in symbolic] == from_tensors


def test_trim_entry_params():
    ptx = (
        ".entry k_1(\n\t.param .u64 k_1_param_0,\n\t.param .u32 k_1_param_1,\n\t.param .u64 k_1_param_2,\n\t.param .u64 k_1_param_3\n)\n"
        "{\n\tld.param.b64 %rd1, [k_1_param_0];\n\tld.param.b32 %r1, [k_1_param_1];\n}\n"
    )
    trimmed = aot.trim_entry_params(ptx, "k_1", 2)
    assert "k_1_param_2" not in trimmed and "k_1_param_3" not in trimmed and "[k_1_param_1]" in trimmed
    with pytest.raises(aot.AotCompileError, match="uses its trailing parameter"):
        aot.trim_entry_params(ptx, "k_1", 0)


_AOT_SCRIPT = """
import json, sys
from triton.backends.compiler import GPUTarget

from medusa_trt.plugins.tree_attention.aot import compile_aot
from medusa_trt.plugins.tree_attention.launch import plan_launch
plan = plan_launch(batch=1, num_q_heads=9, num_kv_heads=3, num_new=None, head_dim=64, cache_slots=0, num_splits=1)
window, softcap = int(sys.argv[3]), float(sys.argv[4])
kernel = compile_aot(float_type=sys.argv[1], mask_type="i1", lengths_type="i64", num_kv_heads=3, groups=3, head_dim=64,
                     scale=0.125, plan=plan, window=window, softcap=softcap, target=GPUTarget("cuda", 90, 32))
open(sys.argv[2], "w").write(kernel.ptx)
print(json.dumps(dict(name=kernel.name, num_params=kernel.num_params, num_warps=kernel.num_warps, shared=kernel.shared_mem)))
"""


@needs_triton
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (6, 2.0)])
def test_aot_compiles_ptx_for_tensorrt(tmp_path, window, softcap):
    """Ahead-of-time compile for sm_90 without a GPU (Triton bundles ptxas), in a process without
    the interpreter: the PTX entry takes exactly TensorRT's arguments (8 input pointers, the int32
    scalars, the output) and assembles; plain layers and windowed, soft-capped ones (sinks are
    always read)."""
    from triton import knobs

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx_file = tmp_path / "tree_attention.ptx"
    run = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT, "bf16", str(ptx_file), str(window), str(softcap)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    info = json.loads(run.stdout.strip().splitlines()[-1])
    num_scalars = len(aot.scalar_arguments((1, 9, 4, 64), (1, 3, 4, 64), (8, 2, 1, 3, 64), layer=0))
    assert info["num_params"] == aot.NUM_INPUT_POINTERS + num_scalars + 1
    ptx = ptx_file.read_text()
    assert info["name"].startswith("tree_attention_kernel_") and f".entry {info['name']}(" in ptx
    assert ptx.count(f"{info['name']}_param_") >= info["num_params"]
    assert f"{info['name']}_param_{info['num_params']}" not in ptx  # Triton's scratch pointers are gone
    assert ".version 8.4" in ptx and info["num_warps"] == 4
    assembled = subprocess.run(
        [knobs.nvidia.ptxas.path, "-arch=sm_90a", str(ptx_file), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert assembled.returncode == 0, assembled.stderr[-3000:]


def test_trt_plugin_without_tensorrt_raises_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)
    monkeypatch.delitem(sys.modules, "medusa_trt.plugins.tree_attention.trt_plugin", raising=False)
    with pytest.raises(TensorRTUnavailableError, match="pip install tensorrt"):
        importlib.import_module("medusa_trt.plugins.tree_attention.trt_plugin")


def test_trt_plugin_registers():
    try:
        import tensorrt as trt
        import tensorrt.plugin
    except (ImportError, OSError):
        pytest.skip("tensorrt not installed")
    from medusa_trt.plugins.tree_attention import spec, trt_plugin

    assert trt_plugin.PLUGIN_ID == "medusa_trt::TreeAttention"
    creator = trt.get_plugin_registry().get_creator(
        spec.TREE_ATTENTION.op_type, str(spec.TREE_ATTENTION.version), spec.TREE_ATTENTION.domain
    )
    assert creator is not None, f"{trt_plugin.PLUGIN_ID} is not in TensorRT's plugin registry"
