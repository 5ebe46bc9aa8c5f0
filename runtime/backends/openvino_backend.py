"""OpenVINO backend: the engine's own ONNX graphs (model.onnx, heads.onnx) compiled by OpenVINO.

``open_openvino`` composes a ``host_backend.HostBackend`` of the compiled step graph (``OpenVinoKernel``, a
``HostKernel`` on named host arrays), the shared ``ort_buffers.HostBuffers`` (the KV cache and every output
allocated once in host memory) and the compiled heads graph (an ``OpenVinoKernel`` too, called as the backend's
``HostHeads``); ``commit`` / ``relayout`` are the buffers', as for every host backend. A call hands the graph's inputs
(the cache views among them) to OpenVINO without a copy (``share_inputs``) and copies each output from OpenVINO's
memory into the host buffer view of its name after the run, so the ``StepOutput`` views stay valid until the next
step, as the contract says, and commit reads the new K/V where it always does.

Precision: ``"f32"`` (OpenVINO's ``INFERENCE_PRECISION_HINT`` f32, the default) or ``"bf16"`` (weights
and activations in bfloat16 inside OpenVINO; inputs, cache and outputs stay float32), offered only on
CPUs with AMX or AVX512-BF16.

Exactness: OpenVINO's CPU attention sums the last, partial block of a key axis in another order than
a full block, so a token's logits depend on how long the bound key axis is (a verify step binds a
longer one than the token's plain step). Engines with key slots therefore bind every step's key
axis rounded up to ``KEY_BLOCK`` slots (``HostBackend``'s ``key_block``; the extra slots are masked: attention
work only, and the buffers hold them), which leaves only the key slots' lane condition (``runtime/key_slots.py``).
Whether a verify step then gives a token its plain-step logits bit for bit is measured at load on
the engine itself (``_probe`` on the composed backend: the exactness probe of ``runtime/exactness.py`` at each lane
count): an engine that passes claims exactness per node as on ONNX Runtime; one that does not claims
nothing, says so in a warning, and ``backend.exact`` is False (drafted output then equals plain
output to float rounding only). Measured on SmolLM2-135M (AVX-512 CPU, 2 threads): unpadded,
trees differ from plain steps by up to 5e-5 at every lane count; padded to 64, f32 is exact at 16
lanes. bf16 claims nothing: its probe passed at 8 lanes, yet on 29 dev prompts one drafted output
differed from its own plain output, so the probe does not cover it (a warning says so at load).

Speed, on a quiet machine (``medusa-bench --backend onnxruntime --backend openvino --backend openvino:bf16``,
docs/results/bench-backends.json: SmolLM2-135M fp32, AMD EPYC with AVX512-BF16 and no AMX, 2 threads, 29 dev
prompts, 128 greedy tokens): plain 33.4 tok/s on OpenVINO f32 and 43.0 on bf16 against ONNX Runtime's
45.1, drafted 41.5 / 45.5 against 61.8. It does not pay on this CPU; it stays an option (f32 output equals
ONNX Runtime's on 29/29 prompts) for CPUs and devices where OpenVINO is the faster runtime. (A run of
8 prompts on the machine loaded by other work had found it faster, 1.28x plain: contention, not the code.)
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np

from medusa_trt.runtime import exactness, key_slots
from medusa_trt.runtime.backends.host_backend import HostBackend, cache_slots
from medusa_trt.runtime.backends.onnx_backend import DTYPES, checked_files
from medusa_trt.runtime.backends.ort_buffers import BufferSizes, HostBuffers
from medusa_trt.runtime.contract import LOGITS_WANTED_INPUT, NEXT_INPUT, PAST_KEY, PAST_VALUE, SUCCESSORS_OUTPUT
from medusa_trt.runtime.engine import EngineError, engine_meta

log = logging.getLogger(__name__)

NAME = "openvino"
PRECISIONS = ("f32", "bf16")  # INFERENCE_PRECISION_HINT values offered; f32 is the default
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs that run bf16 natively
DEVICES = ("CPU", "GPU", "NPU")  # OpenVINO device names (only CPU is measured and tested here)
REQUESTS = 8  # infer requests a compiled graph keeps, one per input shape (OpenVinoKernel)
KEY_BLOCK = 64  # key-slot engines bind their key axis in multiples of this many slots (a multiple of every lane count)
PROBE_CONTEXTS = (exactness.CONTEXT, 45, 61)  # committed tokens under the probe: a short one can pass at too few lanes
ONNX_8BIT = {2: "u8", 3: "i8"}  # ONNX tensor type numbers of QuantizeLinear's 8-bit outputs -> OpenVINO type names
RANGES = {"u8": (0, 255), "i8": (-128, 127)}  # what _quantize_linear saturates to
_PROBED: dict[tuple, tuple[int | None, exactness.Exactness]] = {}  # (step file, precision, device, threads) -> (lanes, result)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """The CPU runs bfloat16 natively (AMX or AVX512-BF16), read from /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:  # not Linux: no claim
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[-1].split()}
    return any(flag in flags for flag in BF16_FLAGS)


