"""Sampling: the warp, seeded draws, hand-written acceptance cases, and statistical tests that
lossless Medusa sampling has exactly the base model's distribution.

The statistical tests sample the first 3 generated tokens 20,000 times from a tiny random Llama
(vocabulary 8) with random heads and compare their joint distribution with the exact one,
computed from the model's own logits over all 8 x 8 prefixes. A chi-square test over the outcome
cells (cells expected below 5 pooled) rejects at significance ALPHA = 1e-4: with a correct rule
and fresh seeds it fails once in 10,000 runs (the seeds here are fixed, so each run is
repeatable). An outcome of probability zero (outside top-p / top-k) fails at once. The same test
must reject a deliberately wrong rule (always accept the draft).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import STORIES, random_heads

import medusa_trt.runtime.acceptance as acceptance
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.acceptance import Draws, TypicalRule, lossless, rule_for
from medusa_trt.runtime.drafting import StepTree
from medusa_trt.runtime.sampling import SamplingError, SamplingParams, broadcast_params, draw_without_replacement, sample, warp

SAMPLES = 20_000
ALPHA = 1e-4
Z_ALPHA = 3.719  # upper 1e-4 quantile of the standard normal
VOCAB = 8
PROMPT = [1, 3, 5]
BRANCHING = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


class FixedUniforms:
    """A stand-in generator whose random() returns the given uniforms in order."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


# ------------------------------------------------------------------------------------ the warp


def test_warp_temperature_top_k_top_p_by_hand():
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0)), [[0.5, 0.25, 0.15, 0.1]])
    sharp = warp(logits, SamplingParams(temperature=0.5))  # p^2 renormalised
    np.testing.assert_allclose(sharp, [np.array([0.25, 0.0625, 0.0225, 0.01]) / 0.345])
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_k=2)), [[2 / 3, 1 / 3, 0, 0]])
    # top-p 0.7: 0.5 is below it, 0.5 + 0.25 crosses it -> keep two; 0.75 exactly reached keeps two as well
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.7)), [[2 / 3, 1 / 3, 0, 0]])
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.75)), [[2 / 3, 1 / 3, 0, 0]])
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.76)), [[0.5, 0.25, 0.15, 0] / np.float64(0.9)])
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.1)), [[1, 0, 0, 0]])


def test_top_p_on_a_large_vocabulary_matches_a_full_sort():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5000)) * 0.2  # flat: the 1024 candidates do not reach top_p, so the full sort runs
    sharp = rng.normal(size=(3, 5000)) * 6  # peaked: the candidates suffice
    for x in (logits, sharp):
        got = warp(x, SamplingParams(temperature=1.0, top_p=0.9))
        full = warp(x, SamplingParams(temperature=1.0))
        for row, ref in zip(got, full):
            order = np.argsort(-ref, kind="stable")
            keep = order[(np.cumsum(ref[order]) - ref[order]) < 0.9]
            expect = np.zeros_like(ref)
            expect[keep] = ref[keep] / ref[keep].sum()
            np.testing.assert_allclose(row, expect, atol=1e-12)


def test_draws_without_replacement_are_distinct_and_seeded():
    probs = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    a = draw_without_replacement(np.random.default_rng(7), probs, 4)
    b = draw_without_replacement(np.random.default_rng(7), probs, 4)
    assert list(a) == list(b) and sorted(a) == [0, 1, 2, 3]
    assert list(draw_without_replacement(np.random.default_rng(0), probs, 6))[4:] == [-1, -1]  # past the support
    assert sample(FixedUniforms(0.45), probs) == 1 and sample(FixedUniforms(0.0), probs) == 0 and sample(FixedUniforms(0.999), probs) == 3


def test_draws_over_the_support_equal_draws_over_the_whole_vocabulary():
    """The support-only inverse CDF gives the tokens of the CDF over every id, seed for seed."""

    def over_all_ids(rng, probs, count):
        out, left = np.full(count, -1, dtype=np.int64), np.array(probs, dtype=np.float64)
        for i in range(count):
            if left.sum() <= 0:
                break
            out[i] = sample(rng, left)
            left[out[i]] = 0.0
        return out

    gen = np.random.default_rng(3)
    for trial in range(200):
        probs = warp(gen.normal(size=(1, 300)) * 3, SamplingParams(temperature=0.7, top_p=0.9))[0]  # sparse after top-p
        if trial % 2:
            probs = gen.dirichlet(np.ones(300))  # dense
        count = int(gen.integers(1, 12))
        assert list(draw_without_replacement(np.random.default_rng(trial), probs, count)) == list(
            over_all_ids(np.random.default_rng(trial), probs, count)
        )


