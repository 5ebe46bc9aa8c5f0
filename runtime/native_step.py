"""The step of a Llama-pattern engine run by one C function (``native_step.c``), not by a graph runtime.

``native_weights.read_weights`` reads the weights out of the engine's own step graph and checks them.
``NativeStep`` packs the weights once (``pack``: blocks of 32 outputs, each block's K rows contiguous)
and runs a step into caller-owned outputs. The C code is batch-invariant (``native_step.c`` says how),
so a verify step gives each node its plain-step logits bit for bit without key slots.

Nothing a file says reaches C unchecked: ``native_weights`` checks every array against the dims,
``medusa_native_check_model`` checks every linear's K and N again in C, the scratch is sized by C for the
rows, slots and threads the step object was built for (``medusa_native_work_*``), and every call's arrays
are checked here (shapes, dtypes, layout) and again in C (rows, cache lengths, scratch). A step runs on the
``threads`` threads of its own pool (``native_pool.h``), whatever thread calls it, so a server's worker thread gets the
count its runtime was built with; one step at a time (a second thread's call is refused, never run over the first's
scratch). The pool's caller takes every chunk of work no other thread has started, so a busy machine or a CPU quota
below ``threads`` slows a step by the share of cores it lost, not by a scheduler's time slice a barrier.

The library comes from ``native_library.load``: built with the package, for the best instruction set the CPU runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import weakref
from pathlib import Path

import numpy as np

from medusa_trt.runtime import native_library
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEAD_CONFIDENCE,
    HEAD_LOGITS,
    HEAD_TOPK,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    MAX_SUCCESSORS,
    NEW_KEY,
    NEW_VALUE,
    NEXT_IDS,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    SUCCESSORS_OUTPUT,
    TREE_MASK,
)
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.native_weights import QK_SPANS, HeadsWeights, Linear, NativeCannotRun, Weights

log = logging.getLogger(__name__)

BLOCK, VECTOR = 32, 16  # outputs per packed block (native_step.c's BLOCK), and per vector
MAX_TOPK = MAX_SUCCESSORS  # most successors native_step.c ranks (its MAX_TOPK)


def pack(w: np.ndarray) -> np.ndarray:
    """A (K, N) weight in native_step.c's layout: N // 32 blocks of (K, 32), then the rest in blocks of (K, 16), the
    last one zero-padded past N."""
    k, n = w.shape
    wide = n // BLOCK * BLOCK
    parts = [w[:, :wide].reshape(k, -1, BLOCK).transpose(1, 0, 2).reshape(-1)]
    if wide < n:
        rest = np.zeros((k, -(-(n - wide) // VECTOR) * VECTOR), dtype=np.float32)
        rest[:, : n - wide] = w[:, wide:]
        parts.append(rest.reshape(k, -1, VECTOR).transpose(1, 0, 2).reshape(-1))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def pack_int8(w: np.ndarray) -> np.ndarray:
    """A (K, N) int8 weight in native_step.c's layout: ceil(N / 32) blocks of (Kpad / 4, 32, 4), K padded to a
    multiple of 4 and N to one of 32 with zeros: each output's 4 consecutive k's side by side (one VNNI dot)."""
    k, n = w.shape
    kpad, npad = -(-k // 4) * 4, -(-n // BLOCK) * BLOCK
    padded = np.zeros((kpad, npad), dtype=np.int8)
    padded[:k, :n] = w
    blocks = padded.reshape(kpad // 4, 4, npad // BLOCK, BLOCK).transpose(2, 0, 3, 1)  # (blocks, K / 4, 32, 4)
    return np.ascontiguousarray(blocks).reshape(-1)


def pack_nbits(m: Linear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An nbits linear (MatMulNBits' bytes, (N, blocks, block x bits / 8), with (blocks, N) scales and zero points) in
    native_step.c's layout: groups of 32 outputs, each (blocks, block / 4 quads, 32 outputs x 4 k's) of bytes, a 4-bit
    quad's outputs 16-31 in the high nibbles of outputs 0-15's bytes; and the scales and zero points as (groups, blocks,
    32). K is padded to whole blocks and N to a whole group with zeros. Unpacked a few groups at a time, so a 7B
    engine's linear never stands as a byte a value."""
    k, n = m.shape
    blocks, block = m.scale.shape[0], m.block
    groups, npad = -(-n // BLOCK), -(-n // BLOCK) * BLOCK
    per_group = blocks * block * BLOCK * m.bits // 8  # bytes
    packed = np.empty(groups * per_group, dtype=np.uint8)
    rows = m.weight.reshape(n, -1)  # (N, bytes)
    step = max(1, (8 << 20) // (BLOCK * blocks * block))  # groups a pass: about 8 MB of values
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        part = rows[g0 * BLOCK : g1 * BLOCK]
        w = np.zeros(((g1 - g0) * BLOCK, blocks * block), dtype=np.uint8)  # (outputs, K padded): values
        if m.bits == 4:
            w[: len(part), 0::2], w[: len(part), 1::2] = part & 0x0F, part >> 4
        else:
            w[: len(part)] = part
        w[:, k:] = 0  # the last block past K: zeros, whatever the file holds there
        # (groups, 2 halves, 16 outputs, blocks, quads, 4 k's) -> (groups, blocks, quads, halves, 16, 4)
        quads = w.reshape(g1 - g0, 2, 16, blocks, block // 4, 4).transpose(0, 3, 4, 1, 2, 5)
        if m.bits == 4:
            quads = quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)
        packed[g0 * per_group : g1 * per_group] = quads.reshape(-1)

    def grouped(a: np.ndarray, dtype) -> np.ndarray:  # (blocks, N) -> (groups, blocks, 32)
        out = np.zeros((blocks, npad), dtype=dtype)
        out[:, :n] = a
        return np.ascontiguousarray(out.reshape(blocks, npad // BLOCK, BLOCK).transpose(1, 0, 2))

    return packed, grouped(m.scale, np.float32), grouped(m.zero, np.uint8)


class _Linear(ctypes.Structure):  # native_step.c's linear_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("kind", "k", "n", "kpad")),
        *((n, ctypes.c_void_p) for n in ("w", "scale", "colsum")),
        ("tiny", ctypes.c_float),
        ("divisor", ctypes.c_float),
        ("block", ctypes.c_int32),
        ("blocks", ctypes.c_int32),
    ]


_TABLE = ctypes.POINTER(ctypes.c_void_p)  # a C array of pointers, one a layer


class _Model(ctypes.Structure):  # native_step.c's model_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "pad")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((n, ctypes.c_void_p) for n in ("inv_freq", "embed", "norm_final", "lm_head")),
        *((n, _TABLE) for n in ("norm_in", "norm_post", "qkv", "o", "gate_up", "down", "qkv_bias", "q_norm", "k_norm")),
        ("window", ctypes.c_void_p),
        ("qk_eps", ctypes.c_float),
        ("act", ctypes.c_int32),
        ("embed_scale", ctypes.c_float),
        ("rope_tables", ctypes.c_int32),
        ("rope_of", ctypes.c_void_p),
        *((n, _TABLE) for n in ("attn_out_norm", "mlp_out_norm")),
        ("residual_scale", ctypes.c_float),
        ("logit_divisor", ctypes.c_float),
        ("qk_norm_span", ctypes.c_int32),
        ("experts", _TABLE),
        ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float),
        ("layer_norm", ctypes.c_int32),
        ("rotary_dim", ctypes.c_int32),
        *((n, _TABLE) for n in ("norm_in_bias", "norm_post_bias")),
        ("norm_final_bias", ctypes.c_void_p),
        *((n, _TABLE) for n in ("o_bias", "sinks")),
        *((n, ctypes.c_float) for n in ("rope_factor", "act_alpha", "act_limit")),
        *((n, _TABLE) for n in ("gate_up_bias", "down_bias")),
        ("parallel_residual", ctypes.c_int32),
        ("rope_interleaved", ctypes.c_int32),
        ("qk_layer_norm", ctypes.c_int32),
        ("shared_norm", ctypes.c_int32),
    ]


class _Experts(ctypes.Structure):  # native_step.c's experts_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("experts", "top_k", "normalize", "inter", "shared_inter", "topk_first")),
        ("router", ctypes.c_void_p),
        *((n, _TABLE) for n in ("gate_up", "down")),
        *((n, ctypes.c_void_p) for n in ("shared_gate_up", "shared_down", "shared_gate", "router_bias")),
        *((n, _TABLE) for n in ("gate_up_bias", "down_bias")),
    ]


