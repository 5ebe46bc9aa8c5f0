"""The Triton Python-backend model that serves a medusa-trt engine (copied as ``<repo>/medusa/1/model.py``).

Triton runs this file in its Python stub process; it imports the lean runtime only (numpy,
onnxruntime, tokenizers: never torch or transformers, unless the engine is a TensorRT ``.plan``,
whose backend brings tensorrt and torch).
The model is *decoupled*: a request gets any number of responses and then the final flag.

    initialize   MedusaRuntime over the engine named in config.pbtxt (every engine file's sha256
                 checked against the export's manifest, once) + a ContinuousBatcher
    execute      each request: parse its tensors into a batching.Request and submit it; bad input
                 gets one error response with the final flag, at once; a good one gets a thread
                 that forwards the batcher's StreamEvents as responses (stream=true: one per
                 engine step; else one at the end)
    (watchdog)   every CANCEL_POLL_S, requests the client cancelled or dropped free their row, and
                 requests past their deadline end with finish_reason "timeout"
    finalize     close the batcher: requests still running end as cancelled

Inputs: ``text_input`` (BYTES, required), optional ``max_tokens`` INT32, ``temperature`` FP32,
``top_p`` FP32, ``top_k`` INT32, ``stop`` BYTES [-1], ``seed`` UINT64, ``stream`` BOOL,
``timeout_s`` FP32 (seconds from arrival; at most the server's ``request_timeout``).
Outputs per response: ``text_output`` (the new text), ``token_ids`` (the new tokens),
``finish_reason`` ("" until the last response, then "stop", "length" or "timeout"; a request
cancelled by its client or by shutdown ends with a CANCELLED error response instead).
Limits: ``max_tokens`` above the config's ``max_tokens_limit`` is refused (not clamped: the
client learns its request was not served as asked). A request past its deadline frees its row
and ends with finish_reason "timeout" after what it had sent (a tail held back because it could
still become a stop string is not sent). Stop strings: the text sent (streamed or
not) is the runtime's stream events' text, which holds back any tail that could still become a
stop string, so no part of a stop string is ever sent.
Triton rejects input tensors the config does not name; this model rejects every request
parameter (Triton's generate endpoint turns JSON fields that match no input into parameters).
The inputs, outputs and defaults are ``medusa_trt.serving.schema``'s, the validation its
``make_request`` (the OpenAI server's too).

Metrics: the serving metrics (``medusa_trt.serving.metrics``: drafted and accepted tokens by
drafter, drafts, finished requests by reason, tokens, running / waiting, and the latency
histograms where this Triton's Python backend has histograms) as Triton custom metrics
(``pb_utils.MetricFamily``), labelled with the model's name, on the server's metrics endpoint
beside Triton's own.

Outside Triton (tests) the module imports without ``triton_python_backend_utils``:
``parse_request`` and ``ServeDefaults`` need neither the stub nor an engine.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.errors import MedusaError
from medusa_trt.serving.schema import DEFAULT_MAX_TOKENS_LIMIT, RequestError, ServeDefaults, engine_summary, make_request
from medusa_trt.serving.schema import TRITON_INPUT_NAMES as INPUTS

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton's stub (tests of the request parsing)
    pb_utils = None

CANCEL_POLL_S = 0.2  # how often queued and running requests are checked for client cancellation


@dataclass(frozen=True)
class ServeRequest:
    """A parsed request: what the batcher runs, how it is answered, when it must end."""

    request: object  # batching.Request
    stream: bool  # one response per engine step (else one at the end)
    timeout: float | None  # seconds from arrival; None: no deadline


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt ``parameters`` as plain strings (Triton hands them over as {key: {string_value}})."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def defaults_from(params: dict[str, str]) -> ServeDefaults:
    chat = params.get("chat_template", "auto").strip().lower()
    if chat not in ("auto", "true", "false"):
        raise MedusaError(f"config.pbtxt parameter chat_template is {chat!r}: use auto, true or false")
    defaults = ServeDefaults(
        max_tokens=int(params.get("default_max_tokens") or ServeDefaults.max_tokens),
        temperature=float(params.get("default_temperature") or ServeDefaults.temperature),
        top_p=float(params.get("default_top_p") or ServeDefaults.top_p),
        chat_template=None if chat == "auto" else chat == "true",
        max_tokens_limit=int(params.get("max_tokens_limit") or DEFAULT_MAX_TOKENS_LIMIT),
        request_timeout=float(params.get("request_timeout") or ServeDefaults.request_timeout),
    )
    return defaults.with_limit(defaults.max_tokens_limit)  # a default max_tokens above the limit is refused


def parse_request(inputs: dict[str, np.ndarray | None], parameters: dict, defaults: ServeDefaults) -> ServeRequest:
    """A ``ServeRequest`` from a request's tensors (name -> array or None).

    Raises ``RequestError`` / ``SamplingError`` with a message that names the offending input."""
    if parameters:
        raise RequestError(f"unknown request parameter(s) {sorted(parameters)}: this model takes only the inputs {', '.join(INPUTS)}")
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:  # Triton already refuses tensors the config does not name; kept for direct callers
        raise RequestError(f"unknown input(s) {unknown}: this model takes {', '.join(INPUTS)}")

    def scalar(name, kind):
        value = inputs.get(name)
        if value is None:
            return None
        if value.size != 1:
            raise RequestError(f"{name} must hold one value, got shape {list(value.shape)}")
        return kind(value.reshape(-1)[0])

    text = inputs.get("text_input")
    if text is None:
        raise RequestError("text_input is required: send the prompt as a BYTES tensor of shape [1]")
    if text.size != 1:
        raise RequestError(f"text_input must hold one prompt, got shape {list(text.shape)}")
    prompt = _text(text.reshape(-1)[0], "text_input")
    if not prompt:
        raise RequestError("text_input is empty: send a prompt")
    stop = inputs.get("stop")
    request = make_request(
        prompt,
        max_tokens=scalar("max_tokens", int),
        defaults=defaults,
        stop=tuple(_text(s, "stop") for s in stop.reshape(-1)) if stop is not None else None,
        temperature=scalar("temperature", float),
        top_p=scalar("top_p", float),
        top_k=scalar("top_k", int),
        seed=scalar("seed", int),
        chat_template=defaults.chat_template,
    )
    stream = bool(scalar("stream", bool))
    return ServeRequest(request, stream, _timeout(scalar("timeout_s", float), defaults.request_timeout))


def _timeout(asked: float | None, server: float) -> float | None:
    """The request's deadline in seconds: its own ``timeout_s`` (at most the server's), else the server's."""
    if asked is None:
        return server or None
    if not math.isfinite(asked) or asked <= 0:
        raise RequestError(f"timeout_s must be a number of seconds > 0, got {asked}")
    if server and asked > server:
        raise RequestError(
            f"timeout_s {asked:g} exceeds this server's request_timeout of {server:g} s "
            "(medusa-triton-repo --request-timeout): ask for less"
        )
    return asked


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name} is not valid UTF-8: {exc}") from exc
    return str(value)


