"""The engine step contract in one place: tensor names, what a step returns, and the Protocol
between the loop and every backend (ONNX Runtime, TensorRT, torch). The exporter writes graphs
with these names; the backends bind them; the loop only sees ``Backend``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from medusa_trt.runtime.errors import EngineError

ONNX_BACKENDS = ("onnxruntime", "openvino", "native")  # backends that run an engine's ONNX graphs; onnxruntime: where none is named
BACKENDS = (*ONNX_BACKENDS, "tensorrt")  # what RuntimeConfig.backend names
MAX_SUCCESSORS = 64  # the most successors a step graph's next_topk holds (native_step.c's MAX_TOPK is the same cap)

STEP_INPUTS = ("input_ids", "position_ids", "tree_mask", "cache_lengths", "past_key", "past_value")
STEP_OUTPUTS = ("logits", "hidden", "next_ids", "new_key", "new_value")
KEY_SLOTS_INPUT = "key_slots"  # optional int64 (B, T): where each new key sits on the attention's key axis (runtime/key_slots.py)
SUCCESSORS_OUTPUT = "next_topk"  # optional (B, W, k) int64: the base model's top-k after each node (engines since successors)
LOGITS_WANTED_INPUT = "logits_wanted"  # optional bool scalar (default True): False skips the lm_head (exporter/logits_gate.py)
DEFAULT_SUCCESSORS = 8  # its k unless medusa-export --successors says otherwise
HEADS_INPUTS = ("hidden",)
NEXT_INPUT = "root_ids"  # int64 (B,): the next token, a second input of next-token-aware heads' graphs
HEADS_OUTPUTS = ("head_topk", "head_logits")
# each name once, for code that binds one tensor
INPUT_IDS, POSITION_IDS, TREE_MASK, CACHE_LENGTHS, PAST_KEY, PAST_VALUE = STEP_INPUTS
LOGITS, HIDDEN, NEXT_IDS, NEW_KEY, NEW_VALUE = STEP_OUTPUTS
HEAD_TOPK, HEAD_LOGITS = HEADS_OUTPUTS
HEAD_CONFIDENCE = "head_confidence"  # host only, no graph's: float32 (B, n, K), each top-K id's softmax probability under its head


def step_shapes(batch: int, tokens: int, slots: int, kv: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    """Each step input's shape for ``batch`` rows of ``tokens`` new tokens over ``slots`` bound cache slots;
    ``kv`` is (layers, Hkv, D). The one place these shapes are written: the TensorRT backend sets them per step
    and allocates for their maximum, the TensorRT build makes its optimization profile of them."""
    layers, kv_heads, head_dim = kv
    ids = (batch, tokens)  # (B, T)
    cache = (slots, layers, batch, kv_heads, head_dim)  # (S, layers, B, Hkv, D): slot-major, the first S slots one block whatever B
    return {
        INPUT_IDS: ids,
        POSITION_IDS: ids,
        TREE_MASK: (batch, tokens, tokens),  # (B, T, T)
        CACHE_LENGTHS: (batch,),  # (B,)
        PAST_KEY: cache,
        PAST_VALUE: cache,
    }


@dataclass(frozen=True, eq=False)
class StepOutput:
    """What one verify / prefill step gives the host. Valid until the backend's next ``step``: ``commit`` and
    ``propose`` take it and refuse any but the backend's latest (``StepCounter``), whose K/V and hidden states its
    buffers hold."""

    argmax: np.ndarray  # int64 (B, W): the base model's choice after every node, on the host
    topk: np.ndarray | None  # int64 (B, W, k): its top-k there, best first (None: the engine has no successors output)
    _logits: Callable[[], np.ndarray]  # () -> float (B, W, V) on the host
    _rows: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (rows, nodes) -> float (N, V) on the host
    _hidden_rows: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None  # (rows, nodes) -> float32 (N, H) on the host
    # bool (B, W): the node's logits are the ones a plain one-token step gives it, bit for bit (an engine with key
    # slots, runtime/key_slots.py); None: no such claim. The loop accepts no draft past a node without it.
    exact: np.ndarray | None = None
    step: int = 0  # the backend's count of steps when this one ran (StepCounter.stamp; 0: not from a counted backend)

    def logits(self) -> np.ndarray:
        """Base logits (B, W, V) on the host, fetched on first use (sampling rules only)."""
        return self._logits()

    def logits_rows(self, rows, nodes) -> np.ndarray:
        """Base logits at (rows[i], nodes[i]): (N, V) on the host, a small copy."""
        return self._rows(np.asarray(rows), np.asarray(nodes))

    def hidden_rows(self, rows, nodes) -> np.ndarray:
        """The heads' input hidden state at (rows[i], nodes[i]): float32 (N, H) on the host, a copy
        (self-distillation records it instead of running the model again)."""
        if self._hidden_rows is None:
            raise NotImplementedError("this backend does not return hidden states")
        return self._hidden_rows(np.asarray(rows), np.asarray(nodes))


class StaleStepError(EngineError):
    """A step output passed to ``commit`` or ``propose`` after the backend ran another step: its buffers now hold the
    later step's K/V and hidden states."""


