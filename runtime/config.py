"""Runtime configuration: one frozen dataclass, defaults defined here only."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError


DEFAULT_MAX_BATCH = 4
DEFAULT_MAX_CONTEXT = 1024


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int | None = None  # sequences decoded together (cache rows); None: the engine's, or 4 for a torch model
    max_context: int | None = None  # prompt + generated tokens per sequence; None: the engine's, or 1024
    tree: str | tuple | list | None = None  # preset name, chain-N, JSON file or paths; None: the engine's tree or a chain
    prefill_chunk: int = 64  # prompt tokens per engine call: bounds the per-step buffers (logits are chunk x vocab)
    device: str | None = None  # torch backend: "cpu", "cuda"; None: where the model is
    threads: int | None = None  # onnxruntime intra-op threads; None: its default (physical cores)
    cuda_graph: bool = False  # tensorrt backend: capture and replay the verify step (plugin-form engines)
    verify_checksums: bool = False  # check every engine file's sha256 against the export's manifest (servers: once at load)

    def __post_init__(self):
        if self.max_batch is not None and self.max_batch < 1:
            raise MedusaError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_context is not None and self.max_context < 2:
            raise MedusaError(f"max_context must be >= 2, got {self.max_context}")
        if self.prefill_chunk < 1:
            raise MedusaError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


def default_tree(num_heads: int) -> str:
    """A chain over the heads: needs no presets file; pass ``tree=`` for a branching one."""
    return f"chain-{num_heads}"
