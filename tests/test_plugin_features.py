"""The plugin form (``--attention plugin``) of models whose layers ask for a sliding window, logit
soft-capping and attention sinks: a tiny Gemma-2 (window 6 on alternate layers, soft-cap 2.0,
query_pre_attn_scalar 8), a tiny gpt-oss (sinks on every layer, window 6 on two of three), and a
Mistral (every layer windowed) and a Gemma-3 (window mix, qk-norm), the rows of
``tests/architectures.py``.

Each is exported with one ``medusa_trt::TreeAttention`` node per layer and run in ONNX Runtime
through the node's fallback function, against

  * ``transformers``' own eager forward on a prefill longer than the window, and
  * the standard form in torch (the reference math on ``position_ids``) on a tree step over a
    committed cache, with a branch deeper than the window (tree keys past it, not just slots).

Then each feature is dropped from the graph (``window`` 0, ``softcap`` 0, sinks -inf): the match
breaks, so the match above proves the plugin form honours the feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from architectures import ARCHITECTURES, WINDOW, save_fixture

onnx = pytest.importorskip("onnx")
import onnxruntime as ort
import torch

from medusa_trt.exporter import MedusaModel, load_base_model
from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION as SPEC
from medusa_trt.runtime.contract import STEP_INPUTS

# what each fixture makes count; Mistral (every layer windowed) and Gemma-3 (window mix, qk-norm) complete the
# rows of docs/models.md whose plugin form needs a feature
FAMILIES = {"gemma2": ("window", "softcap"), "gpt_oss": ("window", "sinks"), "mistral": ("window",), "gemma3_text": ("window",)}
ATOL = 2e-4  # fp32 logits of ~1-10 through three layers, ONNX Runtime vs torch
# a tree of 9 nodes whose deepest branch (0 -> 1 -> ... -> 7) is deeper than the window: node 7 is
# 7 positions past the root, so it must not see the root's key; node 8 branches off the root
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 6, 0]


@dataclass
class Family:
    name: str
    folder: Path
    model: MedusaModel  # the standard form in torch
    proto: onnx.ModelProto  # the plugin-form step graph, fallback attached


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """bool [T, T]: node i sees itself and its ancestors."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, stories_base) -> Family:
    arch = next(a for a in ARCHITECTURES if a.model_type == request.param)
    folder = save_fixture(arch, tmp_path_factory.mktemp(request.param), stories_base.tokenizer)
    model = MedusaModel(load_base_model(folder), None).eval()
    out = tmp_path_factory.mktemp(f"{request.param}-plugin") / "model.onnx"
    export_onnx(model, ExportConfig(out=out, attention="plugin", max_batch=2, max_context=64, max_tokens=16))
    return Family(request.param, folder, model, onnx.load(str(out)))


def _run(proto: onnx.ModelProto, feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # a graph with its sinks dropped leaves their weights unused: no warning
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {k: v.numpy() for k, v in feeds.items()})))


def _tree_step(model: MedusaModel) -> dict[str, torch.Tensor]:
    """Step inputs: a batch of two over a random committed cache (one longer than the window, one
    shorter), the deep tree, positions = cache_lengths + depth."""
    spec = model.kv_spec
    gen = torch.Generator().manual_seed(0)
    mask = _tree_mask(PARENTS).expand(2, -1, -1)
    lengths = torch.tensor([20, 4])
    past_key, past_value = (torch.randn(24, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, generator=gen) for _ in range(2))
    ids = torch.randint(3, model.vocab_size, (2, len(PARENTS)), generator=gen)
    positions = lengths[:, None] + mask.sum(-1) - 1
    return dict(zip(STEP_INPUTS, (ids, positions, mask.contiguous(), lengths, past_key, past_value)))


