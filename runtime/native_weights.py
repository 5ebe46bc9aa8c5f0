"""The weights of a step graph of the pattern ``native_step.c`` computes, read out of the engine's ONNX file and
checked against it.

``read_weights`` walks the graph from the token embedding to ``hidden``, layer by layer, and refuses by name any
graph that is not that pattern: per layer RMSNorm, one fused q/k/v matmul (split, or Phi-3's three slices; split five
ways where the MLP reads the same norm, StableLM-2 12B), optional q/k/v biases (Qwen2), optional RMS norms of each
query and key head (Qwen3; or each head's own layer norm, StableLM-2 12B), rotate-half rotary embedding (a
RotaryEmbedding node, or its ops: gpt-oss's with YaRN's factor, Helium's over interleaved pairs), attention over the
layer's own cache slice (optionally inside a sliding window: Mistral, Qwen2's windowed layers; an Attention node, or
the decomposed attention of Gemma-2 with its soft-cap or of gpt-oss with its sinks), output matmul (optionally a
bias), residual Add, RMSNorm, one fused gate/up matmul, SiLU gate, down matmul (or routed experts: ``native_experts``;
or an ungated GELU MLP with biases), residual Add (or GPT-NeoX's parallel residual: both norms read the layer's input,
the two outputs added, then the input); then the final RMSNorm (the graph's ``hidden``) and the lm_head (optionally a
divisor or a final soft-cap after it). Each weight matmul is fp32, int8-channel's row-quantized int8 or MatMulNBits'
blocks (``Graph.linear``). Anything else (other activations or norms, a gated MLP's biases, other quantizers) is
refused at load, never approximated: an engine that generates other text
than its model is the worst failure this project can have. The engine's model type must be one whose layers were
checked against it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.contract import KEY_SLOTS_INPUT, NEW_KEY, NEW_VALUE, PAST_KEY, PAST_VALUE, POSITION_IDS
from medusa_trt.runtime.native_experts import MOE_OPS, Experts, read_experts, routed
from medusa_trt.runtime.native_graph import Graph, Linear, NativeCannotRun, attr, biased, gate_of, malformed, unsupported  # noqa: F401 (NativeCannotRun: the error read_weights raises)

# EngineMeta.architecture values whose layers export to the pattern (read_weights checks the graph too); the MoE ones
# route their MLPs through experts (native_experts.py)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# ops a model type's graphs hold beyond OPS: routed experts' (native_experts.py), Gemma-2's decomposed soft-capped
# attention and final soft-cap
MODEL_OPS = {
    **{t: MOE_OPS for t in MOE_TYPES},
    "gemma2": frozenset({"Softmax", "Tanh"}),
    "stablelm": frozenset({"LayerNormalization"}),
    "nemotron": frozenset({"LayerNormalization", "Relu", "Pow"}),
    "gpt_neox": frozenset({"LayerNormalization"}),
    "helium": frozenset({"Neg"}),  # its interleaved rotary's ops
}
MODEL_OPS["gpt_oss"] = MOE_OPS  # its attention's Softmax (with sinks) and its router's TopK, Softmax and clamps
QK_SPANS = ("shared", "whole", "each")  # Weights.qk_norm_span's values, in native_step.c's order (QK_SHARED, ...)
MAX_EXPERTS = 256  # experts a layer, at most (native_step.c's MAX_EXPERTS)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2", "stablelm", "nemotron")
MODEL_TYPES += ("gpt_neox", "helium", *MOE_TYPES)
# every op a supported step graph holds: the layers' ops and the mask, cache and shape glue around them
OPS = frozenset(
    "Shape Squeeze Range Unsqueeze Less Concat Expand Cast ScatterElements Greater Or Not Where Gather Mul RMSNormalization "
    "MatMul Split Reshape Transpose Cos Sin RotaryEmbedding Attention Add Sigmoid Identity If "
    "Slice GreaterOrEqual Sub Gelu "  # Phi-3's q/k/v slices; a sliding window's mask; Gemma's gate
    "Abs ReduceMax Max Div ConstantOfShape QuantizeLinear MatMulInteger "  # int8-channel's matmuls
    "MatMulNBits".split()  # int4's and int8-block's
)


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int  # H
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    inter: int  # I, the MLP's width
    vocab: int  # V
    eps: float
    scale: float  # the attention's score scale


@dataclass(frozen=True)
class Weights:
    dims: Dims
    inv_freq: np.ndarray  # (R, D / 2): each rotary table's inverse frequencies (R: 1, or 2 for local / global bases)
    embed: np.ndarray  # (V, H)
    norm_in: list[np.ndarray | None]  # L x (H); None: the layer's q/k/v matmul reads the residual stream itself
    qkv: list[Linear]  # L x (H, (Hq + 2 Hkv) D)
    o: list[Linear]  # L x (Hq D, H)
    norm_post: list[np.ndarray | None]  # None: the gate/up matmul reads the residual stream itself
    gate_up: list[Linear | None]  # L x (H, 2 I): gate then up (None: the layer routes its MLP through experts)
    down: list[Linear | None]  # L x (I, H)
    norm_final: np.ndarray  # (H)
    lm_head: Linear  # (H, V)
    qkv_bias: list[np.ndarray | None]  # L x ((Hq + 2 Hkv) D): q, k, v biases (None: the layer has none)
    q_norm: list[np.ndarray | None]  # L x (D), or (Hq D) as qk_norm_span says: the query heads' norm weights (None: none)
    k_norm: list[np.ndarray | None]  # L x (D), or (Hkv D)
    windows: tuple[int, ...]  # L: each layer's sliding window in positions (0: every key)
    rope_of: tuple[int, ...]  # L: each layer's rotary table (a row of inv_freq)
    attn_out_norm: list[np.ndarray | None]  # L x (H): the attention output's norm before its residual add (Gemma)
    mlp_out_norm: list[np.ndarray | None]  # L x (H): the MLP output's norm before its residual add
    qk_eps: float = 0.0  # the q/k norms' epsilon
    act: str = "silu"  # the MLP gate: silu, gelu_tanh, gelu, swiglu_limit; relu2 an ungated MLP (native_step.ACTIVATIONS)
    embed_scale: float = 1.0  # the token embedding times this (Gemma: sqrt(hidden))
    residual_scale: float = 1.0  # each attention and MLP output times this before its residual add (Granite)
    logit_divisor: float = 1.0  # the logits are the lm_head's output over this (Granite's logits scaling)
    # q_norm / k_norm: "shared", one (D) weight for every head; "whole", one norm over the whole projection, (Hq D) /
    # (Hkv D) (OLMo-2); "each", each head normed with its own (D) weight, (Hq D) / (Hkv D) in all (StableLM-2 12B)
    qk_norm_span: str = "shared"
    experts: tuple[Experts | None, ...] = ()  # L: each layer's routed experts (None: its dense MLP); (): no layer has any
    attn_softcap: float = 0.0  # each score s (scaled) becomes c tanh(s / c) before the mask and softmax (Gemma-2; 0: none)
    final_softcap: float = 0.0  # each logit z (past the divisor) becomes c tanh(z / c) (Gemma-2; 0: none)
    layer_norm: bool = False  # every norm of the residual stream is a layer norm (mean and variance; StableLM), not RMS
    rotary_dim: int = 0  # the leading dims of each head the rotary embedding turns (0: all; StableLM's partial rotary)
    norm_in_bias: tuple | list = ()  # L x (H) or None: a layer norm's bias (): none at all
    norm_post_bias: tuple | list = ()
    norm_final_bias: np.ndarray | None = None
    o_bias: tuple | list = ()  # L x (H) or None: the attention output projection's bias (gpt-oss); (): none at all
    sinks: tuple | list = ()  # L x (Hq) or None: each head's sink logit in its softmax's denominator (gpt-oss)
    rope_factor: float = 1.0  # the rotary tables' cos and sin times this (YaRN's attention factor)
    act_alpha: float = 0.0  # swiglu_limit's sigmoid slope and clamp (gpt-oss's experts)
    act_limit: float = 0.0
    gate_up_bias: tuple | list = ()  # L x (I) or None: an ungated MLP's up bias (GPT-NeoX); (): none at all
    down_bias: tuple | list = ()  # L x (H) or None
    parallel_residual: bool = False  # x + (mlp(norm_post(x)) + attention(norm_in(x))) (GPT-NeoX)
    rope_interleaved: bool = False  # the rotary turns pairs (2i, 2i + 1), not halves (Helium)
    qk_layer_norm: bool = False  # the q/k norms are layer norms without bias (StableLM), not RMS norms
    # (x + attention(norm_in(x))) + mlp(norm_in(x)): the MLP reads the input norm's output (StableLM-2 12B's parallel
    # residual; its q/k/v and gate/up matmuls fused into one, split five ways)
    shared_norm: bool = False


def check_architecture(path: Path, architecture: str) -> None:
    """Refuse model types whose layers were never checked against the pattern (the graph is read strictly too)."""
    if architecture not in MODEL_TYPES:
        raise unsupported(path, f"model type {architecture!r} is not one of {', '.join(MODEL_TYPES)}")


def _mask_root(g: Graph, tensor: str) -> str:
    """Where an attention's mask comes from, past the per-layer reshapes."""
    while (node := g.producer.get(tensor)) is not None and node.op_type in ("Reshape", "Expand", "Unsqueeze"):
        tensor = node.input[0]
    return tensor


def _past(tensor: str, g: Graph) -> str:
    """``tensor``'s source past the Unsqueezes (a scatter's or a difference's operand)."""
    while (node := g.producer.get(tensor)) is not None and node.op_type == "Unsqueeze":
        tensor = node.input[0]
    return tensor


def _window(g: Graph, step: Path, layer: int, mask: str) -> tuple[str, int]:
    """The mask every layer shares and this layer's sliding window (0: none). A windowed layer's mask is the shared one
    with every key ``window`` or more positions behind its query masked: Where(Sub(query positions, key positions) >=
    window, -inf, shared), the key positions being each slot's (slot s holds position s) with the new keys' scattered
    over their slots."""
    root = _mask_root(g, mask)
    where = g.producer.get(root)
    ge = g.producer.get(_past(where.input[0], g)) if where is not None and where.op_type == "Where" else None
    if ge is None or ge.op_type not in ("GreaterOrEqual", "Sub"):  # not a window's (the shared mask masks with Not)
        return root, 0
    sub = g.producer.get(ge.input[0]) if ge.op_type == "GreaterOrEqual" else None
    keys = g.producer.get(_past(sub.input[1], g)) if sub is not None and sub.op_type == "Sub" else None
    if (
        keys is None
        or _past(sub.input[0], g) != POSITION_IDS
        or keys.op_type != "ScatterElements"
        or list(keys.input[1:]) != [KEY_SLOTS_INPUT, POSITION_IDS]
        or ge.input[1] not in g.init
    ):
        raise unsupported(step, f"layer {layer}'s attention mask is neither the shared one nor it inside a sliding window")
    window = g.scalar(ge.input[1])
    if window != int(window) or not 0 < window < 2**31:
        raise malformed(step, f"layer {layer}'s sliding window of {window} positions")
    return _mask_root(g, where.input[2]), int(window)


