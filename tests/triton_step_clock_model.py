"""The served Triton model with a step clock, for the deadline tests (tests/test_security.py).

``install(model_folder)`` copies this file over ``<model_folder>/1/model.py`` of a repository that
``write_triton_repo`` wrote. Triton then serves ``serving/triton_model.py`` unchanged but for the clock of
its deadlines: a request's time is ``STEP_S`` seconds per engine step that emitted tokens for it, not the
wall clock, so a test knows after how many steps a deadline passes whatever the machine's speed (a
request waiting for a row or a slow machine does not bring its deadline closer).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from medusa_trt.serving import triton_model

STEP_S = 0.003  # seconds a request's deadline counts per engine step


class StepClockLive(triton_model.LiveRequest):
    """A request in flight whose ``elapsed`` counts its engine steps."""

    def __init__(self, request, handle, *args):
        super().__init__(request, _CountedSteps(handle, self), *args)
        self.steps = 0  # events that reached the model's forwarding thread, cancellations left out

    def elapsed(self) -> float:
        return self.steps * STEP_S


class _CountedSteps:
    """A batching handle whose events each count one step of ``live`` before the model reads them."""

    def __init__(self, handle, live: StepClockLive):
        self._handle, self._live = handle, live

    def __iter__(self):
        for event in self._handle:
            if event.finish_reason != "cancelled":
                self._live.steps += 1
            yield event

    def __getattr__(self, name):  # id, cancel: the handle's own
        return getattr(self._handle, name)


class TritonPythonModel(triton_model.TritonPythonModel):
    """Triton's entry point (the name Triton looks up in model.py)."""

    def initialize(self, args):
        triton_model.LiveRequest = StepClockLive  # in Triton's stub process, which serves this one model
        super().initialize(args)


def install_step_clock(model_folder: Path) -> None:
    """Serve the model of ``model_folder`` (what ``write_triton_repo`` returned) with the step clock."""
    shutil.copyfile(__file__, Path(model_folder) / "1" / "model.py")
