"""Engine backends: each runs the step contract of docs/architecture.md on its own buffers and speaks
``runtime.contract.Backend``: ``step`` (score W tokens per row, keep logits / hidden / new K/V,
return a ``StepOutput`` with the base argmax per node on the host and the logits on demand),
``commit`` (copy chosen nodes' K/V into the cache), ``relayout`` and ``propose`` (Medusa heads
at one node per row, a ``Proposals`` with the top-k ids on the host).
"""

from __future__ import annotations

ONNX_BACKENDS = ("onnxruntime", "openvino", "native")  # backends that run an engine's ONNX graphs; onnxruntime is the default
BACKENDS = (*ONNX_BACKENDS, "tensorrt")  # what RuntimeConfig.backend names


def onnx_backend_name(path, asked: str | None) -> str:
    """Which backend runs the ONNX graphs of the engine at ``path``: ``asked``, else the engine folder's
    ``config.json`` choice where it names an ONNX backend, else onnxruntime."""
    from medusa_trt.runtime.engine import EngineError, EngineFiles

    if asked is not None and asked not in ONNX_BACKENDS:
        raise EngineError(f"backend {asked!r} cannot run {path}: use one of {', '.join(ONNX_BACKENDS)} (tensorrt runs .plan engines)")
    if asked is not None:
        return asked
    folder = EngineFiles.locate(path).folder
    if folder is not None:
        from medusa_trt.runtime.engine_folder import read_folder_config

        chosen = read_folder_config(folder).backend
        if chosen in ONNX_BACKENDS:
            return chosen
    return ONNX_BACKENDS[0]


def open_onnx_backend(path, cfg):
    """The backend (``onnx_backend_name``) for the ONNX engine at ``path`` under ``RuntimeConfig`` ``cfg``."""
    name = onnx_backend_name(path, cfg.backend)
    limits = dict(max_batch=cfg.max_batch, max_context=cfg.max_context, threads=cfg.threads, checksums=cfg.verify_checksums)
    if name == "openvino":
        from medusa_trt.runtime.backends.openvino_backend import OpenVinoBackend  # openvino only on this path

        return OpenVinoBackend(path, precision=cfg.precision, **limits)
    if cfg.precision is not None:
        from medusa_trt.runtime.engine import EngineError

        raise EngineError(f"precision {cfg.precision!r} is an openvino option: pass backend='openvino' with it, or drop it")
    if name == "native":  # fp32 Llama-pattern step graphs computed by runtime/native_step.c
        from medusa_trt.runtime.backends.native_backend import NativeBackend

        return NativeBackend(path, **limits)
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend  # onnxruntime only on this path

    return OnnxBackend(path, **limits)