class StepCounter:
    """A backend's steps, counted: each step's output carries its number (``stamp``), and ``commit`` and ``propose``
    take only the latest one (``check``). A backend allocates its buffers once, so an older output's K/V and hidden
    states are gone; called out of order, they raise rather than hand over another step's data."""

    def __init__(self):
        self.latest = 0

    def stamp(self, out: StepOutput, **changes) -> StepOutput:
        """``out`` (with ``changes``: its ``exact``, say) as the newest step's."""
        self.latest += 1
        return dataclasses.replace(out, step=self.latest, **changes)

    def check(self, out: StepOutput, call: str) -> None:
        if not isinstance(out, StepOutput):
            raise TypeError(f"{call} takes the StepOutput of the step it follows, not {type(out).__name__}")
        if out.step != self.latest:
            raise StaleStepError(
                f"{call} was given the output of step {out.step}, but the backend has run step {self.latest} since, whose "
                f"K/V and hidden states replaced it: {call} right after the step whose output it takes"
            )


def without_logits(batch: int, hidden_rows: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> StepOutput:
    """What a step run with ``logits=False`` gives: no argmax (an empty (B, 0) array), no top-k, no logits
    (reading them raises); the hidden states where the backend kept them."""

    def unread(*_):
        raise RuntimeError("this step ran with logits=False: its logits were not computed (pass logits=True to read them)")

    return StepOutput(np.zeros((batch, 0), dtype=np.int64), None, unread, unread, hidden_rows)


@dataclass(frozen=True, eq=False)
class Proposals:
    """The Medusa heads at one node per row. Valid until the backend's next ``propose``."""

    ids: np.ndarray  # int64 (B, n, K): each head's top-K tokens, best first, on the host
    _logits: Callable[[], np.ndarray]  # () -> float32 (B, n, N) on the host: N = the draft vocabulary (EngineMeta.heads_vocab)
    confidence: np.ndarray | None = None  # float32 (B, n, K): each of ids' softmax probability under its head, where the
    # heads computed it beside their logits (the native heads); None: the loop computes it from the logits

    def logits(self) -> np.ndarray:
        """The heads' logits (B, n, N) over token ids 0..N-1 on the host, fetched on first use."""
        return self._logits()


class Backend(Protocol):
    """One engine, its KV cache and output buffers, allocated once."""

    name: str
    max_batch: int  # rows
    max_context: int  # cache slots per row
    max_tokens: int | None  # most new tokens one step takes (None: no limit)

    def describe(self) -> str:
        """The backend as a summary line names it: its name and what it runs on, ``native (avx512_vnni, 2 threads)``."""
        ...

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """Score (B, W) new tokens at ``position_ids`` over each row's first ``cache_lengths`` slots
        under ``tree_mask`` (B, W, W); keeps their K/V (uncommitted) and hidden states. ``logits`` False:
        the caller reads nothing but the K/V (a prompt chunk before the last); a backend may then skip
        the ``lm_head`` and return ``without_logits`` (one whose graph has ``LOGITS_WANTED_INPUT``), or
        compute everything as usual."""
        ...

    def commit(self, output: StepOutput, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` of the step that gave ``output`` (the latest: ``StepCounter``)
        into slots cache_lengths[b] + 0.."""
        ...

    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` to row i when the step's row count changes."""
        ...

    def propose(self, output: StepOutput, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """The heads at node ``nodes[b]`` of the step that gave ``output`` (the latest), for every row; ``roots`` (B,)
        int64, the token chosen after that node (the next tree's root), is what next-token-aware heads read."""
        ...

    def expand(self, paths: list, top_k: int):
        """Sequential heads that read the path and expand the runtime's template (torch backend):
        expand ``paths`` (the template, root excluded) at top-``top_k`` and return the
        ``drafting.sequential.Expansion``; None where the engine fixes its own (exported engines) or has none."""
        ...
