"""MedusaRuntime behaviour: perfect heads, stopping rules, limits, streaming, prompt forms."""

from __future__ import annotations

import pytest
import torch
from conftest import TREES, assert_greedy_identical, medusa_model, random_heads

from medusa_trt.exporter import BaseModel, HeadsConfig, MedusaHeads, MedusaModel
from medusa_trt.runtime import EngineError, InvalidTreeError, MedusaRuntime, PromptError, RuntimeConfig

VOCAB = 16


def _successor(x: int) -> int:
    return (5 * x + 3) % VOCAB  # a permutation of 0..15: the toy model's next token


@torch.no_grad()
def toy_model(tokenizer) -> MedusaModel:
    """A 1-layer Llama whose next token is a fixed function of the current one (attention and MLP
    outputs zeroed, embeddings one-hot, lm_head a permutation), and heads set to match exactly:
    head k maps x to successor^(k+2)(x)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=VOCAB,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
    model.model.layers[0].self_attn.o_proj.weight.zero_()
    model.model.layers[0].mlp.down_proj.weight.zero_()

    def table(steps: int) -> torch.Tensor:
        w = torch.zeros(VOCAB, VOCAB)
        for x in range(VOCAB):
            y = x
            for _ in range(steps):
                y = _successor(y)
            w[y, x] = 1.0
        return w

    model.lm_head.weight.copy_(table(1))
    heads = MedusaHeads(HeadsConfig(num_heads=4, num_layers=1, hidden_size=VOCAB, vocab_size=VOCAB, shared_lm_head=False))
    for k, head in enumerate(heads.heads):
        head[0].linear.weight.zero_()
        head[0].linear.bias.zero_()
        head[1].weight.copy_(table(k + 2))
    base = BaseModel(model=model, tokenizer=tokenizer, name="toy", eos_token_ids=(), is_chat=False)
    return MedusaModel(base, heads.eval())


@pytest.fixture(scope="module")
def toy(stories_base):
    return toy_model(stories_base.tokenizer)


# The perfect heads alone, every template node verified (a flat cost table): the tests below count
# accepted tokens per step exactly, which retrieval drafts and a pruned tree would change.
HEADS_ONLY = dict(drafters=("heads",), step_cost={1: 1.0, 64: 1.0})


@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63"])
def test_perfect_heads_accept_depth_plus_one(toy, tree):
    if tree == "mc_sim_7b_63" and not TREES.is_file():
        pytest.skip(f"{TREES} missing")
    runtime = MedusaRuntime(toy, tree=tree, max_context=128, **HEADS_ONLY)
    result = runtime.generate([[3], [7, 11]], max_new_tokens=41)  # 1 from the prefill + 8 steps of 5
    for prompt, r in zip([[3], [7, 11]], result):
        expected, x = [], prompt[-1]
        for _ in range(41):
            x = _successor(x)
            expected.append(x)
        assert r.token_ids == expected
        assert r.stats.accepted_per_step == [5] * 8  # depth 4 + the bonus token
        assert r.stats.steps == 8 and r.stats.mean_accepted == 5.0


def test_budget_cuts_the_last_step(toy):
    r = MedusaRuntime(toy, tree="chain-4", **HEADS_ONLY).generate([3], max_new_tokens=8)
    assert len(r.token_ids) == 8 and r.finish_reason == "length"
    assert r.stats.accepted_per_step == [5, 2]


def test_context_limit_ends_with_length(toy):
    runtime = MedusaRuntime(toy, tree="chain-4", max_context=12, **HEADS_ONLY)
    r = runtime.generate([1, 2, 3], max_new_tokens=100)
    assert r.finish_reason == "length"
    assert len(r.token_ids) + 3 == 12  # prompt + generated fills the context exactly


def test_prompt_longer_than_context_is_a_clear_error(toy):
    runtime = MedusaRuntime(toy, tree="chain-2", max_context=8, **HEADS_ONLY)
    with pytest.raises(PromptError, match="prompt 0 has 8 tokens but max_context is 8"):
        runtime.generate(list(range(8)))


def test_empty_prompt_and_bad_budget(toy):
    runtime = MedusaRuntime(toy, tree="chain-2", **HEADS_ONLY)
    with pytest.raises(PromptError, match="empty"):
        runtime.generate([[1], []])
    with pytest.raises(PromptError, match="max_new_tokens"):
        runtime.generate([1], max_new_tokens=0)


def test_stream_and_completed_check_their_options_at_the_call(toy):
    """Bad options or prompts raise when ``stream`` / ``completed`` are called, before any iteration,
    as ``generate`` does: a server that checks a request before answering it sees the error there."""
    runtime = MedusaRuntime(toy, tree="chain-2", **HEADS_ONLY)
    for method in (runtime.stream, runtime.completed):
        with pytest.raises(TypeError, match="max_new_token"):
            method([1], max_new_token=4)
        with pytest.raises(PromptError, match="max_new_tokens"):
            method([1], max_new_tokens=0)
        with pytest.raises(PromptError, match="empty"):
            method([[1], []])
    with pytest.raises(TypeError, match="hidden"):
        runtime.stream([1], hidden=True)


def test_tree_deeper_than_heads_is_refused(toy):
    with pytest.raises(InvalidTreeError, match="needs 5 heads"):
        MedusaRuntime(toy, tree="chain-5")


def test_missing_engine_file_and_foreign_objects(tmp_path):
    with pytest.raises(EngineError, match="does not exist: export one with medusa-export"):
        MedusaRuntime(tmp_path / "model.onnx")
    with pytest.raises(EngineError, match="unsupported engine dict"):
        MedusaRuntime({})


def test_eos_stops_and_is_kept(stories_base):
    toy_eos = toy_model(stories_base.tokenizer)
    toy_eos.eos_token_ids = (_successor(_successor(_successor(4))),)  # the third token after 4
    r = MedusaRuntime(toy_eos, tree="chain-4", **HEADS_ONLY).generate([4], max_new_tokens=30)
    assert r.finish_reason == "stop"
    assert r.token_ids == [_successor(4), _successor(_successor(4)), toy_eos.eos_token_ids[0]]


def test_ragged_batch_finishes_independently(stories_base):
    toy_eos = toy_model(stories_base.tokenizer)
    toy_eos.eos_token_ids = (9,)
    results = MedusaRuntime(toy_eos, tree="chain-4", **HEADS_ONLY).generate([[_successor_inverse(9)], [2]], max_new_tokens=20)
    assert results[0].token_ids == [9] and results[0].finish_reason == "stop"
    chain = [2]
    for _ in range(20):
        chain.append(_successor(chain[-1]))
    expected = chain[1 : chain.index(9) + 1] if 9 in chain[1:] else chain[1:]
    assert results[1].token_ids == expected


def _successor_inverse(y: int) -> int:
    return next(x for x in range(VOCAB) if _successor(x) == y)


def test_stop_string_cuts_text_and_tokens(stories_base, stories_prompts):
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, tree="chain-2", max_context=256)
    full = runtime.generate(stories_prompts[0], max_new_tokens=40)
    assert "park" in full.text
    cut = runtime.generate(stories_prompts[0], max_new_tokens=40, stop=["park", "never-there"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("park")]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert "park" in stories_base.tokenizer.decode(cut.token_ids)  # the completing token is kept
    assert "park" not in stories_base.tokenizer.decode(cut.token_ids[:-1])


def test_stream_yields_what_generate_returns(stories_base, stories_prompts):
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, tree="chain-3", max_context=256)
    results = runtime.generate(stories_prompts[:3], max_new_tokens=30)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    texts = {0: "", 1: "", 2: ""}
    for event in runtime.stream(stories_prompts[:3], max_new_tokens=30):
        tokens[event.index] += event.token_ids
        texts[event.index] += event.text
    for i, r in enumerate(results):
        assert tokens[i] == r.token_ids and texts[i] == r.text


def test_more_prompts_than_max_batch(stories_base, stories_prompts):
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, RuntimeConfig(max_batch=2, max_context=256, tree="chain-2"))
    results = runtime.generate(stories_prompts, max_new_tokens=16)
    assert len(results) == len(stories_prompts)
    for prompt, r in zip(stories_prompts, results):
        assert_greedy_identical(stories_base, prompt, r.token_ids, 16, stories_base.eos_token_ids)


def test_prompt_forms(stories_base, stories_prompts):
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, tree="chain-2", max_context=256)
    by_text = runtime.generate("Once upon a time", max_new_tokens=12)
    by_ids = runtime.generate(stories_prompts[0], max_new_tokens=12)
    batch = runtime.generate(["Once upon a time", "One day"], max_new_tokens=12)
    assert by_text.token_ids == by_ids.token_ids == batch[0].token_ids
    assert isinstance(batch, list) and len(batch) == 2
    assert by_text.stats.prompt_tokens == len(stories_prompts[0]) and by_text.stats.tokens_per_second > 0
    with pytest.raises(PromptError, match="no chat template"):
        runtime.generate("hi", chat_template=True)


def test_cache_is_allocated_once(stories_base, stories_prompts):
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, tree="chain-4", max_batch=4, max_context=200)
    key = runtime.backend.cache_key
    ptr = key.data_ptr()
    runtime.generate(stories_prompts, max_new_tokens=20)
    runtime.generate(stories_prompts[:1], max_new_tokens=20)
    assert runtime.backend.cache_key is key and key.data_ptr() == ptr
    assert (key.shape[0], key.shape[2]) == (200, 4)  # max context, max batch (slot-major)


def test_step_cost_follows_real_context(stories_base):
    """The model sees only the first max(cache_lengths) slots of the cache."""
    model = medusa_model(stories_base, random_heads(stories_base))
    runtime = MedusaRuntime(model, tree="chain-2", max_context=1000)
    seen: list[int] = []
    forward = model.forward

    def spy(*args):
        seen.append(args[4].shape[0])
        return forward(*args)

    model.forward = spy
    try:
        runtime.generate([1, 2, 3, 4, 5], max_new_tokens=6)
    finally:
        del model.forward
    assert seen[0] == 0 and max(seen) < 12, seen


@pytest.mark.slow
def test_chat_template_applied_to_plain_prompts(smollm2_chat_runtime):
    runtime, tokenizer = smollm2_chat_runtime
    r = runtime.generate("What is 2+2?", max_new_tokens=8)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    assert r.stats.prompt_tokens == len(ids)
    raw = runtime.generate("What is 2+2?", max_new_tokens=8, chat_template=False)
    assert raw.stats.prompt_tokens == len(tokenizer("What is 2+2?")["input_ids"])


@pytest.fixture(scope="module")
def smollm2_chat_runtime(smollm2_base):
    model = MedusaModel(smollm2_base, random_heads(smollm2_base, shared=True))
    return MedusaRuntime(model, tree="chain-2", max_context=256, max_batch=1), smollm2_base.tokenizer


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_batch"):
        RuntimeConfig(max_batch=0)
    with pytest.raises(ValueError, match="max_context"):
        RuntimeConfig(max_context=1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_prefill_of_ragged_prompts(stories_base, stories_fitted, stories_prompts, chunk):
    """Prompts longer than the prefill chunk, ending in different chunks, still decode exactly."""
    model = medusa_model(stories_base, stories_fitted)
    runtime = MedusaRuntime(model, tree="chain-3", max_context=256, prefill_chunk=chunk)
    results = runtime.generate(stories_prompts, max_new_tokens=16)
    for prompt, r in zip(stories_prompts, results):
        assert_greedy_identical(stories_base, prompt, r.token_ids, 16, stories_base.eos_token_ids)


def test_plain_decoding_never_runs_the_heads(stories_base, stories_prompts):
    """chain-0 on an engine with heads is the plain baseline: it must not pay for proposals."""
    runtime = MedusaRuntime(medusa_model(stories_base, random_heads(stories_base)), tree="chain-3").with_tree("chain-0")
    calls = []
    propose = runtime.backend.propose
    runtime.backend.propose = lambda *a: calls.append(a) or propose(*a)
    result = runtime.generate(stories_prompts[:2], max_new_tokens=8)
    assert calls == [] and all(len(r.token_ids) == 8 for r in result)
    assert all(r.stats.heads_seconds == 0.0 for r in result)


class _PermutationEngine:
    """An engine double for host-cost measurements: the 'model' maps each token to a fixed
    successor (a random permutation of the vocabulary), at no compute cost, so what is timed is
    the host's work alone. Outputs cycle, so retrieval fires on most steps."""

    name, max_tokens = "permutation", None

    def __init__(self, vocab: int, max_batch: int, max_context: int):
        import numpy as np

        self.max_batch, self.max_context = max_batch, max_context
        self.successor = np.random.default_rng(0).permutation(vocab)

    def step(self, input_ids, position_ids, tree_mask, cache_lengths, *, logits=True):
        from medusa_trt.runtime.contract import StepOutput

        return StepOutput(self.successor[input_ids], None, None, None)

    def commit(self, output, nodes, counts, cache_lengths):
        pass

    def relayout(self, rows, old_batch, new_batch, slots):
        pass


