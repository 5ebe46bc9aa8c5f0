"""Native backend: the step of a Llama-pattern engine (fp32 or int8-channel) computed by ``runtime/native_step.c``.

Everything but the step is ``OnnxBackend``'s: this class keeps its ``commit`` / ``relayout`` / ``propose``
over the same ``ort_buffers.HostBuffers`` (the KV cache, slot-major, and every output allocated once in
host memory), and the heads graph still runs on ONNX Runtime. ``_Session`` stands where the step
session was: it reads the bound input and output views and calls the C step on them, so a step writes
straight into the buffers the loop reads and commit copies from.

Exact by construction: the C step is batch-invariant (each output a fixed chain of operations over its
own row; the attention adds a query's keys in position order), so a verify step gives every node the
logits its plain step gives it, bit for bit, whatever the tree; the engine's key slots are not needed
and not used. Its output is not ONNX Runtime's bit for bit (other summation orders): it is the same
model to float rounding, so plain and drafted output agree with ONNX Runtime's except at near-ties.

Only step graphs of the Llama pattern run here, with fp32 matmuls or int8-channel's (int8 columns, one scale a row,
whose integer products are exact: each such matmul gives ONNX Runtime's outputs bit for bit); ``native_weights.read_weights``
refuses others by name. The weights are read from the engine's own ``model.onnx`` and packed once at load.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging

import numpy as np

from medusa_trt.runtime import native_library, native_step, native_weights
from medusa_trt.runtime.backends.onnx_backend import _WANTED, OnnxBackend, _session_options, checked_files, open_heads
from medusa_trt.runtime.backends.ort_buffers import BufferSizes, HostBuffers
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    LOGITS_WANTED_INPUT,
    NEW_KEY,
    NEW_VALUE,
    NEXT_IDS,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    SUCCESSORS_OUTPUT,
    TREE_MASK,
    StepOutput,
)
from medusa_trt.runtime.engine import EngineError

log = logging.getLogger(__name__)


class _Binding:
    """The IOBinding calls ``OnnxBackend.step`` and ``HostBuffers`` make, kept as host arrays for ``_Session``."""

    def __init__(self):
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}

    def clear_binding_inputs(self) -> None:
        self.inputs = {}

    def clear_binding_outputs(self) -> None:
        self.outputs = {}

    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self.inputs[name] = np.require(array, requirements="C")

    def bind_output(self, name: str, device: str, device_id: int, dtype, shape, address: int) -> None:
        """An output view of HostBuffers' memory at ``address`` (alive as long as the backend)."""
        count = int(np.prod(shape))
        memory = (ctypes.c_byte * max(count * np.dtype(dtype).itemsize, 1)).from_address(address)
        self.outputs[name] = np.frombuffer(memory, dtype=dtype, count=count).reshape(tuple(int(n) for n in shape))


class _Session:
    """The C step behind the part of ``onnxruntime.InferenceSession`` the step path uses."""

    def __init__(self, step: native_step.NativeStep):
        self.step = step

    def io_binding(self) -> _Binding:
        return _Binding()

    def run_with_iobinding(self, io: _Binding) -> None:
        i, o = io.inputs, io.outputs
        wanted = LOGITS in o
        self.step(
            i[INPUT_IDS], i[POSITION_IDS], i[TREE_MASK], i[CACHE_LENGTHS], i[PAST_KEY], i[PAST_VALUE],
            o[NEW_KEY], o[NEW_VALUE], o[HIDDEN], o.get(LOGITS), o.get(NEXT_IDS) if wanted else None,
            o.get(SUCCESSORS_OUTPUT) if wanted else None,
        )  # fmt: skip


class NativeBackend(OnnxBackend):
    name = "native"

    def __init__(
        self,
        path,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        threads: int | None = None,
        checksums: bool = False,
        isa: str | None = None,  # the best instruction set at or below this one (default $MEDUSA_TRT_CPU_ISA)
    ):
        self.files, self.meta = files, meta = checked_files(path, checksums=checksums)
        if meta.dtype != "fp32":
            raise native_weights.NativeCannotRun(
                f"backend native runs fp32 engines; {files.step} holds {meta.dtype} weights: use backend onnxruntime",
                f"{meta.dtype} weights, not fp32",
            )
        native_library.load(isa)  # NativeUnavailable (no library for this CPU) before the weights are read
        self.dtype = np.float32
        self.max_batch, self.max_context = meta.check_limits(max_batch, max_context)
        self.max_tokens = meta.max_tokens
        weights = native_weights.read_weights(files.step, meta.architecture)
        d = weights.dims  # read from the weights; each recorded in the metadata by the export too
        found = dict(vocab=d.vocab, layers=d.layers, hidden=d.hidden, kv_heads=d.kv_heads, head_dim=d.head_dim)
        recorded = dict(
            vocab=meta.vocab_size, layers=meta.num_layers, hidden=meta.hidden_size, kv_heads=meta.num_kv_heads, head_dim=meta.head_dim
        )
        if wrong := [f"{k} {found[k]} (metadata: {recorded[k]})" for k in found if found[k] != recorded[k]]:
            raise EngineError(f"{files.step}'s weights do not match its metadata, {', '.join(wrong)}: export again")
        self.session = _Session(
            native_step.NativeStep(weights, rows=self.max_batch * self.max_tokens, slots=self.max_context, threads=threads, isa=isa)
        )
        self.heads_session = open_heads(files, meta, _session_options(threads, spin=False), ["CPUExecutionProvider"])
        self.successors = min(meta.successors, native_step.MAX_TOPK)
        self.slots = self.max_context  # no key slots: no slack past the context
        sizes = BufferSizes.of(meta, max_batch=self.max_batch, max_context=self.slots, dtype=self.dtype, successors=self.successors)
        self.buffers = HostBuffers(sizes)
        self.kv_row = sizes.kv_row
        self._binding = self.session.io_binding()
        self.gated = True  # a step may skip the lm_head whatever the graph (the C step decides)
        self.key_lanes = None
        log.info(
            "native backend (%s, %d threads): %d layers, KV cache %.1f MiB, outputs %.1f MiB",
            self.session.step.isa,
            self.session.step.threads,
            weights.dims.layers,
            self.buffers.cache_bytes / 2**20,
            self.buffers.output_bytes / 2**20,
        )

    def describe(self) -> str:
        """The backend as a summary line names it: ``native (avx512_vnni, 2 threads)``."""
        return f"{self.name} ({self.session.step.isa}, {self.session.step.threads} threads)"

    @property
    def exact(self) -> bool:
        """Verify steps are plain steps bit for bit (the C step is batch-invariant)."""
        return True

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """The step contract (``contract.Backend``); outputs are views of the preallocated buffers, every node exact."""
        batch, tokens = input_ids.shape
        if tokens > self.max_tokens:
            raise EngineError(f"a step of {tokens} tokens exceeds the engine's max_tokens {self.max_tokens}")
        io = self._binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        io.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64))
        io.bind_cpu_input(TREE_MASK, np.ascontiguousarray(tree_mask, dtype=bool))
        io.bind_cpu_input(CACHE_LENGTHS, np.ascontiguousarray(cache_lengths, dtype=np.int64))
        io.bind_cpu_input(LOGITS_WANTED_INPUT, _WANTED[logits])
        self.buffers.bind_step(io, batch, tokens, int(cache_lengths.max()), logits=logits)
        self.session.run_with_iobinding(io)
        out = self.buffers.step_output()
        return out if not logits else dataclasses.replace(out, exact=np.ones((batch, tokens), dtype=bool))
