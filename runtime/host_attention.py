"""Tree attention on the host, over the committed cache where it lies (``host_attention.c``).

A step graph copies each layer's bound cache three times (the layer's ``Gather`` out of the stacked
slot-major input, the ``Transpose`` to head-major, the key scatter) before its ``Attention`` reads it;
the copies grow with the context. This kernel reads the cache in place and the step's own keys from
where the graph left them, and is exact by construction: a query sums its visible keys in position
order with the same instructions wherever a key comes from, so a verify step equals plain steps bit
for bit without key slots (``host_attention.c`` says why). The native step (``native_step.c``) calls it for
every layer; this module runs it alone, for its tests and measurements.

The kernel is compiled into the native step's library (``native_library``: built with the package, for the best
instruction set the CPU runs); here it runs on one thread.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime import native_library


def cpu_name() -> str:
    """This machine's CPU as /proc/cpuinfo names it (the benchmark scripts print it beside every figure)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@dataclass(frozen=True)
class Shapes:
    heads: int  # query heads Hq
    kv_heads: int  # key/value heads Hkv (Hq a multiple of it)
    head_dim: int  # D
    scale: float  # score scale, usually D ** -0.5


class HostAttention:
    """The compiled kernel; ``__call__`` runs one layer of one step."""

    def __init__(self):
        lib = native_library.load().cdll  # NativeUnavailable where the library cannot be had
        fn = lib.medusa_tree_attention
        fn.restype = ctypes.c_int
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [i, i, i, i, i, ctypes.c_float, p, p, p, p, p, i64, i64, p, p, p, p]
        self._fn = fn
        self._need = lib.medusa_tree_attention_scratch
        self._need.restype, self._need.argtypes = i64, [i, i, i64, i]
        self._scratch = np.zeros(0, dtype=np.float32)

    def scratch(self, batch_max_length: int, tokens: int) -> int:
        """The address of a scratch buffer large enough for a step of ``tokens`` over ``batch_max_length`` slots."""
        need = self._need(1, tokens, batch_max_length, 1)  # floats, as host_attention.c sizes them for one thread
        if self._scratch.size < need:
            self._scratch = np.zeros(max(need, 2 * self._scratch.size), dtype=np.float32)
        return self._scratch.ctypes.data

    def raw(self, *args) -> int:
        """The C function itself, addresses and strides given (``SegmentedStep``'s hot path; ``__call__`` checks
        its arguments): (B, T, Hq, Hkv, D, scale, q, k, v, cache_k, cache_v, slot_stride, row_stride, mask,
        lengths, out, scratch); strides in floats; returns non-zero on bad head counts."""
        return self._fn(*args)

    def __call__(
        self,
        shapes: Shapes,
        q: int,  # address of float32 [B, Hq, T, D]
        k: int,  # address of float32 [B, Hkv, T, D]
        v: int,  # address of float32 [B, Hkv, T, D]
        cache_k: np.ndarray,  # float32 (S, ..., B, Hkv, D): the layer's slots, strided (a view of the cache)
        cache_v: np.ndarray,
        mask: np.ndarray,  # uint8/bool [B, T, T]
        lengths: np.ndarray,  # int64 [B]
        out: int,  # address of float32 [B, T, Hq * D]
        batch: int,
        tokens: int,
    ) -> None:
        for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
            if c.dtype != np.float32 or c.strides[-1] != 4 or c.strides[-2] != 4 * shapes.head_dim:
                raise ValueError(f"{name}: float32 (S, B, Hkv, D) with contiguous heads, got {c.dtype} strides {c.strides}")
        if mask.dtype not in (np.uint8, np.bool_) or not mask.flags.c_contiguous or mask.shape != (batch, tokens, tokens):
            raise ValueError(f"mask: contiguous uint8/bool {(batch, tokens, tokens)}, got {mask.dtype} {mask.shape}")
        if lengths.dtype != np.int64 or not lengths.flags.c_contiguous or lengths.shape != (batch,):
            raise ValueError(f"lengths: contiguous int64 ({batch},), got {lengths.dtype} {lengths.shape}")
        scratch = self.scratch(int(lengths.max()), tokens)
        slot_stride, row_stride = cache_k.strides[0] // 4, cache_k.strides[-3] // 4
        if cache_v.strides != cache_k.strides:
            raise ValueError("cache_k and cache_v: one layout")
        rc = self._fn(
            batch, tokens, shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.scale,
            q, k, v, cache_k.ctypes.data, cache_v.ctypes.data, slot_stride, row_stride,
            mask.ctypes.data, lengths.ctypes.data, out, scratch,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"host attention: {shapes.heads} query heads are not a multiple of {shapes.kv_heads} key/value heads")
