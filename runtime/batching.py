"""Continuous batching for servers: requests from any thread join and leave the engine's rows
between steps, each with its own sampling parameters, stop conditions and acceptance length.

    batcher = ContinuousBatcher(MedusaRuntime("build/model.onnx")).start()
    handle = batcher.submit(Request("Hello", max_new_tokens=64, sampling=SamplingParams(temperature=0.7, seed=1)))
    for event in handle:          # StreamEvent per step; the last one has finish_reason set
        print(event.text, end="")
    batcher.close()

One background thread owns the ``scheduler.Scheduler`` (the engine is not thread-safe); ``submit``
checks the request in the caller's thread (bad input raises there, before anything is queued)
and ``cancel`` only sets a flag the loop honours before its next step, freeing the row at once.

Events reach a handle's own queue (iterate the handle, blocking) or, with ``submit(request,
sink=f)``, the callable ``f`` in the loop thread (an asyncio server passes one that hands them to
its event loop). An ``observer`` (``BatchObserver``: the serving metrics) sees every request
submitted and every event delivered, whoever consumes them; ``load()`` says how many requests run
and wait.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.output import request_limits
from medusa_trt.runtime.results import GenerationResult, StreamEvent
from medusa_trt.runtime.sampling import SamplingParams
from medusa_trt.runtime.scheduler import Scheduler, Seq, SeqRequest, admit
from medusa_trt.runtime.text import PromptError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    prompt: str | list[int] | list[dict]  # text (chat template applied for instruct engines), token ids, or a conversation
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] | str | None = None  # stop strings: the text is cut before the first one
    sampling: SamplingParams = SamplingParams()  # temperature 0: greedy
    chat_template: bool | None = None  # None: the engine's default


@dataclass(frozen=True)
class BatcherLoad:
    running: int  # requests that hold a row (or are taking one)
    waiting: int  # requests queued for a free row


class BatchObserver(Protocol):
    """Sees every request of a batcher (the serving metrics implement it). ``submitted`` runs in
    the submitting thread, ``event`` in the loop thread after the handle's timestamps are updated:
    keep both short, they must not raise (an exception is logged and dropped)."""

    def submitted(self, handle: RequestHandle) -> None: ...

    def event(self, handle: RequestHandle, event: StreamEvent, previous_token_at: float | None) -> None: ...


class RequestHandle:
    """A submitted request: iterate for its events (blocking), ``cancel()`` from any thread."""

    def __init__(self, seq: Seq, batcher: ContinuousBatcher, sink: Callable | None = None):
        self.id = seq.request.index
        self.prompt_tokens = len(seq.request.prompt)
        self.max_new_tokens = seq.request.max_new_tokens
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None  # time.monotonic() of the first event with tokens
        self.last_token_at: float | None = None  # of the latest one
        self.new_tokens = 0  # tokens delivered so far
        self._seq, self._batcher = seq, batcher
        self._events: queue.Queue = queue.Queue()
        self._put = sink or self._events.put  # an event or the exception that ended the request
        self._done = False  # the last event was consumed

    def __iter__(self) -> Iterator[StreamEvent]:
        """The events not yet consumed; ends after the last one (at once if it was consumed).
        Not for a handle submitted with a ``sink``: its events go there."""
        while not self._done:
            event = self._events.get()
            if isinstance(event, BaseException):
                self._done = True
                raise EngineError(f"request {self.id} failed: {event}") from event
            self._done = event.finish_reason is not None
            yield event

    def cancel(self) -> None:
        self._seq.cancelled = True
        self._batcher._wake()

    def result(self) -> GenerationResult:
        """Block until the request ends; what it generated."""
        for _ in self:
            pass
        return self._seq.result()


class ContinuousBatcher:
    """Runs a ``MedusaRuntime``'s engine for requests that come and go (see the module doc)."""

    def __init__(self, runtime, observer: BatchObserver | None = None):
        self.runtime = runtime
        self.observer = observer
        self._scheduler = runtime.scheduler()
        self._waiting: deque[Seq] = deque()
        self._handles: dict[int, RequestHandle] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> ContinuousBatcher:
        """Start the loop thread; the batcher holds the runtime's engine until ``close``."""
        if self._thread is None:
            self._engine = self.runtime.engine_lock()
            self._engine.__enter__()  # raises EngineError if the runtime is busy elsewhere
            self._thread = threading.Thread(target=self._loop, name="medusa-batcher", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: Request, *, sink: Callable | None = None) -> RequestHandle:
        """Queue a request; raises ``PromptError`` / ``SamplingError`` for bad input (token ids are
        checked for type and range here, so a bad request never reaches a step shared with others).
        ``sink``: called in the loop thread with each event (and with the exception that ends the
        request if its step fails) instead of queueing them for iteration."""
        rt = self.runtime
        if not isinstance(request, Request):
            raise PromptError(f"submit takes a Request, got {type(request).__name__}")
        if not isinstance(request.sampling, SamplingParams):
            raise PromptError("Request.sampling must be a SamplingParams")
        stops = request_limits(request.max_new_tokens, request.stop)
        if isinstance(request.prompt, list) and not request.prompt:
            raise PromptError("prompt 0 is empty: pass some text or token ids")
        _, batch = rt.encode_prompts(request.prompt, request.chat_template)
        seq = Seq(SeqRequest(next(self._ids), batch[0], request.max_new_tokens, stops, request.sampling))
        handle = RequestHandle(seq, self, sink)
        with self._cond:
            if self._closed:
                raise EngineError("the batcher is closed: create a new one")
            self._handles[seq.request.index] = handle
            self._waiting.append(seq)
            self._cond.notify()
        self._observe("submitted", handle)
        return handle

    def load(self) -> BatcherLoad:
        """Requests running and waiting now (for gauges; any thread)."""
        with self._cond:
            return BatcherLoad(running=len(self._handles) - len(self._waiting), waiting=len(self._waiting))

    def _observe(self, what: str, *args) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, what)(*args)
        except Exception:  # noqa: BLE001 - metrics must never end a request or the loop
            log.exception("batch observer failed on %s", what)

    def close(self) -> None:
        """Stop the loop; requests still running or waiting end with finish_reason "cancelled"."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._engine.__exit__(None, None, None)
        self._finish_all(None)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        scheduler = self._scheduler
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not scheduler.active:
                    self._cond.wait()
                if self._closed:
                    return
                joining = admit(self._waiting, scheduler.free)  # any free row, at once
            for seq in [s for s in joining if s.cancelled]:  # cancelled before it ever ran
                seq.finish_reason = "cancelled"
                self._deliver(seq, StreamEvent(seq.request.index, [], "", "cancelled"))
            joining = [s for s in joining if not s.cancelled]
            try:
                if joining:
                    scheduler.add(joining)
                for seq, event in scheduler.step():
                    self._deliver(seq, event)
            except Exception as exc:  # noqa: BLE001 - a failed step ends the requests in it with the error, not a hang
                log.exception("engine step failed; ending the %d requests in it", scheduler.active)
                self._fail_running(scheduler, exc)
                self._scheduler = scheduler = self.runtime.scheduler()  # fresh rows; waiting requests still run

    def _fail_running(self, scheduler: Scheduler, error: BaseException) -> None:
        """End the requests of a failed step with the error; the batcher keeps serving the others."""
        for seq in [s for s in scheduler.rows if s is not None]:
            seq.finish_reason = seq.finish_reason or "error"
            with self._cond:
                handle = self._handles.pop(seq.request.index, None)
            if handle is not None:
                self._observe("event", handle, StreamEvent(handle.id, [], "", "error"), handle.last_token_at)
                handle._put(error)

    def _deliver(self, seq: Seq, event: StreamEvent) -> None:
        with self._cond:
            handle = self._handles.get(seq.request.index)
            if event.finish_reason is not None:
                self._handles.pop(seq.request.index, None)
        if handle is None:
            return
        previous = handle.last_token_at
        if event.token_ids:
            now = time.monotonic()
            handle.first_token_at = handle.first_token_at or now
            handle.last_token_at = now
            handle.new_tokens += len(event.token_ids)
        self._observe("event", handle, event, previous)
        handle._put(event)

    def _finish_all(self, error: BaseException | None) -> None:
        with self._cond:
            handles, self._handles = self._handles, {}
            self._waiting.clear()
        for handle in handles.values():
            handle._seq.finish_reason = handle._seq.finish_reason or "cancelled"
            event = StreamEvent(handle.id, [], "", "cancelled")
            self._observe("event", handle, event, handle.last_token_at)
            handle._put(error if error is not None else event)
