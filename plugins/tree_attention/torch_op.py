"""The tree-attention op as a torch custom op, and its translation into the ONNX node of ``spec``.

``torch.ops.medusa_trt.tree_attention`` takes the op's inputs in spec order (the whole slot-major
cache, the tree mask, the cache lengths and the per-head sinks, -inf for none) and its four
attributes (``layer``, ``scale``, ``window`` and ``softcap``, 0 for none). Its eager implementation
is the reference math (``kernel.reference_from_spec``), so a model that calls it still runs in
torch (the exporter's verification does); ``torch.export`` keeps it as one opaque node, and
``onnx_translation_table()`` turns that node into one ``medusa_trt::TreeAttention`` node for
``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``.

The dynamo exporter builds ONNX nodes through onnxscript, which looks every op up in ONNX's schema
registry; ``register_onnx_schema()`` puts the spec's signature there (idempotent), which also lets
the ONNX checker and shape inference see the node's types.
"""

from __future__ import annotations

import torch

from medusa_trt.plugins.tree_attention.kernel import reference_from_spec
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
    sinks: torch.Tensor,  # [Hq] per-head sink logits, -inf where none
    layer: int,
    scale: float,
    window: int,  # 0: none
    softcap: float,  # 0: none
) -> torch.Tensor:
    """The op in the node's own terms (positional, every input and attribute present): [B, Hq, T, D]."""
    inputs = (query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks)
    return reference_from_spec(*inputs, layer=layer, scale=scale, window=window, softcap=softcap)


@torch.library.custom_op(OP_NAME, mutates_args=())
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    tree_mask: torch.Tensor,
    cache_lengths: torch.Tensor,
    sinks: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    inputs = (query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks)
    return reference_attend(*inputs, layer, scale, window, softcap).contiguous()


@tree_attention.register_fake
def _(query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks, layer, scale, window, softcap):
    return query.new_empty(query.shape)  # (B, Hq, T, D), like the query


# ONNX type constraint of each input, in spec order: query, key, value, past_key, past_value (T), tree_mask (M),
# cache_lengths (I), sinks (T)
_INPUT_TYPES = dict(zip(TREE_ATTENTION.inputs, ("T", "T", "T", "T", "T", "M", "I", "T"), strict=True))
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_ATTRIBUTES = {  # name -> (ONNX attribute type name, description), in spec order
    "layer": ("INT", "decoder layer: which L-slice of the cache to read"),
    "scale": ("FLOAT", "softmax scale"),
    "window": ("INT", "sliding window: a query at position p sees keys at positions > p - window (0: none)"),
    "softcap": ("FLOAT", "logit soft-capping c: scores = c * tanh(scores / c) before the mask (0: none)"),
}


def register_onnx_schema() -> None:
    """Register the spec's node signature with ONNX (once per process)."""
    import onnx
    from onnx.defs import OpSchema

    spec = TREE_ATTENTION
    if onnx.defs.has(spec.op_type, spec.version, spec.domain):
        return
    assert tuple(_ATTRIBUTES) == spec.attributes, "out of step with spec.TREE_ATTENTION"
    schema = OpSchema(
        spec.op_type,
        spec.domain,
        spec.version,
        doc="Tree attention over the slot-major KV cache (medusa_trt.plugins.tree_attention.spec).",
        inputs=[OpSchema.FormalParameter(name, _INPUT_TYPES[name]) for name in spec.inputs],
        outputs=[OpSchema.FormalParameter(name, "T") for name in spec.outputs],
        type_constraints=[
            ("T", _FLOAT_TYPES, "query, key, value, cache, sinks and output"),
            ("M", ["tensor(bool)"], "tree mask"),
            ("I", ["tensor(int64)"], "cache lengths"),
        ],
        attributes=[OpSchema.Attribute(name, getattr(OpSchema.AttrType, kind), doc) for name, (kind, doc) in _ATTRIBUTES.items()],
    )
    onnx.defs.register_schema(schema)


def onnx_translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``: our torch op -> one spec node."""
    from onnxscript.values import Opset

    register_onnx_schema()
    opset = Opset(TREE_ATTENTION.domain, TREE_ATTENTION.version)
    make_node = getattr(opset, TREE_ATTENTION.op_type)

    def translate(
        query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks, layer: int, scale: float, window: int, softcap: float
    ):
        inputs = (query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks)
        return make_node(*inputs, layer=layer, scale=scale, window=window, softcap=softcap)

    return {torch.ops.medusa_trt.tree_attention.default: translate}
