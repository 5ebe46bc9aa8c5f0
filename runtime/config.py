"""Runtime configuration: one frozen dataclass, defaults defined here only."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_trt.runtime.backends import BACKENDS
from medusa_trt.runtime.errors import MedusaError

DEFAULT_MAX_BATCH = 4
DEFAULT_MAX_CONTEXT = 1024  # capped by the model's positions wherever a context is chosen
DEFAULT_MAX_TOKENS = 64  # the most new tokens one step of an exported engine takes: tree nodes and prefill chunk
DEFAULT_OPSET = 23  # the exporter's ONNX opset: 23 has native Attention, RMSNormalization, RotaryEmbedding ops
DEFAULT_PREFILL_CHUNK = 64  # capped by the engine's tokens per step
DEFAULT_MAX_NEW_TOKENS = 128  # a request's budget when it names none (generate, stream, the batcher, medusa-bench)


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int | None = None  # sequences decoded together (cache rows); None: the engine's, or 4 for a torch model
    max_context: int | None = None  # prompt + generated tokens per sequence; None: the engine's, or 1024
    tree: str | tuple | list | None = (
        None  # the heads' template: preset name, chain-N, JSON file or paths; None: the engine's tree or a chain
    )
    drafters: tuple[str, ...] | None = None  # heads, lookup, recycle; None: every drafter the engine supports; (): plain decoding
    step_cost: dict | None = None  # verify cost by tokens per step, relative (the tree budget); None: drafting.DEFAULT_STEP_COST
    prefill_chunk: int | None = (
        None  # prompt tokens per engine call (bounds the per-step buffers); None: min(64, the engine's tokens per step)
    )
    device: str | None = None  # torch backend: "cpu", "cuda"; None: where the model is
    threads: int | None = None  # onnxruntime intra-op / openvino inference threads; None: its default (physical cores)
    # ONNX engines: onnxruntime, openvino or native; None: the engine folder's choice (its native on onnxruntime where
    # native cannot run), else onnxruntime
    backend: str | None = None
    precision: str | None = None  # openvino's inference precision: f32 (None) or bf16 (CPUs with AMX or AVX512-BF16)
    cuda_graph: bool = False  # tensorrt (plugin-form engines) and torch (CUDA) backends: capture and replay the verify step
    verify_checksums: bool = False  # check every engine file's sha256 against the export's manifest (servers: once at load)

    def __post_init__(self):
        for name, least in (("max_batch", 1), ("max_context", 2), ("prefill_chunk", 1), ("threads", 1)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < least):
                raise MedusaError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.drafters is not None:
            names = (self.drafters,) if isinstance(self.drafters, str) else self.drafters
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
                raise MedusaError(f"drafters must be a tuple of names (heads, lookup, recycle), got {self.drafters!r}")
            object.__setattr__(self, "drafters", tuple(names))
        if self.step_cost is not None:
            table = self.step_cost
            if (
                not isinstance(table, dict)
                or not table
                or not all(is_int(k) and k >= 1 and isinstance(v, (int, float)) and v > 0 for k, v in table.items())
            ):
                raise MedusaError(f"step_cost must map tokens per step (integers >= 1) to positive costs, got {table!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise MedusaError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("cuda_graph", "verify_checksums"):
            if not isinstance(getattr(self, name), bool):
                raise MedusaError(f"{name} must be True or False, got {getattr(self, name)!r}")


def is_int(value) -> bool:
    """An integer proper: int or numpy integer, not bool, not a float that happens to be whole."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def default_tree(num_heads: int) -> str:
    """A chain over the heads: needs no presets file; pass ``tree=`` for a branching one."""
    return f"chain-{num_heads}"
