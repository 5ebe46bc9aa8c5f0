"""Launch geometry of the Triton tree-attention kernel: pure arithmetic on shapes.

One function decides block sizes and the context split from shapes alone, and one maps them to a
launch grid. The Python launcher (``kernel.py``) calls them with ints; the TensorRT ahead-of-time
registration (``trt_plugin.py``) calls ``launch_grid`` with TensorRT's symbolic shape expressions,
so an engine built with dynamic T launches exactly what the Python path would.

Work decomposition (see ``triton_kernels.py``): the query rows of one (sequence b, KV head h)
pair are the ``groups = Hq // Hkv`` query heads that share h times the T tree queries,
``rows = groups * T``, row ``r`` = (query head ``h * groups + r // T``, tree query ``r % T``).
A program owns ``block_m`` of those rows, so the K/V it streams from the cache is read once for
every query head of the group (grouped-query attention costs no extra memory traffic).

    grid = (B * Hkv, cdiv(rows, block_m), num_splits)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIN_BLOCK = 16  # tl.dot needs every operand dimension >= 16
MAX_BLOCK_M = 64  # rows per program; Medusa trees are <= 64 nodes, so T=64 with groups=1 is one block
SPLIT_MIN_SLOTS = 512  # below this many cache slots one pass over the context is short enough
SPLIT_MIN_CHUNK = 256  # each split streams at least this many slots (else the combine costs more than it saves)
MAX_SPLITS = 16
DEFAULT_NUM_SMS = 132  # H100/H200; used when the caller cannot ask the device


@dataclass(frozen=True)
class LaunchPlan:
    """Compile-time block sizes and the context split of one launch."""

    block_m: int  # query rows (query heads x tree queries) per program
    block_n: int  # keys streamed per inner-loop step
    block_d: int  # head_dim padded to a power of two (>= 16)
    num_splits: int  # programs sharing one row block's context (1: single pass, no combine)
    num_warps: int
    num_stages: int


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def plan_launch(
    *,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    num_new: int | None,
    head_dim: int,
    cache_slots: int,
    num_sms: int | None = None,
    num_splits: int | None = None,
) -> LaunchPlan:
    """Block sizes and split count for one launch.

    ``num_new`` (T) may be None where it is only known at run time (a TensorRT engine with a
    dynamic tree size): the row block is then the largest, ``MAX_BLOCK_M``.

    The split heuristic (flash-decoding): a decode-shaped launch has few programs
    (``B * Hkv * row_blocks``, often fewer than the GPU has multiprocessors) each streaming a long
    context. Splitting the context over ``num_splits`` programs fills the GPU; a second small
    kernel merges the partial results. Split only when the cache holds at least
    ``SPLIT_MIN_SLOTS`` slots, give each split at least ``SPLIT_MIN_CHUNK`` of them, and aim for
    about two programs per multiprocessor. ``cache_slots`` is the allocated capacity S, known on
    the host without a device sync; the kernel divides each sequence's *real* length among the
    splits, so splits past a short sequence's end load nothing.
    """
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    groups = num_q_heads // num_kv_heads
    if num_new is None:
        block_m = MAX_BLOCK_M
    else:
        block_m = min(MAX_BLOCK_M, max(MIN_BLOCK, next_power_of_2(groups * num_new)))
    block_d = max(MIN_BLOCK, next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32  # keeps the [block_n, block_d] K/V tiles in registers
    if num_splits is None:
        rows = groups * (num_new if num_new is not None else MAX_BLOCK_M)
        programs = batch * num_kv_heads * math.ceil(rows / block_m)
        if cache_slots < SPLIT_MIN_SLOTS:
            num_splits = 1
        else:
            wanted = math.ceil(2 * (num_sms or DEFAULT_NUM_SMS) / max(programs, 1))
            num_splits = max(1, min(MAX_SPLITS, wanted, cache_slots // SPLIT_MIN_CHUNK))
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return LaunchPlan(block_m=block_m, block_n=block_n, block_d=block_d, num_splits=num_splits, num_warps=4, num_stages=2)


def dot_precision(float_type: str) -> str:
    """``tl.dot`` input precision for "fp32" / "fp16" / "bf16" inputs: fp32 products in true fp32
    ("ieee"), not TF32, so fp32 matches the reference tightly; half types ignore the setting."""
    return "ieee" if float_type == "fp32" else "tf32"


def _int_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_grid(
    plan: LaunchPlan,
    *,
    batch: Any,
    num_kv_heads: Any,
    rows: Any,
    cdiv: Callable[[Any, int], Any] = _int_cdiv,
) -> tuple[Any, Any, Any]:
    """Grid of the attention kernel: (B * Hkv, row blocks, splits).

    ``batch``, ``num_kv_heads`` and ``rows`` (= groups * T) are ints, or symbolic expressions
    with ``*`` and a matching ``cdiv`` (TensorRT's ``trtp.cdiv``)."""
    return batch * num_kv_heads, cdiv(rows, plan.block_m), plan.num_splits


def combine_grid(plan: LaunchPlan, *, batch: int, num_kv_heads: int, rows: int) -> tuple[int, int]:
    """Grid of the split-combine kernel: one program per (sequence, KV head, row block)."""
    return batch * num_kv_heads, _int_cdiv(rows, plan.block_m)
