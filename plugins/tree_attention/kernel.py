"""Python launcher of the Triton tree-attention kernel, and the reference behind the same signature.

Both functions take the op's inputs in ``spec.TREE_ATTENTION.inputs`` order and its attributes
as keywords, so tests and the dispatcher swap one for the other:

    tree_attention_triton(query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks=None, *,
                          layer, scale, window=0, softcap=0.0, out=None)
    reference_from_spec(  query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks=None, *,
                          layer, scale, window=0, softcap=0.0, out=None)

``sinks`` [Hq] may be None here (no sinks; the ONNX node always has the input, -inf for none),
``window`` 0 and ``softcap`` 0 mean none, as the node's attributes do (``spec.py``).

The kernel reads the whole slot-major cache ``[S, L, B, Hkv, D]`` in place (layer picked by
stride), so a call allocates nothing but its output (none with ``out=``) and, on the split-context
path, the small fp32 workspace of partial results. It never synchronises with the host: cache
lengths stay on the device and are clamped to S inside the kernel.

``triton`` is imported lazily (this module imports without it); asking for the kernel without it
raises ``TritonUnavailableError``. On CPU tensors the kernels run only under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before the kernels are first loaded).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from medusa_trt.plugins.tree_attention.errors import TreeAttentionInputError, TritonUnavailableError
from medusa_trt.plugins.tree_attention.launch import LaunchPlan, combine_grid, dot_precision, launch_grid, plan_launch
from medusa_trt.plugins.tree_attention.reference import key_positions, tree_attention, tree_positions, visibility_bias, window_bias

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
TRITON_FLOAT_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@functools.cache
def load_kernels() -> ModuleType:
    """The module of ``@triton.jit`` kernels, imported once (interpreted or compiled as the
    environment said at that moment)."""
    try:
        from medusa_trt.plugins.tree_attention import triton_kernels
    except ImportError as err:
        if err.name is None or not err.name.startswith("triton"):
            raise
        raise TritonUnavailableError(
            f"the Triton tree-attention kernel needs the 'triton' package ({err}); install it with "
            "`pip install 'medusa-trt[kernel]'` (or `pip install 'triton>=3.9,<3.10'`), or use the torch reference "
            "(dispatch.attend(..., impl='reference'))"
        ) from err
    return triton_kernels


def triton_importable() -> bool:
    """Whether the kernels load (``triton`` installed and importable)."""
    try:
        load_kernels()
    except TritonUnavailableError:
        return False
    return True


def interpreter_active() -> bool:
    """Whether the loaded kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(load_kernels().tree_attention_kernel, InterpretedFunction)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks, layer: int, window: int, softcap: float) -> None:
    """Shape / dtype / device checks that need no device sync; raise TreeAttentionInputError."""
    named = dict(query=query, key=key, value=value, past_key=past_key, past_value=past_value)
    ranks = dict(query=4, key=4, value=4, past_key=5, past_value=5, tree_mask=3, cache_lengths=1)
    for name, tensor in (named | dict(tree_mask=tree_mask, cache_lengths=cache_lengths)).items():
        if tensor.dim() != ranks[name]:
            raise TreeAttentionInputError(f"tree attention: {name} must have {ranks[name]} dimensions, got shape {tuple(tensor.shape)}")
    batch, num_q_heads, num_new, head_dim = query.shape
    _, num_kv_heads, _, _ = key.shape
    slots, layers = past_key.shape[:2]
    expect = {
        "key": (batch, num_kv_heads, num_new, head_dim),
        "value": (batch, num_kv_heads, num_new, head_dim),
        "past_key": (slots, layers, batch, num_kv_heads, head_dim),
        "past_value": (slots, layers, batch, num_kv_heads, head_dim),
    }
    for name, shape in expect.items():
        if tuple(named[name].shape) != shape:
            raise TreeAttentionInputError(
                f"tree attention: {name} has shape {tuple(named[name].shape)}, expected {shape} "
                f"(query [B, Hq, T, D] = {tuple(query.shape)}, cache [S, L, B, Hkv, D])"
            )
    if tuple(tree_mask.shape) != (batch, num_new, num_new):
        raise TreeAttentionInputError(f"tree attention: tree_mask has shape {tuple(tree_mask.shape)}, expected {(batch, num_new, num_new)}")
    if tuple(cache_lengths.shape) != (batch,):
        raise TreeAttentionInputError(f"tree attention: cache_lengths has shape {tuple(cache_lengths.shape)}, expected {(batch,)}")
    if num_q_heads % num_kv_heads:
        raise TreeAttentionInputError(f"tree attention: {num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if not 0 <= layer < layers:
        raise TreeAttentionInputError(f"tree attention: layer {layer} is outside the cache's {layers} layers")
    if sinks is not None and (sinks.shape != (num_q_heads,) or not sinks.dtype.is_floating_point or sinks.device != query.device):
        raise TreeAttentionInputError(
            f"tree attention: sinks must be a float vector of the {num_q_heads} query heads on {query.device}, "
            f"got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
        )
    if window < 0 or softcap < 0:
        raise TreeAttentionInputError(f"tree attention: window and softcap must be >= 0 (0: none), got {window} and {softcap}")
    if query.dtype not in TRITON_FLOAT_TYPES or any(t.dtype != query.dtype for t in named.values()):
        dtypes = {n: str(t.dtype) for n, t in named.items()}
        raise TreeAttentionInputError(f"tree attention: query, key, value and the cache must share one of fp16/bf16/fp32, got {dtypes}")
    if tree_mask.dtype.is_floating_point or cache_lengths.dtype.is_floating_point:
        raise TreeAttentionInputError(
            f"tree attention: tree_mask must be bool/int and cache_lengths int, got {tree_mask.dtype} and {cache_lengths.dtype}"
        )
    devices = {t.device for t in (*named.values(), tree_mask, cache_lengths)}
    if len(devices) != 1:
        raise TreeAttentionInputError(f"tree attention: all inputs must be on one device, got {sorted(map(str, devices))}")


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel addresses the last dimension densely; copy only a tensor that is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tree_attention_triton(
    query: torch.Tensor,  # [B, Hq, T, D] rotary applied
    key: torch.Tensor,  # [B, Hkv, T, D] keys of the T new (tree) tokens
    value: torch.Tensor,  # [B, Hkv, T, D]
    past_key: torch.Tensor,  # [S, L, B, Hkv, D] the whole committed cache, read in place
    past_value: torch.Tensor,  # [S, L, B, Hkv, D]
    tree_mask: torch.Tensor,  # bool/int [B, T, T] node i sees node j
    cache_lengths: torch.Tensor,  # int [B] committed slots per sequence (clamped to S)
    sinks: torch.Tensor | None = None,  # float [Hq] per-head sink logits (None: no sinks)
    *,
    layer: int,
    scale: float,
    window: int = 0,  # sliding window (0: none)
    softcap: float = 0.0,  # logit soft-capping (0: none)
    out: torch.Tensor | None = None,  # [B, Hq, T, D], query's dtype; written and returned
    num_splits: int | None = None,  # context splits; None: launch.plan_launch's heuristic
) -> torch.Tensor:
    """Tree attention with the Triton kernel; returns ``out`` [B, Hq, T, D] in query's dtype."""
    _check(query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks, layer, window, softcap)
    kernels = load_kernels()
    if query.device.type != "cuda" and not interpreter_active():
        raise TreeAttentionInputError(
            f"the Triton tree-attention kernel runs on CUDA tensors (got {query.device}); on CPU set TRITON_INTERPRET=1 "
            "before the kernels are first loaded, or use the torch reference (dispatch.attend(..., impl='reference'))"
        )
    if past_key.stride(-1) != 1 or past_value.stride(-1) != 1:
        raise TreeAttentionInputError(
            "tree attention: past_key/past_value must be contiguous in head_dim (the cache is read in place, never copied)"
        )
    query, key, value = _dense_last(query), _dense_last(key), _dense_last(value)
    cache_lengths = cache_lengths.contiguous()  # [B]: read as lens[b]; a no-op for the runtime's buffer
    batch, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads = key.shape[1]
    slots = past_key.shape[0]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise TreeAttentionInputError(
            f"tree attention: out must be {tuple(query.shape)} {query.dtype} on {query.device} with a dense last dimension, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if batch == 0 or num_new == 0:
        return out
    num_sms = None
    if query.device.type == "cuda":
        num_sms = _num_sms(query.device.index if query.device.index is not None else torch.cuda.current_device())
    plan = plan_launch(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_new=num_new,
        head_dim=head_dim,
        cache_slots=slots,
        num_sms=num_sms,
        num_splits=num_splits,
    )
    groups = num_q_heads // num_kv_heads
    rows = groups * num_new
    grid = launch_grid(plan, batch=batch, num_kv_heads=num_kv_heads, rows=rows)
    common = (
        query,
        key,
        value,
        past_key,
        past_value,
        tree_mask,
        cache_lengths,
        query if sinks is None else sinks.contiguous(),  # never read without HAS_SINKS
        num_new,
        slots,
        layer,
        *query.stride()[:3],
        *key.stride()[:3],
        *value.stride()[:3],
        *past_key.stride()[:4],
        *past_value.stride()[:4],
        *tree_mask.stride(),
    )
    meta = dict(
        NUM_KV_HEADS=num_kv_heads,
        GROUPS=groups,
        HEAD_DIM=head_dim,
        QK_SCALE=float(scale) * LOG2E,
        WINDOW=int(window),
        SOFTCAP=float(softcap),
        HAS_SINKS=sinks is not None,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        PRECISION=dot_precision(TRITON_FLOAT_TYPES[query.dtype]),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if plan.num_splits == 1:
        kernels.tree_attention_kernel[grid](*common, *out.stride()[:3], out, **meta)
        return out
    _launch_split(kernels, plan, common, meta, out, batch=batch, num_kv_heads=num_kv_heads, rows=rows, head_dim=head_dim)
    return out


def _launch_split(
    kernels: ModuleType, plan: LaunchPlan, common: tuple, meta: dict, out: torch.Tensor, *, batch, num_kv_heads, rows, head_dim
) -> None:
    """Flash-decoding: partial results per context split, then the log-sum-exp combine."""
    device = out.device
    part_o = torch.empty((batch * num_kv_heads, plan.num_splits, rows, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch * num_kv_heads, plan.num_splits, rows), dtype=torch.float32, device=device)
    grid = launch_grid(plan, batch=batch, num_kv_heads=num_kv_heads, rows=rows)
    kernels.tree_attention_split_kernel[grid](*common, part_o, part_lse, **meta)
    kernels.tree_attention_combine_kernel[combine_grid(plan, batch=batch, num_kv_heads=num_kv_heads, rows=rows)](
        part_o,
        part_lse,
        rows // meta["GROUPS"],
        plan.num_splits,
        *out.stride()[:3],
        out,
        NUM_KV_HEADS=num_kv_heads,
        GROUPS=meta["GROUPS"],
        HEAD_DIM=head_dim,
        BLOCK_M=plan.block_m,
        BLOCK_D=plan.block_d,
        num_warps=plan.num_warps,
    )


def reference_from_spec(
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    past_key: torch.Tensor,  # [S, L, B, Hkv, D]
    past_value: torch.Tensor,  # [S, L, B, Hkv, D]
    tree_mask: torch.Tensor,  # bool/int [B, T, T]
    cache_lengths: torch.Tensor,  # int [B]
    sinks: torch.Tensor | None = None,  # float [Hq] (None: no sinks)
    *,
    layer: int,
    scale: float,
    window: int = 0,  # 0: none
    softcap: float = 0.0,  # 0: none
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.tree_attention`` behind the op's signature: the same inputs as the kernel. Positions
    for the window are the step contract's (``reference.tree_positions``): committed slot s holds s."""
    past_k = past_key[:, layer].permute(1, 2, 0, 3)  # (S, B, Hkv, D) -> (B, Hkv, S, D)
    past_v = past_value[:, layer].permute(1, 2, 0, 3)  # (S, B, Hkv, D) -> (B, Hkv, S, D)
    cache_lengths = cache_lengths.long()
    bias = visibility_bias(cache_lengths, tree_mask, past_key.shape[0], query.dtype)  # (B, 1, T, S+T)
    if window:
        positions = tree_positions(cache_lengths, tree_mask)  # (B, T)
        bias = window_bias(bias, positions, key_positions(cache_lengths, positions, past_key.shape[0]), int(window))
    result = tree_attention(query, key, value, past_k, past_v, bias, scale, None, softcap or None, sinks)  # (B, Hq, T, D)
    if out is None:
        return result
    return out.copy_(result)
