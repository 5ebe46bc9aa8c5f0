"""Lean passes over the exported step graph: fewer, larger ops, the same step contract, the same numbers.

``torch.onnx.export`` writes the step graph op for op as the ``transformers`` model runs it, so
every layer recomputes what the model shares (the rotary tables: one ``Cos`` and one ``Sin`` per
``RotaryEmbedding`` node, 60 pairs in SmolLM2) and runs one matmul per ``Linear`` (Q, K, V, gate
and up read the same normed hidden state). These passes rewrite the saved graph in place, after
export and before quantization (``onnx_export.export_onnx``), and each one is exact: a step's
outputs are those of the graph before, bit for bit, on ONNX Runtime's CPU kernels, which the tests
check on tiny models and ``scripts/step_graph_report.py`` on the demo engine.

  shared   one node for identical computations (same op, same inputs, same attributes): the
           rotary tables once per step instead of twice per layer. Pure data flow, so exact.
           (ONNX Runtime's own common-subexpression pass does the same at load: the file says
           what runs, for every reader of the graph.)
  fused    MatMuls by constant weights that read one input become one MatMul over their weights
           side by side and a ``Split`` (``fuse_matmuls_by_input``; the quantizers fuse with it too): 4 weight matmuls a
           layer instead of 7. Each output element is the same dot product over the same K
           weights in the same order, whatever the columns beside it, so the outputs are bit for
           bit those of separate matmuls (MLAS's threads split rows and columns, not the sum;
           measured bit for bit on fp32, int8-channel and int4, which fused already).

Standard ops only: the graph stays what every runtime that reads the step graph understands
(ONNX Runtime, OpenVINO, TensorRT's ONNX parser). ``--quantize int8`` (one activation scale per
call, per weight tensor) keeps its weights apart: fused, their one scale would span Q, K and V.

Not done here, and why: the cache's per-layer ``Gather`` / ``Transpose`` / ``ScatterElements``
copies come from the slot-major cache the step contract binds (a per-layer cache input removes the
first; it changes every backend: docs/benchmarks.md, "What limits the ratios"); the ``lm_head``
covers every node of a step because ``next_ids`` and ``next_topk`` are contract outputs of every node
(a step whose outputs no one reads skips it whole: ``exporter/logits_gate.py``, after quantization); ONNX
Runtime's ``SkipSimplifiedLayerNormalization`` gives other last bits than ``Add`` +
``RMSNormalization`` (row-invariant, so verify steps would stay exact) and exists in ONNX Runtime only.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.exporter import lazy_weights

log = logging.getLogger(__name__)

# ops whose output depends on more than their inputs and attributes: never merged
IMPURE = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


@dataclass(frozen=True)
class LeanReport:
    shared: int  # nodes removed as duplicates of an earlier identical node
    fused: int  # weight MatMuls merged into the one before them that reads the same input
    before: dict[str, int]  # op type -> count, before the passes
    after: dict[str, int]  # op type -> count, after

    def describe(self) -> str:
        total = (sum(self.before.values()), sum(self.after.values()))
        return f"lean step graph: {total[0]} -> {total[1]} nodes ({self.shared} shared, {self.fused} matmuls fused)"


def op_counts(graph) -> dict[str, int]:
    """Op type -> nodes of that type in ``graph`` (a ``GraphProto``), most frequent first."""
    return dict(Counter(n.op_type for n in graph.node).most_common())


def _key(node, rename: dict[str, str]) -> tuple:
    attrs = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
    return (node.domain, node.op_type, tuple(rename.get(i, i) for i in node.input), len(node.output), attrs)


def share_identical(graph) -> int:
    """Drop every node that repeats an earlier node's op, inputs and attributes; its readers read the
    earlier node's outputs. Nodes in topological order (as exported); subgraphs are left alone.
    A node whose output is a graph output stays. Returns how many nodes went."""
    outputs = {o.name for o in graph.output}
    rename: dict[str, str] = {}  # dropped output -> the kept node's output
    seen: dict[tuple, list[str]] = {}
    kept = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        has_subgraph = any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute)
        if node.op_type in IMPURE or has_subgraph or not node.output or any(o in outputs for o in node.output):
            kept.append(node)
            continue
        key = _key(node, rename)
        if key in seen:
            rename.update({o: k for o, k in zip(node.output, seen[key]) if o})
            continue
        seen[key] = list(node.output)
        kept.append(node)
    dropped = len(graph.node) - len(kept)
    del graph.node[:]
    graph.node.extend(kept)
    return dropped


def fuse_matmuls_by_input(graph) -> int:
    """MatMuls by 2-D constant weights that read the same input as one MatMul over their weights
    side by side, then a Split back into their outputs; in place. Q / K / V of a layer read the same
    normed hidden state, gate / up too (the heads' first layers too): a quantized graph then
    quantizes that input once and runs one matmul instead of three. Each output column depends
    on its own weight column only, so quantized with per-column (per-block) scales the outputs are
    those of one matmul per weight. Returns how many MatMuls it merged away."""
    import numpy as np
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in graph.initializer}
    groups: dict[str, list] = {}
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is not None and len(weight.dims) == 2:
            groups.setdefault(node.input[0], []).append(node)
    groups = {x: g for x, g in groups.items() if len(g) > 1 and len({m.input[1] for m in g}) == len(g)}
    first = {g[0].output[0]: g for g in groups.values()}
    merged = {m.output[0] for g in groups.values() for m in g}
    nodes = []
    for node in graph.node:
        if node.output[0] not in merged:
            nodes.append(node)
            continue
        group = first.get(node.output[0])
        if group is None:  # merged into its group's first, which stands earlier
            continue
        name = f"{node.name or node.output[0]}_fused"
        parts = [weights[m.input[1]] for m in group]  # (K, N_i) each; lazy ones (exporter/lazy_weights.py) stay so
        shape = (parts[0].dims[0], sum(p.dims[1] for p in parts))
        dtype = helper.tensor_dtype_to_np_dtype(parts[0].data_type)
        fused = lazy_weights.derived(name + "_weight", parts, lambda *a: np.concatenate(a, axis=1), shape, dtype)
        graph.initializer.append(fused)  # (K, sum N_i)
        widths = numpy_helper.from_array(np.array([p.dims[1] for p in parts], dtype=np.int64), name + "_widths")
        graph.initializer.append(widths)
        nodes.append(helper.make_node("MatMul", [node.input[0], name + "_weight"], [name], name=name))  # (..., sum N_i)
        nodes.append(helper.make_node("Split", [name, widths.name], [m.output[0] for m in group], name=name + "_split", axis=-1))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    for weight in [weights[m.input[1]] for g in groups.values() for m in g]:
        if weight.name not in used:  # now a copy inside the fused weight
            graph.initializer.remove(weight)
    return sum(len(g) - 1 for g in groups.values())


def lean_graph(proto, *, fuse: bool = True) -> LeanReport:
    """Apply the passes to ``proto`` (a ``ModelProto`` with its weights loaded), in place."""
    graph = proto.graph
    before = op_counts(graph)
    shared = share_identical(graph)
    fused = fuse_matmuls_by_input(graph) if fuse else 0
    return LeanReport(shared, fused, before, op_counts(graph))


def lean_step_file(path: Path, *, fuse: bool = True, out: Path | None = None) -> LeanReport:
    """Rewrite the step graph at ``path`` by ``lean_graph`` (metadata kept): in place, or into a new
    graph ``out`` (with its own external data file) that must not exist yet."""
    import onnx

    from medusa_trt.exporter.external_data import data_path, has_external_data, save_graph

    path = Path(path)
    proto = onnx.load(str(path))
    report = lean_graph(proto, fuse=fuse)
    external = has_external_data(path)
    if out is None:
        out = path
        for f in (path, data_path(path)):  # the graph and its .data: staged files of this export only
            f.unlink(missing_ok=True)
    elif Path(out).exists() or data_path(out).exists():
        raise FileExistsError(f"{out} or its data file exists: pass a new path")
    save_graph(proto, out, external=external)
    log.info(report.describe())
    return report
