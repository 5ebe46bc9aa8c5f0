"""ONNX Runtime backend: numpy + onnxruntime only (no torch, no transformers).

Buffers are allocated once: the KV cache (slot-major, [slots, layers, max_batch, Hkv, D] worth of
elements) and every output at its largest size (max_batch x max_tokens). Each step binds
views of them through IOBinding, so ONNX Runtime reads the first S = max(cache_lengths) cache
slots in place and writes outputs straight into the preallocated memory. For a batch of B
sequences the flat cache is viewed as [slots, layers, B, Hkv, D], which keeps the first S slots
one contiguous block whatever B is.

Where the buffers live is ``ort_buffers``' business: host numpy arrays on the CPU provider; with
the CUDA provider (onnxruntime-gpu) CUDA ``OrtValue`` s, so the cache and the float outputs stay
on the GPU, the commit runs there and only the ids and the rows the loop reads come back.
"""

from __future__ import annotations

import logging

import numpy as np

from medusa_trt.runtime import key_slots
from medusa_trt.runtime.backends.common import check_proposal, commit_indices
from medusa_trt.runtime.backends.ort_buffers import BufferSizes, DeviceBuffers, HostBuffers, StepBuffers
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEADS_INPUTS,
    HEADS_OUTPUTS,
    INPUT_IDS,
    LOGITS_WANTED_INPUT,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    STEP_INPUTS,
    SUCCESSORS_OUTPUT,
    TREE_MASK,
    Proposals,
    StepCounter,
    StepOutput,
)
from medusa_trt.runtime.engine import (
    EngineError,
    EngineFiles,
    EngineMeta,
    EngineSource,
    check_folder_meta,
    engine_meta,
    open_session,
    read_meta,
)
from medusa_trt.runtime.manifest import check_manifest

log = logging.getLogger(__name__)

DTYPES = {"fp32": np.float32, "fp16": np.float16}
BUFFERS = ("auto", "host", "device")  # auto: device buffers on the CUDA provider, host buffers otherwise
_LANES: dict[tuple, int | None] = {}  # key slots' measured lane count per (head_dim, groups, dtype, provider, threads)
_WANTED = {flag: np.array(flag) for flag in (False, True)}  # the gate's scalar input, made once
SMALL_INPUTS = tuple(n for n in STEP_INPUTS if n not in (PAST_KEY, PAST_VALUE))  # from the host; buffers bind the cache


# ONNX Runtime fuses the step graph's per-layer Gathers of the cache (one layer's slots each) into one Split of
# the whole cache before layer 0; unfused, each layer copies its slots just before it reads them, while they are
# still in cache. Outputs are the same bit for bit (the same copies). int8-channel SmolLM2, 2 threads, 29 dev prompts,
# interleaved in one run: plain 69.9 -> 74.0 tok/s, drafted 89.8 -> 94.0, tokens identical (docs/results/bench-nosplit-ab.json).
STEP_DISABLED_OPTIMIZERS = ["GatherSliceToSplitFusion"]


def session_options(threads: int | None, *, spin: bool):
    """Session options of the step graph (``spin``) and of the heads graph.

    The step session keeps ONNX Runtime's default: its pool threads spin between parallel sections
    and between calls instead of sleeping, which a decoding loop's thousands of small kernels per
    step pay for in wake-ups otherwise (int8-channel SmolLM2 engine, 2 threads, 29 dev prompts, against
    both sessions sleeping, interleaved in one run: plain 52.9 -> 63.2 tokens/s, drafted 79.7 -> 88.3,
    tokens identical; docs/results/bench-spin-ab.json). The heads session runs between two steps: its threads
    sleep after a call so they never spin on the cores the step session's threads need next."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def heads_session_options(threads: int | None):
    """The heads graph's session options: its threads sleep after a call (``session_options``)."""
    return session_options(threads, spin=False)


def is_gated(session) -> bool:
    """Whether a step session's graph has the ``logits_wanted`` input (exporter/logits_gate.py)."""
    return LOGITS_WANTED_INPUT in {i.name for i in session.get_inputs()}


def with_gate(session, feeds: dict) -> dict:
    """``feeds`` of a step graph run, with ``logits_wanted`` True where the graph has that input (its logits computed)."""
    return feeds | {LOGITS_WANTED_INPUT: _WANTED[True]} if is_gated(session) else feeds


