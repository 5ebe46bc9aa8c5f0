"""TensorRT registration of ``medusa_trt::TreeAttention`` (``spec.TREE_ATTENTION``) as a quickly
deployable plugin with an ahead-of-time implementation: importing this module registers it.

  * ``@trtp.register``: the shape/type descriptor, out = query's shape and dtype.
  * ``@trtp.autotune``: the supported type combination (query, key, value, cache, sinks and out
    share fp32/fp16/bf16; tree_mask bool; cache_lengths int64), linear layouts.
  * ``@trtp.aot_impl``: compiles ``triton_kernels.tree_attention_kernel`` to PTX at engine build
    (``aot.compile_aot``) and returns its name, PTX, launch parameters (grid from the symbolic
    shapes through ``launch.launch_grid``, block = warps x 32, shared memory) and the int32
    scalars (sizes, layer, strides from ``aot.scalar_arguments``). The engine embeds the PTX and
    launches it without Python at serve time. ``layer``, ``scale``, ``window`` and ``softcap`` are
    baked in at build (the AOT path does not serialise attributes; a model with sliding and full
    layers gets one kernel of each); the sinks input is read at run time. Hq, Hkv and D must be
    build-time constants, B, T and S may be dynamic. The single-pass kernel is used (an AOT plugin launches one kernel and has no
    workspace for the split-context partials).

Written against the documented ``tensorrt.plugin`` API (TensorRT >= 10.9, the first with AOT plugins);
TensorRT's libraries cannot be installed on the machines this project is tested on, so the registration
and the builder's calls into it are tested against NVIDIA's real ``tensorrt.plugin`` package over a
stand-in for the compiled core (tests/test_trt_validators.py), not against TensorRT itself.
Type hints stay real objects in the ``typing`` forms TensorRT documents (no
``from __future__ import annotations``): ``tensorrt.plugin`` validates them.

Whatever TensorRT cannot do here is one line: ``TensorRTUnavailableError`` on import (no TensorRT, one
older than 10.9, a ``tensorrt.plugin`` without AOT support); errors in the builder's calls
(``TreeAttentionInputError``, ``AotCompileError``) are kept in ``BUILD_ERRORS`` as well, because TensorRT
only logs a plugin's exception and ends the build with a generic message: the exporter reports them.
"""

import logging
from typing import List, Tuple, Union

from medusa_trt.plugins.tree_attention import spec
from medusa_trt.plugins.tree_attention.errors import TensorRTUnavailableError, TreeAttentionInputError

MIN_TENSORRT = (10, 9)  # tensorrt.plugin's aot_impl and KernelLaunchParams
_NEED = f"TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} with its Python plugin API's AOT implementations"
_ELSE = "or export with --attention onnx"

try:
    import tensorrt as trt
    import tensorrt.plugin as trtp
except (ImportError, OSError) as err:  # the PyPI stubs install but fail to load without NVIDIA's libraries
    reason = " ".join(str(err).split())[:160]
    raise TensorRTUnavailableError(
        f"registering the {spec.TREE_ATTENTION.qualified_name} TensorRT plugin needs {_NEED} ({reason}): `pip install tensorrt` "
        f"on a machine that reaches NVIDIA's package index, {_ELSE} (or use the ONNX Runtime / torch backends)"
    ) from err


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def _numpy_converts_one_element_arrays() -> bool:
    import numpy

    try:
        int(numpy.zeros(1, dtype=numpy.int64))
    except TypeError:
        return False
    return True


if _version(getattr(trt, "__version__", "0")) < MIN_TENSORRT:
    raise TensorRTUnavailableError(
        f"TensorRT {getattr(trt, '__version__', '?')} is too old for the {spec.TREE_ATTENTION.qualified_name} plugin: it needs {_NEED}; "
        f"upgrade TensorRT, {_ELSE}"
    )