# native_step.c's ACT_* (native_weights.Weights.act)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu2": 3, "swiglu_limit": 4, "gelu_ungated": 5}


class _Heads(ctypes.Structure):  # native_step.c's heads_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("hidden", "heads", "draft_vocab", "top_k", "reads_roots", "vocab")),
        ("eps", ctypes.c_float),
        *((n, ctypes.c_void_p) for n in ("embed", "bias", "fused", "lm")),
    ]


class _Work(ctypes.Structure):  # native_step.c's work_t (medusa_native_work_init fills it)
    _fields_ = [
        *((n, ctypes.c_int64) for n in ("rows", "slots", "threads", "att_floats")),
        *((n, ctypes.c_void_p) for n in ("x", "h", "qkv", "q", "k", "v", "attn", "gu", "act", "rot", "att_scratch", "xq", "xs")),
        *((n, ctypes.c_void_p) for n in ("bs", "bsum")),
        ("max_blocks", ctypes.c_int64),
        ("pool", ctypes.c_void_p),
        *((n, ctypes.c_void_p) for n in ("moe_logits", "moe_x", "moe_y", "moe_sum", "moe_w", "moe_ids", "moe_rows", "moe_rw")),
        ("par", ctypes.c_void_p),
    ]


# native_step.c's error codes
_ERRORS = {
    1: "step arrays of shapes the engine does not have",
    2: "input_ids outside the vocabulary",
    3: "cache lengths below 0 or past the cache",
    4: "a step larger than backend native was sized for",
    5: "weights whose shapes do not fit one another",
    6: "scratch smaller than the step needs",
    7: "a step already running on this backend in another thread: step one at a time",
    8: "its threads could not be started: pass fewer threads",
    9: "position_ids before their row's committed cache (a node's position is at least its row's cache length)",
}
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _functions(cap: str | None = None) -> tuple[ctypes.CDLL, str]:
    """The library (at or below the instruction set ``cap``) with its functions' signatures declared."""
    return _declared(native_library.load(cap))


