"""The step of a Llama-pattern engine run by one C function (``native_step.c``), not by a graph runtime.

``native_weights.read_weights`` reads the weights out of the engine's own step graph and checks them.
``NativeStep`` packs the weights once (``pack``: blocks of 32 outputs, each block's K rows contiguous)
and runs a step into caller-owned outputs. The C code is batch-invariant (``native_step.c`` says how),
so a verify step gives each node its plain-step logits bit for bit without key slots.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np

from medusa_trt.runtime import host_attention
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.native_weights import Linear, Weights

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("native_step.c"), host_attention.SOURCE)
FLAGS = (*host_attention.FLAGS, "-fopenmp")
BLOCK, VECTOR = 32, 16  # outputs per packed block (native_step.c's BLOCK), and per vector
MAX_TOPK = 64  # most successors native_step.c ranks



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


class _Linear(ctypes.Structure):  # native_step.c's linear_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("int8", "k", "n", "kpad")),
        *((n, ctypes.c_void_p) for n in ("w", "scale", "colsum")),
        ("tiny", ctypes.c_float),
        ("divisor", ctypes.c_float),
    ]


_TABLE = ctypes.POINTER(ctypes.c_void_p)  # a C array of pointers, one a layer


class _Model(ctypes.Structure):  # native_step.c's model_t
    _fields_ = [
        *((n, ctypes.c_int32) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "pad")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((n, ctypes.c_void_p) for n in ("inv_freq", "embed", "norm_final", "lm_head")),
        *((n, _TABLE) for n in ("norm_in", "norm_post", "qkv", "o", "gate_up", "down")),
    ]


class _Work(ctypes.Structure):  # native_step.c's work_t
    _fields_ = [(n, ctypes.c_void_p) for n in ("x", "h", "qkv", "q", "k", "v", "attn", "gu", "act", "rot", "att_scratch", "xq", "xs")]


def load_library(path: Path | None = None) -> ctypes.CDLL:
    """The compiled step (built on first use for this machine; ``path``: a build of one's own)."""
    path = path or host_attention.library_path(SOURCES, FLAGS)
    if not path.is_file():
        host_attention.build(path, SOURCES, FLAGS)
    return ctypes.CDLL(str(path))


def run_linear(m: Linear, x: np.ndarray, threads: int | None = None) -> np.ndarray:
    """``x`` (..., K) through one weight matmul as the step computes it: (..., N) float32 (tests, checks)."""
    lib = load_library()
    lib.medusa_native_threads(threads or 0)
    k, n = m.shape
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    y = np.zeros((rows.shape[0], n), dtype=np.float32)
    keep = []
    view = NativeStep._linear_view(m, keep)
    xq, xs = np.zeros(rows.shape[0] * view.kpad, dtype=np.uint8), np.zeros(rows.shape[0], dtype=np.float32)
    work = _Work(xq=xq.ctypes.data, xs=xs.ctypes.data)
    lib.medusa_native_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.medusa_native_linear(ctypes.byref(view), ctypes.byref(work), rows.ctypes.data, rows.shape[0], y.ctypes.data)
    return y.reshape(*np.shape(x)[:-1], n)


class NativeStep:
    """The packed weights, the compiled step and its scratch for up to ``rows`` rows (batch x tokens) over
    ``slots`` cache slots a row."""

    def __init__(self, weights: Weights, *, rows: int, slots: int, threads: int | None = None, library: Path | None = None):
        lib = load_library(library)
        self._lib = lib
        self._fn = lib.medusa_native_step
        self._fn.restype = ctypes.c_int
        p, i = ctypes.c_void_p, ctypes.c_int
        self._fn.argtypes = [p, p, i, i, p, p, p, p, p, p, p, p, p, p, p, p, i]
        lib.medusa_native_threads.restype = ctypes.c_int
        self.threads = lib.medusa_native_threads(threads or 0)
        self.dims = d = weights.dims
        self._keep: list = [weights.inv_freq, weights.embed, weights.norm_final, *weights.norm_in, *weights.norm_post]
        linears = {k: [self._linear(m) for m in getattr(weights, k)] for k in ("qkv", "o", "gate_up", "down")}
        lm = self._linear(weights.lm_head)
        self.int8 = weights.lm_head.int8 or any(m.int8 for k in linears for m in getattr(weights, k))

        def table(items):
            t = (ctypes.c_void_p * len(items))(*(a.ctypes.data if isinstance(a, np.ndarray) else ctypes.addressof(a) for a in items))
            self._keep.append(t)
            return ctypes.cast(t, _TABLE)

        self._model = _Model(
            d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.vocab, 0, d.eps, d.scale,
            weights.inv_freq.ctypes.data, weights.embed.ctypes.data, weights.norm_final.ctypes.data, ctypes.addressof(lm),
            table(weights.norm_in), table(weights.norm_post), *(table(linears[k]) for k in ("qkv", "o", "gate_up", "down")),
        )  # fmt: skip
        qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
        sizes = dict(x=d.hidden, h=d.hidden, qkv=qkv, q=d.heads * d.head_dim, k=d.kv_heads * d.head_dim,
                     v=d.kv_heads * d.head_dim, attn=d.heads * d.head_dim, gu=2 * d.inter, act=d.inter, rot=d.head_dim)  # fmt: skip
        self._work_arrays = {k: np.zeros(rows * n, dtype=np.float32) for k, n in sizes.items()}
        # host_attention.c's RB rows of scores, one set a thread
        self._work_arrays["att_scratch"] = np.zeros(self.threads * 4 * (slots + 2 * rows), dtype=np.float32)
        widest = max(-(-k // 4) * 4 for k in (d.hidden, d.heads * d.head_dim, d.inter))  # the int8 linears' padded K
        self._work_arrays["xq"] = np.zeros(rows * widest, dtype=np.uint8)
        self._work_arrays["xs"] = np.zeros(rows, dtype=np.float32)
        self._work = _Work(**{k: a.ctypes.data for k, a in self._work_arrays.items()})
        self.rows, self.slots = rows, slots

    def _linear(self, m: Linear) -> _Linear:
        return self._linear_view(m, self._keep)

    @staticmethod
    def _linear_view(m: Linear, keep: list) -> _Linear:
        """The C view of one weight matmul, its packed arrays kept alive in ``keep``."""
        k, n = m.shape
        if not m.int8:
            packed = pack(m.weight)
            keep.append(packed)
            view = _Linear(0, k, n, k, packed.ctypes.data, None, None, 0.0, 1.0)
        else:
            packed = pack_int8(m.weight)
            colsum = (128 * m.weight.astype(np.int32).sum(axis=0)).astype(np.int32)  # (N): the rows' zero point, taken out
            scale = np.ascontiguousarray(m.scale, dtype=np.float32)
            keep += [packed, colsum, scale]
            view = _Linear(1, k, n, -(-k // 4) * 4, packed.ctypes.data, scale.ctypes.data, colsum.ctypes.data, m.tiny, m.divisor)
        keep.append(view)
        return view

    def __call__(
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
        batch, tokens = input_ids.shape
        if batch * tokens > self.rows or int(cache_lengths.max()) > self.slots:
            raise EngineError(f"a step of {batch} x {tokens} tokens exceeds what backend native was sized for ({self.rows} rows)")
        k = 0 if next_topk is None else next_topk.shape[-1]
        addr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        rc = self._fn(
            ctypes.byref(self._model), ctypes.byref(self._work), batch, tokens,
            addr(input_ids), addr(position_ids), addr(tree_mask), addr(cache_lengths), addr(past_key), addr(past_value),
            addr(new_key), addr(new_value), addr(hidden), addr(logits), addr(next_ids), addr(next_topk), k,
        )  # fmt: skip
        if rc == 2:
            raise EngineError(f"input_ids outside the vocabulary (0..{self.dims.vocab - 1})")
        if rc != 0:
            raise EngineError(f"backend native: bad step shapes ({self.dims}, top-k {k})")