class TritonPythonModel:
    """Triton's entry points; see the module doc."""

    def initialize(self, args):
        from medusa_trt.runtime import MedusaRuntime
        from medusa_trt.runtime.batching import ContinuousBatcher
        from medusa_trt.serving.metrics import MetricsObserver

        config = json.loads(args["model_config"])
        params = model_parameters(config)
        self.defaults = defaults_from(params)
        engine = Path(params.get("engine", ""))
        if not params.get("engine"):
            raise MedusaError("config.pbtxt has no 'engine' parameter: write the repository with medusa-triton-repo --engine E")
        if not engine.is_absolute():  # relative to the model's folder (an engine copied into the repository)
            engine = (Path(args["model_repository"]) / engine).resolve()  # through the run folder's link: messages name the real file
        if not engine.exists():
            raise MedusaError(
                f"engine {engine} (config.pbtxt parameter 'engine') does not exist: "
                "export it with medusa-export --out, or rewrite the repository with medusa-triton-repo --engine"
            )

        def opt_int(key):
            return int(params[key]) if params.get(key) else None

        # verify_checksums: a file corrupted in place (same size) is named here, once, not served
        drafters = params.get("drafters") or None  # "": the engine's default set; "none": plain decoding
        drafters = None if drafters is None else () if drafters == "none" else tuple(drafters.split(","))
        runtime = MedusaRuntime(
            str(engine),
            max_batch=opt_int("max_batch"),
            max_context=opt_int("max_context"),
            backend=params.get("backend") or None,
            threads=opt_int("threads"),
            tree=params.get("tree") or None,
            verify_checksums=True,
            drafters=drafters,
        )
        self.runtime = runtime
        self.metrics = _TritonMetrics(args.get("model_name") or config.get("name", "medusa"))
        self.batcher = ContinuousBatcher(runtime, observer=MetricsObserver(self.metrics)).start()
        self._live: dict[int, LiveRequest] = {}  # request id -> the request in flight
        self._lock = threading.Lock()  # guards _live
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="medusa-cancel-watch", daemon=True)
        self._watchdog.start()
        pb_utils.Logger.log_info(
            f"medusa: {engine} ({engine_summary(runtime)}; drafters {','.join(runtime.drafting.names) or 'none'}; heads template "
            f"{runtime.tree.name}, {runtime.tree.num_nodes} nodes), "
            f"max_batch {runtime.max_batch}, max_context {runtime.max_context}"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            arrived = time.monotonic()
            try:
                parsed = parse_request(_inputs(request), json.loads(request.parameters() or "{}"), self.defaults)
                handle = self.batcher.submit(parsed.request)  # PromptError (empty, too long) / SamplingError here
            except MedusaError as exc:
                _send_error(sender, str(exc), "INVALID_ARG")
                continue
            except Exception as exc:  # noqa: BLE001 - an unexpected failure answers this request, the model stays up
                pb_utils.Logger.log_error(f"medusa: request failed: {exc!r}")
                _send_error(sender, f"internal error: {exc}", "INTERNAL")
                continue
            live = LiveRequest(request, handle, sender, arrived, parsed.timeout)
            live.thread = threading.Thread(target=self._forward, args=(live, parsed.stream), name=f"medusa-req-{handle.id}", daemon=True)
            with self._lock:
                self._live[handle.id] = live
            live.thread.start()
        # decoupled: nothing to return, responses go through each request's sender

    def _forward(self, live: LiveRequest, stream: bool) -> None:
        """Send one request's events as responses; the last one carries the final flag."""
        text, tokens = [], []
        try:
            for event in live.handle:
                if not event.finish_reason and self._free_if_cancelled(live):
                    continue  # the cancelled event follows (and ends the request); the poll alone could miss a short one
                if event.finish_reason != "cancelled" and live.past_deadline():  # checked per step too: the watchdog
                    live.timed_out = True  # polls every CANCEL_POLL_S, longer than a whole short request may take
                    live.handle.cancel()  # frees the row; what this event holds is past the deadline and not sent
                    live.send(_response("" if stream else "".join(text), [] if stream else tokens, "timeout"), final=True)
                    return
                if event.finish_reason == "cancelled" and live.timed_out:  # its deadline passed (_watch)
                    live.send(_response("" if stream else "".join(text), [] if stream else tokens, "timeout"), final=True)
                    return
                if event.finish_reason == "cancelled":
                    live.error("request cancelled" if not self._stopping.is_set() else "the server is shutting down", "CANCELLED")
                    return
                if stream:
                    live.send(_response(event.text, event.token_ids, event.finish_reason or ""), final=event.finish_reason is not None)
                else:
                    text.append(event.text)
                    tokens += event.token_ids
                    if event.finish_reason:
                        live.send(_response("".join(text), tokens, event.finish_reason), final=True)
        except MedusaError as exc:  # the engine failed: every running request ends with the error
            live.error(str(exc), "INTERNAL")
        except Exception as exc:  # noqa: BLE001 - the client went away mid-stream: free the row, keep serving
            pb_utils.Logger.log_warn(f"medusa: request {live.handle.id} ended early ({exc!r}): its row is freed")
            live.handle.cancel()
            live.close()
        finally:
            with self._lock:
                self._live.pop(live.handle.id, None)

    def _watch(self) -> None:
        from medusa_trt.serving.metrics import RUNNING, WAITING

        while not self._stopping.wait(CANCEL_POLL_S):
            load = self.batcher.load()
            self.metrics.set(RUNNING, load.running)
            self.metrics.set(WAITING, load.waiting)
            self.metrics.flush()
            with self._lock:
                running = list(self._live.values())
            for live in running:
                if self._free_if_cancelled(live):
                    continue
                if live.past_deadline() and not live.timed_out:
                    live.timed_out = True  # read by _forward when the cancelled event comes
                    pb_utils.Logger.log_info(f"medusa: request {live.handle.id} passed its deadline: it ends with finish_reason timeout")
                    live.handle.cancel()

    def _free_if_cancelled(self, live: LiveRequest) -> bool:
        """Whether the client cancelled ``live``; the first caller to see it (its forwarder, per
        event, or the watchdog, for requests still waiting for a row) frees the row, once."""
        if not live.cancelled():
            return live.freed
        with self._lock:
            first, live.freed = not live.freed, True
            self._live.pop(live.handle.id, None)
        if first:
            pb_utils.Logger.log_info(f"medusa: request {live.handle.id} cancelled by the client: its row is freed")
            live.handle.cancel()
        return True

    def finalize(self):
        self._stopping.set()
        self.batcher.close()  # running and waiting requests end as cancelled
        with self._lock:
            running = list(self._live.values())
        for live in running:
            live.thread.join(timeout=5)
        self._watchdog.join(timeout=5)
        self.metrics.close()  # Triton wants a MetricFamily's Metric objects gone before it


class _TritonMetrics:
    """``serving.metrics``' sink as Triton custom metrics, labelled ``model``. Updates from the
    batcher's loop thread are summed here and sent to the server by ``flush`` (the watchdog
    thread, every CANCEL_POLL_S): each metric call is a round trip to the server, which the loop
    should not wait on. Histograms only where this Triton's Python backend has them."""

    def __init__(self, model: str):
        from medusa_trt.serving.metrics import METRICS

        self.model = model
        self._lock = threading.Lock()
        self._pending: dict[tuple, float] = {}  # (spec name, labels) -> counter increment not yet sent
        self._observed: list[tuple[str, float]] = []  # histogram observations not yet sent
        self._gauges: dict[str, float] = {}
        self._specs = {spec.name: spec for spec in METRICS}
        kinds = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}
        self._families = {}
        for spec in METRICS:
            kind = getattr(pb_utils.MetricFamily, kinds[spec.kind], None)
            if kind is not None:
                self._families[spec.name] = pb_utils.MetricFamily(name=spec.name, description=spec.help, kind=kind)
        self._metrics: dict[tuple, object] = {}
        self._failed: set[str] = set()  # metrics whose update failed once (logged once)

    def inc(self, spec, value, **labels) -> None:
        key = (spec.name, tuple(sorted(labels.items())))
        with self._lock:
            self._pending[key] = self._pending.get(key, 0.0) + float(value)

    def observe(self, spec, value) -> None:
        if spec.name in self._families:
            with self._lock:
                self._observed.append((spec.name, float(value)))

    def set(self, spec, value) -> None:
        with self._lock:
            self._gauges[spec.name] = float(value)

    def _metric(self, name: str, labels: tuple):
        metric = self._metrics.get((name, labels))
        if metric is None:
            spec, extra = self._specs[name], {}
            if spec.kind == "histogram":
                extra["buckets"] = list(spec.buckets)
            metric = self._metrics[(name, labels)] = self._families[name].Metric(labels={"model": self.model, **dict(labels)}, **extra)
        return metric

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            observed, self._observed = self._observed, []
            gauges = dict(self._gauges)
        updates = [(name, labels, "increment", value) for (name, labels), value in pending.items()]
        updates += [(name, (), "observe", value) for name, value in observed]
        updates += [(name, (), "set", value) for name, value in gauges.items()]
        for name, labels, how, value in updates:
            try:
                getattr(self._metric(name, labels), how)(value)
            except Exception as exc:  # noqa: BLE001 - metrics never stop serving; one failing metric leaves the others
                if name not in self._failed:
                    self._failed.add(name)
                    pb_utils.Logger.log_warn(f"medusa: metrics update failed for {name}: {exc!r}")

    def close(self) -> None:
        self.flush()
        self._metrics.clear()
        self._families.clear()


