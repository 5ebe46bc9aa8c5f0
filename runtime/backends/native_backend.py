"""Native backend: an engine's step computed by ``runtime/native_step.c``, for every family the exporter proves
(``native_weights.read_weights`` reads each layer's plan from the step graph), fp32, int8-channel, int4 or int8-block.

``open_native`` composes a ``host_backend.HostBackend`` of the C step (``native_step.NativeStep``, a ``HostKernel``
on named host arrays), the shared ``ort_buffers.HostBuffers`` (the KV cache, slot-major, and every output allocated
once in host memory) and the heads: in C on the step's threads (``native_step.NativeHeads``) where they are the
pattern ``medusa_native_heads`` computes, else the heads graph on ONNX Runtime (``onnx_backend.OrtHeads``, on the same
named arrays). A step writes straight into the buffers the loop reads and commit copies from.

Exact by construction: the C step is batch-invariant (each output a fixed chain of operations over its own row; the
attention adds a query's keys in position order), so a verify step gives every node the logits its plain step gives
it, bit for bit, whatever the tree; the engine's key slots are not needed and not used. Its output is not ONNX
Runtime's bit for bit (other summation orders): it is the same model to float rounding, so plain and drafted output
agree with ONNX Runtime's except at near-ties.

int8-channel's matmuls (int8 columns, one scale a row, whose integer products are exact) give ONNX Runtime's outputs
bit for bit. A graph native cannot run is refused by name (``NativeCannotRun``), and every array is checked against
the dims before any pointer is taken. The weights are read from the engine's own ``model.onnx`` and packed once at
load.
"""

from __future__ import annotations

import logging

import numpy as np

from medusa_trt.runtime import native_library, native_step, native_weights
from medusa_trt.runtime.backends.host_backend import HostBackend
from medusa_trt.runtime.backends.onnx_backend import OrtHeads, checked_files, heads_session_options, open_heads
from medusa_trt.runtime.backends.ort_buffers import BufferSizes, HostBuffers
from medusa_trt.runtime.engine import EngineError, engine_meta

log = logging.getLogger(__name__)

NAME = "native"


def open_native(
    path,
    *,
    max_batch: int | None = None,
    max_context: int | None = None,
    threads: int | None = None,
    checksums: bool = False,
    isa: str | None = None,  # the best instruction set at or below this one (default $MEDUSA_TRT_CPU_ISA)
) -> HostBackend:
    """The engine at ``path`` on the native step: ``NativeCannotRun`` where its graph is not the pattern,
    ``NativeUnavailable`` where this CPU has no library, one line each."""
    files, meta = checked_files(path, checksums=checksums)
    if meta.dtype != "fp32":
        raise native_weights.NativeCannotRun(
            f"backend native runs fp32 engines; {files.step} holds {meta.dtype} weights: use backend onnxruntime",
            f"{meta.dtype} weights, not fp32",
        )
    native_library.load(isa)  # NativeUnavailable (no library for this CPU) before the weights are read
    max_batch, max_context = meta.check_limits(max_batch, max_context)
    weights = native_weights.read_weights(files.step, meta.architecture)
    d = weights.dims  # read from the weights; each recorded in the metadata by the export too
    found = dict(vocab=d.vocab, layers=d.layers, hidden=d.hidden, kv_heads=d.kv_heads, head_dim=d.head_dim)
    recorded = dict(
        vocab=meta.vocab_size, layers=meta.num_layers, hidden=meta.hidden_size, kv_heads=meta.num_kv_heads, head_dim=meta.head_dim
    )
    if wrong := [f"{k} {found[k]} (metadata: {recorded[k]})" for k in found if found[k] != recorded[k]]:
        raise EngineError(f"{files.step}'s weights do not match its metadata, {', '.join(wrong)}: export again")
    # consume: each linear's unpacked arrays go once packed (the weights held once, not twice, while they are packed)
    kernel = native_step.NativeStep(weights, rows=max_batch * meta.max_tokens, slots=max_context, threads=threads, isa=isa, consume=True)
    del weights
    heads = _heads(files, meta, kernel, max_batch, threads)
    successors = min(meta.successors, native_step.MAX_TOPK)
    buffers = HostBuffers(BufferSizes.of(meta, max_batch=max_batch, max_context=max_context, dtype=np.float32, successors=successors))
    log.info(
        "native backend (%s): %d layers, KV cache %.1f MiB, outputs %.1f MiB",
        kernel.describe(),
        d.layers,
        buffers.cache_bytes / 2**20,
        buffers.output_bytes / 2**20,
    )
    return HostBackend(NAME, files, meta, kernel, buffers, heads, max_batch=max_batch, max_context=max_context)


def _heads(files, meta, kernel: native_step.NativeStep, max_batch: int, threads: int | None):
    """The engine's heads on the native step's threads (``native_step.NativeHeads``), or its heads graph on ONNX Runtime
    where they are not the pattern ``medusa_native_heads`` computes (said at info level); None: no heads."""
    files.check_heads(meta.num_heads)
    if not meta.num_heads:
        return None
    try:
        weights = native_weights.read_heads(files.heads)
        heads = native_step.NativeHeads.of(weights, kernel, meta, max_batch)
        if weights.reads_roots != meta.reads_roots or engine_meta(files.heads) != meta:
            raise EngineError(
                f"{files.heads} belongs to another engine than {files.step} (their metadata or inputs differ): "
                "keep the files of one export together or export again"
            )
        return heads
    except native_weights.NativeCannotRun as exc:
        log.info("heads on onnxruntime: native cannot run %s (%s)", files.heads.name, exc.what or exc)
    return OrtHeads(open_heads(files, meta, heads_session_options(threads), ["CPUExecutionProvider"]))
