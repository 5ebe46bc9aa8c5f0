"""The ``lm_head`` behind a gate: a step graph that computes its logits only when a caller reads them.

A prompt is scored in chunks of up to ``max_tokens`` tokens, and the loop reads nothing of a chunk
but its K/V until the prompt's last one (the first new token, the recycle drafter's successors).
The ``lm_head`` with its ``ArgMax`` / ``TopK`` is a fifth of a token's work in SmolLM2-135M, and ONNX
Runtime runs every node of a plan whatever the caller fetches (``RunOptions`` included: measured
in docs/benchmarks.md, "The prompt's share of it"). So this pass moves the nodes that only the
logits outputs need (``logits``, ``next_ids``, ``next_topk``) into the ``then`` branch of one
``If`` on a new scalar bool input, ``logits_wanted``; the ``else`` branch runs the same nodes on
zero rows, so it gives empty tensors of every output's type and rank (``_on_nothing`` says why
not constants).

The input is required, not optional with an initializer as its default: ONNX Runtime's IOBinding
cannot bind such an input (it is no "NodeArg in the def list") and warns at every load that it is
one. Fed ``True``, the graph runs node for node the same kernels on the same inputs as before, so
the same numbers bit for bit (tested on fp32, int8-channel and int4). The ONNX Runtime backend
feeds ``False`` for a step whose outputs the scheduler will not read and then binds none of the
three outputs (their else-branch shapes are empty); ``with_gate`` is what every other caller of a
step graph adds to its feeds.

Nodes computed from initializers alone (fp32's transposed tied embedding) stay outside the
branch, where ONNX Runtime folds them once at load. Written for ONNX Runtime engines only: a
TensorRT plan keeps the ungated graph (its conditional wants both branches' shapes equal), and the
OpenVINO backend compiles the then branch in the If's place (``_inline_logits_gate``: its bf16 CPU
plugin misbehaved with the If).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.contract import LOGITS, LOGITS_WANTED_INPUT, NEXT_IDS, SUCCESSORS_OUTPUT

log = logging.getLogger(__name__)

GATED_OUTPUTS = (LOGITS, NEXT_IDS, SUCCESSORS_OUTPUT)  # what a step's caller may not read; the rest it always does
_THEN, _ELSE = "_gate_then", "_gate_else"  # suffixes of the branches' own output names (no shadowing of the If's)


@dataclass(frozen=True)
class GateReport:
    gated: int  # nodes moved into the If's then branch
    outputs: tuple[str, ...]  # the graph outputs the If gives

    def describe(self) -> str:
        return f"logits gate: {self.gated} nodes behind {LOGITS_WANTED_INPUT} ({', '.join(self.outputs)})"


def _producers(graph) -> dict[str, object]:
    return {o: n for n in graph.node for o in n.output if o}


def _ancestors(names, producers) -> set[int]:
    """ids of the nodes ``names`` depend on (subgraphs' outer-scope reads included)."""
    seen, stack = set(), list(names)
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(node_reads(node))
    return seen


def node_reads(node) -> list[str]:
    """Every value ``node`` reads: its inputs and what its subgraphs (an ``If`` 's branches) read from outside them."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input} | {t.name for t in sub.initializer}
            names += [r for n in sub.node for r in node_reads(n) if r not in inner]
    return names


def _constant(graph) -> set[int]:
    """ids of the nodes whose inputs are all initializers or outputs of such nodes (folded at load)."""
    known = {t.name for t in graph.initializer} - {i.name for i in graph.input}
    ids = set()
    for node in graph.node:  # topological order, as exported
        reads = node_reads(node)
        if reads and all(r in known for r in reads) and node.op_type not in ("RandomNormal", "RandomUniform"):
            ids.add(id(node))
            known.update(o for o in node.output if o)
    return ids


def _on_nothing(moved: list, entries: list[str]) -> list:
    """The else branch: ``moved`` again (copies, their values renamed) on the first zero rows of each of ``entries``
    (the tail's inputs from the step body), so every gated output comes out empty with its own type and rank. Cheaper
    forms fail elsewhere: an empty ``Constant`` or ``ConstantOfShape`` per output makes OpenVINO's ONNX reader count
    fewer else outputs than then outputs on the step graph, and the rank must be static for its CPU plugin."""
    from onnx import TensorProto, helper

    def renamed(name: str) -> str:
        return name.replace(_THEN, "") + _ELSE if name else name

    nodes = [
        helper.make_node("Constant", [], [f"zero{_ELSE}"], value=helper.make_tensor("zero", TensorProto.INT64, [1], [0])),
    ]
    for entry in entries:  # (0, ...): the entry's first axis cut to nothing
        nodes.append(helper.make_node("Slice", [entry, f"zero{_ELSE}", f"zero{_ELSE}", f"zero{_ELSE}"], [renamed(entry)]))
    inner = set(entries) | {o for n in moved for o in n.output if o}
    for node in moved:
        copy = type(node)()
        copy.CopyFrom(node)
        copy.ClearField("metadata_props")
        copy.name = renamed(node.name)
        copy.input[:] = [renamed(i) if i in inner else i for i in node.input]
        copy.output[:] = [renamed(o) for o in node.output]
        nodes.append(copy)
    return nodes


def _like(name: str, value_info):
    """``value_info`` (a graph output) under another name: its type, rank and dims."""
    copy = type(value_info)()
    copy.CopyFrom(value_info)
    copy.name = name
    return copy


def gate_logits(proto) -> GateReport:
    """Put ``proto``'s logits tail behind ``logits_wanted`` (in place). A graph without those outputs,
    or gated already, is left as it is (a report of 0 nodes)."""
    from onnx import TensorProto, helper

    graph = proto.graph
    outputs = {o.name: o for o in graph.output}
    gated_names = tuple(n for n in GATED_OUTPUTS if n in outputs)
    if not gated_names or any(i.name == LOGITS_WANTED_INPUT for i in graph.input):
        return GateReport(0, ())
    producers = _producers(graph)
    kept = _ancestors([o for o in outputs if o not in gated_names], producers)
    constant = _constant(graph)
    wanted = _ancestors(gated_names, producers)
    moved = [n for n in graph.node if id(n) in wanted and id(n) not in kept and id(n) not in constant]
    if not moved or any(id(producers.get(name)) not in {id(n) for n in moved} for name in gated_names):
        return GateReport(0, ())  # an output computed outside the tail (an input passed through, say): nothing to gate
    rename = {name: f"{name}{_THEN}" for name in gated_names}
    for node in moved:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    moved_ids = {id(n) for n in moved}
    produced = {o for n in moved for o in n.output if o}
    reads = dict.fromkeys(r for n in moved for r in node_reads(n) if r not in produced)  # in order, once
    entries = [r for r in reads if r in producers and id(producers[r]) not in constant]  # from the step body, not folded
    # a branch reads a graph output (hidden) through an Identity (ONNX Runtime drops it at load): OpenVINO's ONNX reader
    # makes an outer graph output a branch reads one more result of that branch, which shifts the If's outputs
    aliases = {e: f"{e}_gate_in" for e in entries if e in outputs}
    for node in moved:
        node.input[:] = [aliases.get(i, i) for i in node.input]
    entries = [aliases.get(e, e) for e in entries]
    then_outputs = [_like(rename[n], outputs[n]) for n in gated_names]  # with their ranks: OpenVINO's CPU plugin needs them
    else_outputs = [_like(f"{n}{_ELSE}", outputs[n]) for n in gated_names]
    else_nodes = _on_nothing(moved, entries)
    then_branch = helper.make_graph(moved, "logits_then", [], then_outputs)
    else_branch = helper.make_graph(else_nodes, "logits_else", [], else_outputs)
    gate = helper.make_node(
        "If", [LOGITS_WANTED_INPUT], list(gated_names), name="logits_gate", then_branch=then_branch, else_branch=else_branch
    )
    rest = [n for n in graph.node if id(n) not in moved_ids]
    rest += [helper.make_node("Identity", [e], [alias], name=alias) for e, alias in aliases.items()]
    del graph.node[:]
    graph.node.extend([*rest, gate])
    graph.input.append(helper.make_tensor_value_info(LOGITS_WANTED_INPUT, TensorProto.BOOL, []))
    return GateReport(len(moved), gated_names)


def _rewrite_file(path: Path, rewrite, changed=bool):
    """``rewrite(proto)`` on the graph file at ``path`` (its external weights untouched), written back whole
    (``runtime/durable.py``) where ``changed(result)`` says it changed the graph; returns the result."""
    import onnx

    from medusa_trt.runtime import durable

    proto = onnx.load(str(path), load_external_data=False)
    result = rewrite(proto)
    if changed(result):
        durable.write_bytes(path, proto.SerializeToString())
    return result


def gate_logits_file(path: Path) -> GateReport:
    """``gate_logits`` on the step graph file at ``path``, in place."""
    report = _rewrite_file(Path(path), gate_logits, changed=lambda r: r.gated > 0)
    if report.gated:
        log.info(report.describe())
    return report


def ungate_logits(proto) -> bool:
    """Undo ``gate_logits`` in place: the then branch's nodes back in the graph under the outputs' own names, the
    aliases and the ``logits_wanted`` input gone. For passes that rewrite a whole graph without reading into an If's
    branches (ONNX Runtime's quantizers drop the weights only a branch reads); they gate it again after. Returns
    whether ``proto`` was gated."""
    graph = proto.graph
    gate = next((n for n in graph.node if n.op_type == "If" and list(n.input) == [LOGITS_WANTED_INPUT]), None)
    if gate is None:
        return False
    then_branch = next(a.g for a in gate.attribute if a.name == "then_branch")
    rename = {o.name: name for o, name in zip(then_branch.output, gate.output)}  # x_gate_then -> x
    aliases = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity" and n.output[0].endswith("_gate_in")}
    nodes = []
    for node in then_branch.node:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, aliases.get(i, i)) for i in node.input]
        nodes.append(node)
    kept = [n for n in graph.node if n is not gate and not (n.op_type == "Identity" and n.output[0] in aliases)]
    del graph.node[:]
    graph.node.extend([*kept, *nodes])
    inputs = [i for i in graph.input if i.name != LOGITS_WANTED_INPUT]
    del graph.input[:]
    graph.input.extend(inputs)
    return True


def ungate_logits_file(path: Path) -> bool:
    """``ungate_logits`` on the step graph file at ``path``, in place."""
    return _rewrite_file(Path(path), ungate_logits)
