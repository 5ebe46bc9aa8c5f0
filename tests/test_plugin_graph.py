"""Plugin-form export (``--attention plugin``): one spec node per layer, its CPU fallback in ONNX
Runtime, and the same greedy tokens as the standard graph."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORIES, STORY_PROMPTS, TREES, medusa_model

onnx = pytest.importorskip("onnx")
import onnxruntime as ort
import torch

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter import save_heads
from medusa_trt.plugins.tree_attention.onnx_fallback import count_nodes, fallback_function
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION as SPEC
from medusa_trt.plugins.tree_attention.torch_op import reference_attend, register_onnx_schema
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import read_meta


@pytest.fixture(scope="module")
def standard_engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with test_onnx_export


@pytest.fixture(scope="module")
def plugin_export(tmp_path_factory, stories_fitted):
    """The same model and heads exported through the CLI with --attention plugin: (exit code, stdout, path)."""
    folder = tmp_path_factory.mktemp("plugin-engine")
    heads = save_heads(stories_fitted, folder / "heads")
    out = folder / "model.onnx"
    args = [
        "--model",
        str(STORIES),
        "--heads",
        str(heads),
        "--out",
        str(out),
        "--attention",
        "plugin",
        "--max-context",
        "256",
        "--max-batch",
        "4",
        "--tree",
        "mc_sim_7b_63" if TREES.is_file() else "chain-4",
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = export_main(args)
    return code, stdout.getvalue(), out


@pytest.fixture(scope="module")
def plugin_engine(plugin_export):
    code, _, out = plugin_export
    assert code == 0, "medusa-export --attention plugin failed"
    return out


def test_cli_plugin_export_verifies_against_torch(plugin_export):
    code, stdout, out = plugin_export
    assert code == 0 and any(line.startswith(f"wrote {out}") for line in stdout.splitlines())
    assert "verified against torch: max abs difference" in stdout  # ONNX Runtime ran the plugin form via the fallback
    meta = read_meta(out)
    assert meta.attention == "plugin" and meta.num_heads == 4


def test_one_spec_node_per_layer(plugin_engine, standard_engine, stories_base):
    proto = onnx.load(str(plugin_engine))
    cfg = stories_base.model.config
    nodes = [n for n in proto.graph.node if n.domain == SPEC.domain]
    assert len(nodes) == count_nodes(proto) == cfg.num_hidden_layers
    assert {(n.domain, n.op_type) for n in nodes} == {(SPEC.domain, SPEC.op_type)}
    assert {o.domain: o.version for o in proto.opset_import}[SPEC.domain] == SPEC.version
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for layer, node in enumerate(nodes):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert tuple(sorted(attrs)) == tuple(sorted(SPEC.attributes))
        assert attrs["layer"] == layer and attrs["scale"] == pytest.approx(head_dim**-0.5)
        assert attrs["window"] == 0 and attrs["softcap"] == 0.0  # a Llama: no window, no soft-capping
        assert len(node.input) == len(SPEC.inputs) and len(node.output) == len(SPEC.outputs)
        # the cache, mask and lengths are the graph's own inputs: the plugin reads the whole cache in place
        assert list(node.input[3:7]) == ["past_key", "past_value", "tree_mask", "cache_lengths"]
        assert node.input[7] not in {i.name for i in proto.graph.input}  # sinks: a constant (-inf, none) in the graph
    assert [(f.domain, f.name) for f in proto.functions] == [(SPEC.domain, SPEC.op_type)]  # the CPU fallback
    assert {"Attention", "Softmax"}.isdisjoint(n.op_type for n in proto.graph.node)  # no attention left in standard ops

    standard = onnx.load(str(standard_engine))
    assert count_nodes(standard) == 0 and not standard.functions
    assert {o.domain for o in standard.opset_import} == {""}
    assert read_meta(standard_engine).attention == "onnx"


@pytest.mark.parametrize("batch", [1, 4])
def test_same_tokens_as_standard_graph(plugin_engine, standard_engine, stories_prompts, batch):
    """Greedy Medusa over a branching tree: the plugin form (fallback in ONNX Runtime) and the
    standard graph emit the same tokens, ragged batch included."""
    prompts = stories_prompts[:batch]
    plugin = MedusaRuntime(plugin_engine, tree=CUSTOM_TREE).generate(prompts, max_new_tokens=24)
    standard = MedusaRuntime(standard_engine, tree=CUSTOM_TREE).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in plugin] == [r.token_ids for r in standard]
    assert all(len(r.token_ids) == 24 or r.finish_reason == "stop" for r in plugin)
    assert max(r.stats.mean_accepted for r in plugin) > 1.0, "no draft was ever accepted: the tree was not exercised"


def test_text_round_trip(plugin_engine):
    result = MedusaRuntime(plugin_engine).generate(STORY_PROMPTS[0], max_new_tokens=12)
    assert len(result.token_ids) == 12 and result.text


def test_plugin_form_in_torch_matches_standard(stories_base, stories_fitted):
    """The wrapper's custom op (eager: the reference) gives the standard form's outputs."""
    model = medusa_model(stories_base, stories_fitted).eval()
    spec = model.kv_spec
    gen = torch.Generator().manual_seed(0)
    past = torch.randn(6, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, generator=gen)
    ids = torch.randint(0, model.vocab_size, (2, 4), generator=gen)
    lengths = torch.tensor([6, 3])
    positions = lengths[:, None] + torch.tensor([0, 1, 1, 2])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(2, 4, 4)
    with torch.no_grad():
        standard = model(ids, positions, mask, lengths, past, past * 0.5)
        plugin = model.in_form("plugin")(ids, positions, mask, lengths, past, past * 0.5)
    assert model.attention_form == "onnx" and model.in_form("plugin").base is model.base  # a view: nothing copied
    for a, b in zip(standard, plugin):  # fp32 rounding only: the op's softmax (sinks of -inf included) is not SDPA's
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _single_node_session(opset: int = 23, window: int = 0, softcap: float = 0.0) -> ort.InferenceSession:
    register_onnx_schema()
    helper, tp = onnx.helper, onnx.TensorProto
    attrs = dict(layer=1, scale=0.3, window=window, softcap=softcap)
    node = helper.make_node(SPEC.op_type, list(SPEC.inputs), list(SPEC.outputs), domain=SPEC.domain, **attrs)
    kinds = [tp.FLOAT] * 5 + [tp.BOOL, tp.INT64, tp.FLOAT]
    dims = [
        ["B", "Hq", "T", "D"],
        ["B", "H", "T", "D"],
        ["B", "H", "T", "D"],
        ["S", "L", "B", "H", "D"],
        ["S", "L", "B", "H", "D"],
        ["B", "T", "T"],
        ["B"],
        ["Hq"],
    ]
    graph = helper.make_graph(
        [node],
        "one_node",
        [helper.make_tensor_value_info(n, k, d) for n, k, d in zip(SPEC.inputs, kinds, dims)],
        [helper.make_tensor_value_info(SPEC.outputs[0], tp.FLOAT, ["B", "Hq", "T", "D"])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(SPEC.domain, SPEC.version)],
        functions=[fallback_function(opset)],
    )
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


FEATURES = {
    "none": {},
    "window": dict(window=3),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=True),
    "all": dict(window=2, softcap=1.5, sinks=True),
}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,tokens,slots,lengths",
    [(1, 2, 2, 1, 0, [0]), (2, 4, 2, 5, 7, [7, 3]), (3, 4, 1, 3, 4, [0, 4, 2]), (2, 2, 2, 6, 9, [9, 9]), (2, 8, 2, 7, 9, [9, 5])],
)
def test_fallback_matches_reference(batch, q_heads, kv_heads, tokens, slots, lengths, features):
    """The fallback function in ONNX Runtime against the op's torch reference over swept shapes
    (empty cache, grouped-query heads of ratios 1, 2, 4 and multi-query, ragged lengths, a branching
    mask), with each feature: windows shorter than the cache and the tree's depth, soft-capping,
    sinks (some heads -inf: none), and all three at once. Dropping the feature fails."""
    extra = FEATURES[features]
    window, softcap = extra.get("window", 0), extra.get("softcap", 0.0)
    session = _single_node_session(window=window, softcap=softcap)
    gen = torch.Generator().manual_seed(batch * 100 + slots)
    dim, layers = 8, 2
    query = torch.randn(batch, q_heads, tokens, dim, generator=gen) * (4.0 if softcap else 1.0)
    key, value = (torch.randn(batch, kv_heads, tokens, dim, generator=gen) for _ in range(2))
    past_key, past_value = (torch.randn(slots, layers, batch, kv_heads, dim, generator=gen) for _ in range(2))
    mask = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool)).repeat(batch, 1, 1)
    if tokens > 2:
        mask[:, tokens - 1, 1] = False  # last node not a child of node 1: a branch
    lens = torch.tensor(lengths)
    sinks = torch.full((q_heads,), float("-inf"))
    if extra.get("sinks"):
        sinks = torch.randn(q_heads, generator=gen) * 2.0
        sinks[::3] = float("-inf")
    inputs = (query, key, value, past_key, past_value, mask, lens, sinks)
    expected = reference_attend(*inputs, 1, 0.3, window, softcap)
    (got,) = session.run(None, dict(zip(SPEC.inputs, (t.numpy() for t in inputs))))
    diff = float(np.abs(got - expected.numpy()).max())
    name = f"B={batch} Hq={q_heads} Hkv={kv_heads} T={tokens} S={slots} lengths={lengths} features={features} {extra}"
    assert diff < 1e-5, f"{name}: max diff {diff:.3g}"
    if features == "none" or max(lengths) + tokens <= 2:
        return
    without = reference_attend(*inputs[:7], torch.full_like(sinks, float("-inf")), 1, 0.3, 0, 0.0)  # every feature dropped
    assert float(np.abs(got - without.numpy()).max()) > 1e-2, f"{name}: the features change nothing, so this case does not test them"
