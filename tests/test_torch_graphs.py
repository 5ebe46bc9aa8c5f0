"""The torch backend's static steps (``StepGraphs``): what a CUDA graph of the verify step replays, run eagerly on the
CPU. Batch and tokens padded up to their buckets, the whole cache bound, the padding inert: greedy drafting gives the
tokens eager drafting gives, at batch 1 and at a batch whose bucket is capped by max_batch. The capture itself needs
CUDA (tests/test_gpu.py::test_cuda_graphs_are_greedy_identical)."""

from __future__ import annotations

import pytest
from conftest import CUSTOM_TREE, medusa_model

from medusa_trt.runtime import EngineError, MedusaRuntime
from medusa_trt.runtime.backends.torch_backend import StepGraphs, bucket


def test_buckets_are_powers_of_two_capped_by_the_rows_there_are():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert [bucket(n, 3) for n in (1, 2, 3)] == [1, 2, 3]  # a batch of 3 with 3 cache rows: no fourth row to pad into
    assert bucket(5, 6) == 6 and bucket(4, 6) == 4


@pytest.mark.parametrize("batch", [1, 3])
def test_static_steps_decode_what_eager_steps_decode(stories_base, stories_fitted, stories_prompts, batch):
    model = medusa_model(stories_base, stories_fitted)
    eager = MedusaRuntime(model, tree=CUSTOM_TREE, max_batch=batch, max_context=256)
    want = [r.token_ids for r in eager.generate(stories_prompts[:batch], max_new_tokens=40)]
    static = MedusaRuntime(model, tree=CUSTOM_TREE, max_batch=batch, max_context=256)
    static.backend.graphs = graphs = StepGraphs(static.backend, capture=False)
    results = static.generate(stories_prompts[:batch], max_new_tokens=40)
    assert [r.token_ids for r in results] == want
    assert max(a for r in results for a in r.stats.accepted_per_step) >= 2  # drafts were taken: trees of several sizes
    assert len({tokens for _, tokens in graphs.buckets}) >= 2 and all(b <= batch for b, _ in graphs.buckets)


def test_cuda_graphs_of_a_model_on_the_cpu_are_one_line(stories_base, stories_fitted):
    model = medusa_model(stories_base, stories_fitted)
    with pytest.raises(EngineError, match="cuda_graph=True captures CUDA graphs: the model is on cpu") as info:
        MedusaRuntime(model, max_batch=1, max_context=64, cuda_graph=True)
    assert "\n" not in str(info.value)
