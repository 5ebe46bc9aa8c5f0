"""Small clients of the two serving paths.

    stream_generate(address, text, max_tokens=64)        Triton's medusa model over one gRPC stream
                                                         (tritonclient): a ``Chunk`` per response
    stream_completion(url, prompt, max_tokens=64)        the OpenAI server's /v1/completions (or
                                                         /v1/chat/completions with messages=) as
                                                         server-sent events, over the standard
                                                         library's http.client: a ``Delta`` per event

Both raise ``RequestFailed`` with the server's message for an error response. Closing the
generator early closes the stream or connection, which cancels the request on the server.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError
from medusa_trt.serving.schema import TRITON_INPUTS


class RequestFailed(MedusaError):
    """The server answered a request with an error response (its message is the server's)."""


@dataclass(frozen=True)
class Chunk:
    """One response of a streamed generation."""

    text: str  # text added by this engine step
    token_ids: list[int]  # tokens added by it
    finish_reason: str  # "" until the last response


# the model's optional inputs: (wire type, numpy dtype) from the schema config.pbtxt is written from
_INPUT_TYPES = {t.name: (t.wire_type, t.dtype) for t in TRITON_INPUTS if t.optional and t.name != "stop"}


def stream_generate(
    address: str,
    text: str,
    *,
    model: str = "medusa",
    stop=None,
    timeout: float = 300.0,
    extra_inputs=(),
    parameters: dict | None = None,
    **inputs,
):
    """Generate over one gRPC stream (tritonclient), yielding a ``Chunk`` per response; raises
    ``RequestFailed`` for an error response. ``inputs``: max_tokens, temperature, top_p, top_k,
    seed, stream (default True), timeout_s; ``extra_inputs``: ready-made ``InferInput``s and ``parameters``:
    request parameters (the model refuses both unless they are its own; tests send them)."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs.setdefault("stream", True)
    tensors = []

    def add(name, array, datatype):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)

    add("text_input", np.array([text.encode("utf-8")], dtype=np.object_), "BYTES")
    for name, value in inputs.items():
        if name not in _INPUT_TYPES:
            raise TypeError(f"unknown input {name!r}: pass it in extra_inputs")
        datatype, dtype = _INPUT_TYPES[name]
        add(name, np.array([value], dtype=dtype), datatype)
    if stop:
        add("stop", np.array([s.encode("utf-8") for s in ([stop] if isinstance(stop, str) else stop)], dtype=np.object_), "BYTES")
    tensors += list(extra_inputs)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout)
    done = False
    try:
        client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                done = True
                raise RequestFailed(error.message() if hasattr(error, "message") else str(error))
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in response.parameters else False
            if response.outputs:
                reason = result.as_numpy("finish_reason")
                yield Chunk(
                    text=b"".join(result.as_numpy("text_output").tolist()).decode("utf-8"),
                    token_ids=[int(t) for t in result.as_numpy("token_ids")],
                    finish_reason=reason.reshape(-1)[0].decode("utf-8") if reason is not None else "",
                )
            if final:
                done = True
                return
    finally:
        # Half-close when the request is over; cancel only one still running (the caller stopped
        # early). Triton 2.51 leaks a model reference when a stream whose request it refused
        # (unknown input, wrong type) is cancelled rather than closed: unloading then waits out
        # --exit-timeout-secs.
        client.stop_stream(cancel_requests=not done)
        client.close()


@dataclass(frozen=True)
class Delta:
    """One server-sent event of an OpenAI streaming response."""

    text: str  # the text it adds ("" for the usage event)
    finish_reason: str | None  # set on the choice's last event
    usage: dict | None = None  # the last event with stream_options.include_usage: prompt / completion tokens


def stream_completion(
    url: str,
    prompt: str | list[int] | None = None,
    *,
    messages: list[dict] | None = None,
    api_key: str | None = None,
    timeout: float = 300.0,
    **fields,
) -> Iterator[Delta]:
    """Stream a completion from the OpenAI server at ``url`` (``http://HOST:PORT``): ``prompt`` to
    /v1/completions, or ``messages`` to /v1/chat/completions; ``fields``: any other body fields
    (max_tokens, temperature, stop, seed ...). Usage is asked for: the last ``Delta`` carries it."""
    if (prompt is None) == (messages is None):
        raise TypeError("pass prompt= (a completion) or messages= (a chat completion)")
    chat = messages is not None
    body = {"messages": messages} if chat else {"prompt": prompt}
    body |= {"stream": True, "stream_options": {"include_usage": True}} | fields
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RequestFailed(_error_message(response.status, response.read()))
        while True:
            line = response.readline()
            if not line:
                raise RequestFailed("the server closed the stream before data: [DONE]")
            line = line.strip()
            if not line.startswith(b"data: "):
                continue  # the blank line between events
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed(event["error"].get("message", str(event["error"])))
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
                yield Delta(text, choice.get("finish_reason"))
            if event.get("usage"):
                yield Delta("", None, event["usage"])
    finally:
        conn.close()


def _error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}"
