"""The tree-attention op as a torch custom op, and its translation into the ONNX node of ``spec``.

``torch.ops.medusa_trt.tree_attention`` takes the op's inputs in spec order (the whole slot-major
cache, the tree mask and the cache lengths) and the two attributes. Its eager implementation is the
reference math, so a model that calls it still runs in torch (the exporter's verification does);
``torch.export`` keeps it as one opaque node, and ``onnx_translation_table()`` turns that node into
one ``medusa_trt::TreeAttention`` node for ``torch.onnx.export(..., dynamo=True,
custom_translation_table=...)``.

The dynamo exporter builds ONNX nodes through onnxscript, which looks every op up in ONNX's schema
registry; ``register_onnx_schema()`` puts the spec's signature there (idempotent), which also lets
the ONNX checker and shape inference see the node's types.
"""

from __future__ import annotations

import torch

from medusa_trt.plugins.tree_attention.reference import tree_attention as _tree_attention
from medusa_trt.plugins.tree_attention.reference import visibility_bias
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION

OP_NAME = "medusa_trt::tree_attention"  # the torch op; the ONNX node is TREE_ATTENTION.qualified_name


def reference_attend(
    query: torch.Tensor,  # [B, Hq, T, D], rotary applied
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    past_key: torch.Tensor,  # [S, L, B, Hkv, D] whole committed cache, slot-major
    past_value: torch.Tensor,  # [S, L, B, Hkv, D]
    tree_mask: torch.Tensor,  # bool [B, T, T]
    cache_lengths: torch.Tensor,  # int64 [B]
    layer: int,
    scale: float,
) -> torch.Tensor:
    """The spec's signature over ``reference.tree_attention``: returns [B, Hq, T, D]."""
    past_k = past_key[:, layer].permute(1, 2, 0, 3)  # (S, B, Hkv, D) -> (B, Hkv, S, D)
    past_v = past_value[:, layer].permute(1, 2, 0, 3)
    bias = visibility_bias(cache_lengths, tree_mask, past_key.shape[0], query.dtype)  # (B, 1, T, S+T)
    return _tree_attention(query, key, value, past_k, past_v, bias, scale)


@torch.library.custom_op(OP_NAME, mutates_args=())
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    tree_mask: torch.Tensor,
    cache_lengths: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    return reference_attend(query, key, value, past_key, past_value, tree_mask, cache_lengths, layer, scale).contiguous()


@tree_attention.register_fake
def _(query, key, value, past_key, past_value, tree_mask, cache_lengths, layer, scale):
    return query.new_empty(query.shape)  # (B, Hq, T, D), like the query


# ONNX type constraint of each input, in spec order: query, key, value, past_key, past_value (T), tree_mask (M), cache_lengths (I)
_INPUT_TYPES = dict(zip(TREE_ATTENTION.inputs, ("T", "T", "T", "T", "T", "M", "I"), strict=True))
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def register_onnx_schema() -> None:
    """Register the spec's node signature with ONNX (once per process)."""
    import onnx
    from onnx.defs import OpSchema

    spec = TREE_ATTENTION
    if onnx.defs.has(spec.op_type, spec.version, spec.domain):
        return
    assert spec.attributes == ("layer", "scale"), "out of step with spec.TREE_ATTENTION"
    schema = OpSchema(
        spec.op_type,
        spec.domain,
        spec.version,
        doc="Tree attention over the slot-major KV cache (medusa_trt.plugins.tree_attention.spec).",
        inputs=[OpSchema.FormalParameter(name, _INPUT_TYPES[name]) for name in spec.inputs],
        outputs=[OpSchema.FormalParameter(name, "T") for name in spec.outputs],
        type_constraints=[
            ("T", _FLOAT_TYPES, "query, key, value, cache and output"),
            ("M", ["tensor(bool)"], "tree mask"),
            ("I", ["tensor(int64)"], "cache lengths"),
        ],
        attributes=[
            OpSchema.Attribute("layer", OpSchema.AttrType.INT, "decoder layer: which L-slice of the cache to read"),
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale"),
        ],
    )
    onnx.defs.register_schema(schema)


def onnx_translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``: our torch op -> one spec node."""
    from onnxscript.values import Opset

    register_onnx_schema()
    opset = Opset(TREE_ATTENTION.domain, TREE_ATTENTION.version)
    make_node = getattr(opset, TREE_ATTENTION.op_type)

    def translate(query, key, value, past_key, past_value, tree_mask, cache_lengths, layer: int, scale: float):
        return make_node(query, key, value, past_key, past_value, tree_mask, cache_lengths, layer=layer, scale=scale)

    return {torch.ops.medusa_trt.tree_attention.default: translate}
