"""Ahead-of-time compilation of the tree-attention kernel to PTX (for the TensorRT plugin).

TensorRT's AOT plugins launch one kernel with the plugin's input pointers, then int32 scalars,
then output pointers (``trtp.KernelLaunchParams`` + ``trtp.SymIntExprs``), with no Python at serve
time. ``triton_kernels.tree_attention_kernel`` is declared in exactly that order, so this module
only has to:

  * build the Triton signature (pointer element types from the tensors' dtypes, every scalar
    ``i32`` without value specialisation, block sizes and model constants as ``constexpr``);
  * compile it for a CUDA target (the current GPU, or any given one: Triton bundles ``ptxas``, so
    this works on a machine without a GPU, which is how the tests exercise it);
  * drop the two trailing pointer parameters Triton >= 3.3 appends for global / profile scratch
    memory, which this kernel never uses and TensorRT does not pass;
  * list the scalar arguments in kernel order from the tensors' shapes (dense layouts, as
    TensorRT binds them), for ints or for TensorRT's symbolic shape expressions alike.

The split-context path is not available here: an AOT plugin launches a single kernel and gets no
scratch workspace, so the engine runs the single-pass kernel (``num_splits = 1``).

Needs ``triton`` (imported inside the functions that compile); nothing here needs TensorRT.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from medusa_trt.plugins.tree_attention.launch import LaunchPlan, dot_precision

LOG2E = 1.4426950408889634
# PTX ISA 8.4 (CUDA 12.4): new enough for sm_90 (wgmma), old enough for the PTX loaders of current
# TensorRT releases and drivers; Triton's own default follows its bundled CUDA (9.x for triton 3.9).
AOT_PTX_VERSION = 84
# The oldest PTX ISA each newer architecture's PTX may declare (NVIDIA's PTX ISA release notes: sm_100 and
# sm_101 arrived in 8.6, sm_120 in 8.7, sm_103 and sm_121 in 8.8, sm_110 in 9.0); older targets take
# AOT_PTX_VERSION. A driver JIT-compiles PTX of an ISA no newer than its CUDA version.
MIN_PTX_VERSION = {100: 86, 101: 86, 103: 88, 110: 90, 120: 87, 121: 88}
# Dynamic shared memory a kernel launch gets without opting in (cuFuncSetAttribute), which an AOT plugin
# launched by TensorRT cannot be assumed to do: a kernel needing more would fail to launch on every GPU.
AOT_MAX_SHARED_MEM = 48 * 1024
NUM_INPUT_POINTERS = 8  # spec.TREE_ATTENTION.inputs (sinks included: the node always has them)
FLOAT_TYPES = ("fp32", "fp16", "bf16")
# The version tensorrt.plugin registers every quickly deployable plugin's creator under (it sets
# plugin_version = "1" whatever the op): the ONNX node's plugin_version, which TensorRT's parser looks
# the creator up by, must say this, not the op's own version (spec.TREE_ATTENTION.version, in the
# graph's opset import for the op's domain).
TRT_PLUGIN_VERSION = "1"


def ptx_version_for(capability: int) -> int:
    """The PTX ISA version the AOT kernel declares for a target of this compute capability (e.g. 90, 120)."""
    if capability in MIN_PTX_VERSION:
        return max(AOT_PTX_VERSION, MIN_PTX_VERSION[capability])
    if capability > max(MIN_PTX_VERSION):
        raise AotCompileError(f"compute capability {capability} is newer than the PTX versions this plugin knows: update MIN_PTX_VERSION")
    return AOT_PTX_VERSION


class AotCompileError(RuntimeError):
    """The compiled kernel does not fit TensorRT's AOT calling convention (an internal invariant)."""


@dataclass(frozen=True)
class AotKernel:
    name: str  # PTX entry point
    ptx: str
    num_warps: int  # block_x = num_warps * 32
    shared_mem: int  # dynamic shared memory per block, bytes
    num_params: int  # kernel parameters after trimming: inputs + scalars + outputs
    plan: LaunchPlan | None = None  # the block sizes it was compiled with (its row block sets the launch grid)


