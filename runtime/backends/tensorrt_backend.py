"""TensorRT backend: runs the ``.plan`` engines ``medusa-export --out engine.plan`` builds.

Files: ``engine.plan`` (step), ``engine.heads.plan`` (Medusa heads), ``engine.plan.json`` (the
``EngineMeta`` sidecar), ``engine.tokenizer/``. Needs tensorrt (at least the release the plan's graph
needs, ``EngineMeta.min_tensorrt``; 10.0 for plans that predate it) and a CUDA build of torch; both are
imported only when this backend is built, never by the lean runtime.

Buffers are allocated once, in ``__init__``: one flat torch CUDA tensor per I/O tensor of each
engine, sized for its largest shape (max_batch sequences, max_tokens new tokens, max_context cache
slots), plus pinned host staging for the small per-step inputs and the ids that go back to the
host. The KV cache is the step engine's own ``past_key`` / ``past_value`` input buffer: a flat
buffer viewed as [slots, layers, B, Hkv, D] for a batch of B, so the first S slots are one
contiguous block whatever B is, and ``commit`` writes accepted nodes' K/V into it in place.

Every tensor is bound by the name the engine reports (``num_io_tensors``, ``get_tensor_name``,
``get_tensor_mode``, ``get_tensor_dtype``) and its address never changes (every view starts at the
buffer's start), so ``set_tensor_address`` runs once; a step sets the input shapes and calls
``execute_async_v3`` on the backend's stream.

Cache binding: a standard-attention engine (``attention == "onnx"``) is bound the S = max(cache
lengths) committed slots, so its cost follows the real context. A plugin-form engine is always bound
the whole cache (S = max_context): the plugin reads only slots below each sequence's length, so
the cost still follows the real context, and every input shape of a step depends on (B, T) only.
That is what makes CUDA graphs possible there: with ``cuda_graph=True`` a second context, used for
nothing else, captures a step the second time in a row it sees the same (B, T) (the verify step
of a fixed tree) and replays it while (B, T) stays; the first execution of that shape on the
context comes before the capture, as TensorRT asks.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from medusa_trt.runtime.backends.common import commit_indices
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEAD_LOGITS,
    HEAD_TOPK,
    HEADS_OUTPUTS,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    NEW_KEY,
    NEW_VALUE,
    NEXT_IDS,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    STEP_OUTPUTS,
    SUCCESSORS_OUTPUT,
    TREE_MASK,
    Proposals,
    StepCounter,
    StepOutput,
    step_shapes,
)
from medusa_trt.runtime.engine import EngineError, EngineFiles, EngineMeta, engine_meta, tensorrt_release
from medusa_trt.runtime.manifest import check_manifest

log = logging.getLogger(__name__)

INSTALL_HINT = "install TensorRT 10+ (pip install tensorrt) and a CUDA build of torch on a machine with an NVIDIA GPU"


def read_plan_meta(path) -> EngineMeta:
    """Metadata of a TensorRT engine (``path``, or an ``EngineSource``) from its sidecar ``engine.plan.json`` (an
    engine folder's config.json)."""
    files = EngineFiles.locate(path)
    if not files.step.is_file():
        raise EngineError(f"engine file {files.step} does not exist: build one with medusa-export --out {files.folder or files.step}")
    return engine_meta(path)


def _import_tensorrt():
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:  # the PyPI stub raises either when the libraries are missing
        raise EngineError(f"TensorRT engines need the tensorrt package ({' '.join(str(exc).split())[:120]}): {INSTALL_HINT}") from exc
    return trt


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise EngineError(f"TensorRT engines run on an NVIDIA GPU and torch sees none: {INSTALL_HINT}")


def check_tensorrt_release(version: str, meta: EngineMeta, plan: Path) -> None:
    """Refuse, in one line, a TensorRT older than the one the plan's graph needs (``EngineMeta.min_tensorrt``, recorded
    by the build; plans built before it was recorded need the baseline): its parser lacks an op the plan holds."""
    if tensorrt_release(version) < meta.tensorrt_floor:
        need = ".".join(map(str, meta.tensorrt_floor))
        raise EngineError(
            f"{plan} needs TensorRT {need} or newer (its graph's ops), this is TensorRT {version}: "
            "install a newer TensorRT (pip install --upgrade tensorrt) and build the plan again with it"
        )


def _register_plugin_if_possible() -> None:
    """Register the tree-attention plugin where this install can; go on without it where it cannot.

    The plan embeds the AOT plugin's kernel (PTX and launch parameters), and NVIDIA documents that an
    engine with AOT plugins runs without their Python definitions: a serving install needs neither
    ``tensorrt.plugin``'s AOT support nor triton. Registering where possible changes nothing else; if the
    plan does need the creator after all, deserializing says so in one line (``_Engine``)."""
    from medusa_trt.runtime.errors import MedusaError

    try:
        from medusa_trt.plugins.tree_attention import trt_plugin  # noqa: F401 - registers the plugin creator
    except (ImportError, MedusaError, ValueError, AttributeError, TypeError) as exc:
        log.info("tensorrt backend: plugin-form engine without the Python plugin definitions (%s)", " ".join(str(exc).split())[:160])


def _torch_dtype(trt, dtype):
    import torch

    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.bool: torch.bool,
        trt.int8: torch.int8,
        trt.uint8: torch.uint8,
    }
    if dtype not in table:
        raise EngineError(f"engine I/O tensor of type {dtype} is not supported: build the engine again with medusa-export")
    return table[dtype]


