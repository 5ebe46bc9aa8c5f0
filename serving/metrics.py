"""Serving metrics: their names (after vLLM's), what feeds them, and the Prometheus sink.

The acceptance counters are the number that decides whether Medusa pays in production. Their
terms are ``results.StepDrafts``' (vLLM's): per request and verify step, the *draft tokens* are the
step tree's nodes below its root (the root is the previous step's bonus token, not a draft) and
the *accepted tokens* are the draft tokens on the accepted path that were committed (the bonus
token after them is not counted: a step emits accepted + 1 tokens). So

    mean acceptance length (tokens per step) = 1 + accepted_tokens / num_drafts
    draft acceptance rate                    = accepted_tokens / draft_tokens

``num_drafts`` counts verify steps that held at least one draft token (plain decoding drafts
nothing and moves none of the three). Draft and accepted tokens carry a ``drafter`` label
(heads, lookup, recycle): a node several drafters proposed is credited to the one whose
candidate created it, so the per-drafter series add up to the totals.

    medusa:spec_decode_num_drafts_total                      counter
    medusa:spec_decode_num_draft_tokens_total{drafter}       counter
    medusa:spec_decode_num_accepted_tokens_total{drafter}    counter
    medusa:requests_finished_total{finish_reason}            counter  stop, length, cancelled, error
    medusa:prompt_tokens_total, medusa:generation_tokens_total  counters
    medusa:num_requests_running, medusa:num_requests_waiting    gauges (rows held, queued for a row)
    medusa:time_to_first_token_seconds                       histogram  from submission to the first token
    medusa:inter_token_latency_seconds                       histogram  between a request's successive engine steps
    medusa:e2e_request_latency_seconds                       histogram  from submission to the last event

Every series also has a ``model`` label (the served model's name). ``MetricsObserver`` is the
``batching.BatchObserver`` that turns a batcher's events into updates of a *sink*:
``PrometheusSink`` (the OpenAI server's /metrics) here, Triton's custom metrics in
``serving/triton_model.py`` (histograms where that Triton's Python backend has them). Nothing
here imports prometheus_client until a ``PrometheusSink`` is made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed; counters end in _total
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()  # besides "model"
    buckets: tuple[float, ...] = ()  # histograms: upper bounds in seconds


NUM_DRAFTS = MetricSpec("medusa:spec_decode_num_drafts_total", "counter", "Verify steps of a request that held at least one draft token")
NUM_DRAFT_TOKENS = MetricSpec(
    "medusa:spec_decode_num_draft_tokens_total",
    "counter",
    "Draft tokens verified (tree nodes below the root), by the drafter credited with them",
    ("drafter",),
)
NUM_ACCEPTED_TOKENS = MetricSpec(
    "medusa:spec_decode_num_accepted_tokens_total",
    "counter",
    "Draft tokens accepted and committed (the bonus token not counted), by drafter",
    ("drafter",),
)
REQUESTS_FINISHED = MetricSpec("medusa:requests_finished_total", "counter", "Requests finished, by finish reason", ("finish_reason",))
PROMPT_TOKENS = MetricSpec("medusa:prompt_tokens_total", "counter", "Prompt tokens of the requests submitted")
GENERATION_TOKENS = MetricSpec("medusa:generation_tokens_total", "counter", "Tokens generated")
RUNNING = MetricSpec("medusa:num_requests_running", "gauge", "Requests holding an engine row")
WAITING = MetricSpec("medusa:num_requests_waiting", "gauge", "Requests queued for a free engine row")
TTFT = MetricSpec(
    "medusa:time_to_first_token_seconds",
    "histogram",
    "Seconds from submission to the first token",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0),
)
ITL = MetricSpec(
    "medusa:inter_token_latency_seconds",
    "histogram",
    "Seconds between successive engine steps of a request",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
)
E2E = MetricSpec(
    "medusa:e2e_request_latency_seconds",
    "histogram",
    "Seconds from submission to the request's last event",
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0),
)
METRICS = (
    NUM_DRAFTS,
    NUM_DRAFT_TOKENS,
    NUM_ACCEPTED_TOKENS,
    REQUESTS_FINISHED,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    RUNNING,
    WAITING,
    TTFT,
    ITL,
    E2E,
)


class Sink(Protocol):
    """Where metric updates go (labels: the spec's labels; the sink adds ``model``)."""

    def inc(self, spec: MetricSpec, value: float, **labels: str) -> None: ...

    def observe(self, spec: MetricSpec, value: float) -> None: ...

    def set(self, spec: MetricSpec, value: float) -> None: ...


class MetricsObserver:
    """The ``batching.BatchObserver`` behind every metric above; gauges come from ``refresh``."""

    def __init__(self, sink: Sink):
        self.sink = sink

    def submitted(self, handle) -> None:
        self.sink.inc(PROMPT_TOKENS, handle.prompt_tokens)

    def event(self, handle, event, previous_token_at: float | None) -> None:
        sink = self.sink
        if event.token_ids:
            sink.inc(GENERATION_TOKENS, len(event.token_ids))
            if previous_token_at is None:
                sink.observe(TTFT, handle.first_token_at - handle.submitted_at)
            else:
                sink.observe(ITL, handle.last_token_at - previous_token_at)
        drafts = event.drafts
        if drafts is not None and drafts.drafted:
            sink.inc(NUM_DRAFTS, 1)
            for drafter, drafted, accepted in drafts.by_drafter:
                sink.inc(NUM_DRAFT_TOKENS, drafted, drafter=drafter)
                sink.inc(NUM_ACCEPTED_TOKENS, accepted, drafter=drafter)
        if event.finish_reason is not None:
            sink.inc(REQUESTS_FINISHED, 1, finish_reason=event.finish_reason)
            sink.observe(E2E, time.monotonic() - handle.submitted_at)

    def refresh(self, load) -> None:
        """Set the gauges from a ``batching.BatcherLoad``."""
        self.sink.set(RUNNING, load.running)
        self.sink.set(WAITING, load.waiting)


class PrometheusSink:
    """Every metric in its own prometheus_client registry; ``render()`` is the /metrics body.
    ``load``: a callable returning the batcher's ``BatcherLoad``, read at each scrape."""

    def __init__(self, model: str, load=None):
        import prometheus_client as prom

        prom.disable_created_metrics()  # no *_created series beside each counter (as vLLM): the server owns its process
        self.model = model
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self._metrics = {}
        for spec in METRICS:
            labels = ("model", *spec.labels)
            if spec.kind == "counter":  # prometheus_client adds the _total suffix itself
                metric = prom.Counter(spec.name.removesuffix("_total"), spec.help, labels, registry=self.registry)
            elif spec.kind == "gauge":
                metric = prom.Gauge(spec.name, spec.help, labels, registry=self.registry)
            else:
                metric = prom.Histogram(spec.name, spec.help, labels, buckets=spec.buckets, registry=self.registry)
            self._metrics[spec.name] = metric
        if load is not None:
            self._metrics[RUNNING.name].labels(model=model).set_function(lambda: load().running)
            self._metrics[WAITING.name].labels(model=model).set_function(lambda: load().waiting)
        for reason in ("stop", "length"):  # the usual series exist from the start (a rate() needs a zero)
            self._metrics[REQUESTS_FINISHED.name].labels(model=model, finish_reason=reason)

    def inc(self, spec: MetricSpec, value: float, **labels: str) -> None:
        self._metrics[spec.name].labels(model=self.model, **labels).inc(value)

    def observe(self, spec: MetricSpec, value: float) -> None:
        self._metrics[spec.name].labels(model=self.model).observe(value)

    def set(self, spec: MetricSpec, value: float) -> None:
        self._metrics[spec.name].labels(model=self.model).set(value)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
