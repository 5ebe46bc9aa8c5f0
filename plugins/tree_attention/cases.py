"""Synthetic tree-attention inputs for tests, warm-up and benchmarks (no model needed).

``make_case`` builds every input of the op in the layouts of ``spec.TREE_ATTENTION`` with the
traps a kernel can fall into: a multi-layer cache read at one layer, ragged cache lengths, cache
slots past a sequence's length filled with large values (reading them changes the output), and
tree masks that are random valid trees (a node sees itself and its ancestors) or plain causal.

The layer's attention features are optional: a sliding ``window`` (chains and trees deeper than it
put tree keys past the window too), logit ``softcap`` (queries drawn ``SOFTCAP_GAIN`` times larger,
so scores reach tanh's flat part) and ``sinks`` (one logit per query head, some -inf: no sink).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

MASK_KINDS = ("tree", "causal")
STALE_VALUE = 30.0  # what slots past cache_lengths[b] hold: far from randn, so a stray read shows
SOFTCAP_GAIN = 4.0  # query scale in soft-capped cases: scores of several c, where capping changes them


def random_tree_mask(num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    """bool [T, T]: a random tree in topological order (node i's parent is some j < i);
    ``[i, j]`` true where j is i or one of its ancestors."""
    mask = torch.eye(num_nodes, dtype=torch.bool)
    for i in range(1, num_nodes):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        mask[i] |= mask[parent]  # i sees what its parent sees, and itself
    return mask


def causal_mask(num_nodes: int) -> torch.Tensor:
    """bool [T, T] lower triangular: a chain (prefill, plain decoding)."""
    return torch.ones(num_nodes, num_nodes, dtype=torch.bool).tril()


@dataclass(frozen=True)
class AttentionCase:
    """The op's inputs (spec order) and attributes, plus a name for failure messages."""

    query: torch.Tensor  # [B, Hq, T, D]
    key: torch.Tensor  # [B, Hkv, T, D]
    value: torch.Tensor  # [B, Hkv, T, D]
    past_key: torch.Tensor  # [S, L, B, Hkv, D]
    past_value: torch.Tensor  # [S, L, B, Hkv, D]
    tree_mask: torch.Tensor  # bool [B, T, T]
    cache_lengths: torch.Tensor  # int64 [B]
    sinks: torch.Tensor | None  # [Hq] or None (no sinks)
    layer: int
    scale: float
    name: str
    window: int = 0  # 0: none
    softcap: float = 0.0  # 0: none

    @property
    def inputs(self) -> tuple[torch.Tensor | None, ...]:
        """The op's inputs in spec order (``sinks`` None where the case has none)."""
        return (self.query, self.key, self.value, self.past_key, self.past_value, self.tree_mask, self.cache_lengths, self.sinks)

    @property
    def attributes(self) -> dict:
        """The op's attributes, as keywords of the launcher and the reference."""
        return dict(layer=self.layer, scale=self.scale, window=self.window, softcap=self.softcap)

    def to(self, dtype: torch.dtype) -> AttentionCase:
        """The same case with the float tensors in ``dtype`` (e.g. an fp32 reference of an fp16 case)."""
        cast = {n: getattr(self, n).to(dtype) for n in ("query", "key", "value", "past_key", "past_value")}
        return replace(self, **cast, sinks=None if self.sinks is None else self.sinks.to(dtype))


def make_case(
    *,
    cache_lengths: list[int],  # committed slots per sequence (batch = its length)
    num_new: int,  # T
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mask: str = "tree",  # "tree" (random valid trees, one per sequence) or "causal"
    num_layers: int = 3,
    layer: int = 2,
    spare_slots: int = 7,  # cache capacity S = max(cache_lengths) + spare_slots
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    window: int = 0,  # sliding window (0: none)
    softcap: float = 0.0,  # logit soft-capping (0: none)
    sinks: bool = False,  # per-head sink logits, every third head without one (-inf)
) -> AttentionCase:
    if mask not in MASK_KINDS:
        raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask!r}")
    gen = torch.Generator().manual_seed(seed)
    batch = len(cache_lengths)
    slots = max(cache_lengths, default=0) + spare_slots

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    past_key = randn(slots, num_layers, batch, num_kv_heads, head_dim)  # (S, L, B, Hkv, D)
    past_value = randn(slots, num_layers, batch, num_kv_heads, head_dim)
    for b, length in enumerate(cache_lengths):
        past_key[length:, :, b] = STALE_VALUE  # slots past the committed length: never to be read
        past_value[length:, :, b] = STALE_VALUE
    masks = [random_tree_mask(num_new, gen) if mask == "tree" else causal_mask(num_new) for _ in range(batch)]
    depth = max((int(m.sum(dim=-1).max()) - 1 for m in masks), default=0)
    features = "".join(
        [f" window={window} (tree depth {depth})" if window else "", f" softcap={softcap:g}" if softcap else "", " sinks" if sinks else ""]
    )
    name = (
        f"B={batch} lengths={cache_lengths} T={num_new} Hq={num_q_heads} Hkv={num_kv_heads} "
        f"(ratio {num_q_heads // num_kv_heads}) D={head_dim} S={slots} layer={layer}/{num_layers} mask={mask}{features} "
        f"dtype={str(dtype).removeprefix('torch.')} seed={seed}"
    )
    query = randn(batch, num_q_heads, num_new, head_dim) * (SOFTCAP_GAIN if softcap else 1.0)
    sink_logits = None
    if sinks:
        sink_logits = randn(num_q_heads) * 2.0
        sink_logits[::3] = float("-inf")  # heads without a sink: the op's "none"

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return AttentionCase(
        query=put(query),
        key=put(randn(batch, num_kv_heads, num_new, head_dim)),
        value=put(randn(batch, num_kv_heads, num_new, head_dim)),
        past_key=put(past_key),
        past_value=put(past_value),
        tree_mask=torch.stack(masks).to(device) if batch else torch.zeros(0, num_new, num_new, dtype=torch.bool, device=device),
        cache_lengths=torch.tensor(cache_lengths, dtype=torch.int64, device=device),
        sinks=None if sink_logits is None else put(sink_logits),
        layer=layer,
        scale=head_dim**-0.5,
        name=name,
        window=window,
        softcap=softcap,
    )
