"""Torch reference of tree attention: the math the ONNX graph, the kernel and the plugin follow.

Query i of sequence b attends to
  * committed cache slots s < cache_lengths[b] (slots past it hold stale or scratch data), and
  * the new (tree) keys j with tree_mask[b, i, j] true (its ancestors and itself).
Grouped-query attention: query head h reads KV head h // (Hq // Hkv).

With ``key_slots`` (engines that have that step input, ``runtime/key_slots.py``) the new keys are
scattered into the cache view at the host's slots instead of appended after it, so every key can
sit where plain decoding puts it; the math is the same, the key axis is the view's S slots.

Attention features a layer may ask for (``exporter/architecture.LayerAttention``), each applied
here exactly as ``transformers``' eager attention applies it:

* a sliding window W: query position p sees key position k only where p - k < W. A committed
  slot s holds position s; a new key holds its node's position (``key_positions``), so trees whose
  keys lie past the window are masked by position, wherever their keys sit on the key axis;
* logit soft-capping c: scores = c * tanh(scores / c), before the mask;
* attention sinks: one learnt logit per query head joins each softmax and is dropped after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visibility_bias(
    cache_lengths: torch.Tensor,  # int64 [B]
    tree_mask: torch.Tensor,  # bool/int [B, T, T]
    past_len: int,  # S: cache slots handed to the op (>= max(cache_lengths))
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive bias [B, 1, T, S + T]: 0 where visible, the dtype's minimum elsewhere."""
    batch, num_new = tree_mask.shape[0], tree_mask.shape[1]
    slots = torch.arange(past_len, device=tree_mask.device)
    past_visible = slots[None, :] < cache_lengths[:, None]  # (B, S)
    past_visible = past_visible[:, None, :].expand(batch, num_new, past_len)  # (B, T, S)
    visible = torch.cat([past_visible, tree_mask.to(torch.bool)], dim=-1)  # (B, T, S+T)
    bias = torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device)
    bias = bias.masked_fill(~visible, torch.finfo(dtype).min)
    return bias[:, None]  # (B, 1, T, S+T)


def scattered_bias(
    cache_lengths: torch.Tensor,  # int64 [B]
    tree_mask: torch.Tensor,  # bool/int [B, T, T]
    key_slots: torch.Tensor,  # int64 [B, T]: where node j's key sits, in cache_lengths[b] .. S-1
    past_len: int,  # S: the bound view's slots (> max(key_slots))
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive bias [B, 1, T, S] for keys scattered to ``key_slots``: 0 where visible, the dtype's minimum elsewhere."""
    batch, num_new = tree_mask.shape[0], tree_mask.shape[1]
    slots = torch.arange(past_len, device=tree_mask.device)
    past_visible = (slots[None, :] < cache_lengths[:, None])[:, None, :].expand(batch, num_new, past_len)  # (B, T, S)
    new = torch.zeros((batch, num_new, past_len), dtype=dtype, device=tree_mask.device)
    new = new.scatter(2, key_slots[:, None, :].expand(batch, num_new, num_new), tree_mask.to(dtype))  # (B, T, S): 1 where visible
    visible = past_visible | (new > 0)
    bias = torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device).masked_fill(~visible, torch.finfo(dtype).min)
    return bias[:, None]  # (B, 1, T, S)


def tree_positions(
    cache_lengths: torch.Tensor,  # int64 [B]
    tree_mask: torch.Tensor,  # bool/int [B, T, T]
) -> torch.Tensor:
    """int64 [B, T]: each new token's position as the step contract gives it, ``cache_lengths[b] +
    depth(i)``, depth being node i's number of ancestors (``tree_mask[b, i].sum() - 1``). What the
    plugin op, its fallback and the kernel use where the standard form reads ``position_ids``."""
    return cache_lengths[:, None] + tree_mask.to(torch.int64).sum(dim=-1) - 1  # (B, T)