def _qkv_parts(g: Graph, step: Path, layer: int, out: str, width: int) -> tuple[list[str], list[int] | None]:
    """The q, k and v parts of the q/k/v matmul's output and their widths: one Split, or three Slices of the last axis
    (Phi-3's fused qkv_proj). Five parts where the MLP reads the input norm too (StableLM-2 12B): q, k, v, gate, up."""
    readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
    kinds = sorted(n.op_type for n in readers)
    if kinds == ["Split"]:
        split = readers[0]
        widths = g.array(split.input[1]).tolist() if len(split.input) > 1 and split.input[1] else None
        if attr(split, "axis", 0) not in (-1, 2) or len(split.output) not in (3, 5) or len(split.output) == 5 and widths is None:
            raise unsupported(step, f"layer {layer}'s q/k/v matmul is split {len(split.output)} ways or not along its last axis")
        return list(split.output), widths
    if kinds == ["Slice"] * 3:
        bounds = []
        for n in readers:
            starts, ends, axes, steps = g.slice_args(n)
            if axes not in ([-1], [2]) or steps not in (None, [1]) or len(starts) != 1 or len(ends) != 1:
                raise unsupported(step, f"layer {layer}'s q/k/v matmul is sliced other than into parts of its last axis")
            bounds.append((max(0, starts[0]), min(width, ends[0]), n.output[0]))
        bounds.sort()
        if bounds[0][0] != 0 or bounds[1][0] != bounds[0][1] or bounds[2][0] != bounds[1][1] or bounds[2][1] != width:
            raise unsupported(step, f"layer {layer}'s q/k/v slices {[b[:2] for b in bounds]} do not tile its {width} outputs")
        return [b[2] for b in bounds], [b[1] - b[0] for b in bounds]
    raise unsupported(step, f"layer {layer}'s q/k/v matmul is read by {', '.join(kinds) or 'nothing'}, not a Split into q, k, v")


@dataclass(frozen=True)
class _Part:
    """One of q, k, v in its (B, heads, T, D) layout (``_head_part``), and what was added and normed on the way."""

    bias: np.ndarray | None
    norm: np.ndarray | None  # q and k: the norm's weight, as ``span`` says (None: none)
    eps: float
    out: str
    span: str  # QK_SPANS
    layer_norm: bool = False  # the norm is a layer norm without bias, not RMS


def _head_part(g: Graph, step: Path, layer: int, part: str, what: str) -> _Part:
    """One of q, k, v from its slice of the q/k/v matmul to its (B, heads, T, D) layout: an optional bias Add, the
    Reshape to heads and the Transpose, with an optional norm of q and k: RMS over the whole projection before the
    Reshape, RMS over each head before or after the Transpose, or each head's own norm after it (``_each_head``)."""
    bias = weight = None
    eps = 0.0
    readers = [n for n in g.consumers.get(part, []) if n.op_type != "Identity"]
    if len(readers) == 1 and readers[0].op_type == "Add":
        add = readers[0]
        constant = [x for x in add.input if x != part]
        if len(constant) != 1 or constant[0] not in g.init:
            raise unsupported(step, f"layer {layer}'s {what} is added to a computed value, not a bias")
        bias, part = g.array(constant[0]).reshape(-1), add.output[0]
    readers = [n for n in g.consumers.get(part, []) if n.op_type != "Identity"]
    whole = len(readers) == 1 and readers[0].op_type == "RMSNormalization"
    if whole:  # a norm of the whole projection, all heads at once (OLMo-2)
        norm = readers[0]
        if what == "v" or attr(norm, "axis", -1) != -1:
            raise unsupported(step, f"layer {layer}'s {what} is normalized other than over its whole projection")
        weight, eps, part = g.array(norm.input[1]), float(attr(norm, "epsilon", 1e-5)), norm.output[0]
    out = g.only(part, "Reshape").output[0]
    for op in ("Transpose", None):  # a head norm reads the (B, T, heads, D) view or the (B, heads, T, D) transpose
        readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
        if len(readers) == 1 and readers[0].op_type == "RMSNormalization":
            norm = readers[0]
            if weight is not None:
                raise unsupported(step, f"layer {layer}'s {what} is normalized twice")
            if what == "v" or attr(norm, "axis", -1) not in (-1, 3):
                raise unsupported(step, f"layer {layer}'s {what} is normalized other than one head at a time")
            weight, eps, out = g.array(norm.input[1]), float(attr(norm, "epsilon", 1e-5)), norm.output[0]
        if op is None:
            break
        transpose = g.only(out, op)
        if list(attr(transpose, "perm", [])) != [0, 2, 1, 3]:
            raise unsupported(step, f"layer {layer}'s {what} heads are not transposed to (batch, heads, tokens, dim)")
        out = transpose.output[0]
    if (each := _each_head(g, step, layer, out, what)) is None:
        return _Part(bias, weight, eps, out, "whole" if whole else "shared")
    if weight is not None:
        raise unsupported(step, f"layer {layer}'s {what} is normalized twice")
    return _Part(bias, *each, "each", layer_norm=True)


def _each_head(g: Graph, step: Path, layer: int, heads: str, what: str) -> tuple[np.ndarray, float, str] | None:
    """Each head normed with its own weight (StableLM-2 12B's per-head LayerNorm of q and k): a Split of ``heads``
    (B, heads, T, D) into single heads, a LayerNormalization without bias on each, their Concat in the same order.
    (the weights, head after head; the epsilon; the Concat's output), or None where ``heads`` is not split."""
    readers = [n for n in g.consumers.get(heads, []) if n.op_type != "Identity"]
    if [n.op_type for n in readers] != ["Split"] or attr(readers[0], "axis", 0) != 1:  # another Split: a rotary's halves
        return None
    split = readers[0]
    ones = len(split.input) < 2 or not split.input[1] or set(g.array(split.input[1]).tolist()) == {1}
    if what == "v" or not ones:
        raise unsupported(step, f"layer {layer}'s {what} heads are split other than one head each for its own norm")
    norms = [g.only(part, "LayerNormalization") for part in split.output]
    if any(attr(n, "axis", -1) not in (-1, 3) or len(n.input) > 2 and n.input[2] for n in norms):
        raise unsupported(step, f"layer {layer}'s {what} head norms are biased or not over each head's dims")
    if len(eps := {float(attr(n, "epsilon", 1e-5)) for n in norms}) != 1:
        raise unsupported(step, f"layer {layer}'s {what} head norms have different epsilons {sorted(eps)}")
    concat = g.only(norms[0].output[0], "Concat")
    if attr(concat, "axis", 0) != 1 or list(concat.input) != [n.output[0] for n in norms]:
        raise unsupported(step, f"layer {layer}'s {what} head norms are not joined back in order along the heads axis")
    return np.concatenate([g.array(n.input[1]).reshape(-1) for n in norms]), eps.pop(), concat.output[0]


def _rotary_table(g: Graph, step: Path, rotary) -> tuple[np.ndarray, float]:
    """A rotary embedding's table: the inverse frequencies whose products with the positions its cos and sin read, and
    the factor both are multiplied by (YaRN's attention factor, gpt-oss; 1: none)."""
    cos, sin = (g.producer.get(_past(rotary.input[i], g)) for i in (1, 2))
    factor, ends = 1.0, None
    if isinstance(rotary, _Computed) and rotary.interleaved:  # each angle twice, of the first half of cos / sin of (f, f)
        (cos, cos_end), (sin, sin_end) = (_repeated_table(g, step, rotary.input[i]) for i in (1, 2))
        cat = g.producer.get(cos.input[0]) if cos is not None and cos.op_type == "Cos" else None
        if cat is None or cat.op_type != "Concat" or len(set(cat.input)) != 1 or sin is None or sin.input[0] != cos.input[0]:
            raise unsupported(step, "an interleaved rotary table other than cos / sin of the angles twice over")
        angles, ends = cat.input[0], (cos_end, sin_end)
    else:
        if cos is not None and sin is not None and cos.op_type == sin.op_type == "Mul":  # cos(f) x a and sin(f) x a
            a = [x for x in cos.input if x in g.init]
            if len(a) != 1 or [x for x in sin.input if x in g.init] != a or g.array(a[0]).size != 1:
                raise unsupported(step, "rotary tables scaled other than both by one constant")
            factor = g.scalar(a[0])
            cos, sin = (g.producer.get(next(x for x in n.input if x not in g.init)) for n in (cos, sin))
        same = cos is not None and cos.op_type == "Cos" and sin is not None and sin.input[0] == cos.input[0]
        angles = cos.input[0] if same else None
    freq = g.producer.get(angles) if angles is not None else None
    ok = freq is not None and freq.op_type == "Mul" and sin.op_type == "Sin"
    if not ok or freq.input[1] not in g.init or _past(_uncast(g, freq.input[0]), g) != POSITION_IDS:
        raise unsupported(step, "rotary tables other than cos/sin of position x inverse frequencies")
    inv = g.array(freq.input[1]).reshape(-1)
    if ends is not None and ends != (inv.size, inv.size):
        raise unsupported(step, f"an interleaved rotary table of {ends[0]} angles for {inv.size} frequencies")
    if attr(rotary, "interleaved", 0) or attr(rotary, "rotary_embedding_dim", 0):
        raise unsupported(step, "an interleaved or partial rotary embedding")
    if not (math.isfinite(factor) and factor > 0):
        raise malformed(step, f"rotary tables scaled by {factor}")
    return inv, float(factor)


def _uncast(g: Graph, tensor: str) -> str:
    node = g.producer.get(tensor)
    return node.input[0] if node is not None and node.op_type == "Cast" else tensor