def dense_strides(shape: Sequence[Any]) -> list[Any]:
    """Row-major strides of a dense tensor from its dims (ints or symbolic expressions)."""
    strides = [1]
    for dim in reversed(shape[1:]):
        strides.insert(0, dim * strides[0])  # dim on the left: symbolic types need not support int * expr
    return strides


def scalar_arguments(
    query_shape: Sequence[Any],  # [B, Hq, T, D]
    key_shape: Sequence[Any],  # [B, Hkv, T, D]
    cache_shape: Sequence[Any],  # [S, L, B, Hkv, D]
    *,
    layer: int,
) -> list[Any]:
    """The kernel's int scalars, in declaration order, for dense tensors of these shapes:
    num_new, num_slots, layer, then the strides the kernel reads (last dimensions are dense)."""
    num_new = query_shape[2]
    mask_shape = (query_shape[0], num_new, num_new)  # [B, T, T]
    q, k, c, m = dense_strides(query_shape), dense_strides(key_shape), dense_strides(cache_shape), dense_strides(mask_shape)
    return [
        num_new,
        cache_shape[0],
        layer,
        *q[:3],  # query
        *k[:3],
        *k[:3],  # key, value
        *c[:4],
        *c[:4],  # past_key, past_value
        *m,  # tree_mask
        *q[:3],  # out (query's shape)
    ]


def kernel_signature(kernel: Any, *, float_type: str, mask_type: str, lengths_type: str, constants: dict[str, Any]) -> dict[str, str]:
    """Triton signature of ``tree_attention_kernel``: name -> "*fp16" / "i32" / "constexpr"."""
    if float_type not in FLOAT_TYPES:
        raise ValueError(f"float_type must be one of {FLOAT_TYPES}, got {float_type!r}")
    pointer_types = {"mask_ptr": f"*{mask_type}", "lens_ptr": f"*{lengths_type}"}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, f"*{float_type}")
        else:
            signature[name] = "i32"
    return signature


def trim_entry_params(ptx: str, entry: str, keep: int) -> str:
    """Drop the parameters of ``.entry entry(...)`` past the first ``keep``; each dropped one
    must be unreferenced in the body (Triton's unused scratch pointers)."""
    head = re.search(rf"\.entry\s+{re.escape(entry)}\s*\(", ptx)
    if head is None:
        raise AotCompileError(f"no .entry {entry}( in the PTX")
    close = ptx.index(")", head.end())
    params = [p.strip() for p in ptx[head.end() : close].split(",") if p.strip()]
    if len(params) < keep:
        raise AotCompileError(f"{entry} declares {len(params)} parameters, fewer than the {keep} TensorRT passes")
    body = ptx[close:]
    for param in params[keep:]:
        name = param.split()[-1]
        if re.search(rf"\b{re.escape(name)}\b", body):
            raise AotCompileError(
                f"{entry} uses its trailing parameter {name} (scratch memory), which a TensorRT AOT launch cannot provide"
            )
    kept = ",\n".join(f"\t{p}" for p in params[:keep])
    return f"{ptx[: head.end()]}\n{kept}\n{ptx[close:]}"