def _standard(model: MedusaModel, feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    assert model.attention_form == "onnx"  # the plugin export traced a view: the model keeps its form
    with torch.no_grad():
        logits, hidden, _, new_key, new_value = model(*feeds.values())
    return dict(logits=logits.numpy(), hidden=hidden.numpy(), new_key=new_key.numpy(), new_value=new_value.numpy())


def _max_diff(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    return {name: float(np.abs(got[name] - want[name]).max()) for name in want}


def test_one_node_per_layer_carries_its_features(family):
    layers = family.model.attention.layers
    nodes = [n for n in family.proto.graph.node if (n.domain, n.op_type) == (SPEC.domain, SPEC.op_type)]
    assert len(nodes) == len(layers)
    initializers = {t.name: t for t in family.proto.graph.initializer}
    for i, (node, layer) in enumerate(zip(nodes, layers)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["layer"] == i and attrs["scale"] == pytest.approx(layer.scale)
        assert attrs["window"] == (layer.window or 0) and attrs["softcap"] == pytest.approx(layer.softcap or 0.0)
        if layer.sinks:  # the layer's learnt sinks, as a weight of the graph
            sinks = onnx.numpy_helper.to_array(initializers[node.input[7]])
            want = family.model.base.model.layers[i].self_attn.sinks.detach().numpy()
            np.testing.assert_array_equal(sinks, want)
    assert {layer.window for layer in layers} == ({WINDOW} if family.name == "mistral" else {WINDOW, None})  # sliding and full layers
    asked = {name for name in ("window", "softcap", "sinks") if any(getattr(layer, name) for layer in layers)}
    assert asked == set(FAMILIES[family.name])


def test_check_form_refuses_only_what_the_spec_lacks(family, monkeypatch):
    """The plugin form takes both models; a spec without one of their features would be refused, naming it."""
    import dataclasses

    from medusa_trt.exporter.architecture import UnsupportedModelError
    from medusa_trt.plugins.tree_attention import spec

    family.model.check_form("plugin")
    family.model.check_form("onnx")
    missing = FAMILIES[family.name][-1]
    lesser = dataclasses.replace(SPEC, features=tuple(f for f in SPEC.features if f != missing))
    monkeypatch.setattr(spec, "TREE_ATTENTION", lesser)
    with pytest.raises(
        UnsupportedModelError, match=f"does not implement this {family.name} model's {missing}: export with --attention onnx"
    ):
        family.model.check_form("plugin")


def test_prefill_matches_transformers(family):
    """A 14-token prompt (the window is 6) from an empty cache: the plugin form in ONNX Runtime
    gives ``transformers``' eager logits."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(family.folder, attn_implementation="eager").eval()
    spec = family.model.kv_spec
    ids = torch.randint(3, family.model.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    empty = torch.zeros(0, spec.num_layers, 1, spec.num_kv_heads, spec.head_dim)
    mask = torch.ones(14, 14, dtype=torch.bool).tril()[None]
    feeds = dict(zip(STEP_INPUTS, (ids, torch.arange(14)[None], mask, torch.tensor([0]), empty, empty)))
    got = _run(family.proto, feeds)["logits"]
    with torch.no_grad():
        want = reference(ids).logits.numpy()
    diff = float(np.abs(got - want).max())
    assert diff < ATOL, f"{family.name}: plugin-form prefill logits differ from transformers by {diff:.3g}"


def test_tree_step_matches_standard_form(family):
    feeds = _tree_step(family.model)
    diffs = _max_diff(_run(family.proto, feeds), _standard(family.model, feeds))
    assert max(diffs.values()) < ATOL, f"{family.name}: plugin form in ONNX Runtime vs the standard form in torch: {diffs}"


def _drop(proto: onnx.ModelProto, feature: str) -> onnx.ModelProto:
    """A copy of the plugin-form graph with ``feature`` dropped from every node."""
    dropped = onnx.ModelProto()
    dropped.CopyFrom(proto)
    num_q_heads = None
    for node in dropped.graph.node:
        if (node.domain, node.op_type) != (SPEC.domain, SPEC.op_type):
            continue
        if feature == "sinks":
            if num_q_heads is None:
                num_q_heads = next(onnx.numpy_helper.to_array(t).shape[0] for t in dropped.graph.initializer if t.name == node.input[7])
                none = np.full((num_q_heads,), -np.inf, dtype=np.float32)
                dropped.graph.initializer.append(onnx.numpy_helper.from_array(none, "dropped_sinks"))
            node.input[7] = "dropped_sinks"
            continue
        for attr in node.attribute:
            if attr.name == feature:
                attr.CopyFrom(onnx.helper.make_attribute(feature, 0 if feature == "window" else 0.0))
    return dropped


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
def test_dropping_a_feature_breaks_the_match(family, feature):
    if feature not in FAMILIES[family.name]:
        pytest.skip(f"the {family.name} fixture has no {feature}")
    feeds = _tree_step(family.model)
    diffs = _max_diff(_run(_drop(family.proto, feature), feeds), _standard(family.model, feeds))
    assert diffs["logits"] > 1e-2, f"{family.name} without its {feature} still matches the standard form ({diffs}): the tests prove nothing"
