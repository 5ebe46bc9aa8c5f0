"""The exporter's error: an export that cannot be done as asked. Commands print its message as one line, exit 2."""

from medusa_trt.runtime.errors import MedusaError


class ExportError(MedusaError):
    """The export cannot be done as asked; the message says what to change."""


class TensorRTBuildError(ExportError):
    """TensorRT could not build the engine as asked; the message says what to change."""
