"""An engine's metadata, ``EngineMeta``: what the step and heads graphs were exported for. It is stored as JSON under
the key ``META_KEY`` in both graphs' ``metadata_props``, in a TensorRT plan's sidecar and in an engine folder's
config.json (``runtime/engine.py``, ``runtime/engine_folder.py``). json only: no numpy, torch or onnx.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from medusa_trt.runtime.errors import EngineError

META_KEY = "medusa_trt"
FORMAT_VERSION = 1
# What every TensorRT engine needs (execute_async_v3, named I/O tensors, int64 I/O, strongly typed networks), and
# what a plan whose metadata records no min_tensorrt (built before the field existed) is taken to need.
TENSORRT_BASELINE = (10, 0)


def tensorrt_release(text: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT version string such as "10.16.1.11"."""
    parts = [int(p) for p in str(text).split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


@dataclass(frozen=True)
class EngineMeta:
    format_version: int
    model: str  # what the base model was loaded from (name or path), for benchmarks and humans
    architecture: str  # the model's model_type: llama, qwen3, gemma2, mixtral, ...
    dtype: str  # fp32 | fp16 | bf16 (weights, KV cache, logits; bf16 for TensorRT only)
    vocab_size: int
    hidden_size: int  # width of the head-input hidden state
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # Medusa heads (0: plain decoding only)
    top_k: int  # proposals per head the heads graph returns
    tree: list  # default tree: list of paths
    tree_name: str
    max_batch: int
    max_context: int
    max_tokens: int  # most new tokens one step takes (tree nodes, prefill chunk)
    eos_token_ids: list
    is_chat: bool
    quantization: str = "none"  # none | int8 (dynamic, weight matmuls) | heads-int8 (the heads graph only)
    attention: str = "onnx"  # onnx: standard ops | plugin: one medusa_trt::TreeAttention node per layer
    successors: int = 0  # k of the step graph's next_topk output (0: engines exported before it)
    # what the heads graph reads: "hidden", "hidden+next" (also root_ids, the next token) or "hidden+path" (sequential
    # heads: root_ids too, and the graph expands the tree's template, one proposals row per expanded node)
    head_input: str = "hidden"
    draft_vocab: int | None = None  # the heads graph's logits cover token ids 0 .. N-1 only (None: the whole vocabulary)
    key_slots: bool = False  # the step graph takes key_slots [B, T] (runtime/key_slots.py); engines before it append the new keys
    # the oldest TensorRT ("10.15") whose ONNX parser imports every op of the graphs the plans were built from
    # (exporter/tensorrt_ops.py), recorded by the TensorRT build; None: not built yet, or built before the field (the
    # baseline). Not part of the graphs' identity: a built folder's config.json has it, its ONNX graphs do not.
    min_tensorrt: str | None = dataclasses.field(default=None, compare=False)

    @property
    def tensorrt_floor(self) -> tuple[int, int]:
        """(major, minor) of the oldest TensorRT this engine's plans build and run with."""
        return tensorrt_release(self.min_tensorrt) if self.min_tensorrt else TENSORRT_BASELINE

    @property
    def reads_roots(self) -> bool:
        """The heads graph takes root_ids (the next token) as a second input."""
        return self.head_input != "hidden"

    @property
    def expansion(self):
        """Sequential heads: the template expansion the heads graph computes (``drafting.sequential``); else None."""
        if self.head_input != "hidden+path":
            return None
        from medusa_trt.runtime.drafting.sequential import expansion

        return expansion([tuple(p) for p in self.tree])

    @property
    def proposal_rows(self) -> int:
        """Rows of the heads graph's outputs per sequence: one per head, or one per expanded template node."""
        plan = self.expansion
        return self.num_heads if plan is None else plan.rows

    @property
    def heads_vocab(self) -> int:
        """Columns of the heads graph's logits: its top-k ids index them directly."""
        return self.draft_vocab or self.vocab_size

    def check_limits(self, max_batch: int | None, max_context: int | None, *, built: bool = False) -> tuple[int, int]:
        """The max batch and context a backend allocates for: those asked (None: the engine's own),
        refused past what the engine was exported (``built``: a TensorRT plan built) for."""
        batch, context = max_batch or self.max_batch, max_context or self.max_context
        if batch > self.max_batch or context > self.max_context:
            made, again = ("built", "build") if built else ("exported", "export")
            raise EngineError(
                f"runtime asks for max_batch {batch} / max_context {context} but the engine was {made} for "
                f"{self.max_batch} / {self.max_context}: {again} again with larger --max-batch / --max-context"
            )
        return batch, context

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> EngineMeta:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise EngineError(f"{source}: engine metadata is not valid JSON ({exc}): export the engine again") from exc
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineError(f"{source}: engine format version {version}, this runtime reads {FORMAT_VERSION}: export it again")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        optional = {f.name for f in fields if f.default is not dataclasses.MISSING}  # added later, with a default for older engines
        missing = names - set(raw) - optional
        if missing:
            raise EngineError(f"{source}: engine metadata lacks {sorted(missing)}: export it again")
        return cls(**{k: v for k, v in raw.items() if k in names})


def precision_name(dtype: str, quantization: str) -> str:
    """An engine's precision as the outputs name it: its quantization ("int8-channel", "int4"), else its dtype ("fp32");
    the heads-only quantization keeps the step's dtype ("fp32, int8 heads")."""
    if quantization == "heads-int8":
        return f"{dtype}, int8 heads"
    return dtype if quantization in ("none", None) else quantization
