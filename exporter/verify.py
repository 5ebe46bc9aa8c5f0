"""Check an exported engine against the torch model it came from.

The ONNX checker first, then the graph and torch on the same inputs: a right-padded prefill of
two prompts of different lengths (chain mask, empty cache; at most 7 tokens and never more than
the engine's tokens per step), then a tree step over the committed prefill cache, then the heads
graph. Returns the max abs difference per output. Each side runs in the engine's own dtype.

fp32 and fp16 graphs run in ONNX Runtime. ONNX Runtime's CPU provider has no bf16 kernels, so a
bf16 graph runs in ONNX's reference evaluator (``onnx.reference``) on ``ml_dtypes.bfloat16``
arrays: every op of the graph as written, each result rounded to bf16 as a bf16 kernel's is
(matmuls accumulate in fp32, as torch's and TensorRT's bf16 GEMMs do), with RMSNormalization
computed in its ``stash_type`` (fp32) as the op's definition says. It is slow (numpy, op by op),
which the small checked steps allow. ``--no-verify`` skips it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from medusa_trt.exporter.logits_gate import GATED_OUTPUTS
from medusa_trt.runtime import key_slots
from medusa_trt.runtime.backends.onnx_backend import is_gated, with_gate
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEADS_INPUTS,
    HIDDEN,
    INPUT_IDS,
    KEY_SLOTS_INPUT,
    LOGITS,
    LOGITS_WANTED_INPUT,
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
)
from medusa_trt.runtime.drafting.sequential import expansion
from medusa_trt.runtime.engine import EngineFiles
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.tree import CompiledTree

log = logging.getLogger(__name__)

PREFILL_TOKENS = 7  # the longer checked prompt; the other is 4 (right-padded, ragged)
RUNNERS = ("ONNX Runtime", "ONNX's reference evaluator")  # what runs the graph: fp32 / fp16, bf16


class VerificationError(MedusaError):
    """The exported graph disagrees with the torch model beyond the tolerance."""


def _diff(a: torch.Tensor, b: np.ndarray) -> float:
    """The largest absolute difference; inf where either side holds a NaN (NaN > tolerance is False: never a pass)."""
    if not b.size:
        return 0.0
    diff = np.abs(a.detach().float().cpu().numpy() - b.astype(np.float32))
    return float("inf") if np.isnan(diff).any() else float(diff.max())


def numpy_dtype(dtype: torch.dtype):
    """The numpy dtype of a torch float dtype (bf16: ``ml_dtypes.bfloat16``)."""
    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16 if dtype == torch.float16 else np.float32)


def to_torch(value: np.ndarray, device) -> torch.Tensor:
    """A numpy array as a torch tensor; bf16 through its bits (torch.from_numpy has no bfloat16)."""
    value = np.ascontiguousarray(value)
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(value).to(device)


def open_graph(path: Path, dtype: torch.dtype):
    """What runs the graph at ``path`` with ``run(None, feeds)`` / ``get_inputs()`` / ``get_outputs()``:
    an ONNX Runtime session, or for bf16 a ``ReferenceSession``."""
    if dtype == torch.bfloat16:
        return ReferenceSession(path)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")  # no second, packed copy of the weights
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class ReferenceSession:
    """ONNX's reference evaluator behind ONNX Runtime's session interface, for graphs ONNX Runtime's
    CPU provider cannot run (bf16). The weights are fed to each run beside the inputs, the graph
    proto keeping no copy: those in an external data file mapped from it read-only (pages of the
    file, which the kernel can drop and read again, not a second copy in memory), the rest read once."""

    def __init__(self, path: Path):
        import onnx
        from onnx.reference import ReferenceEvaluator

        proto = onnx.load(str(path), load_external_data=False)
        self.weights = {t.name: _weight(t, Path(path).parent) for t in proto.graph.initializer}
        del proto.graph.initializer[:]  # now in self.weights, fed to every run
        self._inputs = [_Named(i.name) for i in proto.graph.input]
        self._outputs = [_Named(o.name) for o in proto.graph.output]
        self._evaluator = ReferenceEvaluator(proto, new_ops=[_stashed_rms_normalization()])

    def get_inputs(self):
        return self._inputs

    def get_outputs(self):
        return self._outputs

    def run(self, names, feeds: dict) -> list[np.ndarray]:
        return self._evaluator.run(names, self.weights | feeds)


def _weight(tensor, folder: Path) -> np.ndarray:
    """An initializer as an array: mapped read-only from its external data file, else decoded from the proto."""
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    if not uses_external_data(tensor) or not tensor.dims:
        return numpy_helper.to_array(tensor, base_dir=str(folder))
    info, dtype = ExternalDataInfo(tensor), helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(folder / info.location, dtype=dtype, mode="r", offset=info.offset or 0, shape=tuple(tensor.dims))


class _Named:
    def __init__(self, name: str):
        self.name = name


@functools.cache
def _stashed_rms_normalization():
    """RMSNormalization as its ONNX definition computes it: X cast to ``stash_type``, normalized
    there, cast back, then scaled (onnx.reference's own op ignores ``stash_type`` and sums in X's type)."""
    from onnx.helper import tensor_dtype_to_np_dtype
    from onnx.reference.op_run import OpRun

    class RMSNormalization(OpRun):
        op_domain = ""

        def _run(self, X, Scale, axis=None, epsilon=None, stash_type=None):
            axis = -1 if axis is None else axis
            epsilon = 1e-5 if epsilon is None else epsilon
            stash = tensor_dtype_to_np_dtype(1 if stash_type is None else stash_type)
            x = X.astype(stash)
            axes = tuple(range(axis % X.ndim, X.ndim))
            inv = np.reciprocal(np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + stash.type(epsilon)))
            return ((x * inv).astype(X.dtype) * Scale,)

    return RMSNormalization


@dataclass(frozen=True)
class Verification:
    """The exported graphs against torch: the largest absolute difference per checked output, and how often the step
    graph's top-1 token is torch's over the checked positions (the prefill's and the tree's, random tokens)."""

    diffs: dict[str, float]
    top1: float  # fraction of positions whose argmax agrees
    positions: int  # how many were checked


def _top1(theirs: torch.Tensor, ours: np.ndarray) -> np.ndarray:
    """bool (...): where the graph's argmax over the last axis is torch's."""
    return theirs.detach().float().cpu().numpy().argmax(-1) == ours.astype(np.float32).argmax(-1)


@torch.no_grad()
def verify_engine(
    model,
    files: EngineFiles,
    tree: CompiledTree,
    *,
    strict: bool,
    tolerance: float,
    loose: tuple[str, ...] = (),
    max_tokens: int = PREFILL_TOKENS,
    draft_vocab: int | None = None,
) -> Verification:
    """Max abs difference of the graph (``open_graph``) vs torch per checked output, and the top-1 agreement of its
    logits. ``strict`` fails when one above ``tolerance`` is not named in ``loose`` (outputs reported, not held to it).
    ``max_tokens``: the engine's new tokens per step, which bounds the checked prefill;
    ``draft_vocab``: the heads graph's logits cover the first N token ids only."""
    import onnx

    onnx.checker.check_model(str(files.step))
    spec, device = model.kv_spec, model.device
    session = open_graph(files.step, spec.dtype)
    names = [o.name for o in session.get_outputs()]
    np_dtype = numpy_dtype(spec.dtype)
    gen = np.random.default_rng(0)

    scattered = KEY_SLOTS_INPUT in {i.name for i in session.get_inputs()}
    gated = is_gated(session)
    last: list[dict] = []  # the feeds of the last run

    def run(ids, positions, mask, lengths, past_key, past_value):
        feeds = {
            INPUT_IDS: ids,
            POSITION_IDS: positions,
            TREE_MASK: mask,
            CACHE_LENGTHS: lengths,  # the step contract's order
            PAST_KEY: past_key,
            PAST_VALUE: past_value,
        }
        if scattered:  # the new keys go to slots of the view: pad it to hold them
            key_slots.add_to_feeds(feeds)
        last[:] = [with_gate(session, feeds) if gated else feeds]  # a gated graph's logits, which every check below reads
        ours = dict(zip(names, session.run(None, last[0])))
        theirs = model(*(to_torch(v, device) for v in feeds.values()))
        return ours, dict(zip(STEP_OUTPUTS, theirs))

    # prefill: prompts of 7 and 4 tokens (fewer when a step takes fewer), right-padded, empty cache
    width = min(PREFILL_TOKENS, max_tokens)
    counts = np.array([width, max(1, width * 4 // PREFILL_TOKENS)])
    ids = gen.integers(0, model.vocab_size, size=(2, width)).astype(np.int64)
    positions = np.broadcast_to(np.arange(width), (2, width)).astype(np.int64)
    mask = np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (2, width, width)).copy()
    empty = np.zeros((0, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim), dtype=np_dtype)
    ours, theirs = run(ids, positions, mask, np.zeros(2, dtype=np.int64), empty, empty)
    agree = [_top1(theirs[LOGITS][b, : counts[b]], ours[LOGITS][b, : counts[b]]) for b in range(2)]
    diffs = {
        "prefill logits": max(_diff(theirs[LOGITS][b, : counts[b]], ours[LOGITS][b, : counts[b]]) for b in range(2)),
        "prefill new K/V": max(_diff(theirs[NEW_KEY][: counts[b], :, b], ours[NEW_KEY][: counts[b], :, b]) for b in range(2)),
    }
    # tree step over the committed prefill (ragged: counts tokens)
    past_key = ours[NEW_KEY].copy()  # (width, layers, 2, Hkv, D); slots past a row's length are invisible
    past_value = ours[NEW_VALUE].copy()
    t = tree.num_nodes
    tree_ids = gen.integers(0, model.vocab_size, size=(2, t)).astype(np.int64)
    tree_pos = (counts[:, None] + tree.depth[None, :]).astype(np.int64)
    tree_mask = np.broadcast_to(tree.mask, (2, t, t)).copy()
    ours, theirs = run(tree_ids, tree_pos, tree_mask, counts.astype(np.int64), past_key, past_value)
    diffs["tree logits"] = _diff(theirs[LOGITS], ours[LOGITS])
    agree.append(_top1(theirs[LOGITS], ours[LOGITS]).reshape(-1))
    if SUCCESSORS_OUTPUT in ours:  # the top-k ids must index the k largest logits (ties may order differently)
        k = ours[SUCCESSORS_OUTPUT].shape[-1]
        logits = ours[LOGITS].astype(np.float32)  # (2, T, V); bf16 compares exactly in fp32
        picked = np.take_along_axis(logits, ours[SUCCESSORS_OUTPUT], axis=-1)  # (2, T, k)
        kth = -np.partition(-logits, k - 1, axis=-1)[..., k - 1 : k]  # (2, T, 1)
        if not (picked >= kth - 1e-6).all():
            raise VerificationError(f"{files.step.name}: {SUCCESSORS_OUTPUT} does not hold the top-{k} logits: export again")
    diffs["tree hidden"] = _diff(theirs[HIDDEN], ours[HIDDEN])
    if gated:
        _check_gate(files, session, names, last[0], ours)
    session = None  # the step graph's weights go before the heads graph's come
    if model.num_heads:
        diffs["head logits"] = _heads_diff(model, files, tree, ours, draft_vocab)
    worst = max(v for k, v in diffs.items() if k not in loose)
    runner = RUNNERS[spec.dtype == torch.bfloat16]
    log.info("%s vs torch, max abs difference: %s", runner, ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    if strict and worst > tolerance:
        raise VerificationError(
            f"exported graph disagrees with torch: max abs difference {worst:.3g} > tolerance {tolerance:g} "
            f"({', '.join(f'{k} {v:.2e}' for k, v in diffs.items())}); export with --no-verify to keep it anyway"
        )
    agreed = np.concatenate(agree)
    return Verification(diffs, float(agreed.mean()), int(agreed.size))


def _check_gate(files: EngineFiles, session, names: list[str], feeds: dict, ours: dict[str, np.ndarray]) -> None:
    """A gated step graph (exporter/logits_gate.py) run with ``logits_wanted`` False must give the other outputs of
    its run with True, ``ours``, bit for bit, and empty gated ones."""
    skipped = dict(zip(names, session.run(None, feeds | {LOGITS_WANTED_INPUT: np.array(False)})))
    for name, got in skipped.items():
        if name in GATED_OUTPUTS and got.size:
            raise VerificationError(f"{files.step.name}: {name} was computed with {LOGITS_WANTED_INPUT} False: export again")
        if name not in GATED_OUTPUTS and not np.array_equal(got, ours[name]):
            raise VerificationError(f"{files.step.name}: {name} changes with {LOGITS_WANTED_INPUT} False: export again")


def _heads_diff(model, files: EngineFiles, tree: CompiledTree, ours: dict[str, np.ndarray], draft_vocab: int | None) -> float:
    """Max abs difference of the heads graph's logits against torch, at node 0 of the checked tree step ``ours``."""
    heads = open_graph(files.heads, model.kv_spec.dtype)
    hidden = ours[HIDDEN][:, 0]  # (2, H)
    feeds = {HEADS_INPUTS[0]: np.ascontiguousarray(hidden)}
    roots = ours[NEXT_IDS][:, 0].astype(np.int64)  # (2,) what follows node 0: the next tree's root
    if model.head_input != "hidden":
        feeds[NEXT_INPUT] = roots
    head_topk, head_logits = heads.run(None, feeds)
    hidden_t, roots_t = to_torch(hidden, model.device), to_torch(roots, model.device)
    if model.head_input == "hidden+path":  # the graph expands the tree over the draft vocabulary
        theirs = model.heads.expand(hidden_t, roots_t, expansion(tree.paths), tree.top_k, model.heads.projector(draft_vocab))
    else:
        theirs = model.propose(hidden_t, roots_t)  # (2, n, V)
    return _diff(theirs[..., : draft_vocab or theirs.shape[-1]], head_logits)  # the draft vocabulary's columns
