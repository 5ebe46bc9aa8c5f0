"""The Triton tree-attention kernel compiled for CUDA against the torch reference.

Marked ``gpu``; skipped cleanly without CUDA or triton. ``make gpu-check`` (scripts/gpu_check.sh)
runs it. The same sweep as the interpreter tests (T x context x GQA ratio, ragged lengths with an
empty sequence, random trees and causal masks, layer 2 of a 3-layer cache) at a real head_dim, in
fp32, fp16 and bf16, plus the split-context path at long contexts, the dispatcher's choice on
CUDA and capture in a CUDA graph (the torch backend may replay steps as graphs).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from medusa_trt.plugins.tree_attention import dispatch, kernel, launch
from medusa_trt.plugins.tree_attention.cases import make_case
from medusa_trt.plugins.tree_attention.kernel import reference_from_spec, tree_attention_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)"),
    # find_spec, not kernel.triton_importable(): loading the kernels at collection would fix the
    # interpreter setting before tests/test_tree_attention_kernel.py can set it
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (pip install 'medusa-trt[kernel]')"),
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=1e-2), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    if kernel.interpreter_active():
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels were loaded for the CPU interpreter, not compiled for CUDA")


def assert_matches(case, *, num_splits=None):
    got = tree_attention_triton(*case.inputs, **case.attributes, num_splits=num_splits)
    ref_case = case.to(torch.float32)
    want = reference_from_spec(*ref_case.inputs, **case.attributes)
    assert got.dtype == case.query.dtype and got.shape == case.query.shape, case.name
    err = (got.float() - want).abs()
    tol = TOL[case.query.dtype]
    bad = err > tol["atol"] + tol["rtol"] * want.abs()
    where = tuple(int(i) for i in (bad.nonzero()[0] if bad.any() else ()))
    assert not bad.any(), (
        f"CUDA kernel != reference for {case.name} num_splits={num_splits}: {int(bad.sum())} of {bad.numel()} elements off, "
        f"max abs err {err.max().item():.3g}, first at [b, hq, t, d] = {where}"
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("context", [0, 1, 37, 300])
@pytest.mark.parametrize("num_new", [1, 4, 16, 64])
def test_cuda_kernel_matches_reference(num_new, context, ratio, dtype):
    for i, mask in enumerate(["causal"] if num_new == 1 else ["tree", "causal"]):
        case = make_case(
            cache_lengths=[context, context // 3, 0],
            num_new=num_new,
            num_q_heads=2 * ratio,
            num_kv_heads=2,
            head_dim=64,
            mask=mask,
            dtype=DTYPES[dtype],
            device="cuda",
            seed=num_new * 1000 + context * 10 + ratio + i,
        )
        assert_matches(case)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_new, num_q_heads, num_kv_heads", [(1, 9, 3), (16, 9, 3), (4, 32, 4), (64, 32, 4)])
def test_cuda_split_context(num_new, num_q_heads, num_kv_heads, dtype):
    """Long contexts: the heuristic's split and a forced one, with ragged lengths."""
    case = make_case(
        cache_lengths=[4000, 1500, 0],
        num_new=num_new,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        dtype=DTYPES[dtype],
        device="cuda",
        seed=num_new,
    )
    plan = launch.plan_launch(
        batch=3,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_new=num_new,
        head_dim=64,
        cache_slots=case.past_key.shape[0],
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert_matches(case)
    assert_matches(case, num_splits=max(2, plan.num_splits // 2))


# (Hq, Hkv): GQA ratios 1, 2, 4 and multi-query attention
FEATURE_HEADS = [(8, 8), (8, 4), (32, 8), (8, 1)]
FEATURES = {
    "window": dict(window=24),
    "softcap": dict(softcap=30.0),
    "sinks": dict(sinks=True),
    "all": dict(window=6, softcap=2.0, sinks=True),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("num_q_heads, num_kv_heads", FEATURE_HEADS)
@pytest.mark.parametrize("num_new, context", [(1, 300), (16, 37), (64, 2000)])
def test_cuda_kernel_features(num_new, context, num_q_heads, num_kv_heads, features, dtype):
    """Sliding window (shorter than the trees and the cache), soft-capping and sinks, single pass
    and split context alike (2000 slots split), every GQA ratio and MQA."""
    for i, mask in enumerate(["causal"] if num_new == 1 else ["tree", "causal"]):
        case = make_case(
            cache_lengths=[context, context // 3, 0],
            num_new=num_new,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=64,
            mask=mask,
            dtype=DTYPES[dtype],
            device="cuda",
            seed=num_new + context + i,
            **FEATURES[features],
        )
        assert_matches(case)
        assert_matches(case, num_splits=3)


def test_cuda_dispatch_uses_the_kernel():
    case = make_case(cache_lengths=[37, 0], num_new=4, num_q_heads=6, num_kv_heads=2, head_dim=64, device="cuda")
    assert dispatch.choose_impl(case.query) == "triton"
    got = dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale)
    want = dispatch.attend(*case.inputs, layer=case.layer, scale=case.scale, impl="reference")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_replay(num_splits):
    """Captured once, replayed on new inputs written in place: no host sync or per-call state."""
    case = make_case(
        cache_lengths=[600, 100], num_new=8, num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float16, device="cuda", seed=1
    )
    out = torch.empty_like(case.query)

    def step():
        tree_attention_triton(*case.inputs, layer=case.layer, scale=case.scale, out=out, num_splits=num_splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fresh = make_case(
        cache_lengths=[300, 600], num_new=8, num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float16, device="cuda", seed=2
    )
    for mine, new in zip(case.inputs, fresh.inputs):
        if mine is not None:  # sinks: None in these cases
            mine.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = reference_from_spec(*fresh.to(torch.float32).inputs, layer=case.layer, scale=case.scale)
    torch.testing.assert_close(out.float(), want, **TOL[torch.float16])