def key_positions(
    cache_lengths: torch.Tensor,  # int64 [B]
    position_ids: torch.Tensor,  # int64 [B, T]: each new token's position
    past_len: int,  # S
    key_slots: torch.Tensor | None = None,  # int64 [B, T]: the new keys' slots in the view (None: appended after it)
) -> torch.Tensor:
    """int64 [B, S+T] (appended) or [B, S] (scattered): the position of the token whose key sits at
    each index of the key axis. Committed slot s holds position s; indices that hold no visible key
    get their slot number, which the visibility bias masks anyway."""
    batch = position_ids.shape[0]
    slots = torch.arange(past_len, device=position_ids.device)[None, :].expand(batch, past_len)  # (B, S)
    if key_slots is None:
        return torch.cat([slots, position_ids], dim=1)  # (B, S+T)
    return slots.scatter(1, key_slots, position_ids)  # (B, S)


def window_bias(
    bias: torch.Tensor,  # [B, 1, T, K] from visibility_bias / scattered_bias
    query_positions: torch.Tensor,  # int64 [B, T]
    positions: torch.Tensor,  # int64 [B, K] from key_positions
    window: int,
) -> torch.Tensor:
    """``bias`` with every key at or past ``window`` positions behind its query masked: [B, 1, T, K]."""
    behind = query_positions[:, :, None] - positions[:, None, :]  # (B, T, K)
    return bias.masked_fill((behind >= window)[:, None], torch.finfo(bias.dtype).min)


def scatter_new(past: torch.Tensor, new: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """past [B, Hkv, S, D] with new [B, Hkv, T, D] written at slots key_slots [B, T] (a copy: the cache is untouched)."""
    index = key_slots[:, None, :, None].expand(new.shape)  # (B, Hkv, T, D)
    return past.scatter(2, index, new)


def tree_attention(
    query: torch.Tensor,  # [B, Hq, T, D], rotary already applied
    key: torch.Tensor,  # [B, Hkv, T, D] keys of the new tokens
    value: torch.Tensor,  # [B, Hkv, T, D]
    past_key: torch.Tensor,  # [B, Hkv, S, D] committed cache (view of the first S slots)
    past_value: torch.Tensor,  # [B, Hkv, S, D]
    bias: torch.Tensor,  # [B, 1, T, S+T] from visibility_bias ([B, 1, T, S] from scattered_bias with key_slots)
    scale: float,
    key_slots: torch.Tensor | None = None,  # int64 [B, T]: scatter the new keys into the view instead of appending them
    softcap: float | None = None,  # attention-logit soft-capping
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits
) -> torch.Tensor:
    """Returns the attention output [B, Hq, T, D]. A sliding window is part of ``bias`` (``window_bias``).

    Grouped-query attention without copying the cache per query head: the G = Hq / Hkv query heads
    of one KV head are stacked along the query axis, (B, Hq, T, D) -> (B, Hkv, G*T, D), so every
    query meets its KV head by broadcasting (the exported graph holds no Expand of the cache)."""
    batch, hq, t, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    if key_slots is None:
        keys = torch.cat([past_key, key], dim=2)  # (B, Hkv, S+T, D)
        values = torch.cat([past_value, value], dim=2)  # (B, Hkv, S+T, D)
    else:
        keys, values = scatter_new(past_key, key, key_slots), scatter_new(past_value, value, key_slots)  # (B, Hkv, S, D)
    q = query.reshape(batch, hkv, groups * t, d)  # head h = kv * G + g -> row g * T + i of KV head kv
    mask = bias.to(query.dtype).expand(batch, groups, t, bias.shape[-1]).reshape(batch, 1, groups * t, bias.shape[-1])  # (B, 1, G*T, S+T)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)  # (B, Hkv, G*T, D)
        return out.reshape(batch, hq, t, d)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # (B, Hkv, G*T, K)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:  # head h = kv * G + g owns row g * T + i of KV head kv
        sink = sinks.to(scores.dtype).reshape(1, hkv, groups, 1).expand(batch, hkv, groups, t).reshape(batch, hkv, groups * t, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (B, Hkv, G*T, K+1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1)[..., :-1]  # the sink takes its share, then is dropped
    else:
        probs = torch.softmax(scores, dim=-1)  # (B, Hkv, G*T, K)
    out = torch.matmul(probs.to(values.dtype), values)  # (B, Hkv, G*T, D)
    return out.reshape(batch, hq, t, d)
