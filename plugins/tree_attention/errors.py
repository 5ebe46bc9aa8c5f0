"""Errors of the tree-attention plugin: each a ``MedusaError`` whose message says what to do."""

from __future__ import annotations

from medusa_trt.runtime.errors import MedusaError


class TritonUnavailableError(MedusaError):
    """The Triton kernel was requested but ``triton`` cannot be imported."""


class TensorRTUnavailableError(MedusaError):
    """The TensorRT plugin registration was requested but ``tensorrt`` cannot be imported."""


class TreeAttentionInputError(MedusaError):
    """Inputs that do not fit the tree-attention op (shapes, dtypes, devices, layouts)."""
