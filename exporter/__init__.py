"""medusa_trt.exporter: base models and heads, the export wrapper, ONNX / TensorRT export (``build``:
what medusa-export runs). The Triton model repository lives in serving/, beside the servers.

Names are imported on first use (PEP 562), so a module that needs no torch (``engine_folder``)
can be imported from the lean install; everything else here needs the ``export`` extra.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BuildConfig": "builder",
    "Built": "builder",
    "build": "builder",
    "HeadsConfig": "heads",
    "HeadsFormatError": "heads",
    "HeadsMismatchError": "heads",
    "MedusaHeads": "heads",
    "init_heads": "heads",
    "load_heads": "heads",
    "save_heads": "heads",
    "BaseModel": "models",
    "ModelLoadError": "models",
    "load_base_model": "models",
    "MedusaModel": "wrapper",
    "load_medusa": "wrapper",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
