"""Routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) read out of a step graph, as ``exporter/experts.py`` and the
model's own router export them, and checked against what ``native_step.c``'s ``experts`` computes.

Per layer, on the post-attention norm's rows (flattened to (N, H)):

* the router: one linear to E logits, Softmax, TopK k (largest), optionally the k weights over their sum; or
  (gpt-oss) a linear with a bias, TopK k of the logits, Softmax over those k;
* a fixed loop over the experts 0 .. E - 1: the rows routed to expert e (``Equal(top-k ids, e)``, any over k,
  ``NonZero``) gathered, one gate/up linear, Split, the gate's activation times up, one down linear, times the row's
  routing weight for e, scatter-added (``ScatterND`` add) into a zero sum, expert after expert;
* gpt-oss's experts: biases on gate/up and down, gate and up interleaved (even and odd columns: read here as gate
  then up halves, exact: each output column's sum is its own), the clamped SwiGLU (``swiglu_limit``);
* optionally a shared expert every row runs (Qwen2-MoE): gate and up linears (fused here into one), the activation,
  down, times the sigmoid of one more linear to a single output, added after the routed experts' sum.

Each row's sum is taken in expert order and depends on its own routing alone, so the result never depends on which
other rows share the step (batch invariance; ``docs/exactness.md``). Anything else around the experts (a post-expert
norm, another activation) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.native_graph import Graph, Linear, NativeCannotRun, attr, biased, gate_of, malformed, unsupported

# the ops of routed experts, beside the dense pattern's (native_weights.OPS)
MOE_OPS = frozenset("Gemm Softmax TopK ReduceSum Equal NonZero ScatterND Clip".split())  # Clip: gpt-oss's clamps
# what lies between the top-k ids and an expert's row indices: Equal, Cast, ReduceMax (any over k), Cast, NonZero, ...
_INDEX_OPS = ("Reshape", "Squeeze", "Transpose", "NonZero", "Cast", "ReduceMax", "Unsqueeze")


@dataclass(frozen=True)
class Experts:
    """One layer's routed experts (``native_step.c``'s ``experts_t``)."""

    router: Linear  # (H, E)
    top_k: int  # experts a row
    normalize: bool  # the k routing weights over their sum (Mixtral, Qwen3-MoE); else as the softmax gives them
    gate_up: tuple[Linear, ...]  # E x (H, 2 I): gate then up
    down: tuple[Linear, ...]  # E x (I, H)
    shared_gate_up: Linear | None = None  # (H, 2 Is): a shared expert every row runs (Qwen2-MoE); None: none
    shared_down: Linear | None = None  # (Is, H)
    shared_gate: Linear | None = None  # (H, 1): the shared expert's output times the sigmoid of this
    router_bias: np.ndarray | None = None  # (E): added to the router's logits (gpt-oss)
    topk_first: bool = False  # the softmax over the k largest logits (gpt-oss), not the k largest of the softmax
    gate_up_bias: tuple = ()  # E x (2 I), gate then up (gpt-oss); (): none
    down_bias: tuple = ()  # E x (H)
    alpha: float = 0.0  # swiglu_limit's sigmoid slope and clamp (gpt-oss; 0: another activation)
    limit: float = 0.0

    @property
    def count(self) -> int:
        return len(self.gate_up)

    @property
    def inter(self) -> int:
        return self.down[0].shape[0] if self.down else 0

    @property
    def shared_inter(self) -> int:
        return self.shared_down.shape[0] if self.shared_down is not None else 0

    def linears(self) -> list[tuple[str, Linear, tuple[int, int]]]:
        """(what, linear, expected (K, N)) of every linear, for ``check_weights``."""
        h, e, i = self.router.shape[0], self.count, self.inter
        rows = [("router", self.router, (h, e))]
        for j in range(e):
            rows += [(f"expert {j}'s gate/up_proj", self.gate_up[j], (h, 2 * i)), (f"expert {j}'s down_proj", self.down[j], (i, h))]
        if self.shared_down is not None:
            s = self.shared_inter
            rows += [
                ("shared expert's gate/up_proj", self.shared_gate_up, (h, 2 * s)),
                ("shared expert's down_proj", self.shared_down, (s, h)),
                ("shared expert's gate", self.shared_gate, (h, 1)),
            ]
        return rows


def routed(g: Graph, src: str) -> bool:
    """Whether the MLP reading ``src`` (the post-attention norm's output) is routed experts: ``src`` flattened to rows."""
    readers = [n for n in g.consumers.get(src, []) if n.op_type not in ("Identity", "Add")]
    return [n.op_type for n in readers] == ["Reshape"]


def read_experts(g: Graph, step: Path, layer: int, src: str) -> tuple[Experts, set[str], str]:
    """Layer ``layer``'s routed experts reading ``src``: the experts, their activations (one each for the experts and
    the shared expert) and the tensor their sum is (reshaped back to (B, T, H), before the residual add)."""
    where = f"layer {layer}'s experts"
    views = [g.only(src, "Reshape").output[0]]  # (N, H), and any reshape of it (the router's input)
    for view in views:
        views += [n.output[0] for n in g.consumers.get(view, []) if n.op_type == "Reshape"]
    gathers, linears = [], []
    for view in views:
        for n in g.consumers.get(view, []):
            if n.op_type == "Gather" and n.input[0] == view and attr(n, "axis", 0) == 0:
                gathers.append(n)
            elif n.op_type not in ("Reshape", "Shape", "Identity", "MatMul", "Gemm", "MatMulNBits", "Abs", "QuantizeLinear"):
                raise unsupported(step, f"{where}' input rows are read by a {n.op_type}")
        linears += g.linears(view, bias=True)
    ranked = ("Softmax", "TopK")  # a router's logits are read by its softmax, or (gpt-oss) its top-k
    routers = []
    for lin, out in linears:
        added, logits = biased(g, out) if lin.bias is None else (lin.bias, out)
        if any(n.op_type in ranked for n in g.consumers.get(logits, [])):
            routers.append((lin, out, added, logits))
    if len(routers) != 1:
        raise unsupported(step, f"{where} have {len(routers)} routers (a linear whose logits a Softmax or TopK reads), not one")
    router, router_out, router_bias, logits = routers[0]
    if router_bias is not None and router_bias.shape != (router.shape[1],):
        raise malformed(step, f"{where}' router bias of shape {router_bias.shape} for {router.shape[1]} experts")
    top_k, normalize, topk_first, ids, weights = _routing(g, step, where, logits)
    experts: dict[int, tuple] = {}
    acts, clamps = set(), set()
    for gather in gathers:
        e, act, up, down, scatter, biases, clamp = _expert(g, step, layer, gather, ids, weights)
        if e in experts:
            raise unsupported(step, f"{where} run expert {e} twice")
        experts[e] = (up, down, scatter, *biases)
        acts.add(act), clamps.add(clamp)
    count = router.shape[1]
    if sorted(experts) != list(range(count)) or not 0 < top_k <= count:
        raise unsupported(step, f"{where}: experts {sorted(experts)} for a router of {count} outputs choosing {top_k}")
    total = _sum_in_order(g, step, where, [experts[e][2] for e in range(count)])
    shared = [(lin, out) for lin, out in linears if out != router_out]
    if any(lin.bias is not None for lin, _ in shared):
        raise unsupported(step, f"{where}: a shared expert's linear has a bias (a Gemm's), which native does not add")
    fields = {"router_bias": router_bias, "topk_first": topk_first}
    if len(clamps) != 1:
        raise unsupported(step, f"{where} clamp their gates differently {sorted(clamps)}")
    fields["alpha"], fields["limit"] = clamps.pop()
    biases = [experts[e][3:] for e in range(count)]
    if any(b is not None for pair in biases for b in pair):
        if any(b is None for pair in biases for b in pair):
            raise unsupported(step, f"{where}: some experts have biases and some have none")
        fields["gate_up_bias"], fields["down_bias"] = tuple(b[0] for b in biases), tuple(b[1] for b in biases)
    if shared:
        total, act, shared_fields = _shared(g, step, layer, shared, total)
        acts.add(act), fields.update(shared_fields)
    out = g.only(total, "Reshape").output[0]
    gate_up, down = (tuple(experts[e][j] for e in range(count)) for j in (0, 1))
    return Experts(router, top_k, normalize, gate_up, down, **fields), acts, out


def _routing(g: Graph, step: Path, where: str, logits: str) -> tuple[int, bool, bool, str, str]:
    """Softmax, TopK, optionally the weights over their sum; or TopK, Softmax of the k values (gpt-oss): (k, normalize,
    topk first, the top-k ids, the routing weights)."""
    readers = [n for n in g.consumers.get(logits, []) if n.op_type != "Identity"]
    if [n.op_type for n in readers] == ["TopK"]:
        topk = readers[0]
        softmax = g.only(topk.output[0], "Softmax")
        if attr(topk, "axis", -1) not in (-1, 1) or attr(topk, "largest", 1) != 1 or attr(softmax, "axis", -1) not in (-1, 1):
            raise unsupported(step, f"{where}' router is not the k largest logits and a softmax over them")
        return int(g.scalar(topk.input[1])), False, True, topk.output[1], softmax.output[0]
    softmax = g.only(logits, "Softmax")
    topk = g.only(softmax.output[0], "TopK")
    if attr(softmax, "axis", -1) not in (-1, 1) or attr(topk, "axis", -1) not in (-1, 1) or attr(topk, "largest", 1) != 1:
        raise unsupported(step, f"{where}' router is not a softmax over the experts and the k largest")
    k = int(g.scalar(topk.input[1]))
    values, ids = topk.output[0], topk.output[1]
    readers = {n.op_type: n for n in g.consumers.get(values, []) if n.op_type != "Identity"}
    if sorted(readers) == ["Div", "ReduceSum"] and len(g.consumers[values]) == 2:  # normalized: values / sum(values)
        total, div = readers["ReduceSum"], readers["Div"]
        axes = g.array(total.input[1]).reshape(-1).tolist() if len(total.input) > 1 and total.input[1] else None
        if axes not in ([-1], [1]) or attr(total, "keepdims", 1) != 1 or list(div.input) != [values, total.output[0]]:
            raise unsupported(step, f"{where}' routing weights are not the top-k values over their sum")
        return k, True, False, ids, div.output[0]
    return k, False, False, ids, values


def _index_root(g: Graph, tensor: str) -> str:
    """The tensor past the reshapes of an expert's row indices (what its Gather and its ScatterND both index by)."""
    while (node := g.producer.get(tensor)) is not None and node.op_type in ("Reshape", "Unsqueeze"):
        tensor = node.input[0]
    return tensor


def _chosen(g: Graph, step: Path, where: str, rows: str, ids: str):
    """The Equal(top-k ids, e) an expert's row indices come from, and e: the indices must be NonZero of any-over-k of
    it (the chain ``_INDEX_OPS``)."""
    tensor, seen = rows, []
    while (node := g.producer.get(tensor)) is not None and node.op_type in _INDEX_OPS:
        seen.append(node.op_type)
        tensor = node.input[0]
    equal = g.producer.get(tensor)
    if equal is None or equal.op_type != "Equal" or equal.input[0] != ids or seen.count("NonZero") != 1 or "ReduceMax" not in seen:
        raise unsupported(step, f"{where}: an expert's rows are not those whose top-k ids hold it")
    return equal, int(g.scalar(equal.input[1]))


def _expert(g: Graph, step: Path, layer: int, gather, ids: str, weights: str):
    """One expert from the Gather of its rows: (e, its activation, gate/up, down, its ScatterND, (gate/up bias, down
    bias), (alpha, limit) of a clamped SwiGLU (0, 0: another activation))."""
    where = f"layer {layer}'s experts"
    equal, e = _chosen(g, step, where, gather.input[1], ids)
    up, out = g.linear(gather.output[0])
    up_bias, out = biased(g, out)
    clamp = (0.0, 0.0)
    if sorted(n.op_type for n in g.consumers.get(out, []) if n.op_type != "Identity") == ["Slice", "Slice"]:
        order, (alpha, limit, prod) = _interleaved(g, step, where, e, out, up.shape[1])
        up, up_bias, act, clamp = up.outputs(order), None if up_bias is None else up_bias[order], "swiglu_limit", (alpha, limit)
    else:
        halves = g.only(out, "Split")
        widths = g.array(halves.input[1]).tolist() if len(halves.input) > 1 and halves.input[1] else None
        if len(halves.output) != 2 or widths not in (None, [up.shape[1] // 2] * 2) or up.shape[1] % 2:
            raise unsupported(step, f"{where}: expert {e}'s gate/up matmul is not split into gate and up halves")
        act, gated = gate_of(g, step, layer, halves.output[0])
        prod = g.only(gated, "Mul")
        if halves.output[1] not in prod.input:
            raise unsupported(step, f"{where}: expert {e} does not multiply its activated gate by up")
        prod = prod.output[0]
    down, out = g.linear(prod)
    down_bias, out = biased(g, out)
    weighted = g.only(out, "Mul")
    scale = g.producer.get(_index_root(g, next((x for x in weighted.input if x != out), "")))
    total = g.producer.get(scale.input[0]) if scale is not None and scale.op_type == "Gather" else None
    picked = g.producer.get(total.input[0]) if total is not None and total.op_type == "ReduceSum" else None
    cast = next((g.producer.get(x) for x in picked.input if x != weights), None) if picked is not None and picked.op_type == "Mul" else None
    if (
        scale is None
        or scale.input[1] != gather.input[1]
        or picked is None
        or weights not in picked.input
        or cast is None
        or cast.op_type != "Cast"
        or cast.input[0] != equal.output[0]
    ):
        raise unsupported(step, f"{where}: expert {e}'s output is not scaled by its own routing weight")
    scatter = g.only(weighted.output[0], "ScatterND")
    reduction = attr(scatter, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction != "add" or scatter.input[2] != weighted.output[0] or _index_root(g, scatter.input[1]) != _index_root(g, gather.input[1]):
        raise unsupported(step, f"{where}: expert {e}'s output is not added into its own rows")
    for what, b, n in (("gate/up", up_bias, up.shape[1]), ("down", down_bias, down.shape[1])):
        if b is not None and b.shape != (n,):
            raise malformed(step, f"{where}: expert {e}'s {what} bias of shape {b.shape} for {n} outputs")
    return e, act, up, down, scatter, (up_bias, down_bias), clamp


def _interleaved(g: Graph, step: Path, where: str, e: int, out: str, width: int) -> tuple[np.ndarray, tuple[float, float, str]]:
    """gpt-oss's gate/up: gate the even columns, up the odd ones (two Slices of step 2), then
    (clip(up, -limit, limit) + 1) * (g * sigmoid(alpha g)), g = clip(gate, max=limit): (the column order that makes
    them gate then up halves, (alpha, limit, the product))."""
    parts = {}
    for n in g.consumers[out]:
        if n.op_type == "Identity":
            continue
        starts, ends, axes, steps = g.slice_args(n)
        if n.input[0] != out or axes not in ([-1], [1]) or steps != [2] or starts not in ([0], [1]) or ends[0] < width:
            raise unsupported(step, f"{where}: expert {e}'s gate/up is sliced other than into its even and odd columns")
        parts[starts[0]] = n.output[0]
    if sorted(parts) != [0, 1] or width % 2:
        raise unsupported(step, f"{where}: expert {e}'s gate/up is not its even and odd columns")
    gate_clip, up_clip = g.only(parts[0], "Clip"), g.only(parts[1], "Clip")
    bound = lambda clip, i: g.scalar(clip.input[i]) if len(clip.input) > i and clip.input[i] else None  # noqa: E731
    limit = bound(gate_clip, 2)
    readers = [n for n in g.consumers.get(gate_clip.output[0], []) if n.op_type != "Identity"]
    scaled = next((n for n in readers if n.op_type == "Mul" and any(x in g.init for x in n.input)), None)
    sigmoid = g.only(scaled.output[0], "Sigmoid") if scaled is not None else None
    glu = g.only(sigmoid.output[0], "Mul") if sigmoid is not None else None
    shifted = g.only(up_clip.output[0], "Add")
    prod = g.only(shifted.output[0], "Mul")
    alpha = [g.scalar(x) for x in (scaled.input if scaled is not None else []) if x in g.init]
    one = [g.scalar(x) for x in shifted.input if x in g.init]
    if (
        limit is None
        or bound(gate_clip, 1) is not None
        or bound(up_clip, 1) != -limit
        or bound(up_clip, 2) != limit
        or len(alpha) != 1
        or sorted(n.op_type for n in readers) != ["Mul", "Mul"]
        or glu not in readers
        or sorted(glu.input) != sorted([gate_clip.output[0], sigmoid.output[0]])
        or one != [1.0]
        or sorted(prod.input) != sorted([shifted.output[0], glu.output[0]])
    ):
        raise unsupported(step, f"{where}: expert {e}'s activation is not gpt-oss's clamped SwiGLU")
    if not (limit > 0 and np.isfinite(limit) and np.isfinite(alpha[0])):
        raise malformed(step, f"{where}: expert {e}'s SwiGLU clamp {limit} or slope {alpha[0]}")
    order = np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])
    return order, (float(alpha[0]), float(limit), prod.output[0])


def _sum_in_order(g: Graph, step: Path, where: str, scatters: list) -> str:
    """The experts' ScatterNDs chained in expert order from a zero sum; the sum's tensor."""
    first = g.producer.get(scatters[0].input[0])
    zero = g.producer.get(first.input[0]) if first is not None and first.op_type == "Expand" else None
    zero_value = g.array(first.input[0]) if first is not None and first.op_type == "Expand" and first.input[0] in g.init else None
    if zero is not None or zero_value is None or zero_value.size != 1 or float(zero_value.reshape(-1)[0]) != 0.0:
        raise unsupported(step, f"{where}' sum does not start at zero")
    for before, after in zip(scatters, scatters[1:]):
        if after.input[0] != before.output[0] or len(g.consumers.get(before.output[0], [])) != 1:
            raise unsupported(step, f"{where}' outputs are not summed in expert order")
    return scatters[-1].output[0]


def _shared(g: Graph, step: Path, layer: int, linears: list, total: str) -> tuple[str, str, dict]:
    """A shared expert beside the routed ones: gate and up linears, the activation, down, times the sigmoid of a
    one-output gate linear, added after the routed sum: (the layer's sum, its activation, its Experts fields)."""
    where = f"layer {layer}'s experts"
    if len(linears) == 1:  # the three fused into one matmul and split (the quantizers fuse linears of one input)
        linears = _split_linear(g, step, where, *linears[0])
    gates = [(lin, out) for lin, out in linears if lin.shape[1] == 1]
    if len(linears) != 3 or len(gates) != 1:
        raise unsupported(step, f"{where} read {len(linears)} more linears than their router, not one shared expert's three")
    gate, gate_out = gates[0]
    sigmoid = g.only(gate_out, "Sigmoid")
    scaled = g.only(sigmoid.output[0], "Mul")
    rest = [(lin, out) for lin, out in linears if out != gate_out]
    for (gp, gp_out), (up, up_out) in (rest, rest[::-1]):
        try:
            act, gated = gate_of(g, step, layer, gp_out)
        except NativeCannotRun:  # not the gate projection: try the other
            continue
        prod = g.only(gated, "Mul")
        if up_out not in prod.input:
            continue
        down, out = g.linear(prod.output[0])
        add = g.only(scaled.output[0], "Add")
        if out not in scaled.input or sorted(add.input) != sorted([total, scaled.output[0]]):
            raise unsupported(step, f"{where}: the shared expert's output is not gated by a sigmoid and added to the routed sum")
        return add.output[0], act, dict(shared_gate_up=joined(step, gp, up), shared_down=down, shared_gate=gate)
    raise unsupported(step, f"{where}: the shared expert is not an activated gate times up")


def _split_linear(g: Graph, step: Path, where: str, lin: Linear, out: str) -> list[tuple[Linear, str]]:
    """A linear whose output one Split cuts along its last axis: each part as a linear of its own columns, and the
    part's tensor. Exact: each output column's sum is its own."""
    split = g.only(out, "Split")
    widths = g.array(split.input[1]).reshape(-1).tolist() if len(split.input) > 1 and split.input[1] else None
    if attr(split, "axis", 0) not in (-1, 1) or widths is None or sum(widths) != lin.shape[1] or len(widths) != len(split.output):
        raise unsupported(step, f"{where}: a fused linear split other than into parts of its outputs")
    starts = np.cumsum([0, *widths])
    return [(lin.outputs(slice(a, b)), part) for a, b, part in zip(starts[:-1], starts[1:], split.output)]


def joined(step: Path, a: Linear, b: Linear) -> Linear:
    """Two linears of one input as one, ``a``'s outputs then ``b``'s: exact, each output's sums are its own."""
    if (
        a.shape[0] != b.shape[0]
        or (a.bits, a.block, a.int8) != (b.bits, b.block, b.int8)
        or (a.int8 and (a.tiny, a.divisor) != (b.tiny, b.divisor))
    ):
        raise unsupported(step, f"a gate and an up projection of different forms ({a.shape}, {b.shape})")
    cat = lambda x, y, axis=-1: None if x is None else np.ascontiguousarray(np.concatenate([x, y], axis=axis))  # noqa: E731
    weight = cat(a.weight, b.weight, 0 if a.bits else -1)  # nbits bytes are (N, blocks, bytes)
    return Linear(weight, cat(a.scale, b.scale), a.tiny, a.divisor, cat(a.zero, b.zero), a.block, a.bits, k=a.k)