def test_params_validation_and_broadcast():
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(seed=-1),
        dict(acceptance="maybe"),
        dict(temperature=0.7, acceptance="greedy"),
    ):
        with pytest.raises(SamplingError):
            SamplingParams(**bad)
    assert SamplingParams().rule == "greedy" and SamplingParams(temperature=0.5).rule == "lossless"
    assert SamplingParams(temperature=0.5, acceptance="typical").rule == "typical"
    assert SamplingParams(acceptance="lossless").rule == "greedy"  # temperature 0: a point mass, greedy is exact
    params = broadcast_params(2, temperature=[0.0, 0.7], seed=3)
    assert [p.temperature for p in params] == [0.0, 0.7] and [p.seed for p in params] == [3, 3]
    with pytest.raises(SamplingError, match="2 values for 3 prompts"):
        broadcast_params(3, temperature=[0.1, 0.2])
    with pytest.raises(SamplingError, match="not both"):
        broadcast_params(1, SamplingParams(), temperature=0.3)


# ------------------------------------------------------------------ acceptance rules by hand


def _probs(table):
    return lambda node: np.asarray(table[node], dtype=np.float64)


def _step_tree(tokens, parents, draws) -> StepTree:
    """A per-step tree by hand: node i has token tokens[i] under parents[i] (root: -1), drawn as
    draws[i] (head d's j-th draw = d * K + j, -1 for a point mass); siblings tried in node order."""
    n = len(tokens)
    depth = np.zeros(n, dtype=np.int64)
    children = [[] for _ in range(n)]
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        children[parents[i]].append(i)
    names = ((),) + (("heads",),) * (n - 1)
    return StepTree(np.array(tokens), np.array(parents), depth, np.array(draws), names, names, tuple(map(tuple, children)), np.ones(n))


def test_lossless_chain_accepts_then_rejects_into_the_residual():
    tree = _step_tree([3, 1, 2], [-1, 0, 1], [-1, 0, 1])  # root, head 1's draw, head 2's draw (K = 1)
    p = {0: [0.1, 0.6, 0.2, 0.1], 1: [0.3, 0.3, 0.1, 0.3]}
    q = np.array([[0.1, 0.3, 0.5, 0.1], [0.2, 0.2, 0.4, 0.2]])
    draws = np.array([[1], [2]])
    # node 1: p(1) = 0.6 >= q(1) = 0.3: accepted whatever u. node 2: u q(2) = 0.5 * 0.4 = 0.2 > p(2) = 0.1:
    # rejected; residual = norm(max(0, p - q)) = [0.1, 0.1, 0, 0.1] / 0.3; bonus from it with u = 0.5 -> token 1
    v = lossless(tree, _probs(p), Draws(q, draws), FixedUniforms(0.99, 0.5, 0.5))
    assert (v.path, v.bonus) == ([0, 1], 1)
    # u = 0.2 at node 2: 0.2 * 0.4 = 0.08 < 0.1: accepted; the leaf's bonus comes from p at node 2
    p[2] = [0.0, 0.0, 0.0, 1.0]
    v = lossless(tree, _probs(p), Draws(q, draws), FixedUniforms(0.99, 0.2, 0.3))
    assert (v.path, v.bonus) == ([0, 1, 2], 3)


def test_lossless_siblings_use_residual_and_draws_without_replacement():
    tree = _step_tree([9, 0, 1], [-1, 0, 0], [-1, 0, 1])  # head 1's first and second draws (K = 2)
    p = {0: [0.1, 0.2, 0.3, 0.4]}
    q, draws = np.array([[0.5, 0.3, 0.2, 0.0]]), np.array([[0, 1]])
    # child 1 (token 0): accept prob 0.1 / 0.5 = 0.2; u = 0.5 rejects; residual [0, 0, 0.2, 0.8];
    # child 2 (token 1) was drawn from q without token 0: [0, 0.6, 0.4, 0]; residual(1) = 0 rejects;
    # residual max(0, [0, 0, .2, .8] - [0, .6, .4, 0]) -> [0, 0, 0, 1]: the bonus is token 3
    v = lossless(tree, _probs(p), Draws(q, draws), FixedUniforms(0.5, 0.0, 0.123))
    assert (v.path, v.bonus) == ([0], 3)
    # u = 0.1 accepts the first child; its bonus (a leaf) comes from p at node 1
    p[1] = [0, 1, 0, 0]
    v = lossless(tree, _probs(p), Draws(q, draws), FixedUniforms(0.1, 0.7))
    assert (v.path, v.bonus) == ([0, 1], 1)


