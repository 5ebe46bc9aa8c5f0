"""Cost-aware drafting on every engine: the engine's own measured step cost.

The exporter times an engine folder it writes and records the curve (drafting.json ``step_cost``
and ``heads_cost``); the runtime's budget reads it, and where no tree could beat plain decoding
even with every draft accepted (a steep curve), default drafting is plain decoding, by design.
The steep engine here is a real one behind a backend that sleeps in proportion to the tokens of
a step, as an int4 engine's cost grows.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import numpy as np
import pytest

from medusa_trt.runtime.drafting import CostModel
from medusa_trt.runtime.drafting.builder import DEFAULT_STEP_COST
from medusa_trt.runtime.step_cost import drafting_pays, measure


class SteepBackend:
    """A real backend whose steps cost ``unit`` x tokens^2 seconds more (and the heads call ``heads`` seconds):
    steeper than linear, as an int4 engine's cost grows past a few tokens."""

    def __init__(self, inner, unit: float = 0.002, heads: float = 0.002):
        self.inner, self.unit, self.heads = inner, unit, heads
        self.meta, self.max_tokens, self.max_context = inner.meta, inner.max_tokens, inner.max_context

    def step(self, input_ids, position_ids, tree_mask, cache_lengths, *, logits=True):
        time.sleep(self.unit * (input_ids.shape[0] * input_ids.shape[1]) ** 2)
        return self.inner.step(input_ids, position_ids, tree_mask, cache_lengths)

    def propose(self, output, nodes, top_k, roots=None):
        time.sleep(self.heads)
        return self.inner.propose(output, nodes, top_k, roots)


@pytest.fixture(scope="module")
def folder(stories_base, stories_fitted, tmp_path_factory):
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.exporter.wrapper import MedusaModel

    out = tmp_path_factory.mktemp("cost") / "engine"
    config = ExportConfig(out=out, tree="chain-3", max_batch=2, max_context=320, backend="onnxruntime")
    export_onnx(MedusaModel(stories_base, stories_fitted), config)
    return out


def test_export_records_the_engines_own_cost(folder):
    drafting = json.loads((folder / "drafting.json").read_text())
    table = {int(k): v for k, v in drafting["step_cost"].items()}
    assert sorted(table) == [1, 2, 4, 8, 16, 32, 64] and table[1] == 1.0 and all(v > 0 for v in table.values())
    assert drafting["heads_cost"] > 0


def test_the_default_table_lets_drafting_pay():
    assert drafting_pays(CostModel(dict(DEFAULT_STEP_COST)), 0.2, 64, 8)
    assert not drafting_pays(CostModel({1: 1.0, 64: 64.0}), 0.0, 64, 8)  # a tree costs what its tokens would plain
    assert not drafting_pays(CostModel({1: 1.0, 2: 2.1, 8: 5.0, 64: 40.0}), 0.0, 64, 1)  # one draft deep: at most 2 tokens
    assert not drafting_pays(CostModel(dict(DEFAULT_STEP_COST)), 0.2, 1, 8)


def test_a_steep_engine_decodes_plain_by_default(folder, tmp_path):
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    steep = measure(SteepBackend(OnnxBackend(folder, max_batch=1)), sizes=(1, 2, 4, 8, 16), repeats=2, top_k=1)
    assert steep.table[2] > 2 and steep.table[16] > 50 and steep.heads > 0.2
    assert not drafting_pays(CostModel(steep.table), steep.heads, 64, 8)

    from medusa_trt.exporter.engine_folder import record_step_cost

    work = tmp_path / "steep"
    shutil.copytree(folder, work)
    record_step_cost(work, steep.table, steep.heads)  # what medusa-calibrate does with what it measured
    assert json.loads((work / "drafting.json").read_text())["heads_cost"] == pytest.approx(steep.heads)
    rt = MedusaRuntime(work)
    assert rt.drafting.names == ()  # no tree can pay: plain decoding, no heads call
    flat = MedusaRuntime(folder)
    assert flat.drafting.names == ("heads", "lookup", "recycle")  # the same engine at its own (flatter) cost drafts
    prompt = "Once upon a time"
    got = rt.generate(prompt, max_new_tokens=24)
    assert got.token_ids == flat.plain().generate(prompt, max_new_tokens=24).token_ids
    assert set(got.stats.accepted_per_step) == {1} and got.stats.drafted_tokens == 0 and got.stats.heads_seconds == 0.0
    explicit = MedusaRuntime(work, drafters=("heads",))  # asked for, the heads still draft
    assert explicit.drafting.names == ("heads",)
    assert np.isfinite(steep.step_ms)


