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
    assert code == 0 and stdout.startswith(f"wrote {out}")
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
        assert len(node.input) == len(SPEC.inputs) and len(node.output) == len(SPEC.outputs)
        # the cache, mask and lengths are the graph's own inputs: the plugin reads the whole cache in place
        assert list(node.input[3:]) == ["past_key", "past_value", "tree_mask", "cache_lengths"]
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
        model.attention_form = "plugin"
        plugin = model(ids, positions, mask, lengths, past, past * 0.5)
    for a, b in zip(standard, plugin):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _single_node_session(opset: int = 23) -> ort.InferenceSession:
    register_onnx_schema()
    helper, tp = onnx.helper, onnx.TensorProto
    node = helper.make_node(SPEC.op_type, list(SPEC.inputs), list(SPEC.outputs), domain=SPEC.domain, layer=1, scale=0.3)
    kinds = [tp.FLOAT] * 5 + [tp.BOOL, tp.INT64]
    dims = [
        ["B", "Hq", "T", "D"],
        ["B", "H", "T", "D"],
        ["B", "H", "T", "D"],
        ["S", "L", "B", "H", "D"],
        ["S", "L", "B", "H", "D"],
        ["B", "T", "T"],
        ["B"],
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


@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,tokens,slots,lengths",
    [(1, 2, 2, 1, 0, [0]), (2, 4, 2, 5, 7, [7, 3]), (3, 4, 1, 3, 4, [0, 4, 2]), (2, 2, 2, 6, 9, [9, 9])],
)
def test_fallback_matches_reference(batch, q_heads, kv_heads, tokens, slots, lengths):
    """The fallback function in ONNX Runtime against the torch reference over swept shapes
    (empty cache, grouped-query heads, ragged lengths, a branching mask)."""
    session = _single_node_session()
    gen = torch.Generator().manual_seed(batch * 100 + slots)
    dim, layers = 8, 2
    query = torch.randn(batch, q_heads, tokens, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, tokens, dim, generator=gen) for _ in range(2))
    past_key, past_value = (torch.randn(slots, layers, batch, kv_heads, dim, generator=gen) for _ in range(2))
    mask = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool)).repeat(batch, 1, 1)
    if tokens > 2:
        mask[:, tokens - 1, 1] = False  # last node not a child of node 1: a branch
    lens = torch.tensor(lengths)
    expected = reference_attend(query, key, value, past_key, past_value, mask, lens, 1, 0.3)
    feeds = dict(zip(SPEC.inputs, (t.numpy() for t in (query, key, value, past_key, past_value, mask, lens))))
    (got,) = session.run(None, feeds)
    diff = float(np.abs(got - expected.numpy()).max())
    assert diff < 1e-5, f"B={batch} Hq={q_heads} Hkv={kv_heads} T={tokens} S={slots} lengths={lengths}: max diff {diff:.3g}"