def test_lossless_rejected_draw_leaves_the_residual_of_the_base():
    tree = _step_tree([1, 0], [-1, 0], [-1, 0])
    p = {0: [0.0, 1.0]}
    q = np.array([[1.0, 0.0]])  # the head's only token has no base mass: rejected, the bonus is the base's token
    v = lossless(tree, _probs(p), Draws(q, np.array([[0]])), FixedUniforms(0.9, 0.4))
    assert (v.path, v.bonus) == ([0], 1)


def test_typical_accepts_by_entropy_threshold():
    typical = rule_for(SamplingParams(temperature=1.0, acceptance="typical"))
    assert isinstance(typical, TypicalRule)
    # root p = [0.7, 0.1, 0.1, 0.1]: entropy 0.940, 0.3 exp(-0.940) = 0.117, threshold min(0.09, 0.117) = 0.09
    p = {0: [0.7, 0.1, 0.1, 0.1], 1: [0.25, 0.25, 0.25, 0.25], 2: [1, 0, 0, 0], 3: [1, 0, 0, 0]}
    # node 1 token 1 (p 0.1 > 0.09): accepted; node 2 token 3 (0.1): accepted too; node 3 under node 1:
    # uniform p: entropy ln 4, 0.3 / 4 = 0.075 < 0.09 -> threshold 0.075, token 2 (0.25) accepted
    tree = _step_tree([0, 1, 3, 2], [-1, 0, 0, 1], [-1, -1, -1, -1])
    v = typical.accept(tree, None, _probs(p), None, FixedUniforms(0.5))
    assert (v.path, v.bonus) == ([0, 1, 3], 0)
    # a drafted token at p = 0.05 is refused; the two depth-1 nodes tie in length, the likelier wins
    p[0] = [0.8, 0.1, 0.05, 0.05]
    p[1] = [0, 0, 0.05, 0.95]
    assert typical.accept(_step_tree([0, 1, 2, 2], [-1, 0, 0, 1], [-1] * 4), None, _probs(p), None, FixedUniforms(0.99)).path == [0, 1]
    assert typical.accept(_step_tree([0, 2, 1, 2], [-1, 0, 0, 1], [-1] * 4), None, _probs(p), None, FixedUniforms(0.99)).path == [0, 2]


# --------------------------------------------------------------------- statistical tests


