"""Greedy Medusa output is token-identical to transformers greedy generate() of the base model,
whatever the heads propose: tree x batch x model, torch backend."""

from __future__ import annotations

import pytest

from conftest import CUSTOM_TREE, TREES, assert_greedy_identical, fitted_heads, medusa_model, random_heads
from medusa_trt.exporter import load_base_model
from medusa_trt.runtime import MedusaRuntime

TREES_UNDER_TEST = {"chain-1": "chain-1", "chain-4": "chain-4", "mc_sim_7b_63": "mc_sim_7b_63", "custom": CUSTOM_TREE}


def _tree(name):
    if name == "mc_sim_7b_63" and not TREES.is_file():
        pytest.skip(f"{TREES} missing")
    return TREES_UNDER_TEST[name]


def _check(base, model, prompts, tree, batch, max_new_tokens):
    runtime = MedusaRuntime(model, tree=tree, max_batch=batch, max_context=256)
    chosen = prompts[:batch]
    results = runtime.generate(chosen, max_new_tokens=max_new_tokens)
    for prompt, result in zip(chosen, results):
        assert len(result.token_ids) == max_new_tokens or result.finish_reason == "stop"
        assert_greedy_identical(base, prompt, result.token_ids, max_new_tokens, base.eos_token_ids)
    return results


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", list(TREES_UNDER_TEST))
@pytest.mark.parametrize("heads", ["random", "fitted"])
def test_stories260k(stories_base, stories_prompts, stories_fitted, heads, tree, batch):
    chosen = random_heads(stories_base) if heads == "random" else stories_fitted
    results = _check(stories_base, medusa_model(stories_base, chosen), stories_prompts, _tree(tree), batch, 48)
    if heads == "fitted" and tree != "chain-1":
        # the fitted heads must really exercise acceptance, with lengths that vary per step
        accepted = [a for r in results for a in r.stats.accepted_per_step]
        assert max(accepted) >= 3 and min(accepted) == 1, accepted


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", list(TREES_UNDER_TEST))
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_random_architectures(tiny_model_dir, stories_base, kind, tree, batch):
    base = load_base_model(tiny_model_dir(kind))
    assert base.model.config.model_type == kind
    prompts = [[1, 5, 9], [1, 300, 301, 302, 303, 304, 305, 306], [1, 42], [1, 7, 7, 7, 7, 100]]
    fitted = fitted_heads(base, prompts, new_tokens=40) if tree == "mc_sim_7b_63" else random_heads(base, seed=3)
    _check(base, medusa_model(base, fitted), prompts, _tree(tree), batch, 32)


def test_prompt_lengths_really_differ_in_batch(stories_prompts):
    assert len({len(p) for p in stories_prompts}) == len(stories_prompts)


@pytest.mark.slow
@pytest.mark.parametrize("tree,batch", [("mc_sim_7b_63", 4), ("chain-4", 1), ("custom", 4)])
def test_smollm2(smollm2_base, tree, batch):
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is in one sentence.",
        "List three fruits.",
    ]
    ids = [smollm2_base.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True) for p in prompts]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    model = medusa_model(smollm2_base, random_heads(smollm2_base, shared=True))
    _check(smollm2_base, model, ids, _tree(tree), batch, 64)
