"""The torch backend on CUDA: greedy identity against transformers generate() on the same GPU.

Marked ``gpu``; skipped cleanly without CUDA. ``make gpu-check`` runs these with a short benchmark.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUSTOM_TREE, STORIES, STORY_PROMPTS, TREES, assert_greedy_identical, fitted_heads, medusa_model

from medusa_trt.exporter import load_base_model
from medusa_trt.runtime import MedusaRuntime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)")]


@pytest.fixture(scope="module")
def cuda_stories():
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    base = load_base_model(STORIES, device="cuda")
    prompts = [base.tokenizer(p)["input_ids"] for p in STORY_PROMPTS]
    train = ["Tim had a red ball", "The sun was hot", "Sara found a box", "A cat sat on the mat", "Ben wanted to fly"]
    heads = fitted_heads(base, [base.tokenizer(p)["input_ids"] for p in train])
    return base, prompts, heads


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63", "custom"])
def test_cuda_stories_identity(cuda_stories, tree, batch):
    if tree == "mc_sim_7b_63" and not TREES.is_file():
        pytest.skip(f"{TREES} missing")
    base, prompts, heads = cuda_stories
    model = medusa_model(base, heads)
    assert model.device.type == "cuda"
    runtime = MedusaRuntime(model, tree=CUSTOM_TREE if tree == "custom" else tree, max_batch=batch, max_context=256)
    assert runtime.backend.cache_key.is_cuda
    results = runtime.generate(prompts[:batch], max_new_tokens=48)
    for prompt, r in zip(prompts[:batch], results):
        assert_greedy_identical(base, prompt, r.token_ids, 48, base.eos_token_ids)
    assert max(a for r in results for a in r.stats.accepted_per_step) >= 2


@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_graphs_are_greedy_identical(cuda_stories, batch):
    """The verify step captured as CUDA graphs (one a (batch, tokens) bucket) and replayed: greedy output is
    transformers' (ties proven as in the eager test), the same as the eager runtime's, and graphs were captured."""
    base, prompts, heads = cuda_stories
    model = medusa_model(base, heads)
    runtime = MedusaRuntime(model, tree=CUSTOM_TREE, max_batch=batch, max_context=256, cuda_graph=True)
    results = runtime.generate(prompts[:batch], max_new_tokens=48)
    for prompt, r in zip(prompts[:batch], results):
        assert_greedy_identical(base, prompt, r.token_ids, 48, base.eos_token_ids)
    assert max(a for r in results for a in r.stats.accepted_per_step) >= 2
    graphs = runtime.backend.graphs
    assert graphs.buckets and all(entry.graph is not None for entry in graphs.buckets.values())


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_cuda_tiny_architectures(tiny_model_dir, kind):
    base = load_base_model(tiny_model_dir(kind), device="cuda")
    prompts = [[1, 5, 9], [1, 300, 301, 302, 303, 304, 305, 306], [1, 42], [1, 7, 7, 7, 7, 100]]
    model = medusa_model(base, fitted_heads(base, prompts, new_tokens=40))
    results = MedusaRuntime(model, tree="chain-4", max_batch=4, max_context=256).generate(prompts, max_new_tokens=32)
    for prompt, r in zip(prompts, results):
        assert_greedy_identical(base, prompt, r.token_ids, 32, base.eos_token_ids)


@pytest.mark.parametrize("rule", ["lossless", "typical"])
def test_cuda_sampling_is_reproducible_whatever_the_batch(cuda_stories, rule):
    base, prompts, heads = cuda_stories
    runtime = MedusaRuntime(medusa_model(base, heads), tree=CUSTOM_TREE, max_batch=4, max_context=256)
    batch = runtime.generate(prompts, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=[1, 2, 3, 4], acceptance=rule)
    alone = runtime.generate(prompts[2], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=3, acceptance=rule)
    assert batch[2].token_ids == alone.token_ids and len(alone.token_ids) == 32


def test_cuda_continuous_batching_matches_solo(cuda_stories):
    from medusa_trt.runtime.batching import ContinuousBatcher, Request

    base, prompts, heads = cuda_stories
    runtime = MedusaRuntime(medusa_model(base, heads), tree=CUSTOM_TREE, max_batch=2, max_context=256)
    lengths = [40, 7, 25, 33]
    batcher = ContinuousBatcher(runtime).start()
    handles = [batcher.submit(Request(p, max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    results = [h.result() for h in handles]
    batcher.close()
    for prompt, n, r in zip(prompts, lengths, results):  # 4 requests over 2 rows: two waited for a free row
        assert_greedy_identical(base, prompt, r.token_ids, n, base.eos_token_ids)