@pytest.fixture(scope="module")
def tiny8():
    """A random 1-layer Llama over 8 tokens with 2 random heads (no EOS: every run makes 3 tokens)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.exporter import MedusaModel, load_base_model
    from medusa_trt.exporter.models import BaseModel

    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    tokenizer = load_base_model(STORIES).tokenizer  # decodes ids 0..7; the text is not looked at
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.35,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    base = BaseModel(model, tokenizer, "tiny8", (), False)
    return base, MedusaModel(base, random_heads(base, 2, seed=1))


def exact_joint(base, params: SamplingParams) -> np.ndarray:
    """P(x1, x2, x3) of plain autoregressive sampling [V, V, V], from the model's logits."""
    with torch.no_grad():
        prefixes = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])  # (V*V, 5)
        logits = base.model(prefixes).logits.double().numpy()  # (V*V, 5, V)
    n = len(PROMPT)
    p1 = warp(logits[0, n - 1][None], params)[0]  # (V,)
    p2 = warp(logits[::VOCAB, n], params)  # (V, V): [x1, x2]
    p3 = warp(logits[:, n + 1], params).reshape(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_counts(model, tree, params: SamplingParams, drafters=None) -> tuple[np.ndarray, float]:
    runtime = MedusaRuntime(model, tree=tree, max_batch=2000, max_context=16, drafters=drafters)
    results = runtime.generate(
        [PROMPT] * SAMPLES,
        max_new_tokens=3,
        sampling=[SamplingParams(params.temperature, params.top_p, params.top_k, seed=i) for i in range(SAMPLES)],
    )
    counts = np.zeros((VOCAB,) * 3)
    for r in results:
        assert len(r.token_ids) == 3
        counts[tuple(r.token_ids)] += 1
    steps = [a for r in results for a in r.stats.accepted_per_step]
    return counts, float(np.mean(steps))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, str]:
    """Pearson's statistic over cells expected >= 5 (the rest pooled), its 1 - ALPHA quantile
    (Wilson-Hilferty), and a note of impossible outcomes seen."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    impossible = np.flatnonzero((probs.ravel() == 0) & (counts > 0))
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs.ravel() > 0)].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + Z_ALPHA * math.sqrt(2 / (9 * df))) ** 3
    note = (
        f"{len(impossible)} impossible outcomes seen {[np.unravel_index(i, (VOCAB,) * 3) for i in impossible[:3]]}"
        if len(impossible)
        else ""
    )
    return stat, quantile, note


CASES = [
    pytest.param("chain-2", SamplingParams(temperature=0.7, top_p=0.9), id="chain-t0.7-top_p0.9"),
    pytest.param("chain-2", SamplingParams(temperature=1.0, top_p=0.95, top_k=6), id="chain-t1.0-top_p0.95-top_k6"),
    pytest.param(BRANCHING, SamplingParams(temperature=0.7, top_p=0.9), id="branching-t0.7-top_p0.9"),
    pytest.param(BRANCHING, SamplingParams(temperature=1.0, top_p=0.95), id="branching-t1.0-top_p0.95"),
]


@pytest.mark.parametrize("tree, params", CASES)
def test_lossless_sampling_has_the_base_distribution(tiny8, tree, params):
    """Every drafter at once (the default): sampled head draws and point-mass drafts among siblings."""
    base, model = tiny8
    probs = exact_joint(base, params)
    counts, mean_accepted = sampled_counts(model, tree, params)
    stat, quantile, impossible = chi_square(counts, probs)
    tv = 0.5 * np.abs(counts / SAMPLES - probs).sum()
    assert not impossible, impossible
    assert stat < quantile, f"chi-square {stat:.1f} >= {quantile:.1f} (alpha {ALPHA}); total variation {tv:.4f}"
    assert mean_accepted > 1.1, f"the heads never got a draft accepted ({mean_accepted:.2f} tokens/step): the test would not test drafting"


@pytest.mark.parametrize(
    "drafters, params",
    [
        pytest.param(("lookup",), SamplingParams(temperature=0.7, top_p=0.9), id="lookup-t0.7-top_p0.9"),
        pytest.param(("recycle",), SamplingParams(temperature=1.0, top_p=0.95), id="recycle-t1.0-top_p0.95"),
        pytest.param(("heads", "lookup"), SamplingParams(temperature=1.0, top_p=0.95), id="heads+lookup-t1.0-top_p0.95"),
    ],
)
def test_lossless_sampling_with_deterministic_drafts_has_the_base_distribution(tiny8, drafters, params):
    """Retrieved and recycled drafts are point masses: exact alone and mixed with sampled head draws.
    An 8-token vocabulary makes the prompt's n-grams recur, so lookup fires on most steps."""
    base, model = tiny8
    counts, mean_accepted = sampled_counts(model, BRANCHING, params, drafters=drafters)
    stat, quantile, impossible = chi_square(counts, exact_joint(base, params))
    assert not impossible, impossible
    assert stat < quantile, f"{drafters}: chi-square {stat:.1f} >= {quantile:.1f} (alpha {ALPHA})"
    assert mean_accepted > 1.02, f"{drafters} never got a draft accepted ({mean_accepted:.2f} tokens/step)"


def test_lossless_sampling_with_a_draft_vocabulary_has_the_base_distribution(tiny8):
    """Heads that draft from the first 5 of the 8 token ids (an engine exported with --draft-vocab
    5): their q is zero on ids 5..7, which the base model still emits at its own rate."""
    base, model = tiny8
    params = SamplingParams(temperature=1.0, top_p=0.95)
    model.draft_vocab = 5
    try:
        counts, mean_accepted = sampled_counts(model, BRANCHING, params, drafters=("heads",))
    finally:
        model.draft_vocab = None
    probs = exact_joint(base, params)
    stat, quantile, impossible = chi_square(counts, probs)
    assert not impossible, impossible
    assert stat < quantile, f"chi-square {stat:.1f} >= {quantile:.1f} (alpha {ALPHA})"
    assert mean_accepted > 1.1, f"the heads never got a draft accepted ({mean_accepted:.2f} tokens/step)"
    assert probs[5:].sum() > 0.05 and counts[5:].sum() > 0  # ids past the draft vocabulary are emitted too


