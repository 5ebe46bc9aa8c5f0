"""CPU fallback of the tree-attention node: an ONNX model-local function with the spec's name.

A plugin-form graph (``medusa-export --attention plugin``) holds one ``medusa_trt::TreeAttention``
node per layer. TensorRT runs them with the plugin; everything else needs a body for them. ONNX
lets a model carry a *local function* (a ``FunctionProto`` in ``ModelProto.functions``) whose
domain and name match a node's; a runtime without a kernel for the node inlines the function.
ONNX Runtime does, so the plugin-form graph runs on its CPU provider with no custom-op library
(onnxruntime-extensions' Python ops would serve only the ``ai.onnx.contrib`` domain).

Where it lives: the exporter attaches the function to every plugin-form graph it writes, so the
file is self-contained: the export's own verification, ``MedusaRuntime`` on ONNX Runtime and the
tests run it as is. The TensorRT build strips it (``strip_fallback``) before parsing: TensorRT's
ONNX parser would otherwise import the function body as ordinary layers instead of looking the
node up in its plugin registry.

The body is the reference math (``kernel.reference_from_spec``) in opset-13+ standard ops:

    past      = Transpose(Gather(past_key, layer, axis=1), [1, 2, 0, 3])      (B, Hkv, S, D)
    keys      = Concat(past, key, axis=2)                                      (B, Hkv, S+T, D)
    q         = Reshape(query, [B, Hkv, G, T, D])                              grouped-query heads
    scores    = MatMul(q, keys^T) * scale                                      (B, Hkv, G, T, S+T)
    scores    = Where(softcap > 0, c * Tanh(scores / c), scores)               c = softcap, or 1 when 0
    visible   = Concat(slot < cache_lengths[b] (B, T, S), tree_mask (B, T, T)) (B, T, S+T)
    positions = cache_lengths[b] + ReduceSum(tree_mask, 2) - 1                 (B, T): depth, as the step contract
    behind    = positions (B, T, 1) - Concat(slots, positions) (B, 1, S+T)     committed slot s holds position s
    visible   = visible And (window <= 0 Or behind < window)                   (B, T, S+T)
    logits    = Concat(Where(visible, scores, -inf), sinks (B, Hkv, G, T, 1))  the sink: one more logit
    out       = Reshape(Slice(Softmax(logits), last column dropped) @ values, [B, Hq, T, D])

Attributes at their "none" (window 0, softcap 0) and sinks of -inf leave plain attention: the
Where picks the raw scores, every key passes the window test, and exp(-inf) adds 0 to each sum.
Every row sees at least itself (tree masks hold their diagonal; a window holds position
distance 0), so no softmax row is all -inf.
"""

from __future__ import annotations

from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION


