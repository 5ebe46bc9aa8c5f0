"""Engine backends: each runs the step contract of docs/architecture.md on its own buffers and speaks
``runtime.contract.Backend``: ``step`` (score W tokens per row, keep logits / hidden / new K/V,
return a ``StepOutput`` with the base argmax per node on the host and the logits on demand),
``commit`` (copy chosen nodes' K/V into the cache), ``relayout`` and ``propose`` (Medusa heads
at one node per row, a ``Proposals`` with the top-k ids on the host).
"""

from __future__ import annotations

import logging

from medusa_trt.runtime.contract import BACKENDS, ONNX_BACKENDS  # noqa: F401 (BACKENDS: imported from here too)
from medusa_trt.runtime.errors import EngineError

log = logging.getLogger(__name__)


def onnx_backend_name(path, asked: str | None) -> str:
    """Which backend runs the ONNX graphs of the engine at ``path``: ``asked``, else the engine folder's
    ``config.json`` choice where it names an ONNX backend, else onnxruntime (``open_onnx_backend`` runs a
    folder's choice of native on onnxruntime where native cannot run)."""
    if asked is not None and asked not in ONNX_BACKENDS:
        raise EngineError(f"backend {asked!r} cannot run {path}: use one of {', '.join(ONNX_BACKENDS)} (tensorrt runs .plan engines)")
    if asked is not None:
        return asked
    chosen = _folder_choice(path)
    return chosen if chosen in ONNX_BACKENDS else ONNX_BACKENDS[0]


def _folder_choice(path) -> str | None:
    """The backend the engine folder at ``path`` names (None: not a folder)."""
    from medusa_trt.runtime.engine import EngineFiles

    folder = EngineFiles.locate(path).folder
    if folder is None:
        return None
    from medusa_trt.runtime.engine_folder import read_folder_config

    return read_folder_config(folder).backend


def open_onnx_backend(path, cfg):
    """The backend (``onnx_backend_name``) for the ONNX engine at ``path`` under ``RuntimeConfig`` ``cfg``.

    An engine folder whose config.json names native, opened without ``cfg.backend``, runs on onnxruntime where
    native cannot run (no library for this CPU, a graph it does not compute): one warning says why. Asked for by
    name (``backend="native"``), native that cannot run is an error."""
    name = onnx_backend_name(path, cfg.backend)
    limits = dict(max_batch=cfg.max_batch, max_context=cfg.max_context, threads=cfg.threads, checksums=cfg.verify_checksums)
    if name == "openvino":
        from medusa_trt.runtime.backends.openvino_backend import open_openvino  # openvino only on this path

        return open_openvino(path, precision=cfg.precision, **limits)
    if cfg.precision is not None:
        raise EngineError(f"precision {cfg.precision!r} is an openvino option: pass backend='openvino' with it, or drop it")
    backend = _native(path, cfg, limits) if name == "native" else None
    if backend is None:
        from medusa_trt.runtime.backends.onnx_backend import OnnxBackend  # onnxruntime only on this path

        backend = OnnxBackend(path, **limits)
    if cfg.backend is None:
        _log_choice(path, backend.name)
    return backend


def _native(path, cfg, limits: dict):
    """The native backend (fp32 / int8-channel Llama-pattern step graphs computed by runtime/native_step.c); None where
    it cannot run and was the engine folder's choice, not ``cfg``'s (one warning says why)."""
    from medusa_trt.runtime.backends.native_backend import open_native
    from medusa_trt.runtime.native_library import NativeUnavailable
    from medusa_trt.runtime.native_weights import NativeCannotRun

    try:
        return open_native(path, **limits)
    except (NativeUnavailable, NativeCannotRun) as exc:
        if cfg.backend is not None:  # asked for by name: the caller's to change
            raise
        log.warning("%s names backend native, which cannot run it here (%s): running it on onnxruntime", path, " ".join(str(exc).split()))
        return None


def _log_choice(path, running: str) -> None:
    """Why the export chose the backend ``running`` for the engine folder at ``path``, as its drafting.json records it
    (``exporter/backend_choice.py``; seen with medusa-run -v)."""
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.engine_folder import read_drafting

    folder = EngineFiles.locate(path).folder
    choice = read_drafting(folder).get("backend_choice") if folder is not None else None
    if isinstance(choice, dict) and choice.get("backend") == running and choice.get("reason"):
        log.info("backend %s, the engine folder's choice at export: %s", running, choice["reason"])
