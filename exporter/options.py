"""The step graph's shape and checks, as ``medusa-export`` passes them to the export unchanged: defined once here, and
inherited by ``BuildConfig`` (what ``medusa-export`` and ``build`` take) and ``ExportConfig`` (what ``export_onnx``
takes), so the two share each default and ``build`` hands them over by name (``graph_options``).

Light on purpose (no torch): ``BuildConfig`` is imported by the command line before any model work."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from medusa_trt.runtime.config import DEFAULT_MAX_BATCH, DEFAULT_MAX_TOKENS, DEFAULT_OPSET
from medusa_trt.runtime.contract import DEFAULT_SUCCESSORS


@dataclass(frozen=True, kw_only=True)
class GraphOptions:
    max_batch: int = DEFAULT_MAX_BATCH  # sequences per step the engine is built and checked for
    max_context: int | None = None  # committed + new tokens per sequence; None: 1024 or the model's positions if fewer
    max_tokens: int = DEFAULT_MAX_TOKENS  # new tokens per step: tree nodes and prefill chunk
    dtype: str = "fp32"  # fp32 | fp16 | bf16 (bf16: TensorRT plans; verified in ONNX's reference evaluator)
    opset: int = DEFAULT_OPSET
    attention: str = "onnx"  # onnx: standard ops | plugin: one medusa_trt::TreeAttention node per layer (TensorRT)
    successors: int = DEFAULT_SUCCESSORS  # k of the step graph's next_topk output (recycled drafts); 0: none
    verify: bool = True  # checker + ONNX Runtime vs torch after export (and, for a .plan, TensorRT vs ONNX)


def graph_options(config: GraphOptions) -> dict:
    """``config``'s ``GraphOptions`` fields by name, to build another config that inherits them."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(GraphOptions)}
