"""A backend composed of a step kernel and a heads callable on named host arrays and the shared host buffers.

The host backends whose step is not an ONNX Runtime session (the native C step, OpenVINO's compiled graph) are this
class with a kernel of their own, not subclasses of ``OnnxBackend``: the kernel reads the step's inputs and the bound
cache from a dict of numpy arrays named by ``runtime/contract.py`` and writes its outputs into the arrays there, which
are views of ``ort_buffers.HostBuffers`` (allocated once, at their largest). The heads are called the same way on the
arrays of ``HostBuffers.heads_arrays`` (``onnx_backend.OrtHeads``: the heads graph on ONNX Runtime; OpenVINO's
compiled heads graph). Everything else of the step contract is the buffers' (commit, relayout).

A kernel whose graph reads the engine's key slots (``key_slots=True``: OpenVINO) gets KEY_SLOTS_INPUT (B, T) int64 too,
where ``runtime/key_slots.py`` puts each new key so that a verify step is a plain step, and a bound cache long enough
to hold them (past the context by ``key_slots.slack``); its key axis can be bound in whole blocks (``key_block``).

    kernel(arrays)    arrays: INPUT_IDS (B, T) int64, POSITION_IDS (B, T) int64, TREE_MASK (B, T, T) bool,
                      CACHE_LENGTHS (B,) int64, PAST_KEY / PAST_VALUE (S, L, B, Hkv, D): read;
                      NEW_KEY / NEW_VALUE (T, L, B, Hkv, D), HIDDEN (B, T, H): written; with LOGITS (B, T, V) bound,
                      NEXT_IDS (B, T) and SUCCESSORS_OUTPUT (B, T, k) too (a step without LOGITS skips the lm_head);
                      with key slots, KEY_SLOTS_INPUT (B, T) int64: read
    heads(arrays)     arrays: HIDDEN (B, H) and, for heads that read the next token, NEXT_INPUT (B,) int64: read;
                      HEAD_TOPK (B, n, K) int64, HEAD_LOGITS (B, n, Vd) float32: written; where the heads say
                      ``confidence``, HEAD_CONFIDENCE (B, n, K) float32 too (each top-K id's softmax probability)
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from medusa_trt.runtime import key_slots as key_layout
from medusa_trt.runtime.backends.common import check_proposal, commit_indices
from medusa_trt.runtime.backends.ort_buffers import HostBuffers
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEAD_CONFIDENCE,
    HEAD_LOGITS,
    HEAD_TOPK,
    HIDDEN,
    INPUT_IDS,
    NEXT_INPUT,
    POSITION_IDS,
    TREE_MASK,
    Proposals,
    StepCounter,
    StepOutput,
)
from medusa_trt.runtime.engine import EngineError, EngineFiles, EngineMeta
from medusa_trt.runtime.exactness import Exactness

log = logging.getLogger(__name__)


class HostKernel(Protocol):
    """One step on named host arrays (the module docstring's table)."""

    exact: bool | None  # True: every verify step is a plain step bit for bit (a batch-invariant kernel); None: no claim

    def __call__(self, arrays: dict[str, np.ndarray]) -> None: ...

    def describe(self) -> str:
        """What it runs on, for a summary line: ``avx512_vnni, 2 threads``."""
        ...


class HostHeads(Protocol):
    """The Medusa heads on named host arrays (the module docstring's table)."""

    confidence: bool  # True: a call also writes HEAD_CONFIDENCE, which the loop then need not compute from the logits

    def __call__(self, arrays: dict[str, np.ndarray]) -> None: ...


def cache_slots(max_context: int, max_tokens: int, *, key_slots: bool = False, key_block: int = 1) -> int:
    """Cache slots a ``HostBackend``'s buffers need per row: the context, the slack a tree's scattered keys take with key
    slots (``key_slots.slack``), all rounded up to whole key blocks (the bound key axis is)."""
    slots = max_context + (key_layout.slack(max_tokens) if key_slots else 0)
    return -(-slots // key_block) * key_block


class HostBackend:
    """``contract.Backend`` over a ``HostKernel``: the engine's files and metadata, the host buffers, the heads (None: the
    engine has none).

    ``key_slots``: the kernel reads KEY_SLOTS_INPUT; each step's nodes are laid out by ``key_slots.assign`` at
    ``key_lanes`` (set by whoever measured them; None: the appended layout, no claim) and claim exactness per node.
    ``key_block``: the bound key axis is a multiple of this many slots. ``gated``: a step may skip the lm_head
    (False: the kernel always computes the logits, so every output is bound). ``device`` and ``precision``: what the
    kernel runs on and computes in, where it offers a choice (OpenVINO). The buffers hold ``cache_slots`` slots."""

    def __init__(
        self,
        name: str,
        files: EngineFiles,
        meta: EngineMeta,
        kernel: HostKernel,
        buffers: HostBuffers,
        heads: HostHeads | None,
        *,
        max_batch: int,
        max_context: int,
        key_slots: bool = False,
        key_block: int = 1,
        gated: bool = True,
        device: str = "CPU",
        precision: str | None = None,  # None: the engine's own dtype
    ):
        self.name, self.files, self.meta, self.kernel, self.buffers = name, files, meta, kernel, buffers
        self.heads = heads
        self._steps = StepCounter()
        self.max_batch, self.max_context = max_batch, max_context
        self.max_tokens = meta.max_tokens  # most new tokens one step takes
        self.dtype = buffers.sizes.dtype
        self.successors = buffers.sizes.successors  # k of SUCCESSORS_OUTPUT (0: the engine has none)
        self.kv_row = buffers.sizes.kv_row
        self.key_slots, self.key_block, self.gated = key_slots, key_block, gated
        self.device, self.precision = device, precision
        # the slots a step's keys may take: the context, and with key slots the slack a tree's scattered keys need
        self.slots = max_context + (key_layout.slack(meta.max_tokens) if key_slots else 0)
        assert buffers.sizes.max_context >= cache_slots(max_context, meta.max_tokens, key_slots=key_slots, key_block=key_block)
        self.key_lanes: int | None = None  # key slots' lane count on this machine (runtime/key_slots.py); None: no claim
        self.exactness: Exactness | None = None  # what a load-time probe measured of a key-slot kernel (None: no claim)

    def describe(self) -> str:
        return f"{self.name} ({self.kernel.describe()})"

    @property
    def exact(self) -> bool | None:
        """Verify steps are plain steps bit for bit: with key slots what the probe measured (None: not measured, no
        claim), else the kernel's own claim."""
        if self.key_slots:
            return None if self.exactness is None else self.exactness.exact
        return self.kernel.exact

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """The step contract (``contract.Backend``); outputs are views of the preallocated buffers. ``exact`` per node:
        with key slots where ``key_slots.assign`` placed the node as plain decoding does (at measured lanes), else
        every node where the kernel is exact and computed the logits."""
        batch, tokens = input_ids.shape
        if tokens > self.max_tokens or batch > self.max_batch:
            raise EngineError(f"a step of {batch} x {tokens} tokens exceeds the engine's {self.max_batch} x {self.max_tokens}")
        arrays = {
            INPUT_IDS: np.ascontiguousarray(input_ids, dtype=np.int64),
            POSITION_IDS: np.ascontiguousarray(position_ids, dtype=np.int64),
            TREE_MASK: np.ascontiguousarray(tree_mask, dtype=bool),
            CACHE_LENGTHS: np.ascontiguousarray(cache_lengths, dtype=np.int64),
        }
        past = int(arrays[CACHE_LENGTHS].max())  # host value: the bound view's length
        logits = logits or not self.gated  # a kernel that always computes them has them bound as always
        exact = None
        if self.key_slots:  # each new key where plain decoding puts its position (runtime/key_slots.py)
            slots, placed = key_layout.assign(arrays[TREE_MASK], arrays[CACHE_LENGTHS], self.slots, self.key_lanes)  # (B, T) each
            arrays[key_layout.INPUT] = slots
            exact = placed if self.key_lanes else None
            past = max(past, int(slots.max()) + 1)
        elif logits and self.kernel.exact:
            exact = np.ones((batch, tokens), dtype=bool)
        past = -(-past // self.key_block) * self.key_block  # whole blocks of the key axis; the buffers hold them
        arrays |= self.buffers.step_arrays(batch, tokens, past, logits=logits)
        self.kernel(arrays)
        return self._steps.stamp(self.buffers.step_output(), **({} if exact is None else {"exact": exact}))

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Cache rows ``rows[i]`` of the ``old_batch`` layout to row i of the ``new_batch`` one (first ``slots`` slots)."""
        if slots and len(rows):
            self.buffers.relayout(np.asarray(rows, dtype=np.int64), old_batch, new_batch, slots)

    def commit(self, output: StepOutput, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` of the step that gave ``output`` into slots cache_lengths[b] + 0.."""
        self._steps.check(output, "commit")
        rows, src, dst = commit_indices(nodes, counts, cache_lengths)
        self.buffers.commit(rows, src, dst, nodes.shape[0])

    def run_heads(self, hidden: np.ndarray, roots: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The heads on ``hidden`` (N, H) of ``self.dtype`` (and ``roots`` (N,) int64 for next-token-aware heads) outside
        the loop's buffers: what a graph that ran the heads on every tree node would pay (``medusa-bench`` times it).
        Returns their outputs, HEAD_TOPK (N, n, K) and HEAD_LOGITS (N, n, Vd) (and HEAD_CONFIDENCE (N, n, K) from heads
        that compute it), arrays of their own."""
        shapes = self.buffers.sizes.heads_shapes(len(hidden))
        heads = self._heads()
        out = {HEAD_TOPK: np.empty(shapes[HEAD_TOPK], np.int64), HEAD_LOGITS: np.empty(shapes[HEAD_LOGITS], np.float32)}
        if heads.confidence:
            out[HEAD_CONFIDENCE] = np.empty(shapes[HEAD_TOPK], np.float32)
        heads({HIDDEN: hidden} | out | ({NEXT_INPUT: roots} if self.meta.reads_roots else {}))
        return out

    def expand(self, paths: list, top_k: int) -> None:
        """An exported engine's heads expand what the exporter fixed: nothing to do."""
        return None

    def propose(self, output: StepOutput, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """Medusa heads at node ``nodes[b]`` of the step that gave ``output``: top-k ids (B, n, K) and logits, views of
        the buffers; ``roots`` (B,) the next tokens, read by next-token-aware heads."""
        self._steps.check(output, "propose")
        check_proposal(self.meta, top_k, roots)
        heads = self._heads()
        arrays = self.buffers.heads_arrays(np.asarray(nodes, dtype=np.int64), confidence=heads.confidence)  # hidden (B, H); views
        if self.meta.reads_roots:
            arrays[NEXT_INPUT] = np.ascontiguousarray(roots, dtype=np.int64)  # (B,)
        heads(arrays)
        return self.buffers.proposals(top_k)

    def _heads(self) -> HostHeads:
        if self.heads is None:
            raise EngineError(f"{self.files.step} has no Medusa heads to propose with: run it plain, or export it with heads")
        return self.heads
