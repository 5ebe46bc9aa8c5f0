"""Greedy Medusa output is token-identical to transformers greedy generate() of the base model,
whatever the heads propose: backend x tree x batch x model."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CUSTOM_TREE, TREES, assert_greedy_identical, fitted_heads, medusa_model, random_heads

from medusa_trt.exporter import load_base_model
from medusa_trt.exporter.heads import load_heads
from medusa_trt.runtime import MedusaRuntime

TREES_UNDER_TEST = {"chain-1": "chain-1", "chain-4": "chain-4", "mc_sim_7b_63": "mc_sim_7b_63", "custom": CUSTOM_TREE}


def _tree(name):
    if name == "mc_sim_7b_63" and not TREES.is_file():
        pytest.skip(f"{TREES} missing")
    return TREES_UNDER_TEST[name]


BACKENDS = ["torch", "onnxruntime", "native"]  # native: the exported engine's step run by runtime/native_step.c


def _engine(backend, export_engine, key, model):
    return model if backend == "torch" else export_engine(key, model)


def _options(backend) -> dict:
    """MedusaRuntime keywords of a backend under test (the ONNX engines run on onnxruntime unless told)."""
    return {"backend": "native"} if backend == "native" else {}


def _check(base, engine, prompts, tree, batch, max_new_tokens, backend=None):
    runtime = MedusaRuntime(engine, tree=tree, max_batch=batch, max_context=256, **_options(backend))
    chosen = prompts[:batch]
    results = runtime.generate(chosen, max_new_tokens=max_new_tokens)
    for prompt, result in zip(chosen, results):
        assert len(result.token_ids) == max_new_tokens or result.finish_reason == "stop"
        assert_greedy_identical(base, prompt, result.token_ids, max_new_tokens, base.eos_token_ids)
    return results


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", list(TREES_UNDER_TEST))
@pytest.mark.parametrize(
    "backend,heads",  # native: fitted heads (long accepted paths); its random-heads rejections are the others' too
    [(b, h) for b in BACKENDS for h in ("random", "fitted") if (b, h) != ("native", "random")],
)
def test_stories260k(stories_base, stories_prompts, stories_fitted, export_engine, backend, heads, tree, batch):
    chosen = random_heads(stories_base) if heads == "random" else stories_fitted
    engine = _engine(backend, export_engine, f"stories-{heads}", medusa_model(stories_base, chosen))
    results = _check(stories_base, engine, stories_prompts, _tree(tree), batch, 48, backend)
    if heads == "fitted" and tree != "chain-1":
        # the fitted heads must really exercise acceptance, with lengths that vary per step
        accepted = [a for r in results for a in r.stats.accepted_per_step]
        assert max(accepted) >= 3 and min(accepted) == 1, accepted


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63", "custom"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_next_token_aware_heads(stories_base, stories_prompts, stories_next_aware, export_engine, backend, tree, batch):
    """Heads that read the next token (format version 2): identical tokens, and drafts that land."""
    engine = _engine(backend, export_engine, "stories-next-aware", medusa_model(stories_base, stories_next_aware))
    results = _check(stories_base, engine, stories_prompts, _tree(tree), batch, 48, backend)
    accepted = [a for r in results for a in r.stats.accepted_per_step]
    assert max(accepted) >= 3, accepted


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63", "custom"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequential_heads(stories_base, stories_prompts, stories_sequential, export_engine, backend, tree, batch):
    """Heads that read the drafted path (format version 3), expanded in one heads call: identical
    tokens, and drafts that land. The engine expands its export template (mc_sim_7b_63); the
    runtime trees are subtrees of it."""
    engine = _engine(backend, export_engine, "stories-sequential", medusa_model(stories_base, stories_sequential))
    results = _check(stories_base, engine, stories_prompts, _tree(tree), batch, 48, backend)
    accepted = [a for r in results for a in r.stats.accepted_per_step]
    assert max(accepted) >= 3, accepted


NATIVE_TINY = {"qwen2": None, "llama": None, "mistral": None}  # native: every tree and batch (None), or these


@pytest.mark.parametrize(
    "backend,kind,tree,batch",
    [
        (b, k, t, n)
        for b in BACKENDS
        for k in ("llama", "mistral", "qwen2")
        for t in TREES_UNDER_TEST
        for n in (1, 4)
        if b != "native" or (t, n) in (NATIVE_TINY[k] or [(t2, n2) for t2 in ("mc_sim_7b_63", "custom") for n2 in (1, 4)])
    ],
)
def test_tiny_random_architectures(tiny_base, export_engine, backend, kind, tree, batch):
    base, heads = tiny_base(kind)
    assert base.model.config.model_type == kind
    engine = _engine(backend, export_engine, f"tiny-{kind}", medusa_model(base, heads))
    _check(base, engine, TINY_PROMPTS, _tree(tree), batch, 32, backend)


TINY_PROMPTS = [[1, 5, 9], [1, 300, 301, 302, 303, 304, 305, 306], [1, 42], [1, 7, 7, 7, 7, 100]]


@pytest.fixture(scope="module")
def tiny_base(tiny_model_dir):
    """Each tiny model loaded once, with heads fitted to its own greedy output."""
    made = {}

    def get(kind):
        if kind not in made:
            base = load_base_model(tiny_model_dir(kind))
            made[kind] = base, fitted_heads(base, TINY_PROMPTS, new_tokens=40)
        return made[kind]

    return get


def test_prompt_lengths_really_differ_in_batch(stories_prompts):
    assert len({len(p) for p in stories_prompts}) == len(stories_prompts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,tree,batch",
    [
        ("torch", "mc_sim_7b_63", 4),
        ("torch", "chain-4", 1),
        ("onnxruntime", "mc_sim_7b_63", 4),
        ("onnxruntime", "custom", 1),
        ("native", "mc_sim_7b_63", 4),
    ],
)
def test_smollm2(smollm2_base, smollm2_heads, export_engine, backend, tree, batch):
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is in one sentence.",
        "List three fruits.",
    ]
    ids = [
        smollm2_base.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in prompts
    ]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    engine = _engine(backend, export_engine, "smollm2", medusa_model(smollm2_base, smollm2_heads))
    _check(smollm2_base, engine, ids, _tree(tree), batch, 64, backend)


SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-medusa"


@pytest.fixture(scope="module")
def smollm2_heads(smollm2_base):
    """The shipped SmolLM2 heads (what `make demo` exports): they accept often, so every backend is
    checked on long accepted paths, not only on rejections."""
    cfg = smollm2_base.model.config
    heads = load_heads(
        SHIPPED_HEADS,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        lm_head=smollm2_base.model.lm_head,
        num_decoder_layers=cfg.num_hidden_layers,
        embed=smollm2_base.model.get_input_embeddings(),
    )
    return heads.eval().requires_grad_(False)


DRAFTER_SETS = {"all": None, "heads": ("heads",), "lookup": ("lookup",), "recycle": ("recycle",), "none": ()}
REPEATS = [  # prompts whose n-grams recur, so lookup fires; the model continues them its own way, so some drafts are wrong
    "Tom had a red ball. Tom had a red ball. Tom had a",
    "One, two, three. One, two, three. One, two,",
    "The dog ran to the park. The cat ran to the",
    "Lily said hello. Ben said hello. Mom said",
]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drafters", list(DRAFTER_SETS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_drafter_set_is_greedy_identical(stories_base, stories_fitted, export_engine, backend, drafters, batch):
    """Heads, retrieval and recycled drafts, alone, together or none: the same tokens as transformers."""
    engine = _engine(backend, export_engine, "stories-fitted", medusa_model(stories_base, stories_fitted))
    runtime = MedusaRuntime(
        engine, tree=CUSTOM_TREE, max_batch=batch, max_context=256, drafters=DRAFTER_SETS[drafters], **_options(backend)
    )
    prompts = (
        [stories_base.tokenizer(p)["input_ids"] for p in REPEATS][:batch]
        if batch > 1
        else [stories_base.tokenizer(REPEATS[0])["input_ids"]]
    )
    results = runtime.generate(prompts, max_new_tokens=40)
    for prompt, result in zip(prompts, results):
        assert_greedy_identical(stories_base, prompt, result.token_ids, 40, stories_base.eos_token_ids)
    accepted = [a for r in results for a in r.stats.accepted_per_step]
    if drafters == "none":
        assert set(accepted) == {1}
    elif drafters in ("lookup", "all"):
        assert max(accepted) >= 3, f"{drafters}: drafts never landed on repetitive prompts ({accepted})"
