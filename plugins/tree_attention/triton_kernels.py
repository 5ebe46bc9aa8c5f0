"""Triton kernels of tree attention (imported lazily: this module needs ``triton``).

The op (``spec.TREE_ATTENTION``, math in ``reference.tree_attention``): for sequence b, query
head qh and tree query t, attend over

  * committed cache slots ``s < cache_lengths[b]`` of layer ``layer`` of the slot-major cache
    ``past_key[s, layer, b, qh // groups, :]`` (read in place through strides), then
  * the T new keys ``key[b, qh // groups, j, :]`` where ``tree_mask[b, t, j]``.

The layer's attention features are compile-time constants (a model has one or two kinds of layer):

  * ``WINDOW`` (0: none): tree query t is the token at position ``p = cache_lengths[b] + depth(t)``
    (depth: its tree-mask row's sum - 1, the step contract's positions); it sees slot s only where
    ``p - s < WINDOW`` and tree key j only where ``depth(t) - depth(j) < WINDOW``. Slots before
    ``cache_lengths[b] - WINDOW`` are seen by no row and never read;
  * ``SOFTCAP`` (0: none): scores ``c tanh(x / c)`` before the mask;
  * ``HAS_SINKS``: the query head's sink logit ``sinks[qh]`` joins the softmax as one more logit
    with no value (it adds ``2^(sink - m)`` to ``l`` and nothing to ``acc``); -inf adds nothing.

Decode-shaped: few queries, long context, memory bound. One program owns one (sequence, KV head)
pair and a block of its query rows (all query heads of the group x tree queries, see
``launch.py``), so each K/V tile it streams serves every query head of the group.

Online softmax (base 2, scale folded into ``QK_SCALE = scale * log2(e)``): a program keeps per
row the running maximum ``m``, the running sum ``l = sum_j 2^(s_j - m)`` and the unnormalised
output ``acc = sum_j 2^(s_j - m) v_j``. A new tile of scores ``s`` updates them with
``m' = max(m, max_j s_j)``, ``alpha = 2^(m - m')``, ``l' = alpha l + sum_j 2^(s_j - m')`` and
``acc' = alpha acc + sum_j 2^(s_j - m') v_j``, so the context is read once, in tiles, never
materialising the score row. The result is ``acc / l``. Accumulation is fp32 for every input
dtype; probabilities are cast to V's dtype for the P @ V product (as flash attention does).

Split context (flash-decoding): with long contexts and few programs, ``tree_attention_split_kernel``
runs ``num_splits`` programs per row block, each over one chunk of the sequence's *real* context
(``cache_lengths[b]`` divided evenly, in whole key tiles; split 0 also takes the tree keys and the
sinks). Each
writes its normalised partial output ``o_s = acc_s / l_s`` and log-sum-exp ``lse_s = m_s +
log2(l_s)`` (-inf when its chunk was empty). ``tree_attention_combine_kernel`` merges them:
``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M`` the running maximum of the
``lse_s`` (itself an online-softmax pass over the splits).

Argument order of ``tree_attention_kernel`` follows TensorRT's ahead-of-time plugin calling
convention: the op's inputs (spec order), then int32 scalars, then the output; everything after
is compile-time (``tl.constexpr``). Offsets into the cache are computed in int64 (a cache can
exceed 2^31 elements); last dimensions are contiguous (checked by the launcher).
"""

from __future__ import annotations

