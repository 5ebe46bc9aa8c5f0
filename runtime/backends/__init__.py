"""Engine backends: each runs the step contract of docs/architecture.md on its own buffers and speaks
``runtime.contract.Backend``: ``step`` (score W tokens per row, keep logits / hidden / new K/V,
return a ``StepOutput`` with the base argmax per node on the host and the logits on demand),
``commit`` (copy chosen nodes' K/V into the cache), ``relayout`` and ``propose`` (Medusa heads
at one node per row, a ``Proposals`` with the top-k ids on the host).
"""

from __future__ import annotations

import logging

from medusa_trt.runtime.contract import BACKENDS, ONNX_BACKENDS  # noqa: F401 (BACKENDS: imported from here too)
from medusa_trt.runtime.engine import EngineSource
from medusa_trt.runtime.errors import EngineError

log = logging.getLogger(__name__)


def backend_name(path, asked: str | None) -> str:
    """Which backend runs the engine at ``path`` (or an ``EngineSource``), decided here only: ``asked``; else tensorrt
    for a plan (a folder built for TensorRT); else the engine folder's config.json choice where it names an ONNX backend;
    else onnxruntime (``open_onnx_backend`` runs a folder's choice of native on onnxruntime where native cannot run)."""
    source = EngineSource.read(path)
    if source.files.is_plan and asked in (None, "tensorrt"):
        return "tensorrt"
    if asked is not None and asked not in ONNX_BACKENDS:
        where = source.files.folder or source.files.step
        raise EngineError(f"backend {asked!r} cannot run {where}: use one of {', '.join(ONNX_BACKENDS)} (tensorrt runs .plan engines)")
    if asked is not None:
        return asked
    chosen = source.folder.backend if source.folder is not None else None
    return chosen if chosen in ONNX_BACKENDS else ONNX_BACKENDS[0]


def onnx_backend_name(path, asked: str | None) -> str:
    """Which backend runs the ONNX graphs of the engine at ``path`` (``backend_name``, a plan's ONNX graphs included)."""
    name = backend_name(path, asked)
    return ONNX_BACKENDS[0] if name == "tensorrt" else name


def open_onnx_backend(path, cfg):
    """The backend (``backend_name``) for the ONNX engine at ``path`` (or an ``EngineSource``) under ``RuntimeConfig``
    ``cfg``.

    An engine folder whose config.json names native, opened without ``cfg.backend``, runs on onnxruntime where
    native cannot run (no library for this CPU, a graph it does not compute): one warning says why. Asked for by
    name (``backend="native"``), native that cannot run is an error."""
    source = EngineSource.read(path)
    name = onnx_backend_name(source, cfg.backend)
    limits = dict(max_batch=cfg.max_batch, max_context=cfg.max_context, threads=cfg.threads, checksums=cfg.verify_checksums)
    if name == "openvino":
        from medusa_trt.runtime.backends.openvino_backend import open_openvino  # openvino only on this path

        return open_openvino(source, precision=cfg.precision, **limits)
    if cfg.precision is not None:
        raise EngineError(f"precision {cfg.precision!r} is an openvino option: pass backend='openvino' with it, or drop it")
    backend = _native(source, cfg, limits) if name == "native" else None
    if backend is None:
        from medusa_trt.runtime.backends.onnx_backend import OnnxBackend  # onnxruntime only on this path

        backend = OnnxBackend(source, **limits)
    if cfg.backend is None:
        _log_choice(source, backend.name)
    return backend


def _native(source: EngineSource, cfg, limits: dict):
    """The native backend (the step graphs runtime/native_weights.py reads, computed by runtime/native_step.c); None where
    it cannot run and was the engine folder's choice, not ``cfg``'s (one warning says why)."""
    from medusa_trt.runtime.backends.native_backend import open_native
    from medusa_trt.runtime.native_library import NativeUnavailable
    from medusa_trt.runtime.native_weights import NativeCannotRun

    try:
        return open_native(source, **limits)
    except (NativeUnavailable, NativeCannotRun) as exc:
        if cfg.backend is not None:  # asked for by name: the caller's to change
            raise
        where = source.files.folder or source.files.step
        log.warning("%s names backend native, which cannot run it here (%s): running it on onnxruntime", where, " ".join(str(exc).split()))
        return None


def _log_choice(source: EngineSource, running: str) -> None:
    """Why the export chose the backend ``running`` for the engine folder of ``source``, as its drafting.json records it
    (``exporter/backend_choice.py``; seen with medusa-run -v)."""
    choice = source.drafting.get("backend_choice")
    if isinstance(choice, dict) and choice.get("backend") == running and choice.get("reason"):
        log.info("backend %s, the engine folder's choice at export: %s", running, choice["reason"])
