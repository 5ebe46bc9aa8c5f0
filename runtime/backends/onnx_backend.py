"""ONNX Runtime backend: numpy + onnxruntime only (no torch, no transformers).

Buffers are allocated once: the KV cache (slot-major, [slots, layers, max_batch, Hkv, D] worth of
elements) and every output at its largest size (max_batch x max_tokens). Each step binds
views of them through IOBinding, so ONNX Runtime reads the first S = max(cache_lengths) cache
slots in place and writes outputs straight into the preallocated memory. For a batch of B
sequences the flat cache is viewed as [slots, layers, B, Hkv, D], which keeps the first S slots
one contiguous block whatever B is.
"""

from __future__ import annotations

import logging

import numpy as np

from medusa_trt.runtime.backends.common import commit_indices
from medusa_trt.runtime.contract import NEXT_INPUT, STEP_INPUTS, SUCCESSORS_OUTPUT, Proposals, StepOutput
from medusa_trt.runtime.engine import EngineError, EngineFiles, EngineMeta, check_folder_meta, open_session, read_meta
from medusa_trt.runtime.manifest import check_manifest

log = logging.getLogger(__name__)

DTYPES = {"fp32": np.float32, "fp16": np.float16}


def default_providers() -> list[str]:
    """CUDA when onnxruntime-gpu is installed and sees a GPU, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in available else ["CPUExecutionProvider"]


class OnnxBackend:
    name = "onnxruntime"

    def __init__(self, path, *, max_batch: int | None = None, max_context: int | None = None, providers=None, threads: int | None = None,
                 checksums: bool = False):
        import onnxruntime as ort

        files = EngineFiles.locate(path).onnx  # a file and its siblings, or a folder (its ONNX graphs)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads

        providers = providers or default_providers()
        if files.heads.is_file():
            # Step and heads sessions alternate every step: threads that spin after a run (ONNX
            # Runtime's default) steal the cores the other session needs next (measured: a
            # 3-node verify step took 46 ms instead of 35 ms). A plain-only engine keeps spinning.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if not files.step.is_file():
            raise EngineError(f"engine file {files.step} does not exist: export one with medusa-export --out {files.step}")
        check_manifest(files, checksums=checksums)  # sizes always; sha256 when asked (servers, once at load)
        self.session = open_session(files.step, options, providers)
        self.meta: EngineMeta = read_meta(files.step, self.session)
        check_folder_meta(files, self.meta)
        meta = self.meta
        self.files = files
        self.heads_session = None
        if meta.num_heads:
            if not files.heads.is_file():
                raise EngineError(f"{files.heads} is missing: the engine has {meta.num_heads} heads; copy it beside {files.step} or export again")
            self.heads_session = open_session(files.heads, options, providers)
            heads_meta = read_meta(files.heads, self.heads_session)
            if heads_meta != meta:
                raise EngineError(f"{files.heads} belongs to another engine than {files.step} (their metadata differ): "
                                  "keep the files of one export together or export again")
            inputs = {i.name for i in self.heads_session.get_inputs()}
            if (NEXT_INPUT in inputs) != (meta.head_input == "hidden+next"):
                raise EngineError(f"{files.heads} takes inputs {sorted(inputs)} but the engine says its heads read "
                                  f"{meta.head_input}: export again")
        self.max_batch, self.max_context = max_batch or meta.max_batch, max_context or meta.max_context
        if self.max_batch > meta.max_batch or self.max_context > meta.max_context:
            raise EngineError(
                f"runtime asks for max_batch {self.max_batch} / max_context {self.max_context} but the engine was exported for "
                f"{meta.max_batch} / {meta.max_context}: export again with larger --max-batch / --max-context"
            )
        self.max_tokens = meta.max_tokens  # most new tokens one step takes
        if meta.dtype not in DTYPES:
            raise EngineError(f"{files.step} holds {meta.dtype} weights, which ONNX Runtime on this machine cannot run: "
                              f"export with --dtype fp32 or fp16 for ONNX Runtime ({meta.dtype} is for TensorRT plans)")
        self.dtype = DTYPES[meta.dtype]
        kv_row = meta.num_layers * meta.num_kv_heads * meta.head_dim  # elements per slot per sequence
        self.kv_row = kv_row
        self._key = np.zeros(self.max_context * self.max_batch * kv_row, dtype=self.dtype)  # flat: viewed per batch size
        self._value = np.zeros_like(self._key)
        width = self.max_batch * meta.max_tokens
        self._out = {
            "logits": np.zeros(width * meta.vocab_size, dtype=self.dtype),
            "hidden": np.zeros(width * meta.hidden_size, dtype=self.dtype),
            "next_ids": np.zeros(width, dtype=np.int64),
            "new_key": np.zeros(width * kv_row, dtype=self.dtype),
            "new_value": np.zeros(width * kv_row, dtype=self.dtype),
        }
        self.successors = meta.successors if SUCCESSORS_OUTPUT in {o.name for o in self.session.get_outputs()} else 0
        if self.successors:
            self._out[SUCCESSORS_OUTPUT] = np.zeros(width * self.successors, dtype=np.int64)
        else:
            log.info("%s has no %s output (exported before it): the recycle drafter learns the argmax only", files.step.name,
                     SUCCESSORS_OUTPUT)
        if meta.num_heads:
            self._head_logits = np.zeros(self.max_batch * meta.num_heads * meta.vocab_size, dtype=np.float32)
            self._head_topk = np.zeros(self.max_batch * meta.num_heads * meta.top_k, dtype=np.int64)
        self._binding = self.session.io_binding()
        self._views: dict[str, np.ndarray] = {}
        self._batch = 0
        log.info("onnxruntime backend (%s): KV cache %.1f MiB, outputs %.1f MiB", providers[0],
                 2 * self._key.nbytes / 2**20, sum(a.nbytes for a in self._out.values()) / 2**20)

    def _cache_views(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return self._layout(self._key, batch), self._layout(self._value, batch)

    def _view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._out[name][: int(np.prod(shape))].reshape(shape)

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray) -> StepOutput:
        """The step contract (``contract.Backend``); outputs are views of the preallocated buffers."""
        batch, tokens = input_ids.shape
        if tokens > self.meta.max_tokens:
            raise EngineError(f"a step of {tokens} tokens exceeds the engine's max_tokens {self.meta.max_tokens}")
        meta = self.meta
        key, value = self._cache_views(batch)
        past = int(cache_lengths.max())  # host value: the bound view's length
        inputs = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
            "tree_mask": np.ascontiguousarray(tree_mask, dtype=bool),
            "cache_lengths": np.ascontiguousarray(cache_lengths, dtype=np.int64),
            "past_key": key[:past],  # contiguous: slot-major layout
            "past_value": value[:past],
        }
        kv = (tokens, meta.num_layers, batch, meta.num_kv_heads, meta.head_dim)
        self._views = {
            "logits": self._view("logits", (batch, tokens, meta.vocab_size)),
            "hidden": self._view("hidden", (batch, tokens, meta.hidden_size)),
            "next_ids": self._view("next_ids", (batch, tokens)),
            "new_key": self._view("new_key", kv),
            "new_value": self._view("new_value", kv),
        }
        if self.successors:
            self._views[SUCCESSORS_OUTPUT] = self._view(SUCCESSORS_OUTPUT, (batch, tokens, self.successors))
        io = self._binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        for name in STEP_INPUTS:
            io.bind_cpu_input(name, inputs[name])
        for name, array in self._views.items():
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self.session.run_with_iobinding(io)
        logits, hidden = self._views["logits"], self._views["hidden"]
        return StepOutput(self._views["next_ids"], self._views.get(SUCCESSORS_OUTPUT), lambda: logits, lambda rows, nodes: logits[rows, nodes],
                          lambda rows, nodes: hidden[rows, nodes].astype(np.float32))

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` of the [slots, layers, old_batch, ...] layout to row i of the
        [slots, layers, new_batch, ...] layout (the batch size changes every element's place in
        the flat buffer). Copies the first ``slots`` slots once; not per step."""
        if slots == 0 or len(rows) == 0:
            return
        for flat in (self._key, self._value):
            old = self._layout(flat, old_batch)[:slots]
            moved = old[:, :, rows].copy()  # (slots, layers, n, Hkv, D)
            self._layout(flat, new_batch)[:slots, :, : len(rows)] = moved

    def _layout(self, flat: np.ndarray, batch: int) -> np.ndarray:
        shape = (self.max_context, self.meta.num_layers, batch, self.meta.num_kv_heads, self.meta.head_dim)
        return flat[: int(np.prod(shape))].reshape(shape)

    def commit(self, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` into slots cache_lengths[b] + 0.. in place."""
        key, value = self._cache_views(nodes.shape[0])
        rows, src, dst = commit_indices(nodes, counts, cache_lengths)
        key[dst, :, rows] = self._views["new_key"][src, :, rows]
        value[dst, :, rows] = self._views["new_value"][src, :, rows]

    def propose(self, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """Medusa heads at node ``nodes[b]`` of the last step: top-k ids (B, n, K), logits views;
        ``roots`` (B,) the next tokens, read by next-token-aware heads."""
        meta = self.meta
        if top_k > meta.top_k:
            raise EngineError(f"the tree needs top-{top_k} proposals but the engine's heads return top-{meta.top_k}: export with that tree")
        batch = nodes.shape[0]
        hidden = np.ascontiguousarray(self._views["hidden"][np.arange(batch), nodes])  # (B, H)
        topk = self._head_topk[: batch * meta.num_heads * meta.top_k].reshape(batch, meta.num_heads, meta.top_k)
        head_logits = self._head_logits[: batch * meta.num_heads * meta.vocab_size].reshape(batch, meta.num_heads, meta.vocab_size)
        io = self.heads_session.io_binding()
        io.bind_cpu_input("hidden", hidden)
        if meta.head_input == "hidden+next":
            if roots is None:
                raise EngineError("these heads read the next token: pass roots to propose")
            io.bind_cpu_input(NEXT_INPUT, np.ascontiguousarray(roots, dtype=np.int64))
        io.bind_output("head_topk", "cpu", 0, np.int64, list(topk.shape), topk.ctypes.data)
        io.bind_output("head_logits", "cpu", 0, np.float32, list(head_logits.shape), head_logits.ctypes.data)
        self.heads_session.run_with_iobinding(io)
        return Proposals(topk[:, :, :top_k], lambda: head_logits)

