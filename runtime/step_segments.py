"""A step graph cut at its attentions, so that the host kernel attends between the pieces.

``cut`` splits an exported step graph (the standard attention form, key slots or not) into
``layers + 1`` segment graphs: segment 0 runs from the inputs to layer 0's rotated queries, keys and
values; segment i from layer i-1's attention output to layer i's; the last one to the logits. The
per-layer cache ``Gather`` / ``Transpose`` / scatter, the ``Attention`` and its layout nodes, and the
``new_key`` / ``new_value`` stacks drop out: ``runtime/host_attention.py`` reads the cache in place
and the step's own keys where the segment left them, and a runtime commits those same keys.
Constant subgraphs are copied into every segment that reads them (a tied ``lm_head``'s transposed
embedding stays a constant ONNX Runtime folds at load). Pure graph rewriting; ``SegmentedStep`` runs
the pieces in ONNX Runtime sessions that share one thread pool.

Only layers the kernel computes exactly as the graph would are cut: no soft-capping, no attention
sinks, one visibility mask for every layer (no sliding window). ``NotSegmentable`` says which rule a
graph breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.contract import LOGITS_WANTED_INPUT
from medusa_trt.runtime.errors import MedusaError

WANTED = np.array(True)  # a gated graph's logits_wanted (exporter/logits_gate.py)
CACHE_OUTPUTS = ("new_key", "new_value")  # the graph's stacks of the step's keys: the segments hand them over per layer


class NotSegmentable(MedusaError):
    """The step graph has an attention the host kernel does not compute (the message says which)."""


@dataclass(frozen=True)
class Layer:
    query: str  # float [B, Hq, T, D], rotary applied: a segment output
    key: str  # float [B, Hkv, T, D]
    value: str  # float [B, Hkv, T, D]
    output: str  # float [B, T, Hq * D]: the kernel's, read by the next segment
    heads: int
    kv_heads: int
    scale: float


@dataclass(frozen=True)
class Segment:
    model: object  # onnx.ModelProto, weights still referring to the step graph's external data
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Segments:
    layers: tuple[Layer, ...]
    segments: tuple[Segment, ...]  # len(layers) + 1
    outputs: tuple[str, ...]  # the step graph's outputs the last segments give (new_key / new_value excepted)


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _layers(graph) -> list[Layer]:
    prod = {o: n for n in graph.node for o in n.output}
    cons: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    attentions = [n for n in graph.node if n.op_type == "Attention"]
    if not attentions:
        raise NotSegmentable("the step graph has no Attention node (a plugin-form engine?): export the standard form")
    masks = {a.input[3] if len(a.input) > 3 else "" for a in attentions}
    if len(masks) != 1:
        raise NotSegmentable("its layers attend under different masks (a sliding window): the host kernel has one mask")
    layers = []
    for a in attentions:
        where = f"{a.name}: "
        if float(_attr(a, "softcap", 0.0) or 0.0) != 0.0:
            raise NotSegmentable(where + "attention-logit soft-capping is not in the host kernel")
        if len(a.input) > 4 and any(a.input[4:]):
            raise NotSegmentable(where + "past key/value inputs or sinks are not in the host kernel")
        fold = prod.get(a.input[0])
        rot_q = prod.get(fold.input[0]) if fold is not None and fold.op_type == "Reshape" else None
        scatters = [prod.get(a.input[1]), prod.get(a.input[2])]
        stores = ("ScatterElements", "Concat")  # the key-slot scatter, or the appended layout
        if rot_q is None or rot_q.op_type != "RotaryEmbedding" or any(s is None or s.op_type not in stores for s in scatters):
            raise NotSegmentable(where + "not the exporter's rotary -> attention pattern")
        new = [s.input[2] if s.op_type == "ScatterElements" else s.input[1] for s in scatters]  # the step's own keys / values
        rot_k = prod.get(new[0])
        x, chain = a.output[0], []
        for _ in range(3):  # Reshape -> Transpose -> Reshape to (B, T, Hq * D)
            users = cons.get(x, [])
            if len(users) != 1 or users[0].op_type not in ("Reshape", "Transpose"):
                raise NotSegmentable(where + "its output is not laid out back to (B, T, H) as exported")
            chain.append(users[0].op_type)
            x = users[0].output[0]
        if chain != ["Reshape", "Transpose", "Reshape"] or rot_k is None or rot_k.op_type != "RotaryEmbedding":
            raise NotSegmentable(where + "not the exporter's attention layout")
        heads, kv_heads = int(_attr(rot_q, "num_heads", 0)), int(_attr(rot_k, "num_heads", 0))
        scale = _attr(a, "scale")
        if not heads or not kv_heads or scale is None:
            raise NotSegmentable(where + "rotary num_heads or the attention scale is not recorded")
        layers.append(Layer(fold.input[0], new[0], new[1], x, heads, kv_heads, float(scale)))
    return layers


def cut(model) -> Segments:
    """``model``: the step graph (``onnx.ModelProto``; external weights need not be loaded)."""
    import onnx
    from onnx import helper

    from medusa_trt.exporter.logits_gate import node_reads  # inputs and a branch's outer-scope reads (the logits gate's If)

    graph = model.graph
    layers = _layers(graph)
    outputs = tuple(o.name for o in graph.output if o.name not in CACHE_OUTPUTS)
    kernel_out = {layer.output: i + 1 for i, layer in enumerate(layers)}
    kernel_in = {t for layer in layers for t in (layer.query, layer.key, layer.value)}
    need, keep = set(outputs) | kernel_in, []
    for node in reversed(graph.node):  # what the outputs and the kernels read; the kernels' outputs are theirs
        if any(o in need for o in node.output) and not any(o in kernel_out for o in node.output):
            keep.append(node)
            need.update(node_reads(node))
    keep.reverse()
    inits = {i.name: i for i in graph.initializer}
    constant = set(inits) - {i.name for i in graph.input}  # an input's initializer is its default, not a constant
    producer = {}
    for node in keep:
        for o in node.output:
            producer[o] = node
        if all(i in constant for i in node_reads(node)):
            constant.update(node.output)
    seg_of = {i.name: 0 for i in graph.input} | kernel_out
    node_seg = {}
    for node in keep:
        if node.output[0] in constant:
            continue
        s = max([seg_of[i] for i in node_reads(node) if i not in constant] + [0])
        node_seg[id(node)] = s
        for o in node.output:
            seg_of[o] = s
    read_in: dict[str, set[int]] = {}
    for node in keep:
        if id(node) in node_seg:
            for i in node_reads(node):
                read_in.setdefault(i, set()).add(node_seg[id(node)])
    for i, layer in enumerate(layers):  # the kernel of layer i runs after segment i
        for t in (layer.query, layer.key, layer.value):
            read_in.setdefault(t, set()).add(i + 0.5)
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - types then come from the graph's own declarations only
        inferred = graph
    declared = {v.name: v for v in [*inferred.value_info, *graph.input, *graph.output] if v.type.tensor_type.HasField("shape")}

    def info(name):  # what shape inference found (its rank at least), else a float tensor of unknown shape
        return declared[name] if name in declared else helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)

    order = {id(n): k for k, n in enumerate(keep)}
    segments = []
    for s in range(len(layers) + 1):
        nodes = [n for n in keep if node_seg.get(id(n)) == s]
        wanted = [i for n in nodes for i in node_reads(n) if i in constant and i not in inits]
        folded, seen = [], set()
        while wanted:  # the constant subgraphs this segment reads, copied in
            t = wanted.pop()
            node = producer[t]
            if id(node) in seen:
                continue
            seen.add(id(node))
            folded.append(node)
            wanted += [i for i in node_reads(node) if i in constant and i not in inits]
        body = sorted(folded + nodes, key=lambda n: order[id(n)])
        produced = {o for n in body for o in n.output}
        used = [i for n in body for i in node_reads(n)]
        ins = sorted({t for t in used if t not in produced and t not in inits})
        outs = sorted(t for t in produced if t in outputs or any(r > s for r in read_in.get(t, ())))
        weights = [inits[t] for t in sorted(set(used)) if t in inits]
        g = helper.make_graph(body, f"{graph.name}.segment{s}", [info(t) for t in ins], [info(t) for t in outs], weights)
        m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
        segments.append(Segment(m, tuple(ins), tuple(outs)))
    return Segments(tuple(layers), tuple(segments), outputs)


EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"  # ONNX Runtime: where a graph from bytes finds its weights


def share_threads(threads: int) -> None:
    """One intra-op pool for every session of this process (before its first session): the segments of a step
    run one after another, and a pool each would spin against the others on the same cores."""
    import onnxruntime.capi._pybind_state as C

    C.set_global_thread_pool_sizes(threads, 1)


class SegmentedStep:
    """A step graph's segments in ONNX Runtime sessions on the process's shared pool (``share_threads``), the
    host kernel between them. ``run`` takes the step's inputs as numpy arrays: ``past_key`` / ``past_value``
    (S, layers, B, Hkv, D) are read where they lie."""

    def __init__(self, step, kernel, *, shared_pool: bool = True, threads: int | None = None, disabled_optimizers=()):
        import onnx
        import onnxruntime as ort

        from medusa_trt.runtime.backends.onnx_backend import session_options

        self.plan = cut(onnx.load(str(step), load_external_data=False))
        self.kernel = kernel
        self.sessions = []
        for segment in self.plan.segments:
            options = session_options(threads, spin=shared_pool)  # pools of their own must not spin against each other
            options.use_per_session_threads = not shared_pool
            options.add_session_config_entry(EXTERNAL_FOLDER, str(step.parent))
            data = segment.model.SerializeToString()
            skip = list(disabled_optimizers)
            self.sessions.append(ort.InferenceSession(data, options, ["CPUExecutionProvider"], disabled_optimizers=skip))
        self.bindings = [s.io_binding() for s in self.sessions]
        self._layer_of = {layer.output: i for i, layer in enumerate(self.plan.layers)}
        self._out: dict[tuple, list] = {}

    def run(self, feed: dict) -> tuple[dict, list[tuple]]:
        """(the step's outputs by name, as numpy arrays; per layer (key, value) [B, Hkv, T, D] numpy arrays)."""
        import numpy as np

        batch, tokens = feed["input_ids"].shape
        mask = np.ascontiguousarray(feed["tree_mask"]).astype(np.uint8, copy=False)
        lengths = np.ascontiguousarray(feed["cache_lengths"], dtype=np.int64)
        past_key, past_value = feed["past_key"], feed["past_value"]  # (S, layers, B, Hkv, D) float32
        if past_key.dtype != np.float32 or past_key.strides != past_value.strides or past_key.strides[-1] != 4:
            raise ValueError("past_key / past_value: float32 (S, layers, B, Hkv, D) of one layout, heads contiguous")
        head_dim = past_key.shape[-1]
        if past_key.strides[-2] != 4 * head_dim:
            raise ValueError("past_key / past_value: each slot's heads contiguous")
        outs = self._out.get((batch, tokens))
        if outs is None:  # one buffer per layer and step shape, allocated once
            outs = self._out[(batch, tokens)] = [np.zeros((batch, tokens, lay.heads * head_dim), np.float32) for lay in self.plan.layers]
        slot, layer_bytes, row = past_key.strides[0] // 4, past_key.strides[1], past_key.strides[2] // 4
        key_base, value_base = past_key.ctypes.data, past_value.ctypes.data
        fixed = (mask.ctypes.data, lengths.ctypes.data)
        scratch = self.kernel.scratch(int(lengths.max()), tokens)
        values: dict = {}
        feed = {LOGITS_WANTED_INPUT: WANTED, **feed}  # a gated graph (exporter/logits_gate.py): its logits, as the graph's
        layers = self.plan.layers
        for s, (session, io, segment) in enumerate(zip(self.sessions, self.bindings, self.plan.segments)):
            for name in segment.inputs:
                if name in feed:
                    io.bind_cpu_input(name, feed[name])
                elif name in values:
                    io.bind_ortvalue_input(name, values[name])
                else:  # a kernel's output
                    io.bind_cpu_input(name, outs[self._layer_of[name]])
            for name in segment.outputs:
                io.bind_output(name, "cpu")
            session.run_with_iobinding(io)
            values.update(zip(segment.outputs, io.get_outputs()))
            if s < len(layers):
                lay = layers[s]
                offset = s * layer_bytes  # the layer's slots, read where they lie
                rc = self.kernel.raw(
                    batch, tokens, lay.heads, lay.kv_heads, head_dim, lay.scale,
                    values[lay.query].data_ptr(), values[lay.key].data_ptr(), values[lay.value].data_ptr(),
                    key_base + offset, value_base + offset, slot, row, *fixed, outs[s].ctypes.data, scratch,
                )  # fmt: skip
                if rc:
                    raise ValueError(f"layer {s}: {lay.heads} query heads are not a multiple of {lay.kv_heads} key/value heads")
        result = {name: values[name].numpy() for name in self.plan.outputs}
        cache = [(values[lay.key].numpy(), values[lay.value].numpy()) for lay in layers]
        return result, cache