def test_plain_sampling_has_the_base_distribution(tiny8):
    base, model = tiny8
    params = SamplingParams(temperature=1.0, top_p=0.9)
    counts, steps = sampled_counts(model, "chain-0", params, drafters=())
    assert steps == 1.0
    stat, quantile, impossible = chi_square(counts, exact_joint(base, params))
    assert not impossible and stat < quantile, (stat, quantile, impossible)


@pytest.mark.parametrize("drafters", [("heads",), ("lookup",)])
def test_a_wrong_rule_fails_the_same_test(tiny8, monkeypatch, drafters):
    """Test of the test: always accepting the draft gives the drafts' distribution, not the base's."""
    base, model = tiny8
    params = SamplingParams(temperature=0.7, top_p=0.9)
    monkeypatch.setattr(acceptance, "accepts", lambda u, p_x, q_x: True)
    counts, _ = sampled_counts(model, BRANCHING, params, drafters=drafters)
    stat, quantile, impossible = chi_square(counts, exact_joint(base, params))
    assert impossible or stat > 10 * quantile, f"always-accept passed: chi-square {stat:.1f} vs {quantile:.1f}"


# ------------------------------------------------------------------ runtime, backends, CLI


@pytest.fixture(scope="module")
def stories_runtime(stories_base, stories_fitted):
    from conftest import CUSTOM_TREE, medusa_model

    return MedusaRuntime(medusa_model(stories_base, stories_fitted), tree=CUSTOM_TREE, max_batch=4, max_context=256)


@pytest.mark.parametrize("rule", ["lossless", "typical"])
def test_same_seed_same_output_whatever_the_batch(stories_runtime, stories_prompts, rule):
    runtime, prompts = stories_runtime, stories_prompts
    mixed = runtime.generate(
        prompts[:3], max_new_tokens=40, temperature=[0.8, 0.0, 1.0], top_p=[0.9, 1.0, 1.0], seed=[5, 6, 7], acceptance=[rule, None, rule]
    )
    alone = runtime.generate(prompts[0], max_new_tokens=40, temperature=0.8, top_p=0.9, seed=5, acceptance=rule)
    other = runtime.generate(
        [prompts[2], prompts[0]], max_new_tokens=40, temperature=[1.0, 0.8], top_p=[1.0, 0.9], seed=[7, 5], acceptance=rule
    )
    greedy = runtime.generate(prompts[1], max_new_tokens=40)
    assert mixed[0].token_ids == alone.token_ids == other[1].token_ids
    assert mixed[2].token_ids == other[0].token_ids
    assert mixed[1].token_ids == greedy.token_ids  # the greedy sequence of a mixed batch is unaffected
    fresh = runtime.generate(prompts[0], max_new_tokens=40, temperature=0.8, top_p=0.9, seed=6, acceptance=rule)
    assert fresh.token_ids != alone.token_ids  # another seed, another sample (40 tokens at T=0.8)


def test_onnx_backend_samples_reproducibly(export_engine, stories_base, stories_fitted, stories_prompts):
    from conftest import medusa_model

    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    runtime = MedusaRuntime(engine, max_batch=4)
    batch = runtime.generate(stories_prompts, max_new_tokens=32, temperature=0.9, top_k=20, seed=[1, 2, 3, 4])
    alone = runtime.generate(stories_prompts[2], max_new_tokens=32, temperature=0.9, top_k=20, seed=3)
    assert batch[2].token_ids == alone.token_ids
    typical = runtime.generate(stories_prompts[2], max_new_tokens=32, temperature=0.9, seed=3, acceptance="typical")
    assert len(typical.token_ids) == 32 and typical.stats.steps > 0
    plain = runtime.with_tree("chain-0").generate(stories_prompts[2], max_new_tokens=32, temperature=0.9, top_k=20, seed=3)
    assert plain.stats.mean_accepted == 1.0


def test_cli_sampling_is_reproducible_and_checks_its_options(export_engine, stories_base, stories_fitted, capsys):
    from conftest import medusa_model

    from medusa_trt.cli.run import main

    engine = str(export_engine("stories-fitted", medusa_model(stories_base, stories_fitted)))
    args = [
        "--engine",
        engine,
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "24",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == first
    assert main(args + ["--acceptance", "typical"]) == 0
    capsys.readouterr()
    for bad, message in (
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "0.5", "--acceptance", "greedy"], "acceptance='greedy'"),
    ):
        assert main(["--engine", engine, "--prompt", "Hi"] + bad) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("medusa-run: error:") and message in err and "\n" not in err