def fallback_function(opset: int):
    """The ``FunctionProto`` of the spec's node, for a model whose default-domain opset is ``opset``."""
    from onnx import AttributeProto, TensorProto, helper

    spec = TREE_ATTENTION
    query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks = spec.inputs  # the function's formal inputs
    n = helper.make_node

    def ints(name: str, values: list[int]):
        return n("Constant", [], [name], value_ints=values)

    def ref(name: str, attr: str, kind):
        """A Constant whose value is the function's attribute ``attr``."""
        value = AttributeProto(name="value_int" if kind == AttributeProto.INT else "value_float", type=kind, ref_attr_name=attr)
        node = helper.make_node("Constant", [], [name])
        node.attribute.append(value)
        return node

    nodes = [
        ref("layer_index", "layer", AttributeProto.INT),  # int64 scalar
        ref("scale_f32", "scale", AttributeProto.FLOAT),
        ref("window", "window", AttributeProto.INT),  # int64 scalar, 0: none
        ref("softcap_f32", "softcap", AttributeProto.FLOAT),  # 0: none
        ints("axis0", [0]),
        ints("axis1", [1]),
        ints("axis2", [2]),
        ints("axes12", [1, 2]),
        ints("minus_one", [-1]),
        ints("ones", [1]),
        ints("zero_1d", [0]),
        n("Constant", [], ["zero"], value_int=0),
        n("Constant", [], ["one"], value_int=1),
        n("Constant", [], ["zero_f32"], value_float=0.0),
        n("Constant", [], ["one_f32"], value_float=1.0),
        n("Constant", [], ["neg_inf_f32"], value_float=float("-inf")),
        # sizes
        n("Shape", [query], ["b"], start=0, end=1),
        n("Shape", [query], ["t"], start=2, end=3),
        n("Shape", [query], ["d"], start=3, end=4),
        n("Shape", [key], ["hkv"], start=1, end=2),
        n("Shape", [past_key], ["s"], start=0, end=1),
        n("Shape", [query], ["query_shape"]),
        # committed cache of this layer, then the new keys/values after it
        n("Gather", [past_key, "layer_index"], ["past_k_sbhd"], axis=1),  # (S, B, Hkv, D)
        n("Gather", [past_value, "layer_index"], ["past_v_sbhd"], axis=1),
        n("Transpose", ["past_k_sbhd"], ["past_k"], perm=[1, 2, 0, 3]),  # (B, Hkv, S, D)
        n("Transpose", ["past_v_sbhd"], ["past_v"], perm=[1, 2, 0, 3]),
        n("Concat", ["past_k", key], ["keys"], axis=2),  # (B, Hkv, S+T, D)
        n("Concat", ["past_v", value], ["values"], axis=2),
        n("Unsqueeze", ["keys", "axis2"], ["keys5"]),  # (B, Hkv, 1, S+T, D)
        n("Unsqueeze", ["values", "axis2"], ["values5"]),
        n("Transpose", ["keys5"], ["keys5_t"], perm=[0, 1, 2, 4, 3]),  # (B, Hkv, 1, D, S+T)
        # grouped-query: query head h reads KV head h // G
        n("Concat", ["b", "hkv", "minus_one", "t", "d"], ["grouped_shape"], axis=0),
        n("Reshape", [query, "grouped_shape"], ["query5"]),  # (B, Hkv, G, T, D)
        n("MatMul", ["query5", "keys5_t"], ["raw_scores"]),  # (B, Hkv, G, T, S+T)
        n("CastLike", ["scale_f32", query], ["scale"]),
        n("Mul", ["raw_scores", "scale"], ["scaled"]),
        # soft-capping: c * tanh(scores / c) where c > 0 (c = 1 stands in elsewhere, never picked)
        n("Greater", ["softcap_f32", "zero_f32"], ["capping"]),
        n("Where", ["capping", "softcap_f32", "one_f32"], ["cap_f32"]),
        n("CastLike", ["cap_f32", query], ["cap"]),
        n("Div", ["scaled", "cap"], ["scores_over_cap"]),
        n("Tanh", ["scores_over_cap"], ["tanh_scores"]),
        n("Mul", ["tanh_scores", "cap"], ["capped"]),
        n("Where", ["capping", "capped", "scaled"], ["scores"]),
        # visibility: committed slots s < cache_lengths[b], then the tree mask
        n("Squeeze", ["s", "axis0"], ["s_scalar"]),
        n("Range", ["zero", "s_scalar", "one"], ["slots"]),  # (S,)
        n("Unsqueeze", ["slots", "axis0"], ["slots_row"]),  # (1, S)
        n("Unsqueeze", [cache_lengths, "axis1"], ["lengths_col"]),  # (B, 1)
        n("Less", ["slots_row", "lengths_col"], ["past_visible"]),  # (B, S)
        n("Unsqueeze", ["past_visible", "axis1"], ["past_visible3"]),  # (B, 1, S)
        n("Concat", ["b", "t", "s"], ["bts"], axis=0),
        n("Expand", ["past_visible3", "bts"], ["past_visible_t"]),  # (B, T, S)
        n("Concat", ["past_visible_t", tree_mask], ["tree_visible"], axis=2),  # (B, T, S+T)
        # sliding window by position: node i at cache_lengths[b] + depth(i), committed slot s at s
        n("Cast", [tree_mask], ["mask_i64"], to=TensorProto.INT64),
        n("ReduceSum", ["mask_i64", "axis2"], ["ancestors_and_self"], keepdims=0),  # (B, T)
        n("Add", ["lengths_col", "ancestors_and_self"], ["positions_plus_one"]),
        n("Sub", ["positions_plus_one", "one"], ["positions"]),  # (B, T)
        n("Concat", ["b", "s"], ["bs"], axis=0),
        n("Expand", ["slots_row", "bs"], ["slot_positions"]),  # (B, S)
        n("Concat", ["slot_positions", "positions"], ["key_positions"], axis=1),  # (B, S+T)
        n("Unsqueeze", ["positions", "axis2"], ["query_positions3"]),  # (B, T, 1)
        n("Unsqueeze", ["key_positions", "axis1"], ["key_positions3"]),  # (B, 1, S+T)
        n("Sub", ["query_positions3", "key_positions3"], ["behind"]),  # (B, T, S+T)
        n("Less", ["behind", "window"], ["in_window"]),
        n("Greater", ["window", "zero"], ["windowed"]),
        n("Not", ["windowed"], ["unwindowed"]),
        n("Or", ["in_window", "unwindowed"], ["window_keeps"]),
        n("And", ["tree_visible", "window_keeps"], ["visible"]),  # (B, T, S+T)
        n("Unsqueeze", ["visible", "axes12"], ["visible5"]),  # (B, 1, 1, T, S+T)
        n("CastLike", ["neg_inf_f32", query], ["neg_inf"]),
        n("Where", ["visible5", "scores", "neg_inf"], ["masked"]),
        # sinks: one more logit per query head, dropped after the softmax
        n("Concat", ["hkv", "minus_one", "ones", "ones"], ["sinks_shape"], axis=0),
        n("Reshape", [sinks, "sinks_shape"], ["sinks4"]),  # (Hkv, G, 1, 1)
        n("Concat", ["b", "ones", "ones", "t", "ones"], ["sinks_expand"], axis=0),
        n("Expand", ["sinks4", "sinks_expand"], ["sinks5"]),  # (B, Hkv, G, T, 1)
        n("Concat", ["masked", "sinks5"], ["logits"], axis=-1),  # (B, Hkv, G, T, S+T+1)
        n("Softmax", ["logits"], ["probs_with_sink"], axis=-1),
        n("Slice", ["probs_with_sink", "zero_1d", "minus_one", "minus_one"], ["probs"]),  # last column (the sink) dropped
        n("MatMul", ["probs", "values5"], ["out5"]),  # (B, Hkv, G, T, D)
        n("Reshape", ["out5", "query_shape"], [spec.outputs[0]]),  # (B, Hq, T, D)
    ]
    return helper.make_function(
        spec.domain,
        spec.op_type,
        list(spec.inputs),
        list(spec.outputs),
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=list(spec.attributes),
    )


def attach_fallback(model) -> None:
    """Add the fallback to an ``onnx_ir`` model (the dynamo exporter's ``ONNXProgram.model``) in place."""
    import onnx_ir as ir

    spec = TREE_ATTENTION
    function = ir.serde.deserialize_function(fallback_function(model.opset_imports[""]))
    model.functions[(spec.domain, spec.op_type, "")] = function
    model.opset_imports.setdefault(spec.domain, spec.version)


def strip_fallback(proto) -> bool:
    """Remove the fallback from an ``onnx.ModelProto`` in place; True if it was there."""
    spec = TREE_ATTENTION
    keep = [f for f in proto.functions if (f.domain, f.name) != (spec.domain, spec.op_type)]
    found = len(keep) != len(proto.functions)
    del proto.functions[:]
    proto.functions.extend(keep)
    return found


def count_nodes(proto) -> int:
    """Spec nodes in the main graph of an ``onnx.ModelProto``."""
    return sum(1 for node in proto.graph.node if (node.domain, node.op_type) == (TREE_ATTENTION.domain, TREE_ATTENTION.op_type))
