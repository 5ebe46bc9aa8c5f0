"""Continuous batching: requests join and leave the engine's rows between steps.

Every request must get exactly what it gets alone (greedy tokens, or the same seeded sample),
whatever joined or left around it; a finished or cancelled request frees its row at once.
Run on the ONNX Runtime backend, whose cache layout depends on the row count (so every join and
leave that changes it re-lays the cache out), and on the torch backend.
"""

from __future__ import annotations

import threading

import pytest
from conftest import CUSTOM_TREE, STORY_PROMPTS, medusa_model

from medusa_trt.runtime import EngineError, MedusaRuntime, PromptError
from medusa_trt.runtime.batching import ContinuousBatcher, Request
from medusa_trt.runtime.sampling import SamplingError, SamplingParams

PROMPTS = STORY_PROMPTS + ["Sam saw a frog", "The sky was blue and", "Mia had a kite. It was red and", "Bob"]
LENGTHS = [40, 7, 25, 33, 12, 48, 3, 20]


@pytest.fixture(scope="module", params=["onnxruntime", "torch"])
def runtime(request, export_engine, stories_base, stories_fitted):
    model = medusa_model(stories_base, stories_fitted)
    if request.param == "torch":
        return MedusaRuntime(model, tree=CUSTOM_TREE, max_batch=4, max_context=256)
    return MedusaRuntime(export_engine("stories-fitted", model), tree=CUSTOM_TREE, max_batch=4)


def solo(runtime, prompt, n, **sampling):
    return runtime.generate(prompt, max_new_tokens=n, chat_template=False, **sampling).token_ids


def test_concurrent_requests_each_get_their_solo_output(runtime):
    batcher = ContinuousBatcher(runtime).start()
    results = {}

    def client(i):
        handle = batcher.submit(Request(PROMPTS[i], max_new_tokens=LENGTHS[i], chat_template=False))
        results[i] = handle.result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    for i, prompt in enumerate(PROMPTS):  # 8 requests over 4 rows: half of them waited for a free row
        assert results[i].token_ids == solo(runtime, prompt, LENGTHS[i]), f"request {i} ({prompt!r}) differs from its solo run"
        assert results[i].finish_reason in ("length", "stop")
    assert batcher._scheduler.rows == []  # every row freed


def test_requests_join_and_leave_mid_flight(runtime):
    batcher = ContinuousBatcher(runtime).start()
    first = batcher.submit(Request(PROMPTS[0], max_new_tokens=48, chat_template=False))
    events = iter(first)
    head = [next(events) for _ in range(3)]  # the first request is decoding alone
    late = [batcher.submit(Request(p, max_new_tokens=n, chat_template=False)) for p, n in zip(PROMPTS[4:7], LENGTHS[4:7])]
    rest = list(events)
    late_results = [h.result() for h in late]
    sampled = [
        batcher.submit(Request(p, max_new_tokens=30, chat_template=False, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=i)))
        for i, p in enumerate(PROMPTS[:3])
    ]
    sampled_results = [h.result() for h in sampled]
    with pytest.raises(EngineError, match="already generating"):  # the batcher owns the engine until closed
        runtime.generate("Hi", max_new_tokens=2)
    batcher.close()
    assert [t for e in head + rest for t in e.token_ids] == solo(runtime, PROMPTS[0], 48)
    for r, p, n in zip(late_results, PROMPTS[4:7], LENGTHS[4:7]):
        assert r.token_ids == solo(runtime, p, n)
    for i, (r, p) in enumerate(zip(sampled_results, PROMPTS[:3])):
        assert r.token_ids == solo(runtime, p, 30, temperature=0.8, top_p=0.9, seed=i)


def test_cancel_frees_the_row_at_once(export_engine, stories_base, stories_fitted):
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    runtime = MedusaRuntime(engine, tree=CUSTOM_TREE, max_batch=1)  # one row: the second request waits for it
    batcher = ContinuousBatcher(runtime).start()
    long = batcher.submit(Request(PROMPTS[0], max_new_tokens=200, chat_template=False))
    waiting = batcher.submit(Request(PROMPTS[1], max_new_tokens=10, chat_template=False))
    events = iter(long)
    next(events)
    long.cancel()
    rest = list(events)
    assert rest[-1].finish_reason == "cancelled" and long.result().finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in rest) < 200
    waited = waiting.result()  # it got the freed row
    never = batcher.submit(Request(PROMPTS[2], max_new_tokens=500, chat_template=False))
    batcher.close()  # ends what is still running
    assert never.result().finish_reason == "cancelled"
    assert waited.token_ids == solo(runtime, PROMPTS[1], 10)


def test_bad_requests_raise_before_queueing(runtime):
    batcher = ContinuousBatcher(runtime).start()
    for request, error in [
        (Request("", chat_template=False), PromptError),
        (Request([], chat_template=False), PromptError),
        (Request("word " * 400, chat_template=False), PromptError),  # over the context
        (Request("Hi", max_new_tokens=-1), PromptError),
        (Request("Hi", stop=("",)), PromptError),
    ]:
        with pytest.raises(error):
            batcher.submit(request)
    with pytest.raises(SamplingError):
        batcher.submit(Request("Hi", sampling=SamplingParams(temperature=-1)))
    ok = batcher.submit(Request(PROMPTS[0], max_new_tokens=5, chat_template=False))  # still serving
    assert len(ok.result().token_ids) == 5
    batcher.close()
