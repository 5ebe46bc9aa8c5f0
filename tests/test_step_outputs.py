"""Step outputs are passed, not remembered: ``commit`` and ``propose`` take the ``StepOutput`` of the step they follow.

A backend allocates its buffers once, so they hold one step's new K/V and hidden states: its latest. Called with an
older step's output (out of the loop's order: a second step ran in between), every backend refuses in one typed error
rather than commit or propose from the later step's rows; called with the latest, it does what the loop does.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import medusa_model

from medusa_trt.runtime.contract import StaleStepError, StepOutput
from medusa_trt.runtime.medusa import MedusaRuntime


@pytest.fixture(scope="module")
def engine(stories_base, stories_fitted, export_engine):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


def _open(kind: str, engine, stories_base, stories_fitted):
    if kind == "torch":
        return MedusaRuntime(medusa_model(stories_base, stories_fitted), max_batch=2, max_context=64).backend
    if kind == "native":
        from medusa_trt.runtime.backends.native_backend import open_native

        return open_native(engine, max_batch=2, max_context=64, threads=2)
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    return OnnxBackend(engine, max_batch=2, max_context=64, threads=2)


def _step(backend, tokens: list[int], start: int = 0) -> StepOutput:
    n = len(tokens)
    return backend.step(
        np.array([tokens, tokens[::-1]]),
        start + np.arange(n)[None].repeat(2, 0),
        np.tri(n, dtype=bool)[None].repeat(2, 0),
        np.full(2, start),
    )


@pytest.mark.parametrize("kind", ["onnxruntime", "native", "torch"])
def test_an_older_step_output_is_refused_and_the_latest_commits_and_proposes(kind, engine, stories_base, stories_fitted):
    backend = _open(kind, engine, stories_base, stories_fitted)
    first = _step(backend, [5, 6, 7, 8])
    second = _step(backend, [9, 10, 11, 12])
    nodes, counts, lengths = np.tile(np.arange(4), (2, 1)), np.array([4, 4]), np.zeros(2, dtype=np.int64)
    roots = np.array([3, 4])
    with pytest.raises(StaleStepError, match="output of step 1, but the backend has run step 2 since"):
        backend.commit(first, nodes, counts, lengths)
    with pytest.raises(StaleStepError, match="propose right after the step whose output it takes"):
        backend.propose(first, np.array([3, 3]), 2, roots)
    with pytest.raises(TypeError, match="takes the StepOutput of the step it follows"):
        backend.commit(nodes, counts, lengths, lengths)  # the old call, without the output: refused, not misread
    proposals = backend.propose(second, np.array([3, 1]), 2, roots)  # the latest: the heads at its nodes
    assert proposals.ids.shape[0] == 2
    backend.commit(second, nodes, counts, lengths)
    # what was committed is the second step's K/V: a step after it sees the second prompt, as a fresh run of it does
    after = _step(backend, [13], start=4).logits()[:, 0].copy()
    fresh = _open(kind, engine, stories_base, stories_fitted)
    out = _step(fresh, [9, 10, 11, 12])
    fresh.commit(out, nodes, counts, lengths)
    np.testing.assert_array_equal(after, _step(fresh, [13], start=4).logits()[:, 0])
