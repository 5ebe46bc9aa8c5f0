"""medusa_trt.exporter: base models and heads, the export wrapper (and, later, ONNX/TensorRT export)."""

from medusa_trt.exporter.heads import HeadsConfig, HeadsFormatError, HeadsMismatchError, MedusaHeads, init_heads, load_heads, save_heads
from medusa_trt.exporter.models import BaseModel, ModelLoadError, load_base_model
from medusa_trt.exporter.wrapper import MedusaModel, load_medusa

__all__ = [
    "BaseModel", "HeadsConfig", "HeadsFormatError", "HeadsMismatchError", "MedusaHeads", "MedusaModel",
    "ModelLoadError", "init_heads", "load_base_model", "load_heads", "load_medusa", "save_heads",
]