def _cache_write(g: Graph, step: Path, layer: int, tensor: str, cache: str, into: str, stacked: list[str]) -> None:
    """``tensor``, the layer's new keys or values, scattered into the layer's slice of ``cache`` to make the attention's
    input ``into``, and stacked as the layer's row of the step's new_key / new_value (``stacked``)."""
    readers = {n.op_type: n for n in g.consumers.get(tensor, []) if n.op_type != "Identity"}
    scatter, unsqueeze = readers.get("ScatterElements"), readers.get("Unsqueeze")
    if sorted(readers) != ["ScatterElements", "Unsqueeze"] or scatter.output[0] != into or scatter.input[2] != tensor:
        raise unsupported(step, f"layer {layer}'s new {cache} are not what its attention reads with the cache")
    if layer >= len(stacked) or stacked[layer] != unsqueeze.output[0]:
        raise unsupported(step, f"layer {layer}'s new {cache} are not row {layer} of the step's")
    transpose = g.producer.get(scatter.input[0])
    gather = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    if gather is None or gather.op_type != "Gather" or gather.input[0] != cache or attr(gather, "axis", 0) != 1:
        raise unsupported(step, f"layer {layer}'s attention does not read its slice of {cache}")
    if int(g.scalar(gather.input[1])) != layer:
        raise unsupported(step, f"layer {layer}'s attention reads layer {int(g.scalar(gather.input[1]))} of {cache}")


def _stacked(g: Graph, step: Path, output: str, layers: int) -> list[str]:
    """The per-layer rows the step's ``output`` (new_key / new_value: Transpose of a Concat of one Unsqueeze a layer)
    stacks, in layer order."""
    transpose = g.producer.get(output)
    concat = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    if concat is None or concat.op_type != "Concat" or len(concat.input) != layers:
        raise unsupported(step, f"{output} is not the {layers} layers' new rows stacked")
    return list(concat.input)


def _rotated(g: Graph, step: Path, layer: int, x: str) -> tuple:
    """The rotary embedding of the heads ``x`` (B, heads, T, D): one RotaryEmbedding of all D, or (partial rotary) of
    the leading R dims, Concat-ed back with the rest. (its RotaryEmbedding node, the rotated tensor, R; 0: all D)."""
    readers = [n for n in g.consumers.get(x, []) if n.op_type != "Identity"]
    if [n.op_type for n in readers] == ["RotaryEmbedding"] and readers[0].input[0] == x:
        return readers[0], readers[0].output[0], 0
    if [n.op_type for n in readers] == ["Split"]:
        return _computed_rotary(g, step, layer, readers[0])
    if sorted(n.op_type for n in readers) == ["Mul", "Slice", "Slice"]:
        return _computed_pairs(g, step, layer, x, readers)
    if [n.op_type for n in readers] != ["Slice", "Slice"]:
        raise unsupported(step, f"layer {layer}'s heads are read by {sorted(n.op_type for n in readers)}, not a rotary embedding")
    bounds = []
    for n in readers:
        starts, ends, axes, steps = g.slice_args(n)
        if n.input[0] != x or axes not in ([-1], [3]) or steps not in (None, [1]) or len(starts) != 1 or len(ends) != 1:
            raise unsupported(step, f"layer {layer}'s heads are sliced other than along their last axis")
        bounds.append((starts[0], ends[0], n.output[0]))
    (a0, r, head), (r2, _, tail) = sorted(bounds)
    rotary = g.only(head, "RotaryEmbedding")
    concat = g.only(rotary.output[0], "Concat")
    if a0 != 0 or r2 != r or r <= 0 or list(concat.input) != [rotary.output[0], tail] or attr(concat, "axis", 0) not in (-1, 3):
        raise unsupported(step, f"layer {layer}'s partial rotary is not the leading dims turned and the rest kept")
    if g.consumers.get(tail, []) != [concat]:
        raise unsupported(step, f"layer {layer}'s heads past the rotary dims are read by more than the Concat")
    return rotary, concat.output[0], int(r)


@dataclass(frozen=True)
class _Computed:
    """A rotary embedding exported as its ops (gpt-oss), standing for a RotaryEmbedding node: input [x, cos, sin]."""

    input: tuple[str, str, str]
    attribute: tuple = ()
    interleaved: bool = False  # pairs (2i, 2i + 1) turned (Helium's rotate_every_two), not halves


def _computed_rotary(g: Graph, step: Path, layer: int, split) -> tuple[_Computed, str, int]:
    """rotate_half as ops: the heads Split into halves x1, x2; Concat(x1 cos - x2 sin, x2 cos + x1 sin)."""
    x = split.input[0]
    halves = len(split.input) < 2 or not split.input[1] or len(set(g.array(split.input[1]).reshape(-1).tolist())) == 1
    if attr(split, "axis", 0) not in (-1, 3) or len(split.output) != 2 or not halves:
        raise unsupported(step, f"layer {layer}'s heads are split other than into two halves of the head")
    x1, x2 = split.output
    products = {}  # (half, table) -> the product's tensor
    for half in (x1, x2):
        for n in g.consumers.get(half, []):
            other = [t for t in n.input if t != half]
            if n.op_type != "Mul" or len(other) != 1:
                raise unsupported(step, f"layer {layer}'s rotary reads its heads' halves with a {n.op_type}")
            products[(half, other[0])] = n
    tables = sorted({t for _, t in products})
    if len(products) != 4 or len(tables) != 2:
        raise unsupported(step, f"layer {layer}'s rotary is not each half times a cos and a sin table")
    for cos, sin in (tables, tables[::-1]):
        if all((h, t) in products for h in (x1, x2) for t in (cos, sin)):
            first = g.only(products[(x1, cos)].output[0], "Sub")
            second = g.only(products[(x2, cos)].output[0], "Add")
            concat = g.only(first.output[0], "Concat")
            if (
                list(first.input) == [products[(x1, cos)].output[0], products[(x2, sin)].output[0]]
                and sorted(second.input) == sorted([products[(x2, cos)].output[0], products[(x1, sin)].output[0]])
                and list(concat.input) == [first.output[0], second.output[0]]
                and attr(concat, "axis", 0) in (-1, 3)
            ):
                return _Computed((x, cos, sin)), concat.output[0], 0
    raise unsupported(step, f"layer {layer}'s rotary ops are not rotate_half (x1 cos - x2 sin, x2 cos + x1 sin)")


def _parallel_norms(g: Graph, step: Path, layer: int, x: str, norms: list) -> tuple:
    """The two norms of the layer's input ``x`` in a parallel residual: (the attention's, the MLP's). The attention's is
    the one whose linear's (biased) output is cut into q, k and v (a Reshape, a Split or Slices)."""
    attention = []
    for n in norms:
        if n.input[0] != x or attr(n, "axis", -1) != -1:
            raise unsupported(step, f"layer {layer}'s input is normalized other than along its hidden axis")
        _, out = g.linear(n.output[0])
        _, out = biased(g, out)
        kinds = sorted(r.op_type for r in g.consumers.get(out, []) if r.op_type != "Identity")
        attention.append(kinds in (["Reshape"], ["Split"], ["Slice"] * 3))
    if sorted(attention) != [False, True]:
        raise unsupported(step, f"layer {layer}'s input is read by two norms, neither or both the attention's")
    return (norms[0], norms[1]) if attention[0] else (norms[1], norms[0])


def _parallel_sum(g: Graph, step: Path, layer: int, x: str, mlp: str, attention: str) -> str:
    """The layer's output in a parallel residual: Add(mlp, attention), then Add of that and the layer's input ``x``."""
    both = g.only(mlp, "Add")
    total = g.only(both.output[0], "Add")
    if sorted(both.input) != sorted([mlp, attention]) or sorted(total.input) != sorted([both.output[0], x]):
        raise unsupported(step, f"layer {layer}'s MLP and attention outputs are not added to each other, then to its input")
    return total.output[0]


def _interleaved_heads(g: Graph, step: Path, layer: int, qkv: Linear, out: str):
    """GPT-NeoX's fused q/k/v: its (biased) output reshaped to (B, T, heads, 3 D), transposed, and split into each
    head's q, k and v. Read with its columns in q, k, v order (a column order: exact): (that linear, the three
    (B, heads, T, D) tensors, their widths, their biases); None where the output is cut otherwise."""
    bias, cut = biased(g, out)
    readers = [n for n in g.consumers.get(cut, []) if n.op_type != "Identity"]
    if [n.op_type for n in readers] != ["Reshape"]:
        return None
    transpose = g.only(readers[0].output[0], "Transpose")
    split = g.only(transpose.output[0], "Split")
    sizes = g.array(split.input[1]).reshape(-1).tolist() if len(split.input) > 1 and split.input[1] else None
    if list(attr(transpose, "perm", [])) != [0, 2, 1, 3] or attr(split, "axis", 0) not in (-1, 3) or len(split.output) != 3:
        raise unsupported(step, f"layer {layer}'s q/k/v heads are not transposed and split into each head's q, k, v")
    width = _head_width(g, step, layer, transpose.output[0])  # 3 D
    n = qkv.shape[1]
    if width % 3 or n % width or (sizes is not None and len(set(sizes)) != 1):
        raise unsupported(step, f"layer {layer}'s q/k/v heads of width {width} do not hold three equal parts")
    d, heads = width // 3, n // width
    order = np.array([h * width + p * d + e for p in range(3) for h in range(heads) for e in range(d)])
    bias = None if bias is None else bias[order]
    if bias is not None and bias.shape != (n,):
        raise malformed(step, f"layer {layer}'s q/k/v bias of shape {bias.shape} for {n} outputs")
    biases = (None, None, None) if bias is None else tuple(bias[i * heads * d : (i + 1) * heads * d] for i in range(3))
    return qkv.outputs(order), tuple(split.output), [heads * d] * 3, biases


def _head_width(g: Graph, step: Path, layer: int, heads: str) -> int:
    """The head width of ``heads`` (B, heads, T, D): the last dim of the Reshape before its Transpose (a constant, or
    the last of a Concat of shape parts)."""
    transpose = g.producer.get(heads)
    reshape = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    shape = reshape.input[1] if reshape is not None and reshape.op_type == "Reshape" else None
    concat = g.producer.get(shape) if shape is not None else None
    last = shape if shape in g.init else concat.input[-1] if concat is not None and concat.op_type == "Concat" else None
    width = int(g.array(last).reshape(-1)[-1]) if last in g.init else 0
    if width <= 0:
        raise unsupported(step, f"layer {layer}'s heads are reshaped to a width that is not a constant")
    return width