class _Engine:
    """One deserialized engine, its execution context and one max-size device buffer per I/O tensor.

    ``max_inputs`` gives each input's largest shape; output sizes are what the engine reports for
    them. Addresses are bound once; ``run`` only sets shapes."""

    def __init__(self, trt, runtime, path: Path, max_inputs: dict[str, tuple[int, ...]], outputs: tuple[str, ...], stream):
        import torch

        self.trt, self.path, self.stream = trt, path, stream
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT cannot load {path} (built by another TensorRT version or for another GPU?): build it again here")
        engine = self.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        extra = set(names) - inputs - set(outputs)
        if inputs != set(max_inputs) or not set(outputs) <= set(names) - inputs or extra - {SUCCESSORS_OUTPUT}:
            raise EngineError(f"{path} has I/O tensors {sorted(names)}, not the medusa-trt step contract: build it with medusa-export")
        self.inputs, self.outputs = tuple(max_inputs), tuple(outputs) + tuple(sorted(extra))  # the optional successors output too
        for name, shape in max_inputs.items():  # the runtime's limits must lie inside the engine's one profile
            high = tuple(engine.get_tensor_profile_shape(name, 0)[2])  # (min, opt, max)
            if any(s > h for s, h in zip(shape, high)) or len(shape) != len(high):
                raise EngineError(
                    f"{path}: input {name} needs shape up to {shape} but the engine's profile stops at {high}: "
                    "build with larger --max-batch / --max-context / --max-tokens or lower the runtime's"
                )
        self.context = self._new_context()
        for name, shape in max_inputs.items():
            self.context.set_input_shape(name, shape)
        self.max_shapes = dict(max_inputs) | {n: tuple(self.context.get_tensor_shape(n)) for n in self.outputs}
        self.buffers = {  # flat, so a view of any smaller shape starts at the same address
            n: torch.empty(math.prod(s), dtype=_torch_dtype(trt, engine.get_tensor_dtype(n)), device="cuda")
            for n, s in self.max_shapes.items()
        }
        self._bind(self.context)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _new_context(self):
        context = self.engine.create_execution_context()
        if context is None:
            raise EngineError(f"TensorRT could not create an execution context for {self.path} (out of GPU memory?)")
        context.set_optimization_profile_async(0, self.stream.cuda_stream)
        return context

    def _bind(self, context) -> None:
        for name, buffer in self.buffers.items():
            if not context.set_tensor_address(name, buffer.data_ptr()):
                raise EngineError(f"TensorRT refused the address of {name} in {self.path}")

    def view(self, name: str, shape: tuple[int, ...]):
        return self.buffers[name][: math.prod(shape)].view(shape)

    def set_shapes(self, context, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Set the input shapes; returns every tensor's shape (outputs as the engine infers them)."""
        for name, shape in shapes.items():
            if not context.set_input_shape(name, shape):
                raise EngineError(f"{self.path}: input {name} shape {shape} is outside the engine's profile")
        return dict(shapes) | {n: tuple(context.get_tensor_shape(n)) for n in self.outputs}

    def run(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        self.shapes = self.set_shapes(self.context, shapes)
        self.execute(self.context)
        return self.shapes

    def execute(self, context) -> None:
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise EngineError(f"TensorRT failed to run {self.path}; run with -v for TensorRT's log")


class TensorRTBackend:
    name = "tensorrt"

    def __init__(
        self, path, *, max_batch: int | None = None, max_context: int | None = None, cuda_graph: bool = False, checksums: bool = False
    ):
        trt = _import_tensorrt()
        import torch

        self.files = files = EngineFiles.locate(path)
        self._steps = StepCounter()
        check_manifest(files, checksums=checksums)  # sizes always; sha256 when asked (servers, once at load)
        self.meta = meta = read_plan_meta(path)  # a folder: its config.json (files.step would look for model.plan.json)
        check_tensorrt_release(str(getattr(trt, "__version__", "0")), meta, files.step)
        _require_cuda()
        self.max_batch, self.max_context = meta.check_limits(max_batch, max_context, built=True)
        if meta.key_slots:
            raise EngineError(
                f"{files.step.name} was built from a graph with key slots, which this backend does not feed: "
                "export with --no-key-slots and build again"
            )
        self.max_tokens = meta.max_tokens
        self.whole_cache = meta.attention == "plugin"  # the plugin reads committed slots only: bind them all
        if meta.attention == "plugin":
            _register_plugin_if_possible()

        self._trt_logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._trt_logger)
        self.stream = torch.cuda.Stream()
        batch, tokens, slots = self.max_batch, meta.max_tokens, self.max_context
        self.kv_shape = (meta.num_layers, meta.num_kv_heads, meta.head_dim)  # per slot and sequence
        step_max = step_shapes(batch, tokens, slots, self.kv_shape)  # the largest step: buffers are allocated for it
        self.step_engine = _Engine(trt, self._runtime, files.step, step_max, STEP_OUTPUTS, self.stream)
        self.heads_engine = None
        files.check_heads(meta.num_heads, fix="build again")
        if meta.num_heads:
            heads_inputs = {HIDDEN: (batch, meta.hidden_size)} | ({NEXT_INPUT: (batch,)} if meta.reads_roots else {})
            self.heads_engine = _Engine(trt, self._runtime, files.heads, heads_inputs, HEADS_OUTPUTS, self.stream)
        step = self.step_engine
        self._staging = {  # pinned host copies of the per-step inputs and of the ids the host reads back
            name: torch.empty(step.buffers[name].numel(), dtype=step.buffers[name].dtype, pin_memory=True)
            for name in (INPUT_IDS, POSITION_IDS, TREE_MASK, CACHE_LENGTHS, NEXT_IDS)
        }
        if self.heads_engine is not None:
            topk = self.heads_engine.buffers[HEAD_TOPK]
            self._staging[HEAD_TOPK] = torch.empty(topk.numel(), dtype=topk.dtype, pin_memory=True)
            if NEXT_INPUT in self.heads_engine.inputs:
                self._staging[NEXT_INPUT] = torch.empty(batch, dtype=torch.int64, pin_memory=True)
        width = batch * tokens  # most entries one commit copies
        self._index_host = torch.empty(3 * width, dtype=torch.int64, pin_memory=True)  # commit's (rows, src, dst)
        self._index = torch.empty(3 * width, dtype=torch.int64, device="cuda")
        self._nodes_host = torch.empty(batch, dtype=torch.int64, pin_memory=True)  # propose's nodes: its own staging, as
        self._nodes = torch.empty(batch, dtype=torch.int64, device="cuda")  # commit's copy may still be reading _index_host
        self._rows = torch.arange(batch, dtype=torch.int64, device="cuda")
        self._graph = _StepGraph(step, torch) if cuda_graph and self.whole_cache else None
        if cuda_graph and not self.whole_cache:
            log.info(
                "CUDA graphs need a plugin-form engine (fixed cache binding); %s has standard attention: running without", files.step.name
            )
        total = sum(b.numel() * b.element_size() for e in (step, self.heads_engine) if e for b in e.buffers.values())
        log.info(
            "tensorrt backend: %s, %d I/O buffers, %.1f MiB (KV cache %.1f MiB), CUDA graph %s",
            files.step.name,
            len(step.buffers) + (len(self.heads_engine.buffers) if self.heads_engine else 0),
            total / 2**20,
            2 * step.buffers[PAST_KEY].numel() * step.buffers[PAST_KEY].element_size() / 2**20,
            self._graph is not None,
        )

    # ----------------------------------------------------------------- helpers

    def _upload(self, name: str, array: np.ndarray) -> None:
        """Host array -> its pinned staging -> the engine's input buffer (async on the stream)."""
        n = array.size
        host = self._staging[name][:n]
        np.copyto(host.numpy().reshape(array.shape), array, casting="unsafe")  # int masks -> bool, int32 ids -> int64
        self.step_engine.buffers[name][:n].copy_(host, non_blocking=True)

    def _download(self, name: str, device_view) -> np.ndarray:
        """Device view -> pinned staging -> numpy view; synchronizes the stream (the host needs the ids now)."""
        host = self._staging[name][: device_view.numel()]
        host.copy_(device_view.reshape(-1), non_blocking=True)
        self.stream.synchronize()
        return host.numpy().reshape(tuple(device_view.shape))

    def _cache(self, batch: int):
        """The KV cache viewed for a batch of B: (max_context, layers, B, Hkv, D) each, in place."""
        shape = (self.max_context, self.kv_shape[0], batch, *self.kv_shape[1:])
        return self.step_engine.view(PAST_KEY, shape), self.step_engine.view(PAST_VALUE, shape)

    # ----------------------------------------------------------------- the step contract

    def describe(self) -> str:
        """The backend as a summary line names it."""
        return f"{self.name} (CUDA)"

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """input_ids/position_ids int64 [B, T], tree_mask bool [B, T, T], cache_lengths int64 [B] (``contract.Backend``).

        The argmax comes back through pinned memory; logits stay on the device until asked for. A plan
        computes them whatever ``logits`` says (plans are built from the ungated graph)."""
        import torch

        batch, tokens = input_ids.shape
        if tokens > self.max_tokens:
            raise EngineError(f"a step of {tokens} tokens exceeds the engine's max_tokens {self.max_tokens}")
        past = self.max_context if self.whole_cache else int(cache_lengths.max())  # host value: the bound cache length
        shapes = step_shapes(batch, tokens, past, self.kv_shape)
        with torch.cuda.stream(self.stream):
            for name, array in (
                (INPUT_IDS, input_ids),
                (POSITION_IDS, position_ids),
                (TREE_MASK, tree_mask),
                (CACHE_LENGTHS, cache_lengths),
            ):
                self._upload(name, np.asarray(array))
            if self._graph is not None:
                self.step_engine.shapes = self._graph.run(shapes)
            else:
                self.step_engine.run(shapes)
            next_ids = self.step_engine.view(NEXT_IDS, self.step_engine.shapes[NEXT_IDS])
            argmax = self._download(NEXT_IDS, next_ids)
            topk = None
            if SUCCESSORS_OUTPUT in self.step_engine.outputs:
                topk = (
                    self.step_engine.view(SUCCESSORS_OUTPUT, self.step_engine.shapes[SUCCESSORS_OUTPUT]).cpu().numpy()
                )  # host sync: recycle's table
        return self._steps.stamp(StepOutput(argmax, topk, self._host_logits, self._logits_rows, self._hidden_rows))

    def logits(self):
        """Base logits of the last step [B, T, V], on the device (a view of the engine's buffer)."""
        return self.step_engine.view(LOGITS, self.step_engine.shapes[LOGITS])

    def _hidden_rows(self, rows, nodes) -> np.ndarray:
        """The step's hidden state at (rows[i], nodes[i]) on the host, fp32 [N, H]."""
        hidden = self.step_engine.view(HIDDEN, self.step_engine.shapes[HIDDEN])  # (B, T, H) on the device
        picked = hidden[list(map(int, rows)), list(map(int, nodes))]  # (N, H) a small device copy
        self.stream.synchronize()
        return picked.float().cpu().numpy()

    def _logits_rows(self, rows, nodes) -> np.ndarray:
        """Base logits of the last step at (rows[i], nodes[i]) on the host, fp32 [N, V]."""
        logits = self.logits()
        picked = logits[list(map(int, rows)), list(map(int, nodes))]  # (N, V) a small device copy
        self.stream.synchronize()
        return picked.float().cpu().numpy()  # host sync: sampling walks the tree on the host

    def _host_logits(self) -> np.ndarray:
        """Base logits of the last step on the host [B, T, V] (sampling rows only)."""
        self.stream.synchronize()
        return self.logits().float().cpu().numpy()  # host sync: sampling walks the tree on the host

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` of the [slots, layers, old_batch, ...] layout to row i of the
        [slots, layers, new_batch, ...] layout (the batch size changes every element's place in the
        flat buffer). A copy of the committed slots when the row count changes; not per step."""
        import torch

        if slots == 0 or len(rows) == 0:
            return
        with torch.cuda.stream(self.stream):
            for old, new in zip(self._cache(old_batch), self._cache(new_batch)):
                moved = old[:slots, :, list(map(int, rows))].clone()  # (slots, layers, n, Hkv, D)
                new[:slots, :, : len(rows)] = moved

    def commit(self, output: StepOutput, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` (int64 [B, A]) of the step that gave ``output`` into slots
        cache_lengths[b] + 0.. in place."""
        import torch

        self._steps.check(output, "commit")
        rows, src, dst = commit_indices(nodes, counts, cache_lengths)  # each (N,) on the host
        n = rows.size
        if n == 0:
            return
        host = self._index_host[: 3 * n]
        np.copyto(host.numpy().reshape(3, n), np.stack([rows, src, dst]))
        key, value = self._cache(nodes.shape[0])
        new_key = self.step_engine.view(NEW_KEY, self.step_engine.shapes[NEW_KEY])  # (T, layers, B, Hkv, D)
        new_value = self.step_engine.view(NEW_VALUE, self.step_engine.shapes[NEW_VALUE])
        with torch.cuda.stream(self.stream):
            index = self._index[: 3 * n]
            index.copy_(host, non_blocking=True)
            rows_d, src_d, dst_d = index.view(3, n)
            key[dst_d, :, rows_d] = new_key[src_d, :, rows_d]  # (N, layers, Hkv, D)
            value[dst_d, :, rows_d] = new_value[src_d, :, rows_d]

    def expand(self, paths: list, top_k: int) -> None:
        """An exported engine's heads expand what the exporter fixed: nothing to do."""
        return None

    def propose(self, output: StepOutput, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """Medusa heads at node ``nodes[b]`` of the step that gave ``output``: top-k ids int64 [B, n, K] on the host;
        ``roots`` (B,) the next tokens, read by next-token-aware heads."""
        import torch

        self._steps.check(output, "propose")
        meta = self.meta
        if self.heads_engine is None:
            raise EngineError("this engine has no Medusa heads: use the tree chain-0")
        if top_k > meta.top_k:
            raise EngineError(f"the tree needs top-{top_k} proposals but the engine's heads return top-{meta.top_k}: build with that tree")
        batch = nodes.shape[0]
        heads = self.heads_engine
        with torch.cuda.stream(self.stream):
            index = self._nodes[:batch]
            np.copyto(self._nodes_host[:batch].numpy(), nodes)
            index.copy_(self._nodes_host[:batch], non_blocking=True)
            hidden = self.step_engine.view(HIDDEN, self.step_engine.shapes[HIDDEN])  # (B, T, H)
            heads.view(HIDDEN, (batch, meta.hidden_size)).copy_(hidden[self._rows[:batch], index])  # (B, H)
            shapes = {HIDDEN: (batch, meta.hidden_size)}
            if NEXT_INPUT in heads.inputs:
                if roots is None:
                    raise EngineError("these heads read the next token: pass roots to propose")
                staged = self._staging[NEXT_INPUT][:batch]
                np.copyto(staged.numpy(), np.asarray(roots, dtype=np.int64))
                heads.view(NEXT_INPUT, (batch,)).copy_(staged, non_blocking=True)
                shapes[NEXT_INPUT] = (batch,)
            heads.run(shapes)
            topk = heads.view(HEAD_TOPK, heads.shapes[HEAD_TOPK])  # (B, n, K)
            ids = self._download(HEAD_TOPK, topk)[:, :, :top_k]
        return Proposals(ids, self._head_logits)

    def _head_logits(self) -> np.ndarray:
        """The heads' logits [B, n, N] (N: the draft vocabulary, else V) of the last ``propose``, on the host
        (lossless drafting draws there)."""
        self.stream.synchronize()
        return self.heads_engine.view(HEAD_LOGITS, self.heads_engine.shapes[HEAD_LOGITS]).float().cpu().numpy()


class _StepGraph:
    """CUDA graph of the step for one (B, T) on a context of its own.

    The step's input shapes depend on (B, T) only (plugin-form engine, whole cache bound), and the
    addresses never change, so a graph captured for (B, T) stays valid while (B, T) does. The
    context is used for nothing but this shape: the first step of a new shape runs on the main
    context, the second in a row runs on this one and is then captured, later ones replay."""

    def __init__(self, engine: _Engine, torch):
        self.engine, self.torch = engine, torch
        self.context = engine._new_context()  # its own activation memory (engine.device_memory_size)
        engine._bind(self.context)
        self.key: tuple | None = None  # (B, T) of the captured graph
        self.graph = None
        self.previous: tuple | None = None  # (B, T) of the last step

    def run(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        key = shapes[INPUT_IDS]
        engine = self.engine
        if key == self.key:
            self.graph.replay()
            result = self.shapes
        elif key == self.previous:  # the same shape twice in a row: warm up on the graph context, then capture
            result = engine.set_shapes(self.context, shapes)
            engine.execute(self.context)
            graph = self.torch.cuda.CUDAGraph()
            with self.torch.cuda.graph(graph, stream=engine.stream, capture_error_mode="thread_local"):
                engine.execute(self.context)
            self.graph, self.key, self.shapes = graph, key, result
            log.info("captured a CUDA graph of the step for (batch, tokens) = %s", key)
        else:
            result = engine.run(shapes)
        self.previous = key
        return result