def checked_files(path, *, checksums: bool) -> tuple[EngineFiles, EngineMeta]:
    """An ONNX engine's files and metadata for a backend that opens its graphs itself (OpenVINO, native): the step
    graph there, the files' sizes (sha256 too with ``checksums``) against the manifest, the metadata read from the
    step graph and checked against a folder's config.json."""
    source = EngineSource.read(path)  # a file and its siblings, or a folder: read once
    files = source.files.onnx  # its ONNX graphs
    if not files.step.is_file():
        raise EngineError(f"engine file {files.step} does not exist: export one with medusa-export --out {files.step}")
    check_manifest(files, checksums=checksums)
    meta = engine_meta(files.step)
    check_folder_meta(files, meta, source.folder)
    return files, meta


def open_heads(files: EngineFiles, meta: EngineMeta, options, providers):
    """The heads graph's ONNX Runtime session (None: the engine has no heads), checked against the step graph's
    metadata and the inputs the engine says its heads read."""
    files.check_heads(meta.num_heads)
    if not meta.num_heads:
        return None
    session = open_session(files.heads, options, providers)
    if read_meta(files.heads, session) != meta:
        raise EngineError(
            f"{files.heads} belongs to another engine than {files.step} (their metadata differ): "
            "keep the files of one export together or export again"
        )
    inputs = {i.name for i in session.get_inputs()}
    if (NEXT_INPUT in inputs) != meta.reads_roots:
        raise EngineError(f"{files.heads} takes inputs {sorted(inputs)} but the engine says its heads read {meta.head_input}: export again")
    return session


class OrtHeads:
    """The heads graph's ONNX Runtime session (CPU provider) as a ``host_backend.HostHeads``: a call binds the named
    host arrays through IOBinding, the inputs (HIDDEN, NEXT_INPUT) in place and the outputs (HEAD_TOPK, HEAD_LOGITS)
    by address, so ONNX Runtime writes them into the arrays given."""

    confidence = False  # the loop computes HEAD_CONFIDENCE from the logits

    def __init__(self, session):
        self.session = session

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        io = self.session.io_binding()
        inputs = {name: np.ascontiguousarray(a) for name, a in arrays.items() if name not in HEADS_OUTPUTS}  # alive through the run
        for name, array in inputs.items():
            io.bind_cpu_input(name, array)
        for name in HEADS_OUTPUTS:
            array = arrays[name]
            assert array.flags.c_contiguous, name  # written in place at its address
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self.session.run_with_iobinding(io)


