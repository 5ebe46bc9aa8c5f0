"""The export of a model whose fp32 weights do not fit in memory: traced without its weights, which are read from the
checkpoint one tensor at a time as the engine is written.

A 7B model is 27 GB in fp32; this machine class has 24 GiB. ``models.load_base_model(..., weights=False)`` builds the
model from its config with storage that is allocated but never touched (no page is resident), so tracing it costs
the graph, not the weights. :func:`stream_weights` then gives every initializer the trace took from a model
parameter its checkpoint tensor instead: small ones at once, large ones as recipes (``exporter/lazy_weights.py``) that
read and convert the one tensor when the engine is written. A ``Transpose`` of a large weight (each ``Linear``'s
``x @ W.T``), which the optimizer would fold by computing it, becomes a recipe for the transposed weight: the folded
graph, node for node, as an export in memory writes it. The graph passes then run as they always do (lean, the
quantizers: int8-channel one weight at a time, MatMulNBits with each weight made for its own call), and
``lazy_weights.save`` writes the weights one at a time: memory holds the final weights once (int8: a quarter of fp32,
int4 an eighth) plus the tensor being made.

What it does not do: check the engine against the torch model (that needs the weights in memory; the exactness
probe on the exported engine still runs), read a checkpoint whose tensors ``transformers`` renames or converts at
load (a weight missing by name is refused, naming it), or quantize ``--quantize int8`` (ONNX Runtime's dynamic
quantizer, a pass over files, reads every weight at once).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.exporter import lazy_weights
from medusa_trt.exporter.errors import ExportError

log = logging.getLogger(__name__)

EAGER_ELEMENTS = 1 << 16  # checkpoint tensors this small are read at once (norms, biases); larger ones when written
MEMORY_SHARE = 0.5  # stream when the fp32 weights exceed this share of the memory available now
# what a streamed export quantizes: each weight (or fused group) alone (--quantize int8's pass reads every weight at once)
STREAMED_QUANTIZE = (None, "none", "int8-channel", "int4", "int8-block", "heads-int8")


@dataclass(frozen=True)
class Checkpoint:
    """The safetensors files of a Hugging Face folder: tensor name -> file."""

    folder: Path
    files: dict[str, Path]

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint | None:
        """The folder's checkpoint; None where it has no safetensors (a .gguf, a .bin checkpoint)."""
        from safetensors import safe_open

        folder = Path(folder)
        if not folder.is_dir():
            return None
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            mapping = json.loads(index.read_text())["weight_map"]
            return cls(folder, {name: folder / file for name, file in mapping.items()})
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return None
        from medusa_trt.exporter.models import _bad_weights, _weights_errors

        names = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    names.update({name: file for name in f.keys()})
            except _weights_errors() as exc:
                raise _bad_weights(file, exc) from None  # the file named
        return cls(folder, names)

    def fp32_bytes(self) -> int:
        """Bytes of every tensor in fp32 (what an export in memory holds)."""
        from safetensors import safe_open

        total = 0
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as f:
                total += sum(4 * int(np.prod(f.get_slice(name).get_shape(), dtype=np.int64)) for name in f.keys())
        return total

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """One tensor, converted to ``dtype``."""
        import torch
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            t = f.get_tensor(name)
        return t.to(getattr(torch, np.dtype(dtype).name)).numpy()


def available_memory() -> int:
    """Bytes the kernel says a new process can take now (MemAvailable); 0 where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def should_stream(model: str, asked: bool | None) -> Checkpoint | None:
    """The checkpoint to stream from: where ``asked`` (--stream-weights), or where ``asked`` is None and the model's
    fp32 weights exceed ``MEMORY_SHARE`` of the memory available. None: export in memory."""
    from medusa_trt.exporter.models import BUILTIN_MODELS, ModelLoadError, _bad_weights, _weights_errors

    if asked is False or model in BUILTIN_MODELS:
        return None
    folder = Path(model).expanduser()
    try:
        checkpoint = Checkpoint.open(folder)
        need = checkpoint.fp32_bytes() if checkpoint is not None and not asked else 0
    except (ModelLoadError, *_weights_errors(), OSError, ValueError, KeyError) as exc:  # a corrupt file or index
        if asked:
            raise exc if isinstance(exc, ModelLoadError) else _bad_weights(folder, exc) from None
        return None  # the model's loader says what is wrong with it, as for any export
    if checkpoint is None:
        if asked:
            raise ExportError(f"--stream-weights reads a folder's safetensors files, which {model} has none of: drop --stream-weights")
        return None
    if asked:
        return checkpoint
    have = available_memory()
    if have and need > MEMORY_SHARE * have:
        log.info(
            "%s: its fp32 weights (%.1f GB) exceed half the memory available (%.1f GB): streaming them from its checkpoint "
            "(--no-stream-weights exports in memory)",
            model,
            need / 1e9,
            have / 1e9,
        )
        return checkpoint
    return None


def check_streamable(quantize: str | None, dtype: str) -> None:
    """A streamed export's quantization and dtype, refused before any work where it cannot stream them."""
    if quantize not in STREAMED_QUANTIZE:
        raise ExportError(
            f"--quantize {quantize} reads every weight at once, which a streamed export (weights larger than memory) "
            "cannot: use --quantize int8-channel or int4, or export on a machine with memory for the fp32 model"
        )
    if dtype != "fp32":
        raise ExportError(f"--dtype {dtype}: a streamed export writes fp32 engines (quantized or not): drop --dtype")


