"""Which backend an engine folder names in its config.json when the export is not told (``ExportConfig.backend`` None,
``medusa-export`` without ``--backend``): native where it runs the engine, exactly, and faster; else onnxruntime.

The rule, each test on this machine, on the engine just exported:

1. native opens it: a Llama-pattern graph in fp32 or int8-channel, and a library this CPU runs
   (``NativeBackend`` refuses anything else by name);
2. native is exact: its verify steps give each token its plain-step logits bit for bit (``runtime/exactness.probe``);
3. native is faster: its one-token step and its step of the tree's width both take less time than ONNX Runtime's,
   the two timed in this process, interleaved round by round, medians (``runtime/step_cost.time_steps``). Where the
   memory left after native opens does not hold ONNX Runtime's copy of the engine (a model exported streamed, larger
   than half the memory), the two are not timed and native, exact, is chosen: it was the faster on every model timed.

Failing any, onnxruntime. The export prints the choice and its reason in one line (``BackendChoice.summary``) and
records it with the figures in drafting.json (``"backend_choice"``). Measured on a machine, it holds for that kind of
machine: a folder copied to one where native cannot run falls back to onnxruntime with a warning when opened
(``runtime/backends/__init__.py``), and ``--backend`` overrides the choice at export, ``backend=`` at run time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from medusa_trt.runtime.exactness import Exactness

log = logging.getLogger(__name__)

NATIVE, FALLBACK = "native", "onnxruntime"  # the candidate, and what a folder runs when it is not chosen
ROUNDS = 3  # rounds of turns: each backend steps each width BURST times a round
# steps a turn, the first untimed: ONNX Runtime's pool spins on after its step, and a native step right after one takes
# 1.5-2x its time (SmolLM2-135M, 2 cores), the next ones their own. 3 x 4 steps of 1 and 29 tokens: about 2.5 s there
BURST = 4
# seconds between turns: the other backend's threads stop spinning first. Without it ONNX Runtime's spinning pool
# slowed native's int8-channel SmolLM2 step to ONNX Runtime's (9.6 ms against 5.7 ms alone) in the export's process
SETTLE = 0.05
ORT_COPIES = 2.5  # ONNX Runtime's memory for an engine, in copies of its graph files (the weights, then packed), with room
CONTEXT = 256  # committed tokens before each timed step (fewer when the engine's context is smaller), as step_cost.CONTEXT


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # what config.json records: NATIVE or FALLBACK
    reason: str  # why, in a few words, for the user
    step_ms: dict = field(default_factory=dict)  # {backend: {tokens per step: median ms}}; empty where not timed
    exactness: Exactness | None = None  # the probe on native, where it ran (reused as the folder's own when native is chosen)

    def summary(self) -> str:
        """The one line the export prints: ``backend native: exact, one-token step 12.9 ms vs 17.9 ms on onnxruntime``."""
        return f"backend {self.backend}: {self.reason}"

    def to_json(self) -> dict:
        """drafting.json's ``backend_choice``."""
        return {
            "backend": self.backend,
            "reason": self.reason,
            "step_ms": {name: {str(t): round(ms, 3) for t, ms in sorted(table.items())} for name, table in self.step_ms.items()},
        }


def choose_backend(folder: Path, width: int, *, rounds: int = ROUNDS):
    """The backend for the staged engine ``folder`` whose default tree verifies ``width`` tokens a step, and that
    backend where the choice opened it, at batch 1 (for the step-cost table; None where native cannot run and nothing
    was timed): ``(BackendChoice, backend or None)``."""
    from medusa_trt.runtime.backends.native_backend import open_native
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
    from medusa_trt.runtime.exactness import probe
    from medusa_trt.runtime.native_library import NativeUnavailable
    from medusa_trt.runtime.native_weights import NativeCannotRun

    try:
        native = open_native(folder, max_batch=1)
    except NativeCannotRun as exc:
        return BackendChoice(FALLBACK, f"native cannot run this engine ({exc.what})"), None
    except NativeUnavailable as exc:
        return BackendChoice(FALLBACK, f"native cannot run on this machine ({exc})"), None
    exactness = probe(native)
    if not exactness.exact:
        reason = f"native's verify steps differ from its plain steps (max logit difference {exactness.max_diff:.3g})"
        del native  # its memory back before ONNX Runtime's copy of the weights loads
        return BackendChoice(FALLBACK, reason, exactness=exactness), OnnxBackend(folder, max_batch=1)
    if not _room_for_both(folder):
        reason = (
            "exact; not timed against onnxruntime: a second copy of weights this large does not fit in the memory "
            "left (native's step was the faster on every model timed, docs/benchmarks.md)"
        )
        return BackendChoice(NATIVE, reason, exactness=exactness), native
    onnxruntime = OnnxBackend(folder, max_batch=1)
    step_ms = time_backends({NATIVE: native, FALLBACK: onnxruntime}, width, rounds=rounds)
    faster = all(step_ms[NATIVE][t] < step_ms[FALLBACK][t] for t in step_ms[NATIVE])
    figures = _figures(step_ms)
    if faster:
        return BackendChoice(NATIVE, f"exact, {figures}", step_ms, exactness), native
    return BackendChoice(FALLBACK, f"native is exact but not faster here ({figures})", step_ms, exactness), onnxruntime


def _room_for_both(folder: Path) -> bool:
    """ONNX Runtime can open the engine beside native's: the memory available now (native's copy loaded) holds
    ``ORT_COPIES`` copies of its graph files (its weights, and the packed forms it makes at load)."""
    from medusa_trt.exporter.streamed import available_memory

    have = available_memory()
    return not have or have > ORT_COPIES * sum(f.stat().st_size for f in Path(folder).glob("*.onnx*"))


def time_backends(backends: dict, width: int, *, rounds: int = ROUNDS) -> dict:
    """{name: {tokens per step: median ms}} of a one-token step and a ``width``-token step on each of ``backends``
    (batch 1, over a committed context), interleaved (``step_cost.time_steps``, turns of BURST steps, the first untimed)."""
    from medusa_trt.runtime.step_cost import time_steps

    first = next(iter(backends.values()))
    width = max(1, min(width, first.max_tokens or width))
    context = max(0, min(CONTEXT, first.max_context - width))
    times, _ = time_steps(backends, context, sorted({1, width}), rounds, burst=BURST, settle=SETTLE)
    return {name: {t: float(np.median(s)) * 1e3 for t, s in table.items()} for name, table in times.items()}


def _figures(step_ms: dict) -> str:
    """``one-token step 12.9 ms vs 17.9 ms on onnxruntime, 63-token step 40.1 vs 52.3 ms``."""
    native, other = step_ms[NATIVE], step_ms[FALLBACK]
    parts = []
    for t in sorted(native):
        size = "one-token step" if t == 1 else f"{t}-token step"
        parts.append(f"{size} {_ms(native[t])} ms vs {_ms(other[t])} ms" + (f" on {FALLBACK}" if not parts else ""))
    return ", ".join(parts)


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
