"""Where the ONNX Runtime backend's KV cache and step outputs live: host memory or the device.

``OnnxBackend`` runs one step code over a ``StepBuffers``; two kinds exist:

* ``HostBuffers`` (CPU provider): numpy arrays allocated once at their largest size. A step binds
  views of them through IOBinding (cache slots as CPU inputs, outputs by pointer), ONNX Runtime
  writes the outputs in place, the commit is a numpy copy.
* ``DeviceBuffers`` (CUDA provider, onnxruntime-gpu): ``OrtValue`` s on the session's device,
  allocated once, flat, at their largest size. A step binds them by device address and shape
  (``IOBinding.bind_input`` / ``bind_output``, a pointer, no copy), so the cache, the logits, the
  hidden states and the new K/V never leave the device. What comes back is what the loop reads:
  next_ids and next_topk (bound to host arrays: ONNX Runtime copies them after the run),
  head_topk, and on request the rows of logits or hidden states a rule reads (a GatherND on the
  device, only those rows copied) or the whole logits (sampling rules).

Device work without torch or cupy: tiny ONNX graphs run by ONNX Runtime itself on the same device
over the same memory. The commit is GatherND (accepted nodes' new K/V) + ScatterND into the cache
with the output bound to the cache's own address: ONNX Runtime's ScatterND (CPU and CUDA kernels)
copies data to output only when they are different buffers, so the commit writes the accepted
rows alone. The lean install has no onnx package, so the graphs are written here as protobuf
bytes (the dozen fields they use). ``DeviceBuffers`` on device "cpu" runs the same code on the CPU
provider: tests hold it to ``HostBuffers`` token for token.

Ordering: every ``run_with_iobinding`` returns after its device work is done (ONNX Runtime
synchronizes the providers at the end of a run unless a run option disables it), so a commit or
gather run sees the step run's outputs, whichever stream each session uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from medusa_trt.runtime import onnx_proto as proto
from medusa_trt.runtime.contract import (
    HEAD_CONFIDENCE,
    HEAD_LOGITS,
    HEAD_TOPK,
    HIDDEN,
    LOGITS,
    NEW_KEY,
    NEW_VALUE,
    NEXT_IDS,
    PAST_KEY,
    PAST_VALUE,
    SUCCESSORS_OUTPUT,
    Proposals,
    StepOutput,
    without_logits,
)
from medusa_trt.runtime.engine import EngineMeta
from medusa_trt.runtime.onnx_proto import ELEM_TYPES, FLOAT, FLOAT16, INT64  # noqa: F401 (FLOAT, FLOAT16: for the GPU tests)

FLOAT_OUTPUTS = (LOGITS, HIDDEN, NEW_KEY, NEW_VALUE)  # stay on the device in DeviceBuffers
ID_OUTPUTS = (NEXT_IDS, SUCCESSORS_OUTPUT)  # int64, read by the loop every step: bound to host arrays
GATED = (LOGITS, NEXT_IDS, SUCCESSORS_OUTPUT)  # what a step with logits=False leaves uncomputed (exporter/logits_gate.py)


@dataclass(frozen=True)
class BufferSizes:
    """Shapes of one backend's buffers: the cache [max_context, layers, B, Hkv, D] and every output
    at B = max_batch rows of max_tokens new tokens."""

    max_batch: int
    max_context: int  # cache slots per row: the runtime's max_context and any key-slot slack (runtime/key_slots.py)
    max_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    heads_vocab: int  # columns of head_logits (the engine's draft vocabulary)
    successors: int  # k of next_topk (0: the engine has no such output)
    heads_rows: int  # proposals rows per sequence (EngineMeta.proposal_rows; 0: no heads)
    top_k: int
    dtype: type  # numpy type of the cache and float outputs

    @classmethod
    def of(cls, meta: EngineMeta, *, max_batch: int, max_context: int, dtype, successors: int) -> BufferSizes:
        return cls(
            max_batch,
            max_context,
            meta.max_tokens,
            meta.num_layers,
            meta.num_kv_heads,
            meta.head_dim,
            meta.vocab_size,
            meta.hidden_size,
            meta.heads_vocab,
            successors,
            meta.proposal_rows if meta.num_heads else 0,
            meta.top_k,
            dtype,
        )

    @property
    def kv_row(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim  # elements per slot per sequence

    def cache_shape(self, batch: int, slots: int | None = None) -> tuple[int, ...]:
        """The flat cache viewed for ``batch`` rows: its first ``slots`` slots are one contiguous block."""
        return (self.max_context if slots is None else slots, self.num_layers, batch, self.num_kv_heads, self.head_dim)

    def output_shapes(self, batch: int, tokens: int) -> dict[str, tuple[int, ...]]:
        kv = (tokens, self.num_layers, batch, self.num_kv_heads, self.head_dim)
        shapes = {
            LOGITS: (batch, tokens, self.vocab_size),
            HIDDEN: (batch, tokens, self.hidden_size),
            NEXT_IDS: (batch, tokens),
            NEW_KEY: kv,
            NEW_VALUE: kv,
        }
        if self.successors:
            shapes[SUCCESSORS_OUTPUT] = (batch, tokens, self.successors)
        return shapes

    def bound_outputs(self, batch: int, tokens: int, logits: bool) -> dict[str, tuple[int, ...]]:
        """The outputs a step binds: all of them, or without ``GATED`` for a step whose logits no one reads."""
        shapes = self.output_shapes(batch, tokens)
        return shapes if logits else {name: shape for name, shape in shapes.items() if name not in GATED}

    def output_dtype(self, name: str):
        return np.int64 if name in ID_OUTPUTS else self.dtype

    def heads_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {HEAD_TOPK: (batch, self.heads_rows, self.top_k), HEAD_LOGITS: (batch, self.heads_rows, self.heads_vocab)}


def _elements(shape) -> int:
    return math.prod(int(d) for d in shape)  # a dozen calls a step: np.prod costs 6 us a call, this 0.5


class StepBuffers(Protocol):
    """The KV cache and output buffers of one ONNX Runtime backend, allocated once."""

    sizes: BufferSizes
    cache_bytes: int
    output_bytes: int

    def bind_step(self, io, batch: int, tokens: int, past: int, *, logits: bool = True) -> None:
        """Bind past_key / past_value (the first ``past`` slots of the [*, layers, batch, Hkv, D] layout)
        and every step output for (batch, tokens) on ``io``; the caller binds the small inputs. ``logits``
        False: a gated graph's step without its logits outputs (``GATED``), which are then left unbound."""
        ...

    def step_output(self) -> StepOutput:
        """The last step's outputs, as the loop reads them."""
        ...

    def commit(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, batch: int) -> None:
        """Copy the last step's new K/V of node src[i] of row rows[i] into cache slot dst[i] (``commit_indices``)."""
        ...

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` of the ``old_batch`` layout to row i of the ``new_batch`` one (first ``slots`` slots)."""
        ...

    def bind_heads(self, io, nodes: np.ndarray) -> None:
        """Bind the heads' input (the last step's hidden state at node nodes[b] of row b) and outputs on ``io``."""
        ...

    def proposals(self, top_k: int) -> Proposals:
        """The last heads run's outputs."""
        ...


# ----------------------------------------------------------------------------- host


class HostBuffers:
    """numpy buffers in host memory (CPU provider)."""

    def __init__(self, sizes: BufferSizes):
        self.sizes = s = sizes
        self.key = np.zeros(s.max_context * s.max_batch * s.kv_row, dtype=s.dtype)  # flat: viewed per batch size
        self.value = np.zeros_like(self.key)
        shapes = s.output_shapes(s.max_batch, s.max_tokens)
        self.out = {name: np.zeros(_elements(shape), dtype=s.output_dtype(name)) for name, shape in shapes.items()}
        if s.heads_rows:
            self.head_logits = np.zeros(_elements(s.heads_shapes(s.max_batch)[HEAD_LOGITS]), dtype=np.float32)
            self.head_topk = np.zeros(_elements(s.heads_shapes(s.max_batch)[HEAD_TOPK]), dtype=np.int64)
            self.head_confidence = np.zeros_like(self.head_topk, dtype=np.float32)
        self.cache_bytes = 2 * self.key.nbytes
        self.output_bytes = sum(a.nbytes for a in self.out.values())
        self._views: dict[str, np.ndarray] = {}
        self._heads: dict[str, np.ndarray] = {}

    def _layout(self, flat: np.ndarray, batch: int) -> np.ndarray:
        shape = self.sizes.cache_shape(batch)
        return flat[: _elements(shape)].reshape(shape)

    def step_arrays(self, batch: int, tokens: int, past: int, *, logits: bool = True) -> dict[str, np.ndarray]:
        """The bound cache's first ``past`` slots and every output of a step of ``batch`` x ``tokens``, named as the
        contract names them: views of the buffers, the outputs written in place (a host backend's kernel)."""
        shapes = self.sizes.bound_outputs(batch, tokens, logits)
        self._views = {name: self.out[name][: _elements(shape)].reshape(shape) for name, shape in shapes.items()}
        past_views = {PAST_KEY: self._layout(self.key, batch)[:past], PAST_VALUE: self._layout(self.value, batch)[:past]}
        return past_views | self._views  # contiguous: slot-major layout

    def bind_step(self, io, batch: int, tokens: int, past: int, *, logits: bool = True) -> None:
        arrays = self.step_arrays(batch, tokens, past, logits=logits)
        for name in (PAST_KEY, PAST_VALUE):
            io.bind_cpu_input(name, arrays[name])
        for name, array in self._views.items():
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def step_output(self) -> StepOutput:
        hidden = self._views[HIDDEN]
        if LOGITS not in self._views:
            return without_logits(hidden.shape[0], lambda rows, nodes: hidden[rows, nodes].astype(np.float32))
        logits = self._views[LOGITS]
        return StepOutput(
            self._views[NEXT_IDS],
            self._views.get(SUCCESSORS_OUTPUT),
            lambda: logits,
            lambda rows, nodes: logits[rows, nodes],
            lambda rows, nodes: hidden[rows, nodes].astype(np.float32),
        )

    def commit(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, batch: int) -> None:
        key, value = self._layout(self.key, batch), self._layout(self.value, batch)
        key[dst, :, rows] = self._views[NEW_KEY][src, :, rows]
        value[dst, :, rows] = self._views[NEW_VALUE][src, :, rows]

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        for flat in (self.key, self.value):
            moved = self._layout(flat, old_batch)[:slots][:, :, rows].copy()  # (slots, layers, n, Hkv, D)
            self._layout(flat, new_batch)[:slots, :, : len(rows)] = moved

    def heads_arrays(self, nodes: np.ndarray, *, confidence: bool = False) -> dict[str, np.ndarray]:
        """The heads' input and outputs at node ``nodes[b]`` of row b of the last step, named as the contract names them:
        HIDDEN (B, H) the hidden states there (a copy), HEAD_TOPK (B, n, K) and HEAD_LOGITS (B, n, Vd) views of the
        buffers, written in place (a host backend's heads), and with ``confidence`` HEAD_CONFIDENCE (B, n, K) too (heads
        that compute it); ``proposals`` reads them after the run."""
        batch = nodes.shape[0]
        shapes = self.sizes.heads_shapes(batch)
        topk = _elements(shapes[HEAD_TOPK])
        self._heads = {
            HIDDEN: np.ascontiguousarray(self._views[HIDDEN][np.arange(batch), nodes]),  # (B, H)
            HEAD_TOPK: self.head_topk[:topk].reshape(shapes[HEAD_TOPK]),
            HEAD_LOGITS: self.head_logits[: _elements(shapes[HEAD_LOGITS])].reshape(shapes[HEAD_LOGITS]),
        }
        if confidence:
            self._heads[HEAD_CONFIDENCE] = self.head_confidence[:topk].reshape(shapes[HEAD_TOPK])  # (B, n, K)
        return dict(self._heads)

    def bind_heads(self, io, nodes: np.ndarray) -> None:
        arrays = self.heads_arrays(nodes)
        io.bind_cpu_input(HIDDEN, arrays[HIDDEN])  # kept in self._heads until the run
        for name in (HEAD_TOPK, HEAD_LOGITS):
            array = arrays[name]
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def proposals(self, top_k: int) -> Proposals:
        head_logits, confidence = self._heads[HEAD_LOGITS], self._heads.get(HEAD_CONFIDENCE)
        confidence = None if confidence is None else confidence[:, :, :top_k]  # (B, n, K) where the heads wrote it
        return Proposals(self._heads[HEAD_TOPK][:, :, :top_k], lambda: head_logits, confidence)


# ----------------------------------------------------------------------------- device


class DeviceBuffers:
    """``OrtValue`` buffers on ``device`` ("cuda", or "cpu" to run this code path on the CPU provider)."""

    def __init__(self, sizes: BufferSizes, *, device: str = "cuda", device_id: int = 0):
        import onnxruntime as ort

        self.sizes = s = sizes
        self.device, self.device_id = device, device_id

        self._host_zeros: list[np.ndarray] = []  # on "cpu" the OrtValues wrap these arrays: kept alive with them

        def alloc(elements: int, dtype):
            # zero-filled, as the host buffers are: cache slots past a row's length are masked, but a
            # masked score over uninitialised memory (NaN, inf) still poisons the softmax
            zeros = np.zeros(elements, dtype=dtype)
            if device == "cpu":
                self._host_zeros.append(zeros)
            return ort.OrtValue.ortvalue_from_numpy(zeros, device, device_id)

        self.key = alloc(s.max_context * s.max_batch * s.kv_row, s.dtype)  # flat: viewed per batch size
        self.value = alloc(s.max_context * s.max_batch * s.kv_row, s.dtype)
        shapes = s.output_shapes(s.max_batch, s.max_tokens)
        self.out = {name: alloc(_elements(shapes[name]), s.dtype) for name in FLOAT_OUTPUTS}
        self.host = {name: np.zeros(_elements(shapes[name]), dtype=np.int64) for name in ID_OUTPUTS if name in shapes}
        if s.heads_rows:
            heads = s.heads_shapes(s.max_batch)
            self.head_hidden = alloc(s.max_batch * s.hidden_size, s.dtype)  # (B, H) gathered on the device
            self.head_logits = alloc(_elements(heads[HEAD_LOGITS]), np.float32)
            self.head_topk = np.zeros(_elements(heads[HEAD_TOPK]), dtype=np.int64)
        itemsize = np.dtype(s.dtype).itemsize
        self.cache_bytes = 2 * s.max_context * s.max_batch * s.kv_row * itemsize
        self.output_bytes = sum(_elements(shapes[n]) * itemsize for n in FLOAT_OUTPUTS) + sum(a.nbytes for a in self.host.values())
        self.ops = DeviceOps(device, device_id)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._host_views: dict[str, np.ndarray] = {}
        self._heads: dict = {}

    def _bind(self, io, name: str, value, shape, dtype, *, output: bool = False) -> None:
        """Bind ``shape`` elements from the start of device buffer ``value`` (its address, no copy)."""
        bind = io.bind_output if output else io.bind_input
        bind(name, self.device, self.device_id, dtype, list(shape), value.data_ptr())

    def bind_step(self, io, batch: int, tokens: int, past: int, *, logits: bool = True) -> None:
        s = self.sizes
        self._bind(io, PAST_KEY, self.key, s.cache_shape(batch, past), s.dtype)
        self._bind(io, PAST_VALUE, self.value, s.cache_shape(batch, past), s.dtype)
        self._shapes = s.bound_outputs(batch, tokens, logits)
        self._host_views = {}
        for name, shape in self._shapes.items():
            if name in self.host:  # ids the loop reads every step: ONNX Runtime copies them to these host arrays
                array = self._host_views[name] = self.host[name][: _elements(shape)].reshape(shape)
                io.bind_output(name, "cpu", 0, np.int64, list(shape), array.ctypes.data)
            else:
                self._bind(io, name, self.out[name], shape, s.dtype, output=True)

    def step_output(self) -> StepOutput:
        hidden = (HIDDEN, self.out[HIDDEN], self._shapes[HIDDEN])
        if LOGITS not in self._shapes:

            def hidden_rows(rows, nodes):
                return self.ops.rows_to_host(*hidden[1:], self.sizes.dtype, rows, nodes).astype(np.float32)

            return without_logits(hidden[2][0], hidden_rows)
        logits = (LOGITS, self.out[LOGITS], self._shapes[LOGITS])
        fetched: list[np.ndarray] = []

        def all_logits() -> np.ndarray:
            if not fetched:  # (B, W, V): one copy to the host, for sampling rules only
                fetched.append(self.ops.to_host(logits[1], logits[2], self.sizes.dtype))
            return fetched[0]

        return StepOutput(
            self._host_views[NEXT_IDS],
            self._host_views.get(SUCCESSORS_OUTPUT),
            all_logits,
            lambda rows, nodes: self.ops.rows_to_host(*logits[1:], self.sizes.dtype, rows, nodes),
            lambda rows, nodes: self.ops.rows_to_host(*hidden[1:], self.sizes.dtype, rows, nodes).astype(np.float32),
        )

    def commit(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, batch: int) -> None:
        if len(rows) == 0:
            return
        s = self.sizes
        layers = np.arange(s.num_layers)[None, :]  # (1, L)

        def index(slot: np.ndarray) -> np.ndarray:  # (N, L, 3): (slot, layer, row) of every entry and layer
            return np.stack(np.broadcast_arrays(slot[:, None], layers, rows[:, None]), axis=-1).astype(np.int64)

        self.ops.commit(
            self.key,
            self.value,
            s.cache_shape(batch),
            self.out[NEW_KEY],
            self.out[NEW_VALUE],
            self._shapes[NEW_KEY],
            index(src),
            index(dst),
            s.dtype,
        )

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        # rows past len(rows) of the new layout are unused (their sequences start from slot 0): filled with rows[0]
        take = np.concatenate([rows, np.full(new_batch - len(rows), rows[0])]).astype(np.int64)  # (new_batch,)
        s = self.sizes
        for flat in (self.key, self.value):
            self.ops.take_rows(flat, s.cache_shape(old_batch, slots), s.cache_shape(new_batch, slots), take, s.dtype)

    def bind_heads(self, io, nodes: np.ndarray) -> None:
        s = self.sizes
        batch = nodes.shape[0]
        index = np.stack([np.arange(batch), nodes], axis=-1).astype(np.int64)  # (B, 2)
        self.ops.gather_rows(self.out[HIDDEN], self._shapes[HIDDEN], s.dtype, index, out=self.head_hidden)  # (B, H) on the device
        shapes = s.heads_shapes(batch)
        topk = self.head_topk[: _elements(shapes[HEAD_TOPK])].reshape(shapes[HEAD_TOPK])
        self._heads = {HEAD_TOPK: topk, HEAD_LOGITS: shapes[HEAD_LOGITS]}
        self._bind(io, HIDDEN, self.head_hidden, (batch, s.hidden_size), s.dtype)
        io.bind_output(HEAD_TOPK, "cpu", 0, np.int64, list(topk.shape), topk.ctypes.data)
        self._bind(io, HEAD_LOGITS, self.head_logits, shapes[HEAD_LOGITS], np.float32, output=True)

    def proposals(self, top_k: int) -> Proposals:
        shape = self._heads[HEAD_LOGITS]
        return Proposals(self._heads[HEAD_TOPK][:, :, :top_k], lambda: self.ops.to_host(self.head_logits, shape, np.float32))


# ----------------------------------------------------------------------------- device ops


class DeviceOps:
    """Copies and index ops on one device, each a tiny ONNX graph in its own session (built on first use)."""

    def __init__(self, device: str, device_id: int):
        self.device, self.device_id = device, device_id
        self._sessions: dict[tuple[str, int], object] = {}

    def _session(self, op: str, elem: int):
        import onnxruntime as ort

        key = (op, elem)
        if key not in self._sessions:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            providers = ["CPUExecutionProvider"]
            if self.device == "cuda":
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": self.device_id}))
            self._sessions[key] = ort.InferenceSession(OP_GRAPHS[op](elem), sess_options=options, providers=providers)
        return self._sessions[key]

    def _run(self, op: str, dtype, bind) -> object:
        session = self._session(op, ELEM_TYPES[np.dtype(dtype)])
        io = session.io_binding()
        bind(io)
        session.run_with_iobinding(io)
        return io

    def _input(self, io, name: str, value, shape, dtype) -> None:
        io.bind_input(name, self.device, self.device_id, dtype, list(shape), value.data_ptr())

    def _output(self, io, name: str, value, shape, dtype) -> None:
        io.bind_output(name, self.device, self.device_id, dtype, list(shape), value.data_ptr())

    def commit(self, key, value, cache_shape, new_key, new_value, new_shape, src: np.ndarray, dst: np.ndarray, dtype) -> None:
        """In place: cache[dst[i, l]] = new[src[i, l]] for key and value (indices (N, L, 3) of (slot, layer, row))."""

        def bind(io):
            for name, buf, shape in (
                ("key", key, cache_shape),
                ("value", value, cache_shape),
                (NEW_KEY, new_key, new_shape),
                (NEW_VALUE, new_value, new_shape),
            ):
                self._input(io, name, buf, shape, dtype)
            io.bind_cpu_input("src", src)
            io.bind_cpu_input("dst", dst)
            self._output(io, "key_out", key, cache_shape, dtype)  # the cache itself: ScatterND skips its copy
            self._output(io, "value_out", value, cache_shape, dtype)

        self._run("commit", dtype, bind)

    def gather_rows(self, x, shape, dtype, index: np.ndarray, *, out=None) -> np.ndarray | None:
        """x (B, W, F)[index[i, 0], index[i, 1]] -> (N, F): into device buffer ``out``, or returned on the host."""

        def bind(io):
            self._input(io, "x", x, shape, dtype)
            io.bind_cpu_input("index", index)
            if out is None:
                io.bind_output("y", "cpu")
            else:
                self._output(io, "y", out, (len(index), shape[-1]), dtype)

        io = self._run("gather_rows", dtype, bind)
        return io.copy_outputs_to_cpu()[0] if out is None else None

    def rows_to_host(self, x, shape, dtype, rows: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        return self.gather_rows(x, shape, dtype, np.stack([rows, nodes], axis=-1).astype(np.int64).reshape(-1, 2))

    def to_host(self, x, shape, dtype) -> np.ndarray:
        """The first prod(shape) elements of device buffer ``x`` as a host array of ``shape``."""

        def bind(io):
            self._input(io, "x", x, (_elements(shape),), dtype)
            io.bind_output("y", "cpu")

        return self._run("copy", dtype, bind).copy_outputs_to_cpu()[0].reshape(shape)

    def take_rows(self, flat, old_shape, new_shape, take: np.ndarray, dtype) -> None:
        """flat viewed as old_shape (S, L, B, Hkv, D) -> its batch rows ``take`` as new_shape, in place,
        through a scratch buffer (the two views overlap); transient, like the host path's copy."""
        import onnxruntime as ort

        scratch = ort.OrtValue.ortvalue_from_shape_and_type(list(new_shape), dtype, self.device, self.device_id)

        def gather(io):
            self._input(io, "x", flat, old_shape, dtype)
            io.bind_cpu_input("rows", take)
            self._output(io, "y", scratch, new_shape, dtype)

        def copy_back(io):
            self._input(io, "x", scratch, (_elements(new_shape),), dtype)
            self._output(io, "y", flat, (_elements(new_shape),), dtype)

        self._run("take_rows", dtype, gather)
        self._run("copy", dtype, copy_back)


# ----------------------------------------------------------------------------- the op graphs, as ONNX protobuf (onnx_proto)

CACHE = ("slots", "layers", "batch", "kv_heads", "head_dim")
NEW = ("tokens", "layers", "batch", "kv_heads", "head_dim")


def commit_graph(elem: int) -> bytes:
    """key/value (S, L, B, Hkv, D), new_key/new_value (T, L, B, Hkv, D), src/dst (N, L, 3) ->
    key_out/value_out = the caches with [dst] = new[src] (GatherND then ScatterND)."""
    index = ("entries", "layers", 3)
    nodes = [
        proto.node("GatherND", (NEW_KEY, "src"), ("key_rows",)),
        proto.node("GatherND", (NEW_VALUE, "src"), ("value_rows",)),
        proto.node("ScatterND", ("key", "dst", "key_rows"), ("key_out",)),
        proto.node("ScatterND", ("value", "dst", "value_rows"), ("value_out",)),
    ]
    inputs = [
        proto.tensor("key", elem, CACHE),
        proto.tensor("value", elem, CACHE),
        proto.tensor(NEW_KEY, elem, NEW),
        proto.tensor(NEW_VALUE, elem, NEW),
        proto.tensor("src", INT64, index),
        proto.tensor("dst", INT64, index),
    ]
    return proto.model("medusa_commit", nodes, inputs, [proto.tensor("key_out", elem, CACHE), proto.tensor("value_out", elem, CACHE)])


def gather_rows_graph(elem: int) -> bytes:
    """x (B, W, F), index (N, 2) -> y (N, F) = x[index[:, 0], index[:, 1]]."""
    return proto.model(
        "medusa_gather_rows",
        [proto.node("GatherND", ("x", "index"), ("y",))],
        [proto.tensor("x", elem, ("batch", "tokens", "features")), proto.tensor("index", INT64, ("rows", 2))],
        [proto.tensor("y", elem, ("rows", "features"))],
    )


def take_rows_graph(elem: int) -> bytes:
    """x (S, L, B, Hkv, D), rows (R,) -> y (S, L, R, Hkv, D) = x[:, :, rows]."""
    return proto.model(
        "medusa_take_rows",
        [proto.node("Gather", ("x", "rows"), ("y",), axis=2)],
        [proto.tensor("x", elem, CACHE), proto.tensor("rows", INT64, ("taken",))],
        [proto.tensor("y", elem, ("slots", "layers", "taken", "kv_heads", "head_dim"))],
    )


def copy_graph(elem: int) -> bytes:
    """x (N,) -> y (N,): a device-to-device or device-to-host copy of a flat block."""
    flat = ("elements",)
    identity = proto.node("Identity", ("x",), ("y",))
    return proto.model("medusa_copy", [identity], [proto.tensor("x", elem, flat)], [proto.tensor("y", elem, flat)])


OP_GRAPHS = {"commit": commit_graph, "gather_rows": gather_rows_graph, "take_rows": take_rows_graph, "copy": copy_graph}