def _count_host_calls(monkeypatch) -> list[int]:
    """Patch ``Scheduler``'s host stages to count, per step, the Python-level calls they make
    (profile events 'call': Python functions, 'c_call': builtins and extension functions); the
    list gets one entry per step (a new one at each ``_draft``). A count, unlike a time, is the
    same on a fast or a loaded machine: it says how much host code a step runs, not how fast."""
    import sys

    from medusa_trt.runtime.scheduler import Scheduler

    calls: list[int] = []

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[-1] += 1

    for name in ("_draft", "_accept", "_commit"):
        real = getattr(Scheduler, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            if _name == "_draft":
                calls.append(0)
            sys.setprofile(profile)  # this thread only
            try:
                out = _real(self, *args, **kwargs)
                if _name == "_commit":
                    out = list(out)  # a generator: its work happens as it is consumed
            finally:
                sys.setprofile(None)
            return iter(out) if _name == "_commit" else out

        monkeypatch.setattr(Scheduler, name, counted)
    return calls


def _growth_by_shape(calls: list[int], drafts: list, window: int = 500) -> dict[tuple[int, int], float]:
    """(drafted, accepted) -> the median calls of the last ``window`` steps of that shape over the
    median of its first ``window`` (halves for a shape with fewer than twice that; shapes with
    under 100 steps are left out). Steps of one shape draft, verify and emit as many tokens, so
    their host work per emitted token must not depend on how long the output is already."""
    import numpy as np

    by_shape: dict[tuple[int, int], list[int]] = {}
    for n, d in zip(calls, drafts, strict=True):
        by_shape.setdefault((d.drafted, d.accepted), []).append(n)
    growth = {}
    for shape, counts in by_shape.items():
        if len(counts) >= 100:
            w = min(window, len(counts) // 2)
            growth[shape] = float(np.median(counts[-w:]) / np.median(counts[:w]))
    return growth


@pytest.mark.parametrize("drafters", [(), ("lookup", "recycle")])
def test_host_cost_per_step_stays_flat_over_a_long_generation(stories_base, monkeypatch, drafters):
    """4,000 tokens through the stories260K tokenizer with every host stage real (drafting, tree,
    acceptance, incremental detokenization, stop search): the host's work per emitted token must
    not grow with the output. Work is counted, not timed (``_count_host_calls``), so the test
    does not depend on the machine's speed or load; the engine is a zero-cost double
    (``_PermutationEngine``). Steps are compared with steps of the same shape
    (``_growth_by_shape``): once retrieval finds the text cycling, a step drafts and emits 9
    tokens instead of 1, which would hide growth in a plain per-token average. Re-decoding the
    whole text each step makes the late steps call ~11x (no drafters) and ~2x (retrieval) more."""
    import numpy as np

    runtime = MedusaRuntime(
        medusa_model(stories_base, random_heads(stories_base, 2)), tree="chain-2", max_context=256, max_batch=1, drafters=drafters
    )
    runtime.backend = _PermutationEngine(stories_base.model.config.vocab_size, 1, 4200)
    runtime.max_context = 4200
    runtime.eos = frozenset()  # the permutation would reach EOS: 4,000 tokens are wanted
    calls = _count_host_calls(monkeypatch)
    result = runtime.generate([1, 5, 9], max_new_tokens=4000, stop=["never appears in a story"])
    assert len(result.token_ids) == 4000, result.finish_reason
    growth = _growth_by_shape(calls[1:], result.stats.drafts)  # the first entry is the prefill
    compared = sum(1 for d in result.stats.drafts if (d.drafted, d.accepted) in growth)
    assert compared > len(calls) // 2, growth  # most steps have a shape common enough to compare
    grew = {shape: round(g, 2) for shape, g in growth.items() if g >= 1.1}
    assert not grew, f"host calls per step grew with the output for steps of shape (drafted, accepted): {grew}"
    if drafters:
        assert np.array(result.stats.accepted_per_step).max() > 2  # retrieval drafted and landed


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_hidden_states_recorded_as_generation_runs(stories_base, stories_fitted, stories_prompts, export_engine, backend):
    """``hidden=True``: row i is the heads' input state before new token i, as one forward pass over
    prompt + output gives it, whatever the drafts and batch neighbours; ``completed`` yields every
    prompt once with the result ``generate`` returns, sampled too."""
    model = medusa_model(stories_base, stories_fitted)
    engine = model if backend == "torch" else export_engine("stories-fitted", model)
    runtime = MedusaRuntime(engine, max_batch=2, max_context=256)  # 2 rows for 5 prompts: rows refill as they finish
    prompts = stories_prompts[:5]
    done = dict(runtime.completed(prompts, max_new_tokens=24, hidden=True))
    assert sorted(done) == list(range(len(prompts)))
    plain = runtime.generate(prompts, max_new_tokens=24)
    for i, prompt in enumerate(prompts):
        r = done[i]
        assert r.token_ids == plain[i].token_ids and plain[i].hidden is None
        with torch.no_grad():
            want = stories_base.model.model(torch.tensor([prompt + r.token_ids])).last_hidden_state[0]  # (L, H)
        want = want[len(prompt) - 1 : len(prompt) - 1 + len(r.token_ids)].numpy()
        assert r.hidden.shape == want.shape == (len(r.token_ids), stories_base.model.config.hidden_size)
        assert abs(r.hidden - want).max() < 1e-4
    assert max(r.stats.mean_accepted for r in done.values()) > 1  # drafts were accepted on the way
    sampled = dict(runtime.completed(prompts[:2], max_new_tokens=12, temperature=0.8, seed=3))  # the options generate takes
    want = runtime.generate(prompts[:2], max_new_tokens=12, temperature=0.8, seed=3)
    assert [sampled[i].token_ids for i in range(2)] == [w.token_ids for w in want]


def test_step_threads_spin_and_heads_threads_sleep(stories_base, stories_fitted, export_engine):
    """The step session keeps ONNX Runtime's spinning pool (a step is thousands of small kernels:
    waking sleeping threads for each costs more than the model's matmuls); the heads session, run
    between two steps, lets its threads sleep so they never spin on the step session's cores."""
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    backend = OnnxBackend(export_engine("stories-fitted", medusa_model(stories_base, stories_fitted)), threads=2)
    spin = "session.intra_op.allow_spinning"
    step, heads = backend.session.get_session_options(), backend.heads_session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: ONNX Runtime's default, spinning
        step.get_session_config_entry(spin)
    assert heads.get_session_config_entry(spin) == "0"
    assert step.intra_op_num_threads == heads.intra_op_num_threads == 2


def test_step_session_keeps_each_layers_cache_copy_beside_its_layer(stories_base, stories_fitted, export_engine, tmp_path, monkeypatch):
    """ONNX Runtime would fuse the per-layer Gathers of the cache into one Split of the whole cache
    ahead of layer 0; the step session disables that fusion (by a name this ONNX Runtime knows: with
    it, no Split reads the cache), and the backend opens its step session so."""
    import onnx
    import onnxruntime as ort

    from medusa_trt.runtime.backends import onnx_backend
    from medusa_trt.runtime.contract import PAST_KEY
    from medusa_trt.runtime.engine import open_session

    step = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))

    def splits_of_the_cache(disabled) -> int:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"optimized-{bool(disabled)}.onnx")
        open_session(step, options, ["CPUExecutionProvider"], disabled_optimizers=disabled)
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
        return sum(n.op_type == "Split" and n.input[0] == PAST_KEY for n in graph.node)

    assert splits_of_the_cache(None) == 1 and splits_of_the_cache(onnx_backend.STEP_DISABLED_OPTIMIZERS) == 0
    seen = []
    monkeypatch.setattr(onnx_backend, "open_session", lambda *a, **k: seen.append(k.get("disabled_optimizers")) or open_session(*a, **k))
    onnx_backend.OnnxBackend(step, threads=2)
    assert seen == [onnx_backend.STEP_DISABLED_OPTIMIZERS, None]  # the step session, then the heads session