@functools.cache
def compile_aot(
    *,
    float_type: str,  # "fp32" / "fp16" / "bf16": query, key, value, cache and output
    mask_type: str,  # Triton type of tree_mask's elements: "i1" (bool), "i32", ...
    lengths_type: str,  # of cache_lengths: "i64" or "i32"
    num_kv_heads: int,
    groups: int,  # Hq // Hkv
    head_dim: int,
    scale: float,
    plan: LaunchPlan,
    window: int = 0,  # the layer's sliding window (0: none)
    softcap: float = 0.0,  # its logit soft-capping (0: none)
    target: Any = None,  # triton.backends.compiler.GPUTarget; None: the current GPU
    ptx_version: int | None = None,  # None: ptx_version_for(the target)
) -> AotKernel:
    """Compile the single-pass kernel to PTX with TensorRT's parameter list (inputs, scalars, output).

    The layer's attributes are compile-time constants (``scale``, ``window``, ``softcap``); the sinks
    are always read (the node always has the input; -inf for heads without one).

    Cached: every layer of a model asks for the same kernel. The entry point is renamed after its
    specialisation (TensorRT identifies an AOT kernel by name, so two different PTX bodies under one
    name, e.g. fp16 and fp32 engines built in one process, must not collide)."""
    import triton
    from triton.compiler import ASTSource

    from medusa_trt.plugins.tree_attention import triton_kernels

    kernel = triton_kernels.tree_attention_kernel
    if plan.num_splits != 1:
        raise ValueError("the AOT kernel is the single-pass one: plan.num_splits must be 1")
    constants = dict(
        NUM_KV_HEADS=num_kv_heads,
        GROUPS=groups,
        HEAD_DIM=head_dim,
        QK_SCALE=float(scale) * LOG2E,
        WINDOW=int(window),
        SOFTCAP=float(softcap),
        HAS_SINKS=True,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        PRECISION=dot_precision(float_type),
    )
    signature = kernel_signature(kernel, float_type=float_type, mask_type=mask_type, lengths_type=lengths_type, constants=constants)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    target = target or triton.runtime.driver.active.get_current_target()
    options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages, "enable_fp_fusion": True}
    options["ptx_version"] = ptx_version or ptx_version_for(target.arch)
    options = triton.compiler.make_backend(target).parse_options(options).__dict__
    compiled = triton.compile(source, target=target, options=options)
    if getattr(compiled.metadata, "global_scratch_size", 0) or getattr(compiled.metadata, "profile_scratch_size", 0):
        raise AotCompileError("the kernel needs scratch memory, which a TensorRT AOT launch cannot provide")
    num_params = sum(1 for kind in signature.values() if kind != "constexpr")
    digest = hashlib.sha256(repr(sorted(signature.items()) + sorted(constants.items())).encode()).hexdigest()[:12]
    name = f"{compiled.metadata.name}_{digest}"
    ptx = trim_entry_params(compiled.asm["ptx"].replace(compiled.metadata.name, name), name, num_params)
    if compiled.metadata.shared > AOT_MAX_SHARED_MEM:
        raise AotCompileError(
            f"the {float_type} kernel for head size {head_dim} needs {compiled.metadata.shared} B of shared memory per block, "
            f"more than the {AOT_MAX_SHARED_MEM} B a launch gets without opting in"
        )
    return AotKernel(
        name=name, ptx=ptx, num_warps=compiled.metadata.num_warps, shared_mem=compiled.metadata.shared, num_params=num_params, plan=plan
    )


def fitting_plans(plan: LaunchPlan) -> list[LaunchPlan]:
    """``plan``, then ones needing less shared memory (one pipeline stage, then halved key blocks, then halved
    row blocks, each down to the 16 ``tl.dot`` needs): what ``compile_fitting`` tries in order."""
    plans = [plan, replace(plan, num_stages=1)]
    while plans[-1].block_n > 16:
        plans.append(replace(plans[-1], block_n=plans[-1].block_n // 2))
    while plans[-1].block_m > 16:
        plans.append(replace(plans[-1], block_m=plans[-1].block_m // 2))
    return list(dict.fromkeys(plans))


def compile_fitting(*, plan: LaunchPlan, **kwargs) -> AotKernel:
    """``compile_aot`` with the first of ``fitting_plans(plan)`` whose kernel fits ``AOT_MAX_SHARED_MEM``;
    the kernel's ``plan`` gives the launch grid (its row block may be smaller). Raises ``AotCompileError`` if none fits."""
    error = None
    for candidate in fitting_plans(plan):
        try:
            return compile_aot(plan=candidate, **kwargs)
        except AotCompileError as exc:
            if "shared memory" not in str(exc):
                raise
            error = exc
    raise AotCompileError(
        f"{error}, even with one stage and {candidate.block_m}x{candidate.block_n} blocks: use a smaller head size or fp16 / bf16"
    )
