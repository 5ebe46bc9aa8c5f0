"""Which TensorRT release's ONNX parser imports each op the exporter writes: the graph decides the minimum.

A parser that does not know an op falls back to a plugin lookup by the op's name, and the build ends in
"Plugin not found" after minutes: ``build_engines`` instead reads the graph's ops, takes the newest release
any of them needs (``required_tensorrt``) and refuses an older TensorRT in one line before building.

Sources: onnx-tensorrt's ``docs/operators.md`` (TensorRT 10.0 imports opsets 9 to 20: every op in
``OPS_10_0`` below) and TensorRT's release notes and onnx-tensorrt's changelog for the ops added since
(``Attention`` in 10.14; ``RMSNormalization`` and ``RotaryEmbedding`` in 10.15). The plugin node needs the
release with AOT Python plugins (10.9), its own plugin module checks that again when it registers.

The table lists the ops the suite's exports contain and the ones the supported architectures' graphs are
known to use; tests/test_tensorrt.py exports every attention form and dtype and checks each op is here. An op
missing from the table is not refused (the parser decides): it is logged, and the table should gain it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION
from medusa_trt.runtime.engine import TENSORRT_BASELINE as BASELINE  # execute_async_v3, named I/O tensors, int64 I/O, ...

log = logging.getLogger(__name__)

OPS_10_0 = (
    "Abs Add And ArgMax ArgMin Cast Ceil Clip Concat Constant ConstantOfShape Cos CumSum DequantizeLinear Div Einsum Equal "
    "Erf Exp Expand Flatten Floor Gather GatherElements GatherND Gemm Greater GreaterOrEqual Identity If "
    "LayerNormalization Less LessOrEqual Log LogSoftmax MatMul Max Min Mod Mul Neg Not Or Pow QuantizeLinear Range "
    "Reciprocal ReduceMax ReduceMean ReduceMin ReduceSum Relu Reshape ScatterElements ScatterND Shape Sigmoid Sin Size "
    "Slice Softmax Softplus Split Sqrt Squeeze Sub Tanh Tile TopK Transpose Trilu Unsqueeze Where Xor"
).split()

# (domain, op_type) -> the oldest TensorRT release whose ONNX parser imports it
OP_MIN_TENSORRT: dict[tuple[str, str], tuple[int, int]] = {("", op): BASELINE for op in OPS_10_0} | {
    ("", "Attention"): (10, 14),
    ("", "RMSNormalization"): (10, 15),
    ("", "RotaryEmbedding"): (10, 15),
    (TREE_ATTENTION.domain, TREE_ATTENTION.op_type): (10, 9),  # AOT Python plugins (tensorrt.plugin.aot_impl)
}


@dataclass(frozen=True)
class Requirement:
    """The oldest TensorRT a graph builds with, and the ops that make it so."""

    version: tuple[int, int]
    because: tuple[str, ...]  # the ops needing exactly that version (empty: the baseline)
    unknown: tuple[str, ...]  # ops the table does not list

    @property
    def release(self) -> str:
        """The version as EngineMeta.min_tensorrt records it: "10.15"."""
        return ".".join(map(str, self.version))

    def describe(self) -> str:
        return f"{self.release} (for {', '.join(self.because)})" if self.because else self.release


def graph_ops(proto) -> set[tuple[str, str]]:
    """(domain, op_type) of every node the parser sees: the main graph and its subgraphs (If / Loop bodies).
    Model-local functions are inlined by the parser, so their bodies count too; ``ai.onnx`` is the default domain."""
    found: set[tuple[str, str]] = set()

    def walk(graph):
        for node in graph.node:
            found.add(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    walk(sub)

    walk(proto.graph)
    functions = {(f.domain, f.name): f for f in proto.functions}
    for key in list(found):
        if key in functions:  # a call of a local function: the parser imports its body, not the call
            found.discard(key)
            for node in functions[key].node:
                found.add(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
    return found


def required_tensorrt(*protos) -> Requirement:
    """The oldest TensorRT whose parser imports every op of these graphs (and never older than ``BASELINE``)."""
    ops = set().union(*(graph_ops(p) for p in protos))
    known = {op: OP_MIN_TENSORRT[op] for op in ops if op in OP_MIN_TENSORRT}
    version = max([BASELINE, *known.values()])
    because = tuple(sorted(f"{d}::{o}" if d else o for (d, o), v in known.items() if v == version and version != BASELINE))
    unknown = tuple(sorted(f"{d}::{o}" if d else o for d, o in ops - set(known)))
    if unknown:
        log.warning("ops not in the TensorRT op table (exporter/tensorrt_ops.py), left to the parser: %s", ", ".join(unknown))
    return Requirement(version=version, because=because, unknown=unknown)
