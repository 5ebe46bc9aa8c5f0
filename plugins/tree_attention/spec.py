"""The tree-attention custom op as an ONNX node: defined once here, used by the exporter
(``--attention plugin``), the CPU fallback, the TensorRT registration and the tests.

One node per decoder layer:

  inputs
    0 query         float [B, Hq, T, D]       rotary applied
    1 key           float [B, Hkv, T, D]      keys of the T new (tree) tokens
    2 value         float [B, Hkv, T, D]
    3 past_key      float [S, L, B, Hkv, D]   the whole committed cache, slot-major (read in place)
    4 past_value    float [S, L, B, Hkv, D]
    5 tree_mask     bool  [B, T, T]           node i sees node j
    6 cache_lengths int64 [B]                 committed slots per sequence (S >= max)
  attributes
    layer  int    which L-slice of the cache this node reads
    scale  float  softmax scale (1/sqrt(D) unless the model says otherwise)
  output
    0 out           float [B, Hq, T, D]       same dtype as query

Hq must be a multiple of Hkv (grouped-query attention: query head h reads KV head h // (Hq // Hkv)).
The math is ``reference.tree_attention``.
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

    @property
    def qualified_name(self) -> str:
        """``domain::op_type``, the name TensorRT's plugin registry uses."""
        return f"{self.domain}::{self.op_type}"


TREE_ATTENTION = OpSpec(
    domain="medusa_trt",
    op_type="TreeAttention",
    version=1,
    inputs=("query", "key", "value", "past_key", "past_value", "tree_mask", "cache_lengths"),
    outputs=("out",),
    attributes=("layer", "scale"),
)