def _computed_pairs(g: Graph, step: Path, layer: int, x: str, readers: list) -> tuple[_Computed, str, int]:
    """rotate_every_two as ops (Helium): x * cos + rot(x) * sin, rot(x) the pairs (-x[2i + 1], x[2i]) (even and odd
    Slices of step 2, Neg, each Unsqueezed, Concat, Reshape), cos and sin each angle repeated twice."""
    mul = next(n for n in readers if n.op_type == "Mul")
    parts = {}
    for n in readers:
        if n.op_type != "Slice":
            continue
        starts, ends, axes, steps = g.slice_args(n)
        if axes not in ([-1], [3]) or steps != [2] or starts not in ([0], [1]) or ends[0] < 2**31:
            raise unsupported(step, f"layer {layer}'s rotary slices its heads other than into even and odd dims")
        parts[starts[0]] = n.output[0]
    if sorted(parts) != [0, 1]:
        raise unsupported(step, f"layer {layer}'s rotary does not take its heads' even and odd dims")
    neg = g.only(parts[1], "Neg")
    first, second = g.only(neg.output[0], "Unsqueeze"), g.only(parts[0], "Unsqueeze")
    stack = g.only(first.output[0], "Concat")
    rotated = g.only(stack.output[0], "Reshape").output[0]
    turned = g.only(rotated, "Mul")
    add = g.only(mul.output[0], "Add")
    cos = next((t for t in mul.input if t != x), None)
    sin = next((t for t in turned.input if t != rotated), None)
    if (
        list(stack.input) != [first.output[0], second.output[0]]
        or attr(stack, "axis", 0) != -1
        or sorted(add.input) != sorted([mul.output[0], turned.output[0]])
        or cos is None
        or sin is None
        or mul.input[0] != x
    ):
        raise unsupported(step, f"layer {layer}'s rotary ops are not rotate_every_two (x cos + (-x_odd, x_even) sin)")
    return _Computed((x, cos, sin), interleaved=True), add.output[0], 0


def _repeated_table(g: Graph, step: Path, table: str):
    """The Cos or Sin node an interleaved rotary's table repeats each angle of twice (Slice [0, n) of its last axis,
    Unsqueeze, Expand to pairs, Reshape), and n."""
    tensor, seen, end = table, [], -1
    while (node := g.producer.get(tensor)) is not None and node.op_type in ("Reshape", "Expand", "Unsqueeze", "Slice"):
        if node.op_type == "Slice":
            args = g.slice_args(node)
            if args[0] != [0] or args[3] not in (None, [1]) or len(args[1]) != 1:
                raise unsupported(step, f"an interleaved rotary table sliced as {args[:2]}, not its first angles")
            end = int(args[1][0])
        if node.op_type == "Expand" and (node.input[1] not in g.init or g.array(node.input[1]).reshape(-1)[-1] != 2):
            raise unsupported(step, "an interleaved rotary table expanded other than to pairs")
        seen.append(node.op_type)
        tensor = node.input[0]
    if sorted(set(seen)) != ["Expand", "Reshape", "Slice", "Unsqueeze"] or seen.count("Slice") != 1 or seen.count("Expand") != 1:
        raise unsupported(step, "an interleaved rotary table that is not each angle repeated twice")
    return g.producer.get(tensor), end


def _squared_relu(g: Graph, step: Path, layer: int, up: str) -> str:
    """Nemotron's ungated MLP activation: Pow(Relu(up), 2); its output."""
    square = g.only(g.only(up, "Relu").output[0], "Pow")
    if square.input[1] not in g.init or g.scalar(square.input[1]) != 2.0:
        raise unsupported(step, f"layer {layer}'s MLP raises its ReLU to another power than 2")
    return square.output[0]


def _layers(g: Graph, step: Path) -> int:
    """The layers the step stacks into new_key (one row each)."""
    transpose = g.producer.get(NEW_KEY)
    concat = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    if concat is None or concat.op_type != "Concat" or not concat.input:
        raise unsupported(step, f"{NEW_KEY} is not the layers' new keys stacked")
    return len(concat.input)


@dataclass(frozen=True)
class _Attention:
    """One layer's attention as native computes it: softmax(c tanh(scale q k^T / c) + mask) v (c = softcap; 0: none)."""

    k: str  # the keys it reads (the cache slice with the step's keys scattered in)
    v: str
    mask: str
    out: str  # (B, Hq, T, D), or (B, Hkv, groups x T, D) where decomposed
    scale: float
    softcap: float
    sinks: np.ndarray | None = None  # (Hq): each head's sink logit, the softmax's last term (gpt-oss)


def _attention(g: Graph, step: Path, layer: int, q: str) -> _Attention:
    """The attention reading the rotated queries ``q``: one Attention node (opset 23), or the same decomposed (Gemma-2's
    soft-capped eager attention): MatMul(q, Transpose(k)), Mul(scale), optionally Div(c), Tanh, Mul(c), Add(mask),
    Softmax, MatMul(v)."""
    readers = [n for n in g.consumers.get(q, []) if n.op_type != "Identity"]
    if len(readers) == 1 and readers[0].op_type == "Attention":
        n = readers[0]
        scale, softcap = float(attr(n, "scale", 0.0)), float(attr(n, "softcap", 0.0))
        if len(n.input) != 4 or n.input[0] != q or attr(n, "is_causal", 0) or attr(n, "qk_matmul_output_mode", 0) or not scale > 0:
            raise unsupported(step, f"layer {layer}'s attention is causal, returns its scores or has no explicit scale")
        return _Attention(n.input[1], n.input[2], n.input[3], n.output[0], scale, softcap)
    scores = g.only(q, "MatMul")
    keys = g.producer.get(scores.input[1])
    if scores.input[0] != q or keys is None or keys.op_type != "Transpose" or list(attr(keys, "perm", [])) != [0, 1, 3, 2]:
        raise unsupported(step, f"layer {layer}'s attention scores are not its queries times its keys transposed")
    scaled = g.only(scores.output[0], "Mul")
    constant = [x for x in scaled.input if x != scores.output[0]]
    if len(constant) != 1 or constant[0] not in g.init or g.array(constant[0]).size != 1:
        raise unsupported(step, f"layer {layer}'s attention scores are scaled by something other than one constant")
    scale, softcap, s = g.scalar(constant[0]), 0.0, scaled.output[0]
    readers = [n for n in g.consumers.get(s, []) if n.op_type != "Identity"]
    if len(readers) == 1 and readers[0].op_type == "Div":  # a soft-cap: c tanh(s / c)
        div = readers[0]
        times = g.only(g.only(div.output[0], "Tanh").output[0], "Mul")
        if div.input[0] != s or div.input[1] not in g.init or [x for x in times.input if x in g.init] != [div.input[1]]:
            raise unsupported(step, f"layer {layer}'s attention scores are capped other than as c tanh(s / c)")
        softcap, s = g.scalar(div.input[1]), times.output[0]
    add = g.only(s, "Add")
    sinks, probs = None, add.output[0]
    if [n.op_type for n in g.consumers.get(probs, []) if n.op_type != "Identity"] == ["Concat"]:  # sinks (gpt-oss)
        sinks, probs = _sinks(g, step, layer, g.only(probs, "Concat"))
    softmax = g.only(probs, "Softmax")
    kept = g.only(softmax.output[0], "Slice").output[0] if sinks is not None else softmax.output[0]
    if sinks is not None:
        _last_dropped(g, step, layer, g.producer[kept])
    values = g.only(kept, "MatMul")
    mask = [x for x in add.input if x != s]
    if len(mask) != 1 or attr(softmax, "axis", -1) not in (-1, 3) or values.input[0] != kept:
        raise unsupported(step, f"layer {layer}'s attention is not a softmax over masked scores times its values")
    if not (scale > 0 and math.isfinite(scale) and softcap >= 0 and math.isfinite(softcap)):
        raise malformed(step, f"layer {layer}'s attention scale {scale} or soft-cap {softcap}")
    return _Attention(keys.input[0], values.input[1], mask[0], values.output[0], scale, softcap, sinks)


def _sinks(g: Graph, step: Path, layer: int, concat) -> tuple[np.ndarray, str]:
    """gpt-oss's sinks: Concat(masked scores, each head's sink logit expanded over its rows), its max subtracted
    (ReduceMax, Sub; the softmax's own shift, which changes nothing it computes): (the sinks, the Sub's output)."""
    if len(concat.input) != 2 or attr(concat, "axis", 0) not in (-1, 3):
        raise unsupported(step, f"layer {layer}'s attention scores are joined to more than one column of sinks")
    tensor = concat.input[1]
    while (node := g.producer.get(tensor)) is not None and node.op_type in ("Reshape", "Expand", "Unsqueeze"):
        tensor = node.input[0]
    if tensor not in g.init:
        raise unsupported(step, f"layer {layer}'s attention sinks are computed, not a constant a head")
    readers = sorted((n for n in g.consumers.get(concat.output[0], []) if n.op_type != "Identity"), key=lambda n: n.op_type)
    if [n.op_type for n in readers] != ["ReduceMax", "Sub"] or list(readers[1].input) != [concat.output[0], readers[0].output[0]]:
        raise unsupported(step, f"layer {layer}'s scores with sinks are not shifted by their max before the softmax")
    axes = g.array(readers[0].input[1]).reshape(-1).tolist() if len(readers[0].input) > 1 and readers[0].input[1] else None
    if axes not in ([-1], [3]) or attr(readers[0], "keepdims", 1) != 1:
        raise unsupported(step, f"layer {layer}'s scores with sinks are shifted by another max than their row's")
    return np.ascontiguousarray(g.array(tensor).reshape(-1), dtype=np.float32), readers[1].output[0]


def _last_dropped(g: Graph, step: Path, layer: int, slice_) -> None:
    """The Slice that drops the sinks' column of the probabilities: [0, -1) of the last axis."""
    starts, ends, axes, steps = g.slice_args(slice_)
    if starts != [0] or ends != [-1] or axes not in ([-1], [3]) or steps not in (None, [1]):
        raise unsupported(step, f"layer {layer}'s attention keeps other probabilities than all but the sinks' column")