import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # initial running max: finite, so 2^(m - m') never sees (-inf) - (-inf)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softmax_update(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
    """One online-softmax step: fold scores s [M, N] (base 2, -inf where hidden) and values v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (M,)
    alpha = tl.exp2(m_i - m_new)  # (M,) rescales what was accumulated under the old maximum
    p = tl.exp2(s - m_new[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # (M, D)
    return acc, m_new, l_i


@triton.jit
def _tanh(x):
    """tanh in fp32 through exp2: 1 - 2 / (e^(2x) + 1), clamped where tanh is +-1 to fp32 precision."""
    e = tl.exp2(tl.minimum(tl.maximum(x, -15.0), 15.0) * (2.0 * _LOG2E))  # e^(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _scores(q, k, QK_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scores [M, N] in base 2 (scaled by QK_SCALE = scale * log2(e)), soft-capped when SOFTCAP > 0:
    c tanh(x / c) in natural units is (c log2 e) tanh(x2 / (c log2 e)) on base-2 scores x2."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE
    if SOFTCAP > 0:
        s = (SOFTCAP * _LOG2E) * _tanh(s / (SOFTCAP * _LOG2E))
    return s


@triton.jit
def _depths(mask_ptr, b, nodes, node_mask, num_new, stride_mb, stride_mi, stride_mj, BLOCK_N: tl.constexpr):
    """Depth of each tree node in ``nodes`` [X] (its ancestors: its tree-mask row's sum - 1), int32."""
    depth = nodes * 0  # (X,) int32
    for k0 in range(0, num_new, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        offs = b * stride_mb + nodes[:, None] * stride_mi + offs_k[None, :] * stride_mj  # (X, N)
        seen = tl.load(mask_ptr + offs, mask=node_mask[:, None] & (offs_k < num_new)[None, :], other=0) != 0
        depth += tl.sum(seen.to(tl.int32), axis=1)
    return depth - 1


@triton.jit
def _attend(
    q_ptr,
    k_ptr,
    v_ptr,
    pk_ptr,
    pv_ptr,
    mask_ptr,
    sinks_ptr,
    num_new,
    layer,
    b,
    h,
    row_start,
    seq_len,
    ctx_start,
    ctx_end,
    with_tree,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_pks,
    stride_pkl,
    stride_pkb,
    stride_pkh,
    stride_pvs,
    stride_pvl,
    stride_pvb,
    stride_pvh,
    stride_mb,
    stride_mi,
    stride_mj,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_SCALE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of this program's rows over cache slots [ctx_start, ctx_end) and, when
    ``with_tree``, the visible tree keys and the heads' sinks. Returns (acc [M, D] fp32, m [M], l [M]).

    Sliding window (WINDOW > 0): row (g, t) is the token at position ``seq_len + depth(t)``; it sees
    committed slot s (position s) where ``seq_len + depth(t) - s < WINDOW`` and tree key j (position
    ``seq_len + depth(j)``) where ``depth(t) - depth(j) < WINDOW``."""
    offs_r = row_start + tl.arange(0, BLOCK_M)  # (M,) row = g * T + t
    r_mask = offs_r < GROUPS * num_new
    t = offs_r % num_new  # tree query of each row
    qh = h * GROUPS + offs_r // num_new  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_offs = b * stride_qb + qh[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]  # (M, D)
    q = tl.load(q_ptr + q_offs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if WINDOW > 0:
        q_depth = _depths(mask_ptr, b, t, r_mask, num_new, stride_mb, stride_mi, stride_mj, BLOCK_N)  # (M,)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # committed context: past[s, layer, b, h, :], slot-major, read in place
    layer64 = tl.cast(layer, tl.int64)  # tl.cast, not .to: an int argument equal to 1 arrives as a constant
    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    pk_base = pk_ptr + layer64 * stride_pkl + b64 * stride_pkb + h64 * stride_pkh
    pv_base = pv_ptr + layer64 * stride_pvl + b64 * stride_pvb + h64 * stride_pvh
    for n0 in range(ctx_start, ctx_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (N,) cache slots
        n_mask = offs_n < ctx_end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        slots = offs_n.to(tl.int64)[:, None]
        k = tl.load(pk_base + slots * stride_pks + offs_d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        v = tl.load(pv_base + slots * stride_pvs + offs_d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        s = _scores(q, k, QK_SCALE, SOFTCAP, PRECISION)  # (M, N)
        visible = n_mask[None, :]
        if WINDOW > 0:
            visible = visible & ((seq_len + q_depth)[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, PRECISION)

    # tree keys: key[b, h, j, :] visible to row (g, t) where tree_mask[b, t, j]
    if with_tree:
        for j0 in range(0, num_new, BLOCK_N):
            offs_j = j0 + tl.arange(0, BLOCK_N)  # (N,)
            j_mask = offs_j < num_new
            kv_mask = j_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_j[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_j[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            vis_offs = b * stride_mb + t[:, None] * stride_mi + offs_j[None, :] * stride_mj  # (M, N)
            visible = tl.load(mask_ptr + vis_offs, mask=r_mask[:, None] & j_mask[None, :], other=0) != 0
            if WINDOW > 0:
                k_depth = _depths(mask_ptr, b, offs_j, j_mask, num_new, stride_mb, stride_mi, stride_mj, BLOCK_N)  # (N,)
                visible = visible & (q_depth[:, None] - k_depth[None, :] < WINDOW)
            s = _scores(q, k, QK_SCALE, SOFTCAP, PRECISION)  # (M, N)
            s = tl.where(visible, s, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, PRECISION)
        if HAS_SINKS:  # one more logit per query head, with no value: it only adds to the sum
            sink = tl.load(sinks_ptr + qh, mask=r_mask, other=float("-inf")).to(tl.float32) * _LOG2E  # (M,) base 2
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _context(lens_ptr, b, num_slots, WINDOW: tl.constexpr):
    """(seq_len, lo, length): the sequence's committed length as given (its positions), and the slots
    [lo, length) any of its rows can see: clamped to the cache, and under a window no slot more than
    WINDOW behind its first new token (every row sits at or past position seq_len - 1)."""
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    length = tl.minimum(seq_len, num_slots)  # clamp: never read past the cache
    if WINDOW > 0:
        lo = tl.minimum(tl.maximum(seq_len - WINDOW, 0), length)
    else:
        lo = length * 0
    return seq_len, lo, length


# Scalars that change from call to call (T, the cache capacity, the layer) are not specialised on
# (Triton would otherwise compile separate variants for a value of 1 or a multiple of 16).
_VARYING = ["num_new", "num_slots", "layer"]


@triton.jit(do_not_specialize=_VARYING)
def tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pk_ptr,
    pv_ptr,
    mask_ptr,
    lens_ptr,
    sinks_ptr,
    num_new,
    num_slots,
    layer,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_pks,
    stride_pkl,
    stride_pkb,
    stride_pkh,
    stride_pvs,
    stride_pvl,
    stride_pvb,
    stride_pvh,
    stride_mb,
    stride_mi,
    stride_mj,
    stride_ob,
    stride_oh,
    stride_ot,
    out_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_SCALE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Single pass: grid (B * Hkv, row blocks, 1); writes out [B, Hq, T, D] normalised."""
    pid_bh = tl.program_id(0)
    b = pid_bh // NUM_KV_HEADS
    h = pid_bh % NUM_KV_HEADS
    row_start = tl.program_id(1) * BLOCK_M
    seq_len, lo, length = _context(lens_ptr, b, num_slots, WINDOW)
    acc, _, l_i = _attend(
        q_ptr,
        k_ptr,
        v_ptr,
        pk_ptr,
        pv_ptr,
        mask_ptr,
        sinks_ptr,
        num_new,
        layer,
        b,
        h,
        row_start,
        seq_len,
        lo,
        length,
        True,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_pks,
        stride_pkl,
        stride_pkb,
        stride_pkh,
        stride_pvs,
        stride_pvl,
        stride_pvb,
        stride_pvh,
        stride_mb,
        stride_mi,
        stride_mj,
        GROUPS,
        HEAD_DIM,
        QK_SCALE,
        WINDOW,
        SOFTCAP,
        HAS_SINKS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees nothing (invalid tree) gives 0, not NaN
    offs_r = row_start + tl.arange(0, BLOCK_M)
    t = offs_r % num_new
    qh = h * GROUPS + offs_r // num_new
    offs_d = tl.arange(0, BLOCK_D)
    o_offs = b * stride_ob + qh[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :]  # (M, D)
    o_mask = (offs_r < GROUPS * num_new)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=_VARYING)
def tree_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pk_ptr,
    pv_ptr,
    mask_ptr,
    lens_ptr,
    sinks_ptr,
    num_new,
    num_slots,
    layer,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_pks,
    stride_pkl,
    stride_pkb,
    stride_pkh,
    stride_pvs,
    stride_pvl,
    stride_pvb,
    stride_pvh,
    stride_mb,
    stride_mi,
    stride_mj,
    part_o_ptr,
    part_lse_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_SCALE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Split pass: grid (B * Hkv, row blocks, num_splits). Writes, for split s,
    part_o [B * Hkv, splits, rows, D] (fp32, normalised) and part_lse [B * Hkv, splits, rows] (base 2).
    Split 0 also takes the tree keys and the sinks, so each is counted once."""
    pid_bh = tl.program_id(0)
    b = pid_bh // NUM_KV_HEADS
    h = pid_bh % NUM_KV_HEADS
    row_start = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len, lo, length = _context(lens_ptr, b, num_slots, WINDOW)
    chunk = tl.cdiv(tl.cdiv(length - lo, num_splits), BLOCK_N) * BLOCK_N  # this sequence's visible slots per split, whole tiles
    ctx_start = tl.minimum(lo + split * chunk, length)
    ctx_end = tl.minimum(ctx_start + chunk, length)
    acc, m_i, l_i = _attend(
        q_ptr,
        k_ptr,
        v_ptr,
        pk_ptr,
        pv_ptr,
        mask_ptr,
        sinks_ptr,
        num_new,
        layer,
        b,
        h,
        row_start,
        seq_len,
        ctx_start,
        ctx_end,
        split == 0,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_pks,
        stride_pkl,
        stride_pkb,
        stride_pkh,
        stride_pvs,
        stride_pvl,
        stride_pvb,
        stride_pvh,
        stride_mb,
        stride_mi,
        stride_mj,
        GROUPS,
        HEAD_DIM,
        QK_SCALE,
        WINDOW,
        SOFTCAP,
        HAS_SINKS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    seen = l_i > 0
    part_o = acc / tl.where(seen, l_i, 1.0)[:, None]  # (M, D)
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # (M,)
    rows = GROUPS * num_new
    offs_r = row_start + tl.arange(0, BLOCK_M)
    r_mask = offs_r < rows
    offs_d = tl.arange(0, BLOCK_D)
    base = (pid_bh * num_splits + split).to(tl.int64) * rows + offs_r  # (M,) row index into the workspace
    tl.store(part_lse_ptr + base, lse, mask=r_mask)
    tl.store(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], part_o, mask=r_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["num_new", "num_splits"])
def tree_attention_combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    num_new,
    num_splits,
    stride_ob,
    stride_oh,
    stride_ot,
    out_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the splits: grid (B * Hkv, row blocks). Online softmax over the splits' lse."""
    pid_bh = tl.program_id(0)
    b = pid_bh // NUM_KV_HEADS
    h = pid_bh % NUM_KV_HEADS
    rows = GROUPS * num_new
    offs_r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,)
    r_mask = offs_r < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for split in range(num_splits):
        base = (pid_bh * num_splits + split).to(tl.int64) * rows + offs_r  # (M,)
        lse = tl.load(part_lse_ptr + base, mask=r_mask, other=float("-inf"))  # (M,)
        o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)  # 0 for an empty split (lse = -inf)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    t = offs_r % num_new
    qh = h * GROUPS + offs_r // num_new
    o_offs = b * stride_ob + qh[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