class LiveRequest:
    """One request in flight: its Triton request and response sender, its batching handle and the
    thread forwarding its events. Triton frees a request's response factory once the final
    response is sent, and ``is_cancelled()`` after that reads freed memory (the server crashes),
    so the final send and the cancellation poll hold ``lock``, and ``done`` is set before the
    final send."""

    def __init__(self, request, handle, sender, arrived: float, timeout: float | None):
        self.request, self.handle, self.sender = request, handle, sender
        self.arrived = arrived  # time.monotonic() when the request came
        self.timeout = timeout  # seconds from arrival after which the request ends with "timeout"; None: none
        self.timed_out = False
        self.freed = False  # the client cancelled and the row was given back (``_free_if_cancelled``)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.done = False

    def elapsed(self) -> float:
        """Seconds since the request arrived."""
        return time.monotonic() - self.arrived

    def past_deadline(self) -> bool:
        return self.timeout is not None and self.elapsed() >= self.timeout

    def send(self, response, *, final: bool) -> None:
        if not final:
            self.sender.send(response)
            return
        with self.lock:
            self.done = True
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def error(self, message: str, code: str) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                _send_error(self.sender, message, code)

    def close(self) -> None:
        """The final flag alone, after a failed send (Triton holds the request until it comes)."""
        with self.lock:
            if not self.done:
                self.done = True
                try:
                    self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:  # noqa: BLE001, S110 - the sender is closed already: nothing is pending
                    pass

    def cancelled(self) -> bool:
        with self.lock:
            if self.done:
                return False
            try:
                return bool(self.request.is_cancelled())
            except Exception:  # noqa: BLE001 - not answerable: treat as running, the forwarder ends it
                return False


def _inputs(request) -> dict[str, np.ndarray | None]:
    out = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


def _response(text: str, token_ids: list[int], finish_reason: str):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("token_ids", np.asarray(token_ids, dtype=np.int64)),
            pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        ]
    )


def _send_error(sender, message: str, code: str) -> None:
    error_type = pb_utils.TritonError
    error = error_type(message, getattr(error_type, code)) if hasattr(error_type, code) else error_type(message)
    try:
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as exc:  # noqa: BLE001 - the client is gone; nothing left to tell it
        pb_utils.Logger.log_warn(f"medusa: could not send error response ({exc!r}): {message}")