def test_heads_the_budget_never_keeps_rest(folder, tmp_path):
    """A heads call costs a share of every step: when the budget keeps none of their nodes (here a
    verify cost that makes any tree lose) HEADS_IDLE steps in a row, the sequence stops calling them
    for HEADS_REST steps."""
    from medusa_trt.exporter.engine_folder import record_step_cost
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.drafting.heads import HEADS_IDLE, HEADS_REST

    work = tmp_path / "rest"
    shutil.copytree(folder, work)
    record_step_cost(work, {1: 1.0, 2: 3.0, 64: 100.0}, 0.1)
    rt = MedusaRuntime(work, drafters=("heads",))  # asked for: the runtime drafts with them, the budget keeps no node
    calls = []
    propose = rt.backend.propose
    rt.backend.propose = lambda *a, **k: calls.append(1) or propose(*a, **k)
    got = rt.generate("Once upon a time", max_new_tokens=40)
    steps = got.stats.steps
    assert got.stats.drafted_tokens == 0 and steps >= 30
    period = HEADS_IDLE + HEADS_REST  # HEADS_IDLE steps with the heads, then HEADS_REST without
    assert len(calls) <= 1 + (steps // period + 1) * (HEADS_IDLE + 1) and len(calls) < steps * 0.6
    assert got.token_ids == rt.plain().generate("Once upon a time", max_new_tokens=40).token_ids


class WidthDependentBackend:
    """A real backend whose logits drift by 1e-3 per token of the step: a kernel whose rounding
    depends on how many rows share a call (as MatMulNBits at 128-weight blocks does)."""

    def __init__(self, inner):
        self.inner = inner
        self.meta, self.max_tokens, self.max_context = inner.meta, inner.max_tokens, inner.max_context

    def step(self, input_ids, position_ids, tree_mask, cache_lengths, *, logits=True):
        out = self.inner.step(input_ids, position_ids, tree_mask, cache_lengths)
        logits = out.logits() + 1e-3 * (input_ids.shape[1] - 1)
        return dataclasses.replace(out, _logits=lambda: logits)

    def commit(self, output, nodes, counts, cache_lengths):
        self.inner.commit(output, nodes, counts, cache_lengths)


def test_export_probes_that_verify_steps_are_plain_steps(folder):
    """The exporter checks on the engine it wrote that a verify step (a chain and a tree) gives each
    token its plain-step logits bit for bit, and records it; a backend whose arithmetic depends on
    the step's width fails the same probe with the size of the drift."""
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.exactness import probe

    recorded = json.loads((folder / "drafting.json").read_text())["exactness"]
    assert recorded == {"verify_equals_plain": True, "max_logit_diff": 0.0, "tokens": 8}
    backend = OnnxBackend(folder, max_batch=1)
    assert probe(backend).exact
    drift = probe(WidthDependentBackend(backend))
    assert not drift.exact and drift.tokens == 8 and drift.max_diff == pytest.approx(4e-3, rel=1e-3)  # the 5-node tree


def test_a_folder_recorded_inexact_warns_at_load(folder, tmp_path, caplog):
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.manifest import write_manifest

    work = tmp_path / "inexact"
    shutil.copytree(folder, work)
    drafting = json.loads((work / "drafting.json").read_text())
    drafting["exactness"] = {"verify_equals_plain": False, "max_logit_diff": 1.78, "tokens": 8}
    (work / "drafting.json").write_text(json.dumps(drafting))
    write_manifest(EngineFiles.locate(work))
    with caplog.at_level("WARNING", logger="medusa_trt.runtime.medusa"):
        MedusaRuntime(work)
    assert "verify steps differ from its plain steps (max logit difference 1.78" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_trt.runtime.medusa"):
        MedusaRuntime(folder)
    assert "differ from its plain steps" not in caplog.text
