"""The tree-attention custom op as an ONNX node: defined once here, used by the exporter
(``--attention plugin``), the CPU fallback, the TensorRT registration and the tests.

One node per decoder layer (version 2):

  inputs
    0 query         float [B, Hq, T, D]       rotary applied
    1 key           float [B, Hkv, T, D]      keys of the T new (tree) tokens
    2 value         float [B, Hkv, T, D]
    3 past_key      float [S, L, B, Hkv, D]   the whole committed cache, slot-major (read in place)
    4 past_value    float [S, L, B, Hkv, D]
    5 tree_mask     bool  [B, T, T]           node i sees node j
    6 cache_lengths int64 [B]                 committed slots per sequence (S >= max)
    7 sinks         float [Hq]                per-query-head sink logit; -inf where the layer has none
  attributes
    layer   int    which L-slice of the cache this node reads
    scale   float  softmax scale (1/sqrt(D) unless the model says otherwise)
    window  int    sliding window W: a query at position p sees keys at positions > p - W (0: none)
    softcap float  logit soft-capping c: scores = c * tanh(scores / c) before the mask (0: none)
  output
    0 out           float [B, Hq, T, D]       same dtype as query

Hq must be a multiple of Hkv (grouped-query attention: query head h reads KV head h // (Hq // Hkv)).
The math is ``reference.tree_attention``; the op's own reference over this signature is
``kernel.reference_from_spec``.

Positions (sliding windows) come from the inputs, no position input: the step contract gives the
new token of tree node i the position ``cache_lengths[b] + depth(i)``, depth being its number of
ancestors, ``tree_mask[b, i].sum() - 1``; committed slot s holds position s.

Sinks are a tensor input, not an attribute: they are learnt weights in the model's dtype, and
TensorRT's Python plugin API (``tensorrt.plugin``) takes a fixed list of tensor inputs, none
optional. A layer without sinks passes -inf for every head: an extra logit of -inf adds
exp(-inf) = 0 to each softmax's sum, so the output is plain attention, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    domain: str
    op_type: str
    version: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    features: tuple[str, ...]  # attention features beyond plain attention it implements (LayerAttention's fields)

    @property
    def qualified_name(self) -> str:
        """``domain::op_type``, the name TensorRT's plugin registry uses."""
        return f"{self.domain}::{self.op_type}"


TREE_ATTENTION = OpSpec(
    domain="medusa_trt",
    op_type="TreeAttention",
    version=2,
    inputs=("query", "key", "value", "past_key", "past_value", "tree_mask", "cache_lengths", "sinks"),
    outputs=("out",),
    attributes=("layer", "scale", "window", "softcap"),
    features=("window", "softcap", "sinks"),
)

NO_SINK = float("-inf")  # the sinks value of a head without one: contributes nothing to the softmax