def default_providers() -> list[str]:
    """CUDA when onnxruntime-gpu is installed and sees a GPU, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in available else ["CPUExecutionProvider"]


class OnnxBackend:
    name = "onnxruntime"

    def __init__(
        self,
        path,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        providers=None,
        threads: int | None = None,
        checksums: bool = False,
        buffers: str = "auto",
        profile: str | None = None,
    ):
        source = EngineSource.read(path)  # a file and its siblings, or a folder (its config.json read once)
        files = source.files.onnx  # its ONNX graphs
        self.threads = threads  # None: ONNX Runtime's own count (one per physical core)
        self._steps = StepCounter()
        options, heads_options = session_options(threads, spin=True), session_options(threads, spin=False)
        if profile:  # ONNX Runtime's per-node trace of the step session (scripts/step_profile.py): self.session.end_profiling()
            options.enable_profiling, options.profile_file_prefix = True, profile
        providers = providers or default_providers()
        if not files.step.is_file():
            raise EngineError(f"engine file {files.step} does not exist: export one with medusa-export --out {files.step}")
        check_manifest(files, checksums=checksums)  # sizes always; sha256 when asked (servers, once at load)
        self.session = open_session(files.step, options, providers, disabled_optimizers=STEP_DISABLED_OPTIMIZERS)
        self.meta: EngineMeta = read_meta(files.step, self.session)
        check_folder_meta(files, self.meta, source.folder)
        meta = self.meta
        self.files = files
        self.heads_session = open_heads(files, meta, heads_options, providers)
        self.max_batch, self.max_context = meta.check_limits(max_batch, max_context)
        self.max_tokens = meta.max_tokens  # most new tokens one step takes
        if meta.dtype not in DTYPES:
            raise EngineError(
                f"{files.step} holds {meta.dtype} weights, which ONNX Runtime on this machine cannot run: "
                f"export with --dtype fp32 or fp16 for ONNX Runtime ({meta.dtype} is for TensorRT plans)"
            )
        self.dtype = DTYPES[meta.dtype]
        self.successors = meta.successors if SUCCESSORS_OUTPUT in {o.name for o in self.session.get_outputs()} else 0
        if not self.successors:
            log.info(
                "%s has no %s output (exported before it): the recycle drafter learns the argmax only", files.step.name, SUCCESSORS_OUTPUT
            )
        # engines with key slots scatter a tree's keys past the cache length: slack slots keep them in the buffer
        self.slots = self.max_context + (key_slots.slack(meta.max_tokens) if meta.key_slots else 0)
        sizes = BufferSizes.of(meta, max_batch=self.max_batch, max_context=self.slots, dtype=self.dtype, successors=self.successors)
        self.buffers: StepBuffers = self._buffers(buffers, sizes)
        self.kv_row = sizes.kv_row
        self._binding = self.session.io_binding()
        self.gated = is_gated(self.session)  # the lm_head behind an If (exporter/logits_gate.py)
        self.key_lanes = None  # key slots' lane count on this machine (runtime/key_slots.py); None: the appended layout
        if meta.key_slots and self.session.get_providers()[0] == "CPUExecutionProvider":  # the probed kernels; no claim elsewhere
            self.key_lanes = self._probe_lanes(files, threads)
        log.info(
            "onnxruntime backend (%s, %s buffers): KV cache %.1f MiB, outputs %.1f MiB",
            self.session.get_providers()[0],
            type(self.buffers).__name__,
            self.buffers.cache_bytes / 2**20,
            self.buffers.output_bytes / 2**20,
        )

    def _probe_lanes(self, files: EngineFiles, threads: int | None) -> int | None:
        """The attention's lane count for key slots on this machine, measured once per head size, dtype,
        provider and thread count in a process (``key_slots.probe_lanes``)."""
        groups = max(1, self.meta.hidden_size // self.meta.head_dim // self.meta.num_kv_heads)  # query heads per KV head
        key = (self.meta.head_dim, groups, self.meta.dtype, self.session.get_providers()[0], threads)
        if key not in _LANES:
            _LANES[key] = key_slots.probe_lanes(self.meta.head_dim, groups, self.dtype, self.session.get_providers(), threads)
            if _LANES[key] is None:
                log.warning(
                    "%s: no lane count in %s makes ONNX Runtime's attention lay a tree out as plain steps on this machine; "
                    "drafted output equals plain output to float rounding only",
                    files.step.name,
                    key_slots.LANES,
                )
            else:
                log.info("key slots at %d lanes: a verify step is a plain step, bit for bit", _LANES[key])
        return _LANES[key]

    def _buffers(self, kind: str, sizes: BufferSizes) -> StepBuffers:
        """Device buffers where the step session runs on CUDA (``"device"`` forces them: on the CPU
        provider they are CPU ``OrtValue`` s, the same code path), host buffers otherwise."""
        if kind not in BUFFERS:
            raise EngineError(f"buffers {kind!r} is not one of {', '.join(BUFFERS)}")
        provider = self.session.get_providers()[0]  # what ONNX Runtime really chose (it falls back to CPU quietly)
        if provider == "CUDAExecutionProvider" and kind != "host":
            device_id = int(self.session.get_provider_options()[provider].get("device_id", 0))
            return DeviceBuffers(sizes, device="cuda", device_id=device_id)
        if kind == "device":
            return DeviceBuffers(sizes, device="cpu")
        return HostBuffers(sizes)

    @property
    def _key(self):
        """The flat key cache (numpy for host buffers, an OrtValue for device ones)."""
        return self.buffers.key

    def describe(self) -> str:
        """The backend as a summary line names it: ``onnxruntime (CPUExecutionProvider, 2 threads)``."""
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else "its default threads"
        return f"{self.name} ({self.session.get_providers()[0]}, {threads})"

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """The step contract (``contract.Backend``); outputs are views of the preallocated buffers. ``logits`` False
        on a gated graph (exporter/logits_gate.py) skips the lm_head and binds none of its outputs."""
        batch, tokens = input_ids.shape
        if tokens > self.meta.max_tokens:
            raise EngineError(f"a step of {tokens} tokens exceeds the engine's max_tokens {self.meta.max_tokens}")
        past = int(cache_lengths.max())  # host value: the bound view's length
        small, exact = SMALL_INPUTS, None
        inputs = {
            INPUT_IDS: np.ascontiguousarray(input_ids, dtype=np.int64),
            POSITION_IDS: np.ascontiguousarray(position_ids, dtype=np.int64),
            TREE_MASK: np.ascontiguousarray(tree_mask, dtype=bool),
            CACHE_LENGTHS: np.ascontiguousarray(cache_lengths, dtype=np.int64),
        }
        if self.meta.key_slots:  # each new key where plain decoding puts its position (runtime/key_slots.py)
            slots, exact = key_slots.assign(inputs[TREE_MASK], inputs[CACHE_LENGTHS], self.slots, self.key_lanes)
            inputs[key_slots.INPUT] = slots
            exact = exact if self.key_lanes else None
            past, small = max(past, int(slots.max()) + 1), (*SMALL_INPUTS, key_slots.INPUT)
        io = self._binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        for name in small:
            io.bind_cpu_input(name, inputs[name])
        logits = logits or not self.gated  # an ungated graph computes them anyway: bound as always
        if self.gated:
            io.bind_cpu_input(LOGITS_WANTED_INPUT, _WANTED[logits])
        self.buffers.bind_step(io, batch, tokens, past, logits=logits)  # the first `past` cache slots and every output, in place
        self.session.run_with_iobinding(io)
        return self._steps.stamp(self.buffers.step_output(), **({} if exact is None else {"exact": exact}))

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` of the [slots, layers, old_batch, ...] layout to row i of the
        [slots, layers, new_batch, ...] layout (the batch size changes every element's place in
        the flat buffer). Copies the first ``slots`` slots once; not per step."""
        if slots == 0 or len(rows) == 0:
            return
        self.buffers.relayout(np.asarray(rows, dtype=np.int64), old_batch, new_batch, slots)

    def commit(self, output: StepOutput, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` of the step that gave ``output`` into slots cache_lengths[b] + 0.."""
        self._steps.check(output, "commit")
        rows, src, dst = commit_indices(nodes, counts, cache_lengths)
        self.buffers.commit(rows, src, dst, nodes.shape[0])

    def run_heads(self, hidden: np.ndarray, roots: np.ndarray | None = None) -> None:
        """The heads graph on ``hidden`` (N, H) of ``self.dtype`` (and ``roots`` (N,) int64 for next-token-aware
        heads), outside the loop's buffers: what a graph that ran the heads on every tree node would pay
        (``medusa-bench`` times it)."""
        self.heads_session.run(None, {HEADS_INPUTS[0]: hidden} | ({NEXT_INPUT: roots} if self.meta.reads_roots else {}))

    def expand(self, paths: list, top_k: int) -> None:
        """An exported engine's heads expand what the exporter fixed: nothing to do."""
        return None

    def propose(self, output: StepOutput, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """Medusa heads at node ``nodes[b]`` of the step that gave ``output`` (``heads_proposals``)."""
        self._steps.check(output, "propose")
        return heads_proposals(self.meta, self.heads_session, self.buffers, nodes, top_k, roots)


def heads_proposals(meta: EngineMeta, heads_session, buffers: StepBuffers, nodes: np.ndarray, top_k: int, roots) -> Proposals:
    """The heads graph (an ONNX Runtime session) at node ``nodes[b]`` of the last step, through ``buffers``: top-k ids
    (B, n, K), logits views; ``roots`` (B,) the next tokens, read by next-token-aware heads."""
    check_proposal(meta, top_k, roots)
    io = heads_session.io_binding()
    buffers.bind_heads(io, np.asarray(nodes, dtype=np.int64))  # hidden (B, H) at the nodes; head_topk, head_logits
    if meta.reads_roots:
        roots = np.ascontiguousarray(roots, dtype=np.int64)  # (B,) kept alive through the run
        io.bind_cpu_input(NEXT_INPUT, roots)
    heads_session.run_with_iobinding(io)
    return buffers.proposals(top_k)