@functools.cache
def _declared(library: native_library.Library) -> tuple[ctypes.CDLL, str]:
    lib = library.cdll
    signatures = {
        "medusa_native_step": (_I, [_P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I]),
        "medusa_native_linear": (_I, [_P, _P, _P, _I64, _P, _I64]),
        "medusa_native_check_model": (_I, [_P]),
        "medusa_native_work_floats": (_I64, [_P, _I64, _I64, _I]),
        "medusa_native_work_bytes": (_I64, [_P, _I64]),
        "medusa_native_work_init": (_I, [_P, _P, _P, _I64, _P, _I64, _I64, _I64, _I]),
        "medusa_native_default_threads": (_I, []),
        "medusa_native_work_free": (None, [_P]),
        "medusa_native_work_warm": (_I, [_P, _P, _I64]),
        "medusa_pool_new": (_P, [_I]),
        "medusa_pool_free": (None, [_P]),
        "medusa_native_heads": (_I, [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64]),
        "medusa_native_heads_check": (_I, [_P]),
        "medusa_native_heads_floats": (_I64, [_P, _I64]),
        "medusa_native_heads_bytes": (_I64, [_P, _I64]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, library.isa


def load_library(cap: str | None = None) -> ctypes.CDLL:
    """The compiled step for this CPU (``native_library.load``; ``NativeUnavailable`` where it cannot be had)."""
    return _functions(cap)[0]


CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" (or "max PERIOD"), a container's CPU limit


def cpu_quota(path: Path = CPU_MAX) -> int | None:
    """The CPUs a cgroup v2 quota allows this process, rounded up (None: no quota, or none readable)."""
    try:
        quota, period = path.read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period))) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def default_threads(lib: ctypes.CDLL) -> int:
    """The CPUs this process may run on (its affinity mask), capped by a container's CPU quota."""
    return min(lib.medusa_native_default_threads(), cpu_quota() or os.cpu_count() or 1)


def _threads(threads: int | None, lib: ctypes.CDLL) -> int:
    n = threads or default_threads(lib)
    if not 1 <= n <= 1024:
        raise EngineError(f"backend native: {threads} threads; pass 1 to 1024")
    return n