def stream_weights(ir_model, module, checkpoint: Checkpoint, store: lazy_weights.LazyWeights) -> int:
    """Give each initializer of ``ir_model`` (a traced program's graph) taken from a parameter of ``module`` (the
    weightless model) its checkpoint tensor, large ones lazily; fold ``Transpose``s of large weights into lazy
    transposed weights. Returns how many weights are lazy."""
    import onnx_ir as ir

    names: dict[int, list[str]] = {}  # a parameter's storage -> its names (a tied weight has two)
    base = getattr(module, "base", module)
    for name, p in base.named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
    # buffers the checkpoint holds (persistent ones) from it too; the others (rotary tables) as the config made them
    buffers = {b.data_ptr(): [name] for name, b in base.named_buffers(remove_duplicate=False) if name in checkpoint.files}
    lazy = 0
    graph = ir_model.graph
    for value in list(graph.initializers.values()):
        raw = getattr(value.const_value, "raw", None)
        ptr = raw.data_ptr() if raw is not None and hasattr(raw, "data_ptr") else None
        if ptr not in names and ptr not in buffers:
            continue  # a constant the trace made (a shape, a computed buffer), or one of the heads' own weights: as traced
        candidates = names.get(ptr) or buffers[ptr]
        key = next((n for n in candidates if n in checkpoint.files), None)
        if key is None:
            raise ExportError(
                f"{checkpoint.folder} has no tensor {' or '.join(candidates)}: its checkpoint names weights as transformers "
                "converts them at load, which a streamed export (weights larger than memory) does not read; export it "
                "on a machine with memory for the fp32 model"
            )
        shape = tuple(raw.shape)
        if tuple(checkpoint_shape(checkpoint, key)) != shape:
            raise ExportError(
                f"{checkpoint.folder}: tensor {key} is {list(checkpoint_shape(checkpoint, key))}, its config says {list(shape)}"
            )
        if raw.numel() <= EAGER_ELEMENTS:
            value.const_value = ir.tensor(checkpoint.tensor(key, _numpy_dtype(raw)), name=value.name)
        else:
            value.const_value = store.ir_tensor(value.name, shape, np.float32, lambda key=key: checkpoint.tensor(key))
            lazy += 1
    _fold_lazy_transposes(graph, store)
    return lazy


def _numpy_dtype(t) -> np.dtype:
    """A torch tensor's dtype as numpy's (a buffer may hold integers; the weights are float32)."""
    import torch

    return np.dtype(torch.empty((), dtype=t.dtype).numpy().dtype)


def checkpoint_shape(checkpoint: Checkpoint, key: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(checkpoint.files[key]), framework="pt") as f:
        return f.get_slice(key).get_shape()


def _fold_lazy_transposes(graph, store: lazy_weights.LazyWeights) -> None:
    """``Transpose(W)`` of a lazy 2-D weight read by that node alone: the transposed weight, lazy, under the node's
    output name (as constant folding names what it folds)."""
    import onnx_ir as ir

    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        tensor = source.const_value if source is not None and source.is_initializer() else None
        perm = node.attributes.get("perm")
        if not isinstance(tensor, ir.ExternalTensor) or tensor.location != lazy_weights.LAZY or len(tensor.shape) != 2:
            continue
        if (perm is not None and list(perm.as_ints()) != [1, 0]) or len(source.uses()) != 1:
            continue
        out = node.outputs[0]
        rows, cols = (int(d) for d in tensor.shape)
        made = store.recipe(tensor.offset).make
        folded = ir.Value(name=out.name, shape=ir.Shape([cols, rows]), type=ir.TensorType(ir.DataType.FLOAT))
        folded.const_value = store.ir_tensor(out.name, (cols, rows), np.float32, lambda made=made: np.ascontiguousarray(made().T))
        out.name = None
        out.replace_all_uses_with(folded, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        graph.register_initializer(folded)