def check_options(precision: str, device: str) -> None:
    """Refuse option values this machine cannot honour, with the fix."""
    if precision not in PRECISIONS:
        raise EngineError(f"openvino precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if device not in DEVICES:
        raise EngineError(f"openvino device {device!r} is not one of {', '.join(DEVICES)}")
    if precision == "bf16" and device == "CPU" and not cpu_has_bf16():
        raise EngineError(
            f"openvino precision bf16 needs a CPU with AMX or AVX512-BF16 ({platform.processor() or 'this CPU'} has neither): use f32"
        )


class OpenVinoKernel:
    """A compiled OpenVINO graph called on named host arrays: the step (a ``host_backend.HostKernel``) or the heads
    (a ``host_backend.HostHeads``). The graph's inputs are taken from the arrays by name and handed over as they are
    (``share_inputs``: no copy); each of its outputs is copied into the array of its name after the run.

    One infer request per input shape, the ``REQUESTS`` most recent kept: a request whose input shapes
    change pays OpenVINO's shape inference and allocations again (SmolLM2, f32, 2 threads: a one-token
    step right after an 8-token one cost 103 ms on one request, 83 ms on a request of its own; the same
    width again, about 53). Drafting changes the step's width every step; the key axis changes only
    every ``KEY_BLOCK`` tokens."""

    exact = None  # no claim of its own: key slots at the lanes the load-time probe found decide (the module docstring)
    confidence = False  # as heads: the loop computes HEAD_CONFIDENCE from the logits

    def __init__(self, compiled, device: str, precision: str):
        self.compiled = compiled
        self.device, self.precision = device, precision
        self.inputs = tuple(i.get_any_name() for i in compiled.inputs)
        self.outputs = tuple(o.get_any_name() for o in compiled.outputs)
        self._requests: dict[tuple, object] = {}  # input shapes (the cache's aside) -> request, least recent first

    def describe(self) -> str:
        """``CPU, f32``: the device and the inference precision."""
        return f"{self.device}, {self.precision}"

    def request(self, feeds: dict[str, np.ndarray]):
        key = tuple((name, a.shape) for name, a in feeds.items() if name not in (PAST_KEY, PAST_VALUE))
        request = self._requests.pop(key, None)
        if request is None:
            request = self.compiled.create_infer_request()
        self._requests[key] = request
        if len(self._requests) > REQUESTS:
            del self._requests[next(iter(self._requests))]
        return request

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        """One synchronous inference; then the outputs are in their arrays. Copying them costs less than binding
        them as the request's output tensors (SmolLM2, one token over 300 cached, 2 threads, interleaved: 78 ms
        against 91; 32 tokens 257 against 265; setting each input tensor by name instead: 152 and 336)."""
        feeds = {name: np.require(arrays[name], requirements="C") for name in self.inputs}
        result = self.request(feeds).infer(feeds, share_inputs=True, share_outputs=True)
        for name in self.outputs:
            if name in arrays:  # every output the caller bound (a step binds them all: the graph is not gated)
                np.copyto(arrays[name], result[name])


def open_openvino(
    path,
    *,
    max_batch: int | None = None,
    max_context: int | None = None,
    threads: int | None = None,
    precision: str | None = None,
    device: str = "CPU",
    checksums: bool = False,
) -> HostBackend:
    """The engine at ``path`` on OpenVINO (``device``, ``precision``: f32 unless asked), its exactness probed at load
    where the engine has key slots (f32; bf16 claims nothing)."""
    try:
        import openvino as ov
    except ImportError as exc:
        raise EngineError(f"backend openvino needs the openvino package ({exc}): pip install 'medusa-trt[openvino]'") from exc
    precision = precision or PRECISIONS[0]
    check_options(precision, device)
    files, meta = checked_files(path, checksums=checksums)
    if meta.dtype not in DTYPES:
        raise EngineError(f"{files.step} holds {meta.dtype} weights, which this backend does not run: export with --dtype fp32 or fp16")
    max_batch, max_context = meta.check_limits(max_batch, max_context)
    core = ov.Core()
    from openvino.frontend.onnx import ConversionExtension

    core.add_extension(ConversionExtension("QuantizeLinear", _quantize_linear))  # the row quantizers
    options = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
    if threads:
        options["INFERENCE_NUM_THREADS"] = threads
    kernel = OpenVinoKernel(_compile(core, files.step, device, options), device, precision)
    heads = None
    files.check_heads(meta.num_heads)
    if meta.num_heads:
        if engine_meta(files.heads) != meta:
            raise EngineError(
                f"{files.heads} belongs to another engine than {files.step} (their metadata differ): "
                "keep the files of one export together or export again"
            )
        heads = OpenVinoKernel(_compile(core, files.heads, device, options), device, precision)
        if (NEXT_INPUT in heads.inputs) != meta.reads_roots:
            raise EngineError(
                f"{files.heads} takes inputs {sorted(heads.inputs)} but the engine says its heads read {meta.head_input}: export again"
            )
    successors = meta.successors if SUCCESSORS_OUTPUT in kernel.outputs else 0
    key_block = KEY_BLOCK if meta.key_slots else 1  # room for the rounded-up key axis
    slots = cache_slots(max_context, meta.max_tokens, key_slots=meta.key_slots, key_block=key_block)
    buffers = HostBuffers(BufferSizes.of(meta, max_batch=max_batch, max_context=slots, dtype=DTYPES[meta.dtype], successors=successors))
    backend = HostBackend(
        NAME,
        files,
        meta,
        kernel,
        buffers,
        heads,
        max_batch=max_batch,
        max_context=max_context,
        key_slots=meta.key_slots,
        key_block=key_block,
        gated=False,  # a gated graph's If is inlined at compile (_inline_logits_gate)
        device=device,
        precision=precision,
    )
    if meta.key_slots and precision == "f32":  # the lane count at which verify steps are plain steps here
        backend.key_lanes, backend.exactness = _probe(backend, (files.step.resolve(), precision, device, threads))
    elif meta.key_slots:  # no claim: a bf16 engine passed the probe, then drafted other text than its plain decoding
        backend.exactness = exactness.Exactness(False, float("nan"), 0)
    if precision != "f32":  # an inexact mode is said, never silent
        log.warning(
            "openvino precision %s: the model computes in %s, so its output is not the %s engine's, and drafted output "
            "equals this backend's own plain output to rounding only (not exact): use precision f32 for exact drafting",
            precision,
            precision,
            meta.dtype,
        )
    log.info(
        "openvino backend (%s, precision %s): KV cache %.1f MiB, outputs %.1f MiB",
        device,
        precision,
        buffers.cache_bytes / 2**20,
        buffers.output_bytes / 2**20,
    )
    return backend


def _compile(core, path: Path, device: str, options: dict):
    try:
        return core.compile_model(_inline_logits_gate(core.read_model(str(path))), device, options)
    except RuntimeError as exc:  # OpenVINO raises RuntimeError for unreadable graphs, unknown devices and ops
        reason = " ".join(str(exc).split())[:300]
        raise EngineError(f"OpenVINO cannot compile {path} for {device}: {reason}") from exc


def _inline_logits_gate(model):
    """``model`` with a gated step graph's If (exporter/logits_gate.py) replaced by its then branch and without the
    ``logits_wanted`` input: every step computes its logits. Kept, the If made OpenVINO's bf16 CPU plugin return
    garbage next_ids (negative token ids) on 5 of 12 short generations of the stories260K engine, fed True or not
    (0 of 12 ungated). Other graphs are returned as they are."""
    gate = next((p for p in model.get_parameters() if LOGITS_WANTED_INPUT in p.get_output_tensor(0).get_names()), None)
    if gate is None:
        return model
    gated = [n for n in model.get_ordered_ops() if n.get_type_name() == "If" and n.input_value(0).get_node() == gate]
    for node in gated:
        body = node.get_function(0)  # then
        params, results = body.get_parameters(), body.get_results()
        for d in node.get_input_descriptions(0):  # the branch's reads from outside: the outer values themselves
            params[d.body_parameter_index].output(0).replace(node.input_value(d.input_index))
        for d in node.get_output_descriptions(0):
            node.output(d.output_index).replace(results[d.body_value_index].input_value(0))
    model.remove_parameter(gate)
    model.validate_nodes_and_infer_types()
    return model


def _quantize_linear(node) -> list:
    """OpenVINO's translation of ONNX ``QuantizeLinear`` as its formula, saturate(round(x / scale) + zero point) with
    ties to even: the int8 row quantizers of exporter/quantize.py (``rows_int8_graph``) are a ``QuantizeLinear`` whose one
    block is a whole row (a (..., 1) scale), which OpenVINO 2026.4's ONNX reader refuses ("Conversion is failed for:
    QuantizeLinear-23"), and its per-axis form over rows broadcasts the scale along the wrong axis. Scales that
    broadcast against x as they are (per tensor, or a block the size of the last axis) and per-axis scales are
    taken; blocks smaller than their axis are refused by name."""
    import openvino.opset13 as ops

    x, scale = node.get_input(0), node.get_input(1)
    zero_point = node.get_input(2) if node.get_input_size() > 2 else None
    axis, block = node.get_attribute("axis", 1), node.get_attribute("block_size", 0)
    shape, scale_shape = x.get_partial_shape(), scale.get_partial_shape()
    rank = shape.rank.get_length() if shape.rank.is_static else None
    if block:  # a (..., 1) scale: one block a row (an axis whose length is not known yet is taken to be the block)
        dim = shape[axis] if rank is not None else None
        if dim is not None and dim.is_static and dim.get_length() != block:
            raise RuntimeError(f"QuantizeLinear with blocks of {block} along an axis of {dim.get_length()}: not translated")
    elif scale_shape.rank.is_static and scale_shape.rank.get_length() == 1 and rank is not None and rank > 1:  # per axis
        along = ops.constant(np.array([-1 if i == axis % rank else 1 for i in range(rank)], dtype=np.int64))
        scale = ops.reshape(scale, along, special_zero=False)
        zero_point = None if zero_point is None else ops.reshape(zero_point, along, special_zero=False)
    kind = zero_point.get_element_type().get_type_name() if zero_point is not None else ONNX_8BIT.get(node.get_attribute("output_dtype", 2))
    if kind not in RANGES:
        raise RuntimeError(f"QuantizeLinear to {kind or 'a type other than int8 / uint8'}: not translated")
    low, high = RANGES[kind]
    q = ops.round(ops.divide(x, scale), "half_to_even")
    if zero_point is not None:
        q = ops.add(q, ops.convert(zero_point, x.get_element_type()))
    return [ops.convert(ops.clamp(q, low, high), kind).output(0)]


def _probe(backend: HostBackend, key: tuple) -> tuple[int | None, exactness.Exactness]:
    """The smallest lane count of ``key_slots.LANES`` at which a chain and a branching tree re-score
    the engine's own plain steps bit for bit (``runtime/exactness.py``), measured once per engine,
    precision, device and thread count in a process; (None, the failing result) when none does."""
    if key not in _PROBED:
        _PROBED[key] = _measure_lanes(backend)
        lanes, found = _PROBED[key]
        if lanes is None:
            log.warning(
                "%s on OpenVINO (%s): a verify step's logits differ from a plain step's by up to %.3g, so drafted output "
                "equals plain output to float rounding only (not exact); use the onnxruntime backend "
                "for exact drafting",
                backend.files.step.name,
                key[1],
                found.max_diff,
            )
        else:
            log.info("openvino key slots at %d lanes: a verify step is a plain step, bit for bit", lanes)
    return _PROBED[key]


def _measure_lanes(backend: HostBackend) -> tuple[int | None, exactness.Exactness]:
    """``_probe``'s measurement on ``backend`` (its cache's contents left undefined), setting ``backend.key_lanes`` to
    each lane count it tries."""
    limit = backend.max_tokens
    tokens = max(1, min(exactness.TOKENS, limit - 1))  # the tree holds the path and one sibling
    contexts = sorted({max(1, min(c, limit, backend.max_context - tokens - 2)) for c in PROBE_CONTEXTS})
    rng = np.random.default_rng(0)
    backend.key_lanes = key_slots.LANES[0]
    runs, compared = [], 0  # (context ids, tree layout, plain logits) per context
    for context in contexts:
        ids = rng.integers(0, backend.meta.vocab_size, context, dtype=np.int64)  # (C,)
        path, plain = exactness.plain_steps(backend, ids, tokens)
        layouts = exactness.layouts(path, backend.meta.vocab_size)
        chain = exactness.verify_diffs(backend, ids, layouts["chain"], plain)  # a chain's slots do not depend on the lanes
        compared += len(chain)
        if max(chain) > 0.0:  # wider steps sum in another order: no lane count helps
            return None, exactness.Exactness(False, max(chain), compared)
        runs.append((ids, layouts.get("tree"), plain))
    if runs[0][1] is None:  # one-token trees only
        return backend.key_lanes, exactness.Exactness(True, 0.0, compared)
    worst = []
    for lanes in key_slots.LANES:  # smallest first; every context must pass
        backend.key_lanes, diff = lanes, 0.0
        for ids, tree, plain in runs:
            diffs = exactness.verify_diffs(backend, ids, tree, plain)
            compared += len(diffs)
            diff = max(diff, *diffs)
            if diff > 0.0:
                break
        if diff == 0.0:
            return lanes, exactness.Exactness(True, 0.0, compared)
        worst.append(diff)
    return None, exactness.Exactness(False, min(worst), compared)