if not (hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams")):  # IS_AOT_ENABLED is false in this build
    raise TensorRTUnavailableError(
        f"this tensorrt.plugin (TensorRT {getattr(trt, '__version__', '?')}) has no AOT plugin support, which the "
        f"{spec.TREE_ATTENTION.qualified_name} plugin needs ({_NEED}): install a full TensorRT, {_ELSE}"
    )

if _version(getattr(trt, "__version__", "0")) < (11, 2) and not _numpy_converts_one_element_arrays():
    # tensorrt.plugin before 11.2 reads each scalar attribute as int(field.data) / float(field.data) of a one-element
    # array (_lib.py, create_plugin), which this NumPy raises on: every plugin with int or float attributes fails there
    raise TensorRTUnavailableError(
        f"tensorrt.plugin of TensorRT {trt.__version__} cannot read the {spec.TREE_ATTENTION.qualified_name} plugin's attributes "
        f"under NumPy {_numpy_version()}, which no longer converts one-element arrays to scalars: install TensorRT 11.2+ "
        f"or an older NumPy, {_ELSE}"
    )

from medusa_trt.plugins.tree_attention.aot import AotCompileError, compile_fitting, scalar_arguments  # noqa: E402
from medusa_trt.plugins.tree_attention.launch import launch_grid, plan_launch  # noqa: E402

log = logging.getLogger(__name__)

PLUGIN_ID = spec.TREE_ATTENTION.qualified_name  # "medusa_trt::TreeAttention"
_FLOAT_TYPES = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
_MASK_TYPES = {trt.bool: "i1", trt.int8: "i8", trt.int32: "i32"}
_LENGTH_TYPES = {trt.int64: "i64", trt.int32: "i32"}


BUILD_ERRORS: List[str] = []  # messages of the builder's calls that failed (TensorRT only logs them)


def build_target():
    """The GPU the kernel is compiled for: the current one, which TensorRT builds for (tests set others)."""
    import triton

    return triton.runtime.driver.active.get_current_target()


def _constant(expr, what: str) -> int:
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        raise TreeAttentionInputError(
            f"{PLUGIN_ID}: {what} is not a build-time constant in the engine's shapes (TensorRT could not fold it): "
            "the AOT kernel is specialised on it; export the model again, or with --attention onnx"
        )
    return expr.constant_value()


def _triton_type(table: dict, dtype, what: str) -> str:
    if dtype not in table:
        raise TreeAttentionInputError(f"{PLUGIN_ID}: unsupported {what} dtype {dtype}; supported: {list(table)}")
    return table[dtype]


@trtp.register(PLUGIN_ID)
def tree_attention_desc(
    query: trtp.TensorDesc,
    key: trtp.TensorDesc,
    value: trtp.TensorDesc,
    past_key: trtp.TensorDesc,
    past_value: trtp.TensorDesc,
    tree_mask: trtp.TensorDesc,
    cache_lengths: trtp.TensorDesc,
    sinks: trtp.TensorDesc,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
) -> trtp.TensorDesc:
    """out [B, Hq, T, D]: query's shape and dtype."""
    return query.like()


@trtp.autotune(PLUGIN_ID)
def tree_attention_autotune(
    query: trtp.TensorDesc,
    key: trtp.TensorDesc,
    value: trtp.TensorDesc,
    past_key: trtp.TensorDesc,
    past_value: trtp.TensorDesc,
    tree_mask: trtp.TensorDesc,
    cache_lengths: trtp.TensorDesc,
    sinks: trtp.TensorDesc,
    outputs: Tuple[trtp.TensorDesc],
) -> List[trtp.AutoTuneCombination]:
    # "|" pairs positions: the six float inputs and the output take the same one of the three types
    floats = "FP32|FP16|BF16"
    return [trtp.AutoTuneCombination(f"{floats}, {floats}, {floats}, {floats}, {floats}, BOOL, INT64, {floats}, {floats}", "LINEAR")]


@trtp.aot_impl(PLUGIN_ID)
def tree_attention_aot_impl(
    query: trtp.TensorDesc,
    key: trtp.TensorDesc,
    value: trtp.TensorDesc,
    past_key: trtp.TensorDesc,
    past_value: trtp.TensorDesc,
    tree_mask: trtp.TensorDesc,
    cache_lengths: trtp.TensorDesc,
    sinks: trtp.TensorDesc,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
    outputs: Tuple[trtp.TensorDesc],
    tactic: int,
) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    """TensorRT calls this positionally (inputs, attributes, outputs, tactic); one tactic, TensorRT's default."""
    try:
        return _aot_kernel(query, key, past_key, tree_mask, cache_lengths, layer, scale, window, softcap)
    except (TreeAttentionInputError, AotCompileError) as exc:
        BUILD_ERRORS.append(" ".join(str(exc).split()))
        raise


def _aot_kernel(query, key, past_key, tree_mask, cache_lengths, layer, scale, window, softcap):
    q_shape = query.shape_expr  # [B, Hq, T, D]
    k_shape = key.shape_expr  # [B, Hkv, T, D]
    cache_shape = past_key.shape_expr  # [S, L, B, Hkv, D]
    num_q_heads = _constant(q_shape[1], "the query head count")
    num_kv_heads = _constant(k_shape[1], "the KV head count")
    head_dim = _constant(q_shape[3], "head_dim")
    num_new = q_shape[2].constant_value() if q_shape[2].is_constant else None
    plan = plan_launch(
        batch=1,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_new=num_new,
        head_dim=head_dim,
        cache_slots=0,
        num_splits=1,
    )
    groups = num_q_heads // num_kv_heads
    kernel = compile_fitting(
        float_type=_triton_type(_FLOAT_TYPES, query.dtype, "query"),
        mask_type=_triton_type(_MASK_TYPES, tree_mask.dtype, "tree_mask"),
        lengths_type=_triton_type(_LENGTH_TYPES, cache_lengths.dtype, "cache_lengths"),
        num_kv_heads=num_kv_heads,
        groups=groups,
        head_dim=head_dim,
        scale=scale,
        plan=plan,
        window=int(window),
        softcap=float(softcap),
        target=build_target(),
    )
    grid_x, grid_y, grid_z = launch_grid(kernel.plan, batch=q_shape[0], num_kv_heads=num_kv_heads, rows=q_shape[2] * groups, cdiv=trtp.cdiv)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = grid_x
    launch.grid_y = grid_y
    launch.grid_z = grid_z
    launch.block_x = kernel.num_warps * 32
    launch.shared_mem = kernel.shared_mem
    scalars = scalar_arguments(q_shape, k_shape, cache_shape, layer=layer)  # kernel order, after the 8 input pointers
    extra_args = trtp.SymIntExprs(len(scalars))
    for i, value_expr in enumerate(scalars):
        extra_args[i] = trtp.SymInt32(value_expr)
    log.info(
        "%s: AOT kernel %s (%d params, %d warps, %d B shared) for layer %d (window %d, softcap %g)",
        PLUGIN_ID,
        kernel.name,
        kernel.num_params,
        kernel.num_warps,
        kernel.shared_mem,
        layer,
        window,
        softcap,
    )
    return kernel.name, kernel.ptx, launch, extra_args
