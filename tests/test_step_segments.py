"""A step graph cut at its attentions, the host kernel between the pieces: the graph's numbers, and a verify
step equal to plain steps bit for bit through the whole model."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STORIES, medusa_model

from medusa_trt.runtime.backends.onnx_backend import with_gate
from medusa_trt.runtime.engine import read_meta
from medusa_trt.runtime.host_attention import HostAttention
from medusa_trt.runtime.step_segments import NotSegmentable, SegmentedStep, cut

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")
PARENTS = [-1, 0, 0, 2, 1, 4]  # node 2 a sibling of node 1, node 3 its child, ...


@pytest.fixture(scope="module")
def step(export_engine, stories_base, stories_fitted):
    return export_engine("stories-lean-True", medusa_model(stories_base, stories_fitted), lean=True)


@pytest.fixture(scope="module")
def segmented(step):
    kernel = HostAttention()  # the native library, built with the package
    return SegmentedStep(step, kernel, shared_pool=False, threads=1)


def _mask(parents):
    mask = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def _feeds(meta, rng, past, ids, mask, cache):
    batch, tokens = ids.shape
    depth = mask.sum(axis=-1) - 1
    return {
        "input_ids": ids,
        "position_ids": past[:, None] + depth,
        "tree_mask": mask,
        "cache_lengths": past,
        "past_key": cache[0],
        "past_value": cache[1],
        "key_slots": past[:, None] + np.arange(tokens)[None],
    }


def _cache(meta, rng, slots, batch):
    shape = (slots, meta.num_layers, batch, meta.num_kv_heads, meta.head_dim)
    return rng.standard_normal(shape, dtype=np.float32) * 0.5, rng.standard_normal(shape, dtype=np.float32) * 0.5


def test_cut_at_every_layer(step, segmented):
    import onnx

    meta = read_meta(step)
    plan = segmented.plan
    assert len(plan.layers) == meta.num_layers and len(plan.segments) == meta.num_layers + 1
    assert "new_key" not in plan.outputs and {"logits", "next_ids", "hidden"} <= set(plan.outputs)
    ops = {n.op_type for s in plan.segments for n in s.model.graph.node}
    assert not ops & {"Attention", "ScatterElements"}, "the cache's copies and the attention are gone"
    for segment in plan.segments:
        onnx.checker.check_model(segment.model)


def test_the_graphs_numbers(step, segmented):
    import onnxruntime as ort

    meta = read_meta(step)
    rng = np.random.default_rng(0)
    past, tokens = np.array([11, 7]), len(PARENTS)
    mask = np.broadcast_to(_mask(PARENTS), (2, tokens, tokens)).copy()
    ids = rng.integers(0, meta.vocab_size, (2, tokens))
    feed = _feeds(meta, rng, past, ids, mask, _cache(meta, rng, 11 + tokens, 2))
    graph = ort.InferenceSession(str(step), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in graph.get_outputs()], graph.run(None, with_gate(graph, feed))))
    got, new = segmented.run(feed)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    assert np.array_equal(got["next_ids"], want["next_ids"])
    for layer, (key, value) in enumerate(new):  # (B, Hkv, T, D), the graph's new_key (T, layers, B, Hkv, D)
        np.testing.assert_allclose(key, want["new_key"][:, layer].transpose(1, 2, 0, 3), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(value, want["new_value"][:, layer].transpose(1, 2, 0, 3), rtol=1e-4, atol=1e-5)


def test_a_verify_step_is_plain_steps_bit_for_bit(step, segmented):
    """Every node of a tree, scored in one step, equals the node scored alone after its ancestors were
    committed from that step's keys: the logits, bit for bit, in both rows of a batch."""
    meta = read_meta(step)
    rng = np.random.default_rng(1)
    past, tokens = np.array([13, 4]), len(PARENTS)
    mask = np.broadcast_to(_mask(PARENTS), (2, tokens, tokens)).copy()
    ids = rng.integers(0, meta.vocab_size, (2, tokens))
    cache = _cache(meta, rng, 13 + tokens, 2)
    verify, new = segmented.run(_feeds(meta, rng, past, ids, mask, cache))
    for node in range(tokens):
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        ancestors = path[:0:-1]
        committed = [c.copy() for c in cache]
        for layer, kv in enumerate(new):
            for row in range(2):
                for depth, a in enumerate(ancestors):
                    for c, x in zip(committed, kv):
                        c[past[row] + depth, layer, row] = x[row, :, a]
        one = np.ones((2, 1, 1), bool)
        plain, _ = segmented.run(_feeds(meta, rng, past + len(ancestors), ids[:, node : node + 1], one, committed))
        assert np.array_equal(plain["logits"][:, 0], verify["logits"][:, node]), f"node {node}"


def test_refuses_what_the_kernel_does_not_compute(step):
    import onnx
    from onnx import helper

    model = onnx.load(str(step), load_external_data=False)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    del attention.attribute[:]
    attention.attribute.extend([helper.make_attribute("softcap", 30.0), helper.make_attribute("scale", 0.1)])
    with pytest.raises(NotSegmentable, match="soft-capping"):
        cut(model)


def test_the_ab_script_times_every_form(step, segmented, tmp_path):
    """scripts/segmented_step_ab.py in a process of its own (it sets the process's one thread pool)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "ab.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "segmented_step_ab.py"
    args = ["--engine", str(step), "--context", "9", "--tokens", "2", "--rounds", "2", "--threads", "1", "--out", str(out)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())["engines"][str(step)]
    assert set(report["median_ms"]) == {"graph", "host", "segments_only"}
    assert report["against_graph"]["9 cached, 2 tokens"]["max_logit_diff"] < 1e-3  # fp32: rounding only
    bad = subprocess.run([sys.executable, str(script), "--engine", str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