def _linear_view(m: Linear, keep: list) -> _Linear:
    """The C view of one weight matmul, its packed arrays kept alive in ``keep``."""
    k, n = m.shape
    if m.bits:
        packed, scale, zero = pack_nbits(m)
        keep += [packed, scale, zero]
        blocks = m.scale.shape[0]
        view = _Linear(m.bits, k, n, blocks * m.block, packed.ctypes.data, scale.ctypes.data, zero.ctypes.data, 0.0, 1.0, m.block, blocks)
    elif not m.int8:
        packed = pack(m.weight)
        keep.append(packed)
        view = _Linear(0, k, n, k, packed.ctypes.data, None, None, 0.0, 1.0)
    else:
        packed, colsum, scale = _int8_arrays(m)
        keep += [packed, colsum, scale]
        view = _Linear(1, k, n, -(-k // 4) * 4, packed.ctypes.data, scale.ctypes.data, colsum.ctypes.data, m.tiny, m.divisor)
        view.arrays = (packed, colsum, scale)  # what it points into (NativeStep.lm_prefix shares them)
    view.packed = packed  # its weights, the bulk of what it reads (NativeStep.read_ahead)
    keep.append(view)
    return view


def _int8_arrays(m: Linear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int8 linear's arrays as the C code reads them: packed weights, (N) column sums x 128, (N) column scales."""
    n = m.shape[1]
    packed = pack_int8(m.weight)
    colsum = (128 * m.weight.astype(np.int32).sum(axis=0)).astype(np.int32)  # (N): the rows' zero point, taken out
    scale = np.ascontiguousarray(m.scale, dtype=np.float32)
    if scale.shape != (n,):
        raise EngineError(f"backend native: an int8 linear of {n} outputs with {scale.size} column scales")
    return packed, colsum, scale


class LinearRun:
    """One weight matmul ``m`` as the step computes it, on up to ``rows`` rows, on a pool of its own kept between calls
    (tests, and ``scripts/sums_floor.py``, which times it); ``close`` stops its threads."""

    def __init__(self, m: Linear, rows: int, threads: int | None = None, isa: str | None = None):
        self._lib = lib = load_library(isa)
        self.shape = m.shape  # (K, N)
        self.rows = rows
        self._keep: list = []
        self._view = view = _linear_view(m, self._keep)
        self._xq, xs = np.zeros(rows * view.kpad, dtype=np.uint8), np.zeros(rows, dtype=np.float32)
        bs, bsum = np.zeros((rows, view.blocks), dtype=np.float32), np.zeros((rows, view.blocks), dtype=np.int32)
        self._keep += [xs, bs, bsum]
        self.threads = _threads(threads, lib)
        self._pool = lib.medusa_pool_new(self.threads)
        if not self._pool:
            raise EngineError(f"backend native: {_ERRORS[8]}")
        self._work = _Work(rows=rows, threads=self.threads, xq=self._xq.ctypes.data, xs=xs.ctypes.data, pool=self._pool,
                           bs=bs.ctypes.data, bsum=bsum.ctypes.data, max_blocks=view.blocks)  # fmt: skip

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x`` (..., K) at most ``rows`` rows: (..., N) float32, into ``out`` (rows, N) where given."""
        k, n = self.shape
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
        if not 0 < rows.shape[0] <= self.rows:
            raise EngineError(f"backend native: {rows.shape[0]} rows through a linear run sized for {self.rows}")
        y = np.zeros((rows.shape[0], n), dtype=np.float32) if out is None else out[: rows.shape[0]]
        if y.shape != (rows.shape[0], n) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise EngineError(f"backend native: a linear run's output must be contiguous float32 ({rows.shape[0]}, {n})")
        if not self._pool:
            raise EngineError("backend native: this linear run is closed")
        rc = self._lib.medusa_native_linear(ctypes.byref(self._view), ctypes.byref(self._work), rows.ctypes.data,
                                            rows.shape[0], y.ctypes.data, self._xq.size)  # fmt: skip
        if rc:
            raise EngineError(f"backend native: {_ERRORS.get(rc, rc)}")
        return y.reshape(*np.shape(x)[:-1], n)

    def close(self) -> None:
        if getattr(self, "_pool", None):  # a constructor that raised has none
            self._lib.medusa_pool_free(self._pool)
            self._pool = None

    def __del__(self):
        self.close()


def run_linear(m: Linear, x: np.ndarray, threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """``x`` (..., K) through one weight matmul as the step computes it: (..., N) float32 (tests, checks)."""
    run = LinearRun(m, math.prod(np.shape(x)[:-1]), threads, isa)
    try:
        return run(x)
    finally:
        run.close()


def _stop(free, work, keep: list) -> None:
    """A step object's finalizer: its pool's threads stop (and are joined) while ``keep``, every array they may read
    (weights, a read-ahead's region), is still held."""
    free(work)
    del keep  # released only now, after the threads are joined


def _expect(name: str, a: np.ndarray | None, dtype, shape: tuple) -> None:
    """A step array as the C code reads it: this dtype and shape, C-contiguous."""
    if a is None or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        found = "None" if a is None else f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' strided'}"
        raise EngineError(f"backend native: {name} must be contiguous {np.dtype(dtype)} {shape}, got {found}")


class NativeStep:
    """The packed weights, the compiled step and its scratch for up to ``rows`` rows (batch x tokens) over
    ``slots`` cache slots a row, on ``threads`` threads (default ``default_threads``: the CPUs this process may use),
    with the library of the best instruction set at or below ``isa`` (default ``$MEDUSA_TRT_CPU_ISA``). Its threads
    stop when it is garbage collected."""

    def __init__(
        self, weights: Weights, *, rows: int, slots: int, threads: int | None = None, isa: str | None = None, consume: bool = False
    ):
        """``consume``: each layer's linears leave ``weights`` as they are packed (their entries become None), so a
        caller that drops ``weights`` after holds the weights once while they are packed, not twice."""
        lib, self.isa = _functions(isa)
        self._fn, self._lib = lib.medusa_native_step, lib
        self.threads = _threads(threads, lib)
        self.dims = d = weights.dims
        self._keep: list = [weights.inv_freq, weights.embed, weights.norm_final]
        optional = (
            *weights.norm_in,
            *weights.norm_post,
            *weights.qkv_bias,
            *weights.q_norm,
            *weights.k_norm,
            *weights.attn_out_norm,
            *weights.mlp_out_norm,
            *weights.norm_in_bias,
            *weights.norm_post_bias,
            weights.norm_final_bias,
            *weights.o_bias,
            *weights.sinks,
            *weights.gate_up_bias,
            *weights.down_bias,
        )
        self._keep += [a for a in optional if a is not None]
        window = np.ascontiguousarray(weights.windows, dtype=np.int32)
        rope_of = np.ascontiguousarray(weights.rope_of, dtype=np.int32)
        self._keep += [window, rope_of]
        view = lambda m: None if m is None else _linear_view(m, self._keep)  # noqa: E731
        every = [weights.lm_head, *(m for k in ("qkv", "o", "gate_up", "down") for m in getattr(weights, k) if m is not None)]
        every += [m for e in weights.experts if e is not None for _, m, _ in e.linears()]
        self.int8, self.bits = any(m.int8 for m in every), max(m.bits for m in every)
        del every

        def views(items: list) -> list:  # each linear's C view; with consume, the linear then leaves ``items``
            out = []
            for i, m in enumerate(items):
                out.append(view(m))
                if consume:
                    items[i] = None
            return out

        linears = {k: views(getattr(weights, k)) for k in ("qkv", "o", "gate_up", "down")}
        lm = _linear_view(weights.lm_head, self._keep)
        self._lm = lm if lm.kind == 1 else None  # int8: the heads may share its first outputs (lm_prefix)

        def table(items):  # a C array of pointers: an array's data, a linear_t's address, or NULL for None
            address = lambda a: None if a is None else a.ctypes.data if isinstance(a, np.ndarray) else ctypes.addressof(a)  # noqa: E731
            t = (ctypes.c_void_p * len(items))(*(address(a) for a in items))
            self._keep.append(t)
            return ctypes.cast(t, _TABLE)

        experts = [None if e is None else self._experts(e, view, table) for e in weights.experts or [None] * d.layers]
        self._model = _Model(
            d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.vocab, 0, d.eps, d.scale,
            weights.inv_freq.ctypes.data, weights.embed.ctypes.data, weights.norm_final.ctypes.data, ctypes.addressof(lm),
            table(weights.norm_in), table(weights.norm_post), *(table(linears[k]) for k in ("qkv", "o", "gate_up", "down")),
            table(weights.qkv_bias), table(weights.q_norm), table(weights.k_norm), window.ctypes.data, weights.qk_eps,
            ACTIVATIONS[weights.act], weights.embed_scale, weights.inv_freq.shape[0], rope_of.ctypes.data,
            table(weights.attn_out_norm), table(weights.mlp_out_norm), weights.residual_scale, weights.logit_divisor,
            QK_SPANS.index(weights.qk_norm_span), table(experts), weights.attn_softcap, weights.final_softcap, int(weights.layer_norm),
            weights.rotary_dim or d.head_dim, table(list(weights.norm_in_bias) or [None] * d.layers),
            table(list(weights.norm_post_bias) or [None] * d.layers),
            None if weights.norm_final_bias is None else weights.norm_final_bias.ctypes.data,
            table(list(weights.o_bias) or [None] * d.layers), table(list(weights.sinks) or [None] * d.layers),
            weights.rope_factor, weights.act_alpha, weights.act_limit if weights.act_limit > 0 else 1.0,
            table(list(weights.gate_up_bias) or [None] * d.layers), table(list(weights.down_bias) or [None] * d.layers),
            int(weights.parallel_residual), int(weights.rope_interleaved), int(weights.qk_layer_norm), int(weights.shared_norm),
        )  # fmt: skip
        model = ctypes.byref(self._model)
        if lib.medusa_native_check_model(model):
            raise EngineError(f"backend native: weights whose shapes do not fit one another ({d})")
        floats = lib.medusa_native_work_floats(model, rows, slots, self.threads)
        nbytes = lib.medusa_native_work_bytes(model, rows)
        if floats < 0 or nbytes < 0:
            raise EngineError(f"backend native: cannot size a step of {rows} rows over {slots} slots")
        self._arena = np.zeros(floats, dtype=np.float32)
        self._bytes = np.zeros(nbytes, dtype=np.uint8)
        self._work = _Work()
        rc = lib.medusa_native_work_init(
            model, ctypes.byref(self._work), self._arena.ctypes.data, floats, self._bytes.ctypes.data, nbytes, rows, slots, self.threads
        )
        if rc:
            raise EngineError(f"backend native: {_ERRORS.get(rc, rc)}")
        weakref.finalize(self, _stop, lib.medusa_native_work_free, ctypes.byref(self._work), self._keep)
        self.rows, self.slots = rows, slots
        # what a step reads whatever its tokens: every packed weight and norm (the embedding: only its tokens' rows)
        self.weight_bytes = sum(a.nbytes for a in self._keep if isinstance(a, np.ndarray) and a is not weights.embed)

    def _experts(self, e, view, table) -> _Experts:
        """The C view of one layer's routed experts (``native_experts.Experts``), kept alive with the step."""
        shared = [view(m) for m in (e.shared_gate_up, e.shared_down, e.shared_gate)]
        address = lambda v: None if v is None else ctypes.addressof(v)  # noqa: E731
        biases = [b for b in (e.router_bias, *e.gate_up_bias, *e.down_bias) if b is not None]
        self._keep += biases
        c = _Experts(e.count, e.top_k, int(e.normalize), e.inter, e.shared_inter, int(e.topk_first), address(view(e.router)),
                     table([view(m) for m in e.gate_up]), table([view(m) for m in e.down]), *map(address, shared),
                     None if e.router_bias is None else e.router_bias.ctypes.data,
                     table(list(e.gate_up_bias) or [None] * e.count), table(list(e.down_bias) or [None] * e.count))  # fmt: skip
        self._keep.append(c)
        return c

    def lm_prefix(self, m: Linear, keep: list) -> _Linear | None:
        """A C view of this step's lm_head's first outputs where ``m`` is them bit for bit (its arrays kept alive in
        ``keep``), else None. An int8-channel engine's heads project with the base lm_head's draft-vocabulary rows: they
        then hold no copy of them, and find them in cache, as the step's lm_head reads its first outputs last."""
        if self._lm is None or not m.int8:
            return None
        lm = self._lm
        packed, colsum, scale = lm.arrays
        k, n = m.shape
        same_rows = np.float32(m.tiny) == np.float32(lm.tiny) and np.float32(m.divisor) == np.float32(lm.divisor)
        if k != lm.k or not 0 < n <= lm.n or n % BLOCK or not same_rows:
            return None
        own = _int8_arrays(m)
        if not all(np.array_equal(mine, theirs[: mine.size]) for mine, theirs in zip(own, (packed, colsum, scale))):
            return None
        view = _Linear(1, k, n, lm.kpad, packed.ctypes.data, scale.ctypes.data, colsum.ctypes.data, lm.tiny, lm.divisor)
        keep += [packed, colsum, scale, view]
        return view

    def read_ahead(self, region: np.ndarray | None) -> bool:
        """After each step that follows a heads call, the pool's workers load ``region`` (the heads' fused weights,
        which the step's own weights push out of the caches) while the caller commits the step, and the next call of
        this step object takes them back within one 64 KB chunk. Reads only: no number changes. ``region`` is held
        as long as this object; None: nothing read ahead. False where nothing is read ahead (None, one thread, or a
        region past the 8 MB a read-ahead takes)."""
        if region is not None and not any(region is a for a in self._keep):
            self._keep.append(region)
        base, size = (None, 0) if region is None else (region.ctypes.data, region.nbytes)
        rc = self._lib.medusa_native_work_warm(ctypes.byref(self._work), base, size)
        if rc == 1:
            log.debug("backend native: a %.1f MB region is past what a read-ahead takes", region.nbytes / 2**20)
            return False
        if rc != 0:
            raise EngineError(f"backend native: {_ERRORS.get(rc, rc)} (read-ahead)")
        return region is not None and self.threads > 1

    exact = True  # batch-invariant: every verify step is a plain step bit for bit

    def describe(self) -> str:
        return f"{self.isa}, {self.threads} thread{'s' if self.threads > 1 else ''}"

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        """The step on named host arrays (``host_backend.HostKernel``): a step without ``logits`` skips the lm_head."""
        logits = arrays.get(LOGITS)
        self.step(
            arrays[INPUT_IDS], arrays[POSITION_IDS], arrays[TREE_MASK], arrays[CACHE_LENGTHS], arrays[PAST_KEY], arrays[PAST_VALUE],
            arrays[NEW_KEY], arrays[NEW_VALUE], arrays[HIDDEN], logits,
            arrays.get(NEXT_IDS) if logits is not None else None, arrays.get(SUCCESSORS_OUTPUT) if logits is not None else None,
        )  # fmt: skip

    def step(
        self,
        input_ids: np.ndarray,  # int64 (B, T)
        position_ids: np.ndarray,  # int64 (B, T)
        tree_mask: np.ndarray,  # bool (B, T, T)
        cache_lengths: np.ndarray,  # int64 (B)
        past_key: np.ndarray,  # float32 (S, L, B, Hkv, D), contiguous
        past_value: np.ndarray,
        new_key: np.ndarray,  # float32 (T, L, B, Hkv, D), written
        new_value: np.ndarray,
        hidden: np.ndarray,  # float32 (B, T, H), written
        logits: np.ndarray | None,  # float32 (B, T, V), written (None: the lm_head is skipped)
        next_ids: np.ndarray | None,  # int64 (B, T)
        next_topk: np.ndarray | None,  # int64 (B, T, k)
    ) -> None:
        d = self.dims
        if input_ids.ndim != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise EngineError(f"backend native: input_ids must be (batch, tokens), got {input_ids.shape}")
        batch, tokens = input_ids.shape
        if batch * tokens > self.rows:
            raise EngineError(f"a step of {batch} x {tokens} tokens exceeds what backend native was sized for ({self.rows} rows)")
        slots = past_key.shape[0] if past_key.ndim == 5 else -1
        kv = (d.layers, batch, d.kv_heads, d.head_dim)
        for name, a, dtype, shape in (
            ("input_ids", input_ids, np.int64, (batch, tokens)),
            ("position_ids", position_ids, np.int64, (batch, tokens)),
            ("tree_mask", tree_mask, np.bool_, (batch, tokens, tokens)),
            ("cache_lengths", cache_lengths, np.int64, (batch,)),
            ("past_key", past_key, np.float32, (slots, *kv)),
            ("past_value", past_value, np.float32, (slots, *kv)),
            ("new_key", new_key, np.float32, (tokens, *kv)),
            ("new_value", new_value, np.float32, (tokens, *kv)),
            ("hidden", hidden, np.float32, (batch, tokens, d.hidden)),
        ):
            _expect(name, a, dtype, shape)
        k = 0
        if logits is not None:
            _expect("logits", logits, np.float32, (batch, tokens, d.vocab))
            _expect("next_ids", next_ids, np.int64, (batch, tokens))
            if next_topk is not None:
                k = next_topk.shape[-1]
                _expect("next_topk", next_topk, np.int64, (batch, tokens, k))
                if k > MAX_TOPK:
                    raise EngineError(f"backend native ranks at most {MAX_TOPK} successors, not {k}")
        if cache_lengths.min() < 0 or cache_lengths.max() > min(slots, self.slots):
            raise EngineError(f"backend native: cache lengths {cache_lengths.tolist()} outside 0..{min(slots, self.slots)}")
        addr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        rc = self._fn(
            ctypes.byref(self._model), ctypes.byref(self._work), batch, tokens,
            addr(input_ids), addr(position_ids), addr(tree_mask), addr(cache_lengths), addr(past_key), addr(past_value), slots,
            addr(new_key), addr(new_value), addr(hidden), addr(logits), addr(next_ids) if logits is not None else None,
            addr(next_topk) if logits is not None else None, k,
        )  # fmt: skip
        if rc == 2:
            raise EngineError(f"input_ids outside the vocabulary (0..{d.vocab - 1})")
        if rc != 0:
            raise EngineError(f"backend native: {_ERRORS.get(rc, rc)} (batch {batch}, tokens {tokens}, top-k {k})")


class NativeHeads:
    """The Medusa heads (``native_weights.read_heads``) computed by ``medusa_native_heads`` on a ``NativeStep``'s
    threads, as a ``host_backend.HostHeads`` on named arrays, for up to ``max_batch`` rows. ``NativeCannotRun`` where
    they do not fit the engine's metadata (its heads then run on ONNX Runtime)."""

    confidence = True  # HEAD_CONFIDENCE where the arrays have it: computed while the logits are in cache

    def __init__(
        self,
        weights: HeadsWeights,
        step: NativeStep,
        *,
        hidden: int,
        heads: int,
        draft_vocab: int,
        top_k: int,
        max_batch: int,
        share_lm_head: bool = True,  # False: a packed copy of their own even where the step's lm_head rows are theirs (A/B)
        read_ahead: bool = True,  # False: their fused weights are not read ahead after each step (A/B)
    ):
        wanted = dict(hidden=hidden, heads=heads, draft_vocab=draft_vocab, top_k=top_k)
        found = dict(hidden=weights.hidden, heads=weights.heads, draft_vocab=weights.lm.shape[1], top_k=weights.top_k)
        if wrong := [f"{k} {found[k]} (metadata: {wanted[k]})" for k in found if found[k] != wanted[k]]:
            raise NativeCannotRun(f"heads graph of {', '.join(wrong)}", "heads that do not fit the metadata")
        if max_batch * weights.heads > step.rows:
            raise NativeCannotRun(f"{max_batch} x {weights.heads} heads rows past the step's {step.rows}", "too many heads rows")
        lib, _ = _functions(step.isa)
        self._fn, self._step, self.reads_roots = lib.medusa_native_heads, step, weights.reads_roots
        self._keep: list = [weights.bias]
        embed = weights.embed
        if embed is not None:
            self._keep.append(embed)
        fused = _linear_view(weights.fused, self._keep)
        lm = step.lm_prefix(weights.lm, self._keep) if share_lm_head else None  # the step's rows where they are the heads'
        self.shares_lm_head = lm is not None
        lm = lm or _linear_view(weights.lm, self._keep)
        self._heads = _Heads(
            weights.hidden, weights.heads, weights.lm.shape[1], weights.top_k, int(embed is not None),
            0 if embed is None else embed.shape[0], weights.eps, None if embed is None else embed.ctypes.data,
            weights.bias.ctypes.data, ctypes.addressof(fused), ctypes.addressof(lm),
        )  # fmt: skip
        view = ctypes.byref(self._heads)
        if lib.medusa_native_heads_check(view):
            raise NativeCannotRun(f"heads whose shapes do not fit one another ({found})", "malformed heads")
        self.fused_weights = fused.packed  # what the step reads ahead for them
        self.reads_ahead = read_ahead and step.read_ahead(self.fused_weights)
        self._floats = np.zeros(lib.medusa_native_heads_floats(view, max_batch), dtype=np.float32)
        self._bytes = np.zeros(lib.medusa_native_heads_bytes(view, max_batch), dtype=np.uint8)
        self.shape = (weights.heads, weights.top_k, weights.lm.shape[1])  # n, K, Vd
        self.max_batch, self.hidden = max_batch, weights.hidden

    @classmethod
    def of(
        cls, weights: HeadsWeights, step: NativeStep, meta, max_batch: int, *, share_lm_head: bool = True, read_ahead: bool = True
    ) -> NativeHeads:
        """The heads an engine's metadata (``EngineMeta``) describes: its hidden size, proposal rows, draft vocabulary
        and top-k."""
        return cls(weights, step, hidden=meta.hidden_size, heads=meta.proposal_rows, draft_vocab=meta.heads_vocab,
                   top_k=meta.top_k, max_batch=max_batch, share_lm_head=share_lm_head, read_ahead=read_ahead)  # fmt: skip

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        """The heads on hidden (B, H) into HEAD_TOPK (B, n, K) and HEAD_LOGITS (B, n, Vd), and HEAD_CONFIDENCE (B, n, K)
        where the arrays have it: ``max_batch`` rows a call (more rows, such as every node of a tree, in turns of that
        many: each row's proposals are its own)."""
        hidden = np.ascontiguousarray(arrays[HIDDEN], dtype=np.float32)  # (B, H)
        batch = hidden.shape[0] if hidden.ndim == 2 else -1
        if batch < 1 or hidden.shape[1] != self.hidden:
            raise EngineError(f"backend native: heads on hidden {hidden.shape}, not (rows, {self.hidden})")
        n, k, vd = self.shape
        _expect(HEAD_TOPK, arrays.get(HEAD_TOPK), np.int64, (batch, n, k))
        _expect(HEAD_LOGITS, arrays.get(HEAD_LOGITS), np.float32, (batch, n, vd))
        confidence = arrays.get(HEAD_CONFIDENCE)
        if confidence is not None:
            _expect(HEAD_CONFIDENCE, confidence, np.float32, (batch, n, k))
        roots = None
        if self.reads_roots:
            roots = np.ascontiguousarray(arrays[NEXT_INPUT], dtype=np.int64)
            _expect(NEXT_INPUT, roots, np.int64, (batch,))
        for first in range(0, batch, self.max_batch):
            rows = slice(first, min(batch, first + self.max_batch))
            conf = None if confidence is None else confidence[rows]
            self._run(hidden[rows], None if roots is None else roots[rows], arrays[HEAD_LOGITS][rows], arrays[HEAD_TOPK][rows], conf)

    def _run(self, hidden: np.ndarray, roots: np.ndarray | None, logits: np.ndarray, topk: np.ndarray, conf: np.ndarray | None) -> None:
        """One call of at most ``max_batch`` rows, every array C-contiguous (row slices of checked arrays)."""
        rc = self._fn(
            ctypes.byref(self._heads), ctypes.byref(self._step._work), hidden.shape[0], hidden.ctypes.data,
            None if roots is None else roots.ctypes.data, logits.ctypes.data, topk.ctypes.data,
            None if conf is None else conf.ctypes.data, self._floats.ctypes.data, self._floats.size, self._bytes.ctypes.data,
            self._bytes.size,
        )  # fmt: skip
        if rc == 2:
            raise EngineError("backend native: heads' root ids outside the vocabulary")
        if rc != 0:
            raise EngineError(f"backend native: heads: {_ERRORS.get(rc, rc)} (batch {hidden.shape[0]})")