def read_weights(step: Path, architecture: str) -> Weights:
    """The weights of the step graph at ``step``, checked against the pattern ``native_step.c`` computes."""
    check_architecture(step, architecture)
    g = Graph(step)
    ops = Counter(n.op_type for n in g.nodes)
    if extra := sorted(set(ops) - OPS - MODEL_OPS.get(architecture, frozenset())):
        raise unsupported(step, f"its step graph has {', '.join(extra)} nodes (a graph native runs has none)")
    layers = _layers(g, step)
    if ops["RotaryEmbedding"] not in (0, 2 * layers):  # 0: the rotary exported as its ops (_computed_rotary)
        raise unsupported(step, f"{ops['RotaryEmbedding']} RotaryEmbedding nodes for {layers} layers (the pattern has {2 * layers})")
    stacked = {cache: _stacked(g, step, output, layers) for cache, output in ((PAST_KEY, NEW_KEY), (PAST_VALUE, NEW_VALUE))}

    gather = [n for n in g.nodes if n.op_type == "Gather" and n.input[1] == "input_ids"]
    if len(gather) != 1:
        raise unsupported(step, "no token embedding Gather of input_ids")
    embed = g.array(gather[0].input[0])
    x, embed_scale = gather[0].output[0], 1.0
    readers = [n for n in g.consumers.get(x, []) if n.op_type != "Identity"]
    if len(readers) == 1 and readers[0].op_type == "Mul":  # a scaled embedding (Gemma's sqrt(hidden))
        constant = [name for name in readers[0].input if name != x]
        if len(constant) != 1 or constant[0] not in g.init or g.array(constant[0]).size != 1:
            raise unsupported(step, "the token embedding is multiplied by something other than one constant")
        x, embed_scale = readers[0].output[0], g.scalar(constant[0])
    per_layer = (
        "norm_in",
        "qkv",
        "o",
        "norm_post",
        "gate_up",
        "down",
        "qkv_bias",
        "q_norm",
        "k_norm",
        "attn_out",
        "mlp_out",
        "experts",
        "norm_in_bias",
        "norm_post_bias",
        "o_bias",
        "sinks",
        "gate_up_bias",
        "down_bias",
    )
    w = {k: [] for k in per_layer}
    parallel, pairs, shared = set(), set(), set()  # per layer: a parallel residual; an interleaved rotary; a shared norm
    eps, qk_eps, masks, windows, acts, heads, residual_scales, spans = set(), set(), set(), [], set(), set(), set(), set()
    scales, softcaps, norm_kinds, rotary_dims, factors = set(), set(), set(), set(), set()
    tables: dict[tuple[str, str], int] = {}  # (cos, sin) -> the table's index
    rope_of, inv_freqs = [], []
    splits = []  # per layer: the q/k/v parts' and the gate/up Split's widths, checked once the dims are
    for layer in range(layers):
        w["gate_up_bias"].append(None), w["down_bias"].append(None)  # an ungated MLP's (GPT-NeoX) set below
        in_norms = [n for n in g.consumers.get(x, []) if n.op_type in NORMS]
        if len(in_norms) == 2:  # a parallel residual (GPT-NeoX): the MLP's norm reads the layer's input too
            norm, parallel_post = _parallel_norms(g, step, layer, x, in_norms)
        else:
            norm, parallel_post = _norm_of(g, step, x, f"layer {layer}'s input norm", optional=True), None  # OLMo-2: none
        parallel.add(parallel_post is not None)
        if norm is not None:
            eps.add(float(attr(norm, "epsilon", 1e-5)))
        w["norm_in"].append(None if norm is None else g.array(norm.input[1]))
        w["norm_in_bias"].append(_norm_bias(g, norm, norm_kinds))
        qkv, out = g.linear(x, beside=("Add",)) if norm is None else g.linear(norm.output[0])
        mlp_parts = None  # the gate and up parts of a q/k/v matmul the MLP shares (StableLM-2 12B)
        if (heads_first := _interleaved_heads(g, step, layer, qkv, out)) is not None:  # GPT-NeoX's per-head q, k, v
            qkv, (q, k, v), qkv_widths, (qb, kb, vb) = heads_first
            qp = kp = _Part(None, None, 0.0, "", "shared")
        else:
            parts, qkv_widths = _qkv_parts(g, step, layer, out, qkv.shape[1])
            if len(parts) == 5:  # its columns: q, k, v, then gate, up (exact: each output's sums are its own)
                fused, qkv_width = qkv, sum(qkv_widths[:3])
                qkv = fused.outputs(np.arange(qkv_width))
                mlp_parts = fused.outputs(np.arange(qkv_width, fused.shape[1])), parts[3:], qkv_widths[3:]
                parts, qkv_widths = parts[:3], qkv_widths[:3]
            qp, kp, vp = (_head_part(g, step, layer, t, what) for t, what in zip(parts, "qkv"))
            q, k, v, qb, kb, vb = qp.out, kp.out, vp.out, qp.bias, kp.bias, vp.bias
        qn, kn, qe, ke = qp.norm, kp.norm, qp.eps, kp.eps
        w["qkv"].append(qkv)
        spans.update((p.span, p.layer_norm) for p in (qp, kp) if p.norm is not None)
        shared.add(mlp_parts is not None)
        (q_rot, q_out, q_dim), (k_rot, k_out, k_dim) = _rotated(g, step, layer, q), _rotated(g, step, layer, k)
        rotary_dims.update((q_dim, k_dim))
        pairs.update(getattr(r, "interleaved", False) for r in (q_rot, k_rot))
        direct = [n.op_type for n in g.consumers.get(q_out, []) if n.op_type != "Identity"] == ["Attention"]  # GPT-NeoX
        attention = _attention(g, step, layer, q_out if direct else g.only(q_out, "Reshape").output[0])
        scales.add(attention.scale), softcaps.add(attention.softcap)
        table = (q_rot.input[1], q_rot.input[2])
        if (k_rot.input[1], k_rot.input[2]) != table:
            raise unsupported(step, f"layer {layer}'s queries and keys are rotated by different tables")
        if table not in tables:
            tables[table] = len(inv_freqs)
            freq, factor = _rotary_table(g, step, q_rot)
            inv_freqs.append(freq), factors.add(factor)
        _rotary_table(g, step, k_rot)  # its form checked too
        rope_of.append(tables[table])
        if isinstance(q_rot, _Computed):  # no num_heads attribute: the q and k widths over the heads' width
            D = _head_width(g, step, layer, q)
            if qkv_widths is None or qkv_widths[0] % D or qkv_widths[1] % D:
                raise unsupported(step, f"layer {layer}'s q/k/v widths {qkv_widths} are not whole heads of {D}")
            heads.add((qkv_widths[0] // D, qkv_widths[1] // D))
        else:
            heads.add((int(attr(q_rot, "num_heads", 0)), int(attr(k_rot, "num_heads", 0))))
        w["sinks"].append(attention.sinks)
        _cache_write(g, step, layer, k_out, PAST_KEY, attention.k, stacked[PAST_KEY])
        _cache_write(g, step, layer, v, PAST_VALUE, attention.v, stacked[PAST_VALUE])
        biases = [qb, kb, vb]
        w["qkv_bias"].append(None if all(b is None for b in biases) else biases)
        w["q_norm"].append(qn)
        w["k_norm"].append(kn)
        qk_eps.update(e for e, n in ((qe, qn), (ke, kn)) if n is not None)
        mask, window = _window(g, step, layer, attention.mask)
        masks.add(mask)
        windows.append(window)
        out = attention.out
        heads_out = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]  # (B, Hq, T, D) where q was 4-D
        for op in ("Transpose", "Reshape") if [n.op_type for n in heads_out] == ["Transpose"] else ("Reshape", "Transpose", "Reshape"):
            node = g.only(out, op)
            if op == "Transpose" and list(attr(node, "perm", [])) != [0, 2, 1, 3]:
                raise unsupported(step, f"layer {layer}'s attention output is transposed other than heads after tokens")
            out = node.output[0]
        o, out = g.linear(out)
        o_bias, out = biased(g, out)
        w["o"].append(o), w["o_bias"].append(o_bias)
        attn_out = out
        if parallel_post is None:
            x, out_norm = _residual(g, step, x, out, f"layer {layer}'s attention output", eps, residual_scales)
            post = _norm_of(g, step, x, f"layer {layer}'s post-attention norm", optional=True)
        else:  # added with the MLP's output below
            out_norm, post = None, parallel_post
        w["attn_out"].append(out_norm)
        if post is not None:
            eps.add(float(attr(post, "epsilon", 1e-5)))
        w["norm_post"].append(None if post is None else g.array(post.input[1]))
        w["norm_post_bias"].append(_norm_bias(g, post, norm_kinds))
        if routed(g, x if post is None else post.output[0]):
            if parallel_post is not None:
                raise unsupported(step, f"layer {layer} runs routed experts beside its attention (a parallel residual)")
            experts, layer_acts, out = read_experts(g, step, layer, x if post is None else post.output[0])
            w["gate_up"].append(None), w["down"].append(None), w["experts"].append(experts), acts.update(layer_acts)
            x, out_norm = _residual(g, step, x, out, f"layer {layer}'s experts' output", eps, residual_scales)
            w["mlp_out"].append(out_norm)
            continue
        w["experts"].append(None)
        if mlp_parts is not None:  # gate and up: the last two parts of the layer's q/k/v matmul (StableLM-2 12B)
            if post is not None or parallel_post is not None:
                raise unsupported(step, f"layer {layer}'s MLP reads its input norm and a norm of its own")
            gu, gate_up, gate_up_widths = mlp_parts
            w["gate_up"].append(gu)
        else:
            gu, out = g.linear(x, beside=("Add",)) if post is None else g.linear(post.output[0])
            w["gate_up"].append(gu)
            up_bias, up_out = biased(g, out)
            if [n.op_type for n in g.consumers.get(up_out, []) if n.op_type != "Identity"] == ["Gelu"]:  # ungated GELU, biases
                gelu = g.only(up_out, "Gelu")
                approximate = attr(gelu, "approximate", b"none")
                if (approximate.decode() if isinstance(approximate, bytes) else approximate) != "none":
                    raise unsupported(step, f"layer {layer}'s ungated MLP is GELU's tanh approximation")
                down, out = g.linear(gelu.output[0])
                down_bias, out = biased(g, out)
                acts.add("gelu_ungated"), splits.append((layer, qkv_widths, None)), w["down"].append(down)
                w["gate_up_bias"][-1], w["down_bias"][-1] = up_bias, down_bias
                if parallel_post is not None:
                    x, out_norm = _parallel_sum(g, step, layer, x, out, attn_out), None
                    residual_scales.add(1.0)
                else:
                    x, out_norm = _residual(g, step, x, out, f"layer {layer}'s MLP output", eps, residual_scales)
                w["mlp_out"].append(out_norm)
                continue
            if parallel_post is not None:
                raise unsupported(step, f"layer {layer}'s parallel residual beside a gated MLP")
            if [n.op_type for n in g.consumers.get(out, []) if n.op_type != "Identity"] == ["Relu"]:  # ungated: down(relu(up)^2)
                down, out = g.linear(_squared_relu(g, step, layer, out))
                acts.add("relu2"), splits.append((layer, qkv_widths, None)), w["down"].append(down)
                x, out_norm = _residual(g, step, x, out, f"layer {layer}'s MLP output", eps, residual_scales)
                w["mlp_out"].append(out_norm)
                continue
            halves = g.only(out, "Split")
            if len(halves.output) != 2:
                raise unsupported(step, f"layer {layer}'s gate/up matmul is split {len(halves.output)} ways, not into gate and up")
            gate_up = halves.output
            gate_up_widths = g.array(halves.input[1]).tolist() if len(halves.input) > 1 and halves.input[1] else None
        splits.append((layer, qkv_widths, gate_up_widths))
        gate, up = gate_up
        act, gated = gate_of(g, step, layer, gate)
        acts.add(act)
        prod = g.only(gated, "Mul")
        if up not in prod.input:
            raise unsupported(step, f"layer {layer}'s MLP does not multiply its activated gate by up")
        down, out = g.linear(prod.output[0])
        w["down"].append(down)
        x, out_norm = _residual(g, step, x, out, f"layer {layer}'s MLP output", eps, residual_scales)
        w["mlp_out"].append(out_norm)
    if len(masks) != 1:
        raise unsupported(step, "layers that read different attention masks")
    if len(scales) != 1 or len(softcaps) != 1:
        raise unsupported(step, f"layers with different score scales {sorted(scales)} or soft-caps {sorted(softcaps)}")
    if len(acts) != 1:
        raise unsupported(step, f"layers with different MLP gates {sorted(acts)}")
    if len(heads) != 1:
        raise unsupported(step, f"layers with different head counts {sorted(heads)}")
    final = _norm_of(g, step, x, "the final norm")
    eps.add(float(attr(final, "epsilon", 1e-5)))
    final_bias = _norm_bias(g, final, norm_kinds)
    if len(norm_kinds) != 1 or len(rotary_dims) != 1:
        raise unsupported(step, f"norms of kinds {sorted(norm_kinds)} or rotary widths {sorted(rotary_dims)} across layers")
    if final.output[0] != "hidden":
        raise unsupported(step, "the final norm is not the graph's hidden output")
    if len(eps) != 1 or len(qk_eps) > 1:
        raise unsupported(step, f"norms with different epsilons {sorted(eps | qk_eps)}")
    if len({f.shape for f in inv_freqs}) != 1:
        raise malformed(step, f"rotary tables of different lengths {sorted({f.shape for f in inv_freqs})}")
    vocab, hidden = embed.shape if embed.ndim == 2 else (0, 0)  # a 1-D embedding: check_weights names it
    ((heads, kv_heads),) = heads
    dims = Dims(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=w["o"][0].shape[0] // heads if heads > 0 else 0,
        inter=next(d.shape[0] for d in w["down"] + [e.down[0] for e in w["experts"] if e and e.down] if d is not None),  # dense first
        vocab=vocab,
        eps=eps.pop(),
        scale=scales.pop(),
    )
    q, kv, i = heads * dims.head_dim, kv_heads * dims.head_dim, dims.inter
    qkv_bias = [None if b is None else _joined_bias(step, layer, b, [q, kv, kv]) for layer, b in enumerate(w["qkv_bias"])]
    lm_head, logit_divisor, final_softcap = _lm_head(g, step)
    if len(residual_scales) != 1:
        raise unsupported(step, f"residual adds scaled by different factors {sorted(residual_scales)}")
    residual_scale = residual_scales.pop()
    if len(spans) > 1:
        raise unsupported(step, f"q/k norms of different spans or kinds across layers {sorted(spans)}")
    span, qk_layer_norm = spans.pop() if spans else ("shared", False)
    if len(factors) != 1:
        raise unsupported(step, f"rotary tables scaled by different factors {sorted(factors)}")
    clamps = {(e.alpha, e.limit) for e in w["experts"] if e is not None} or {(0.0, 0.0)}
    if len(clamps) != 1:
        raise unsupported(step, f"layers whose experts clamp their gates differently {sorted(clamps)}")
    (alpha, limit), any_of = clamps.pop(), lambda rows: rows if any(r is not None for r in rows) else ()  # noqa: E731
    if len(parallel) != 1 or len(pairs) != 1 or len(shared) != 1:
        raise unsupported(step, "parallel residuals, interleaved rotaries or shared input norms in some layers and not in others")
    weights = Weights(dims, np.ascontiguousarray(np.stack(inv_freqs)), embed, w["norm_in"], w["qkv"], w["o"], w["norm_post"],
                      w["gate_up"], w["down"], g.array(final.input[1]), lm_head, qkv_bias, w["q_norm"], w["k_norm"],
                      tuple(windows), tuple(rope_of), w["attn_out"], w["mlp_out"], qk_eps.pop() if qk_eps else 0.0, acts.pop(),
                      embed_scale, residual_scale, logit_divisor, span, tuple(w["experts"]),
                      softcaps.pop(), final_softcap, norm_kinds.pop() == "LayerNormalization", rotary_dims.pop(),
                      w["norm_in_bias"], w["norm_post_bias"], final_bias, any_of(w["o_bias"]), any_of(w["sinks"]),
                      factors.pop(), alpha, limit, any_of(w["gate_up_bias"]), any_of(w["down_bias"]), parallel.pop(),
                      pairs.pop(), qk_layer_norm, shared.pop())  # fmt: skip
    check_weights(weights, step)
    for layer, qkv_widths, gate_up_widths in splits:
        if qkv_widths not in (None, [q, kv, kv]):
            raise unsupported(step, f"layer {layer} splits its q/k/v matmul as {qkv_widths}, not as q, k, v: {[q, kv, kv]}")
        if gate_up_widths not in (None, [i, i]):
            raise unsupported(step, f"layer {layer} splits its gate/up matmul as {gate_up_widths}, not into halves of {i}")
    return weights


NORMS = ("RMSNormalization", "LayerNormalization")  # a layer norm's bias is its third input (StableLM's)


def _norm_of(g: Graph, step: Path, x: str, what: str, optional: bool = False):
    """The one RMSNormalization or LayerNormalization reading the residual stream ``x`` (the residual Add reads it too);
    None where ``optional`` and no norm reads it (the next linear reads the stream itself: OLMo-2's layers)."""
    norms = [n for n in g.consumers.get(x, []) if n.op_type in NORMS]
    if optional and not norms:
        return None
    others = [n.op_type for n in g.consumers.get(x, []) if n.op_type not in (*NORMS, "Add", "Identity")]
    if len(norms) != 1 or others or norms[0].input[0] != x or attr(norms[0], "axis", -1) != -1:
        raise unsupported(step, f"{what} is not one RMS or layer norm of the residual stream")
    return norms[0]


def _norm_bias(g: Graph, norm, kinds: set) -> np.ndarray | None:
    """A norm's bias (a LayerNormalization's third input; None: an RMS norm or none), its kind added to ``kinds``."""
    if norm is None:
        return None
    kinds.add(norm.op_type)
    return g.array(norm.input[2]) if norm.op_type == "LayerNormalization" and len(norm.input) > 2 and norm.input[2] else None


def _residual(g: Graph, step: Path, x: str, out: str, what: str, eps: set, scales: set) -> tuple[str, np.ndarray | None]:
    """The residual stream after ``out``, optionally RMS-normalized first (Gemma's post norms; its epsilon into
    ``eps``) and optionally times one constant (Granite's residual multiplier, into ``scales``; 1.0 where none), is
    added to ``x``; and that norm's weight (None: none)."""
    weight = None
    readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
    if len(readers) == 1 and readers[0].op_type == "RMSNormalization":
        norm = readers[0]
        if attr(norm, "axis", -1) != -1:
            raise unsupported(step, f"{what} is normalized along another axis than the hidden one")
        eps.add(float(attr(norm, "epsilon", 1e-5)))
        weight, out = g.array(norm.input[1]), norm.output[0]
    readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
    scale = 1.0
    if len(readers) == 1 and readers[0].op_type == "Mul":
        constant = [name for name in readers[0].input if name != out]
        if len(constant) != 1 or constant[0] not in g.init or g.array(constant[0]).size != 1:
            raise unsupported(step, f"{what} is multiplied by something other than one constant")
        scale, out = g.scalar(constant[0]), readers[0].output[0]
        readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
    scales.add(scale)
    if [n.op_type for n in readers] != ["Add"]:  # a scaled residual (Granite's multiplier), say
        found = ", ".join(n.op_type for n in readers) or "nothing"
        raise unsupported(step, f"{what} is read by {found}, not added to the residual stream")
    add = readers[0]
    if x not in add.input:
        raise unsupported(step, f"{what} is not added to the residual stream")
    return add.output[0], weight


def _joined_bias(step: Path, layer: int, biases: list, want: list[int]) -> np.ndarray:
    """The q, k and v biases (None: zeros) as one vector over the q/k/v matmul's outputs."""
    parts = []
    for b, width, what in zip(biases, want, "qkv"):
        if b is not None and (b.dtype != np.float32 or b.shape != (width,)):
            raise malformed(step, f"layer {layer}'s {what} bias has {b.dtype} {b.shape}, not float32 ({width},)")
        parts.append(np.zeros(width, np.float32) if b is None else b)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def check_weights(weights: Weights, path: Path) -> None:
    """Every array's shape and dtype against the dims, in every layer, before a pointer to any of them reaches C (the
    C step trusts both; the values may be anything). The dims read from arrays (hidden and vocab from the embedding,
    head_dim and the MLP width from layer 0's o_proj and down_proj) are checked against every other array, layer 0's
    included. Raises one line naming the first that does not fit."""
    d = weights.dims
    H, Hq, Hkv, D, I, V = d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.vocab  # noqa: E741
    positive = lambda x: math.isfinite(x) and x > 0
    tables = weights.inv_freq.shape[0] if weights.inv_freq.ndim == 2 else 0
    for ok, what in (
        (d.layers > 0, f"{d.layers} layers"),
        (H > 0 and V > 0, f"an embedding of shape {weights.embed.shape}, not (vocab, hidden)"),
        (Hq > 0 and Hkv > 0 and Hq % Hkv == 0, f"{Hq} attention heads over {Hkv} kv heads"),
        (D > 0 and D % 2 == 0, f"head_dim {D} (layer 0's o_proj rows over {Hq} heads; rotate-half needs it even)"),
        (I > 0, f"MLP width {I} (layer 0's down_proj rows)"),
        (positive(d.eps), f"norm epsilon {d.eps}"),
        (positive(d.scale), f"attention score scale {d.scale}"),
        (all(0 <= int(w) < 2**31 for w in weights.windows), f"sliding windows {weights.windows}"),
        (all(0 <= int(r) < max(tables, 1) for r in weights.rope_of), f"rotary tables {weights.rope_of} of {tables}"),
        (weights.act in ("silu", "gelu_tanh", "gelu", "relu2", "swiglu_limit", "gelu_ungated"), f"MLP gate {weights.act}"),
        (
            weights.act != "swiglu_limit" or (positive(weights.act_limit) and math.isfinite(weights.act_alpha)),
            f"clamped SwiGLU limit {weights.act_limit} and slope {weights.act_alpha}",
        ),
        (positive(weights.rope_factor), f"rotary factor {weights.rope_factor}"),
        (math.isfinite(weights.embed_scale), f"embedding scale {weights.embed_scale}"),
        (math.isfinite(weights.residual_scale), f"residual scale {weights.residual_scale}"),
        (math.isfinite(weights.logit_divisor) and weights.logit_divisor != 0, f"logit divisor {weights.logit_divisor}"),
        (
            all(math.isfinite(c) and c >= 0 for c in (weights.attn_softcap, weights.final_softcap)),
            f"soft-caps {weights.attn_softcap}, {weights.final_softcap}",
        ),
        (positive(weights.qk_eps) or not any(n is not None for n in weights.q_norm + weights.k_norm), f"q/k norm epsilon {weights.qk_eps}"),
        (weights.qk_norm_span in QK_SPANS, f"q/k norms spanning {weights.qk_norm_span!r}"),
        (
            not weights.shared_norm or _shared_norm_alone(weights),
            "an MLP reading the input norm beside a norm of its own, experts or GPT-NeoX's parallel residual",
        ),
    ):
        if not ok:
            raise malformed(path, f"dims that do not fit: {what}")
    fields = (
        "norm_in",
        "norm_post",
        "qkv",
        "o",
        "gate_up",
        "down",
        "qkv_bias",
        "q_norm",
        "k_norm",
        "windows",
        "rope_of",
        "attn_out_norm",
        "mlp_out_norm",
    )
    fields += tuple(f for f in ("experts", "o_bias", "sinks", "gate_up_bias", "down_bias") if getattr(weights, f))  # (): none at all
    counts = {field: len(getattr(weights, field)) for field in fields}
    if wrong := {field: n for field, n in counts.items() if n != d.layers}:
        raise malformed(path, f"arrays a layer {wrong} for {d.layers} layers")

    # (what, array, expected shape, dtypes): every array C reads
    f32, weight = (np.float32,), (np.float32, np.int8)
    table = [("the embedding", weights.embed, (V, H), f32), ("the final norm", weights.norm_final, (H,), f32)]
    if tables == 0 or not weights.inv_freq.flags.c_contiguous:
        raise malformed(path, f"rotary tables of shape {weights.inv_freq.shape}, not one contiguous (tables, head_dim / 2)")
    R = weights.rotary_dim or D
    if not (0 < R <= D and R % 2 == 0):
        raise malformed(path, f"a rotary embedding of {R} dims of heads of {D}")
    table += [("the rotary inv_freq" if tables == 1 else f"rotary table {r}'s inv_freq", weights.inv_freq[r], (R // 2,), f32)
              for r in range(tables)]  # fmt: skip
    if weights.norm_final_bias is not None:
        table.append(("the final norm's bias", weights.norm_final_bias, (H,), f32))
    linears = [("the lm_head", weights.lm_head, (H, V))]
    for layer in range(d.layers):
        q_span, k_span = (D, D) if weights.qk_norm_span == "shared" else (Hq * D, Hkv * D)
        optional = ((f"layer {layer}'s input norm", weights.norm_in, (H,)),
                    (f"layer {layer}'s post-attention norm", weights.norm_post, (H,)),
                    (f"layer {layer}'s q/k/v bias", weights.qkv_bias, ((Hq + 2 * Hkv) * D,)),
                    (f"layer {layer}'s query norm", weights.q_norm, (q_span,)),
                    (f"layer {layer}'s key norm", weights.k_norm, (k_span,)),
                    (f"layer {layer}'s attention output norm", weights.attn_out_norm, (H,)),
                    (f"layer {layer}'s MLP output norm", weights.mlp_out_norm, (H,)),
                    (f"layer {layer}'s input norm bias", weights.norm_in_bias or [None] * d.layers, (H,)),
                    (f"layer {layer}'s post-attention norm bias", weights.norm_post_bias or [None] * d.layers, (H,)),
                    (f"layer {layer}'s o_proj bias", weights.o_bias or [None] * d.layers, (H,)),
                    (f"layer {layer}'s attention sinks", weights.sinks or [None] * d.layers, (Hq,)),
                    (f"layer {layer}'s up_proj bias", weights.gate_up_bias or [None] * d.layers, (I,)),
                    (f"layer {layer}'s down_proj bias", weights.down_bias or [None] * d.layers, (H,)))  # fmt: skip
        table += [(what, arrays[layer], shape, f32) for what, arrays, shape in optional if arrays[layer] is not None]
        linears += [(f"layer {layer}'s q/k/v_proj", weights.qkv[layer], (H, (Hq + 2 * Hkv) * D)),
                    (f"layer {layer}'s o_proj", weights.o[layer], (Hq * D, H))]  # fmt: skip
        experts = weights.experts[layer] if weights.experts else None
        if experts is None:  # a dense MLP
            ungated = weights.act in ("relu2", "gelu_ungated")
            linears += [(f"layer {layer}'s gate/up_proj", weights.gate_up[layer], (H, I if ungated else 2 * I)),
                        (f"layer {layer}'s down_proj", weights.down[layer], (I, H))]  # fmt: skip
            continue
        E, k = experts.count, experts.top_k
        if weights.gate_up[layer] is not None or weights.down[layer] is not None or not (0 < k <= E <= MAX_EXPERTS and experts.inter > 0):
            raise malformed(path, f"layer {layer}: {E} experts choosing {k} of width {experts.inter}, or experts beside a dense MLP")
        if len({m is None for m in (experts.shared_gate_up, experts.shared_down, experts.shared_gate)}) != 1:
            raise malformed(path, f"layer {layer}: a shared expert without its gate/up, down or gate")
        linears += [(f"layer {layer}'s {what}", m, shape) for what, m, shape in experts.linears()]
        if experts.router_bias is not None:
            table.append((f"layer {layer}'s router bias", experts.router_bias, (E,), f32))
        for j, (up, down) in enumerate(zip(experts.gate_up_bias, experts.down_bias)):
            table += [(f"layer {layer}'s expert {j}'s gate/up bias", up, (2 * experts.inter,), f32),
                      (f"layer {layer}'s expert {j}'s down bias", down, (H,), f32)]  # fmt: skip
        if experts.gate_up_bias and len(experts.gate_up_bias) != E or len(experts.gate_up_bias) != len(experts.down_bias):
            raise malformed(path, f"layer {layer}: biases for {len(experts.gate_up_bias)} of {E} experts")
    for what, m, shape in linears:
        if m.bits:
            table += _nbits_rows(path, what, m, shape)
            continue
        table.append((what, m.weight, shape, weight))
        if m.int8:  # one float32 scale a column; the row quantizer's floor and divisor
            table.append((f"{what}'s column-scale vector", m.scale, shape[1:], f32))
            for name, value in (("tiny", m.tiny), ("divisor", m.divisor)):
                if not positive(value):
                    raise malformed(path, f"{what} row quantizer {name} {value} is not a positive number")
    legend = f"hidden {H} and vocab {V} read from the embedding, head_dim {D} and MLP width {I} from layer 0, {Hq} heads, {Hkv} kv heads"
    _check_arrays(path, table, legend)


def _shared_norm_alone(weights: Weights) -> bool:
    """Every layer has an input norm for its attention and MLP to share, and nothing else normalizes the MLP's input."""
    no_post = all(n is None for n in weights.norm_post)
    return not weights.parallel_residual and all(n is not None for n in weights.norm_in) and no_post and not any(weights.experts)


def _nbits_rows(path: Path, what: str, m: Linear, shape: tuple[int, int]) -> list:
    """``_check_arrays`` rows of an nbits linear: its bytes (N, blocks, block x bits / 8) (every byte a valid pair of
    4-bit values, or one 8-bit value), (blocks, N) scales and zero points below 2**bits."""
    blocks = -(-shape[0] // m.block) if m.block >= 16 and not m.block & (m.block - 1) else -1
    if m.bits not in (4, 8) or blocks < 0 or m.k != shape[0]:
        raise malformed(path, f"{what} holds {m.bits}-bit blocks of {m.block} over {m.k} inputs, not {shape[0]}")
    if m.zero is not None and m.zero.size and int(m.zero.max()) >= 1 << m.bits:
        raise malformed(path, f"{what}'s {m.bits}-bit zero points reach {int(m.zero.max())}")
    return [(what, m.weight, (shape[1], blocks, m.block * m.bits // 8), (np.uint8,)),
            (f"{what}'s block scales", m.scale, (blocks, shape[1]), (np.float32,)),
            (f"{what}'s zero points", m.zero, (blocks, shape[1]), (np.uint8,))]  # fmt: skip


def _check_arrays(path: Path, table: list, legend: str) -> None:
    """Each (what, array, expected shape, dtypes) of ``table`` as C reads it: that shape, one of those dtypes,
    contiguous; else one line naming the first that is not (``legend``: where the expected shapes come from)."""
    for what, a, shape, dtypes in table:
        if a is None or a.shape != shape:
            raise malformed(path, f"{what} has shape {None if a is None else a.shape}, not {shape} ({legend})")
        if a.dtype not in dtypes:
            raise malformed(path, f"{what} has dtype {a.dtype}, not {' or '.join(np.dtype(t).name for t in dtypes)}")
        if not a.flags.c_contiguous:  # C reads the norms, the embedding and the scales where they lie
            raise malformed(path, f"{what} is not one contiguous array")


def _lm_head(g: Graph, step: Path) -> tuple[Linear, float, float]:
    """The lm_head: the weight matmul reading ``hidden``, in the graph or in the logits gate's then branch (which
    reads it through an Identity), whose output (or its quotient by one constant: Granite's logits scaling; or that
    quotient's tanh times the same constant: Gemma-2's final soft-cap) is the logits the step returns and ranks; that
    divisor (1: none) and that soft-cap (0: none)."""
    gates = [n for n in g.nodes if n.op_type == "If"]
    if not gates:
        graph, source, logits = g, "hidden", {"logits"}
    else:
        if len(gates) != 1 or g.producer.get(gates[0].input[0]) is not None:
            raise unsupported(step, "an If other than the logits gate")
        branch = next(a.g for a in gates[0].attribute if a.name == "then_branch")
        graph = g.branch(branch.node)
        identity = [n for n in g.consumers.get("hidden", []) if n.op_type == "Identity"]
        if len(identity) != 1:
            raise unsupported(step, "a logits gate that does not read hidden")
        source, logits = identity[0].output[0], {branch.output[0].name}
    lm, out = graph.linear(source)
    divisor = 1.0
    readers = [n for n in graph.consumers.get(out, []) if n.op_type == "Div"]
    if out not in logits and len(readers) == 1 and readers[0].input[0] == out and readers[0].input[1] in g.init:
        divisor, out = g.scalar(readers[0].input[1]), readers[0].output[0]
    softcap = 0.0
    tanh = [n for n in graph.consumers.get(out, []) if n.op_type == "Tanh"]
    if out not in logits and divisor != 1.0 and len(tanh) == 1 and len(graph.consumers[out]) == 1:  # Gemma-2's c tanh(z / c)
        times = graph.only(tanh[0].output[0], "Mul")
        if [x for x in times.input if x != tanh[0].output[0]] == [readers[0].input[1]]:  # the same constant c
            softcap, divisor, out = divisor, 1.0, times.output[0]
    if out not in logits:  # a soft-cap, say, between the lm_head and the logits
        found = ", ".join(sorted(n.op_type for n in graph.consumers.get(out, []))) or "nothing"
        raise unsupported(step, f"the lm_head's output is read by {found} before it is the step's logits")
    if not (math.isfinite(divisor) and divisor != 0 and math.isfinite(softcap) and softcap >= 0):
        raise malformed(step, f"logits divided by {divisor}, soft-capped at {softcap}")
    return lm, divisor, softcap


@dataclass(frozen=True)
class HeadsWeights:
    """The Medusa heads graph ``native_step.c``'s ``medusa_native_heads`` computes: one residual SiLU block a head,
    every head's linear fused into one, then one shared projection to the draft vocabulary and its top-k."""

    hidden: int  # H
    heads: int  # n
    top_k: int  # K
    fused: Linear  # (H, n H), or (2 H, n H) for heads that also read the next token's normalized embedding
    bias: np.ndarray  # (n H) float32
    lm: Linear  # (H, Vd)
    embed: np.ndarray | None = None  # (V, H) float32 where the heads read the next token
    eps: float = 0.0  # that embedding's RMS norm epsilon (no weight)

    @property
    def reads_roots(self) -> bool:
        return self.embed is not None


HEADS_OPS = frozenset(
    "Gather Pow ReduceMean Add Sqrt Reciprocal Mul Concat MatMul Gemm Split Sigmoid Unsqueeze TopK Identity Transpose MatMulNBits "
    "Abs ReduceMax Max Div Shape ConstantOfShape QuantizeLinear MatMulInteger Cast".split()
)


def read_heads(path: Path) -> HeadsWeights:
    """The weights of the heads graph at ``path`` (an engine's heads.onnx), checked against the pattern
    ``medusa_native_heads`` computes: [hidden | RMS-normalized embedding of root_ids] -> one fused linear (fp32 or
    int8-channel) -> Split a head -> + bias, SiLU, + hidden -> stacked -> one linear -> TopK. Any other heads graph
    (more blocks a head, a projection a head, heads that read the path) raises ``NativeCannotRun``, naming why."""
    from medusa_trt.runtime.contract import HEAD_LOGITS, HEAD_TOPK, HEADS_INPUTS, NEXT_INPUT

    g = Graph(path)
    if extra := sorted({n.op_type for n in g.nodes} - HEADS_OPS):
        raise unsupported(path, f"its heads graph has {', '.join(extra)} nodes")
    hidden_name = HEADS_INPUTS[0]
    x, embed, eps = hidden_name, None, 0.0
    gathers = [n for n in g.consumers.get(NEXT_INPUT, []) if n.op_type == "Gather"]
    if gathers:  # the next token's embedding, RMS-normalized without a weight, beside hidden
        gather = gathers[0]
        embed = g.array(gather.input[0])
        e = gather.output[0]
        readers = {n.op_type: n for n in g.consumers.get(e, [])}
        if sorted(readers) != ["Mul", "Pow"] or len(g.consumers[e]) != 2 or g.scalar(readers["Pow"].input[1]) != 2.0:
            raise unsupported(path, f"the next token's embedding is read by {sorted(readers)}, not an RMS norm")
        add = g.only(g.only(readers["Pow"].output[0], "ReduceMean").output[0], "Add")
        eps = g.scalar(add.input[1])
        mul = g.only(g.only(g.only(add.output[0], "Sqrt").output[0], "Reciprocal").output[0], "Mul")
        if e not in mul.input:
            raise unsupported(path, "the next token's embedding norm is not x / sqrt(mean(x^2) + eps)")
        concat = g.only(mul.output[0], "Concat")
        if list(concat.input) != [hidden_name, mul.output[0]] or attr(concat, "axis") not in (-1, 1):
            raise unsupported(path, "the heads do not read [hidden | the next token's normalized embedding]")
        x = concat.output[0]
    gemms = [n for n in g.consumers.get(x, []) if n.op_type == "Gemm"]
    if gemms:  # fp32 heads: a Gemm a head (x @ W_j.T + b_j), fused here into one linear
        for gemm in gemms:
            form = tuple(attr(gemm, name, default) for name, default in (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0)))
            if form != (0, 1, 1.0, 1.0):
                raise unsupported(path, "a head's Gemm is not x @ W.T + b")
        ws = [g.array(n.input[1]) for n in gemms]  # (H, Kin) each
        if len({w.shape for w in ws}) != 1 or ws[0].ndim != 2:
            raise malformed(path, f"the heads' Gemm weights have shapes {sorted({w.shape for w in ws})}, not one (H, K) each")
        h = ws[0].shape[0]
        bs = [g.array(n.input[2]).reshape(-1) if len(n.input) > 2 else np.zeros(h, np.float32) for n in gemms]
        fused = Linear(np.ascontiguousarray(np.concatenate([w.T for w in ws], axis=1), dtype=np.float32))
        outputs = [n.output[0] for n in gemms]
    else:  # one fused linear (int8-channel rows or a MatMul), split a head, then each head's bias
        fused, y = g.linear(x, beside=("Add",) if x == hidden_name else ())  # hidden also feeds each head's residual
        split = g.only(y, "Split")
        widths = list(g.array(split.input[1]).reshape(-1)) if len(split.input) > 1 else None
        n = len(split.output)
        h = int(fused.shape[1]) // n if n else 0
        if not n or widths not in (None, [h] * n) or h * n != fused.shape[1]:
            raise unsupported(path, f"the fused heads linear is split as {widths}, not into {n} equal heads")
        adds = [g.only(part, "Add") for part in split.output]
        bs = [g.array(add.input[1]).reshape(-1) for add in adds]
        outputs = [add.output[0] for add in adds]
    n = len(outputs)
    if fused.shape[1] != n * h or any(b.shape != (h,) for b in bs):
        raise unsupported(path, f"{n} heads of {h} outputs from a fused linear of {fused.shape}")
    blocks = []
    for z in outputs:  # SiLU, then the residual on hidden
        readers = {r.op_type: r for r in g.consumers.get(z, [])}
        silu = g.only(readers["Sigmoid"].output[0], "Mul") if sorted(readers) == ["Mul", "Sigmoid"] else None
        if silu is None or silu is not readers["Mul"] or len(g.consumers[z]) != 2:
            raise unsupported(path, f"a head's block is {sorted(readers)}, not bias, SiLU, residual")
        residual = g.only(silu.output[0], "Add")
        if hidden_name not in residual.input:
            raise unsupported(path, "a head's residual does not add hidden (more than one block a head)")
        unsqueeze = g.only(residual.output[0], "Unsqueeze")
        if list(g.array(unsqueeze.input[1]).reshape(-1)) not in ([1], [-2]):
            raise unsupported(path, "a head's output is not unsqueezed to (B, 1, H)")
        blocks.append(unsqueeze.output[0])
    stack = g.only(blocks[0], "Concat")
    if list(stack.input) != blocks or attr(stack, "axis") not in (1, -2):
        raise unsupported(path, "the heads' outputs are not stacked in order along (B, n, H)'s axis 1")
    lm, logits = g.linear(stack.output[0])
    topk = g.only(logits, "TopK")
    if HEAD_LOGITS not in ({logits} | {n.output[0] for n in g.consumers.get(logits, []) if n.op_type == "Identity"}):
        raise unsupported(path, f"the heads' logits are not the graph's {HEAD_LOGITS}")
    if topk.output[1] != HEAD_TOPK and HEAD_TOPK not in {n.output[0] for n in g.consumers.get(topk.output[1], [])}:
        raise unsupported(path, f"the top-k ids are not the graph's {HEAD_TOPK}")
    if attr(topk, "largest", 1) != 1 or attr(topk, "axis", -1) not in (-1, 2):
        raise unsupported(path, "a TopK other than the largest along the vocabulary")
    k = int(g.array(topk.input[1]).reshape(-1)[0])
    heads = HeadsWeights(h, n, k, fused, np.ascontiguousarray(np.concatenate(bs), dtype=np.float32), lm, embed, eps)
    _check_heads(heads, path)
    return heads


def _check_heads(w: HeadsWeights, path: Path) -> None:
    """Every heads array's shape and dtype (``_check_arrays``, as ``check_weights``), before a pointer to any reaches C."""
    h, n = w.hidden, w.heads
    width = (2 if w.reads_roots else 1) * h
    f32, weight = (np.float32,), (np.float32, np.int8)
    table = [("the heads' biases", w.bias, (n * h,), f32)]
    for what, m, shape in (("the fused heads linear", w.fused, (width, n * h)), ("the heads' projection", w.lm, (h, w.lm.shape[1]))):
        if m.bits:
            table += _nbits_rows(path, what, m, shape)
        else:
            table.append((what, m.weight, shape, weight))
    if w.reads_roots:
        table.append(("the next token's embedding", w.embed, (w.embed.shape[0], h), f32))
    for what, m in (("the fused heads linear", w.fused), ("the heads' projection", w.lm)):
        if m.int8:
            table.append((f"{what}'s column scales", m.scale, m.shape[1:], f32))
    _check_arrays(path, table, f"{n} heads of {h} read from the graph's Split or Gemms")
    if not (0 < w.top_k <= 64 and w.top_k <= w.lm.shape[1]) or (w.reads_roots and not (math.isfinite(w.eps) and w.eps > 0)):
        raise malformed(path, f"heads with top-{w.top_k} of {w.lm.shape[1]} ids, norm epsilon {w.eps}")
