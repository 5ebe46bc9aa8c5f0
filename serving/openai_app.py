"""The OpenAI-compatible API as a FastAPI app over a ``ContinuousBatcher`` (``serve_openai`` runs it).

    POST /v1/completions        prompt (text or token ids) -> text, as OpenAI's legacy completions
    POST /v1/chat/completions   messages (system / user / assistant turns) through the model's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs
    GET  /metrics               Prometheus text (``serving.metrics``)

Fields: ``max_tokens`` (chat: or ``max_completion_tokens``), ``stop`` (text or a list),
``temperature``, ``top_p``, ``top_k`` (an extension, as vLLM's), ``seed``, ``stream`` with
``stream_options.include_usage``, ``user`` (recorded nowhere); chat: ``chat_template_kwargs`` (an
extension, as vLLM's: variables for the chat template, such as Qwen3's ``{"enable_thinking": false}``;
a name the template does not read is a 400). Fields OpenAI defines that change
the output in ways this server does not build (``n`` > 1, ``logprobs``, ``echo``, ``best_of`` > 1,
``suffix``, penalties, ``logit_bias``, tools, a JSON ``response_format``) are refused with a 400
naming the field, as is any field OpenAI does not define: a request is never served other than
as asked. Every client error is a 400 with OpenAI's body, ``{"error": {"message", "type":
"invalid_request_error", "param", "code"}}``: malformed JSON, a wrong type, an empty prompt, a
prompt that leaves no room in the context, ``max_tokens`` beyond the context or the server's limit,
a body larger than the context can use, more than ``MAX_STOP_STRINGS`` stop strings or
``MAX_STOP_BYTES`` of them. A missing or wrong API key (``--api-key``) is a 401 on every /v1 route;
another model name a 404.

Cheap refusals come first, in a plain ASGI middleware (``_Guard``), before any body is read: on a
loopback server a ``Host`` header other than 127.0.0.1, localhost or [::1] (any port) is a 403, so
a web page the user opens cannot reach the server through DNS rebinding (a name of the attacker's
that resolves to 127.0.0.1); then the API key; then a POST whose Content-Type is not
application/json is a 415, so a page cannot send a "simple" cross-origin request (text/plain, no
CORS preflight) either.

Defaults: a request that sends no ``temperature`` decodes greedily (``ServeDefaults``, the
server's ``--temperature``), unlike OpenAI's 1.0: the same request gives the same text, which
Medusa's speedup is measured on. ``max_tokens`` left out: the server's default, or what room the
context leaves if less.

Streaming is server-sent events (``data: {chunk}`` lines, ``data: [DONE]`` last), one event per
engine step (Medusa emits several tokens per step). A client that disconnects, streaming or not,
cancels its request: the batcher frees its row before the next step, and the request counts as
``cancelled``. Events come from the batcher's loop thread through ``loop.call_soon_threadsafe``
into one asyncio queue per request; a non-streaming request's queue also gets ``_GONE`` from a
task that waits for the client's disconnect (``_watch_disconnect``).

Stopping (``serve_openai`` on SIGTERM sets ``app.state.stopping``): a new generation request is a
503; requests the server ends (``ContinuousBatcher.close``) get, streamed, an error event and
``data: [DONE]``, and otherwise a 503, both in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.text import TemplateKwargsError, check_messages
from medusa_trt.serving.schema import RequestError, ServeDefaults, make_request

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # the Host names a loopback server answers (any port)
JSON_TYPE = "application/json"  # the only request body type


@dataclass(frozen=True)
class AppConfig:
    model_name: str  # the name /v1/models lists and requests may send
    defaults: ServeDefaults  # max_tokens, temperature, top_p of a request that sends none; max_tokens_limit
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 routes when set
    max_body_bytes: int = 1 << 20  # a larger body is refused before it is parsed
    # Host header names (lower case; IPv6 in brackets) answered, with any port; None: any (--allow-remote)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def response_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status)


# ---------------------------------------------------------------------------------- the request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None  # text or a list of text
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # defined by OpenAI, served only at the value that changes nothing (else: a 400 naming the field)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field asking for what this server does not build."""
        if self.n != 1:
            return "n", f"n={self.n}: this server returns one choice per request; send n parallel requests (with seeds) instead"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported: it would change the tokens Medusa must reproduce; leave it at 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options go with stream: true"
        return None


class CompletionRequest(_Generation):
    prompt: Any  # text or a list of token ids
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's extension: the choice also carries token_ids and prompt_token_ids

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(t, (str, list)) for t in value):
            raise ValueError("a list of prompts (a batch) is not supported: send one request per prompt")
        raise ValueError("must be text or a non-empty list of token ids")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported: the prompt is not returned"
        if self.logprobs is not None:
            return "logprobs", "logprobs is not supported by this server"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of={self.best_of} is not supported: one candidate per request"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported"
        if self.return_token_ids and self.stream:
            return "return_token_ids", "return_token_ids is served without stream only"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_Generation):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra chat template variables, e.g. {"enable_thinking": false}

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs" if self.logprobs else "top_logprobs", "logprobs are not supported by this server"
        if self.tools:
            return "tools", "tools (function calling) are not supported by this server"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported: this server calls no tools"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", f"response_format {self.response_format.type!r} is not supported: only text"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_completion_tokens", "send max_tokens or max_completion_tokens, not both"
        return super().unsupported()


# ---------------------------------------------------------------------------------- the app


def _validation_error(exc: ValidationError) -> ApiError:
    """The first problem of a body, as one message naming the field."""
    error = exc.errors()[0]
    param = ".".join(str(p) for p in error["loc"]) or None
    kind, message = error["type"], error["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({message.removeprefix('Invalid JSON: ')}): send a JSON object")
    if kind == "model_type" and not param:
        return ApiError(400, "the body must be a JSON object")
    if kind == "extra_forbidden":
        return ApiError(
            400, f"unknown field {param!r}: this server does not support it (see the OpenAI API reference for the fields)", param
        )
    if kind == "missing":
        return ApiError(400, f"{param} is required", param)
    return ApiError(400, f"{param}: {message}", param)


def build_app(runtime, batcher, config: AppConfig, metrics=None) -> FastAPI:
    """The app over a started ``ContinuousBatcher`` of ``runtime``; ``metrics``: a
    ``PrometheusSink`` for /metrics (None: 404). ``app.state.stopping``: set by the server on SIGTERM."""
    app = FastAPI(title="medusa-trt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping = False
    _add_errors(app)
    app.add_middleware(_Guard, api_key=config.api_key, allowed_hosts=config.allowed_hosts, state=app.state)
    _add_info_routes(app, config.model_name, runtime.max_context, metrics)
    api = _Generate(runtime, batcher, config, app.state)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


def _add_errors(app: FastAPI) -> None:
    """Errors as OpenAI's bodies."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), type_="invalid_request_error").response()


class _Guard:
    """The refusals that need no body, before routing: a foreign ``Host`` (403), a missing or wrong
    API key on /v1 routes (401), a POST body that is not JSON (415).

    A plain ASGI middleware on purpose: ``@app.middleware("http")`` (Starlette's
    ``BaseHTTPMiddleware``) passes the route a ``receive`` through which
    ``request.is_disconnected()`` never sees the client go, so a dropped non-streaming request kept
    its row to the end. This one hands the route the server's own ``receive``. It also ends quietly
    a request that uvicorn cancels at shutdown (a client that stopped reading its stream), instead
    of a traceback in the log."""

    def __init__(self, app, *, api_key: str | None, allowed_hosts: tuple[str, ...] | None, state):
        self.app, self.api_key, self.allowed_hosts, self.state = app, api_key, allowed_hosts, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is not None:
            return await refused.response()(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.state.stopping:
                raise
            log.warning("%s %s: cut off at shutdown (its client was not reading the answer)", scope["method"], scope["path"])

    def refusal(self, scope) -> ApiError | None:
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
        if self.allowed_hosts is not None:
            hosts = headers.get("host", [])
            if len(hosts) != 1 or _host_name(hosts[0]) not in self.allowed_hosts:
                shown = repr(hosts[0]) if len(hosts) == 1 else f"{len(hosts)} Host headers"
                return ApiError(
                    403,
                    f"Host {shown} is not this server's: a loopback server answers only "
                    f"{', '.join(self.allowed_hosts)} (with any port); serve other names with --allow-remote",
                    type_="permission_error",
                    code="host_not_allowed",
                )
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = (headers.get("authorization") or [""])[0]
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(
                    401,
                    "missing or wrong API key: send it as the header 'Authorization: Bearer KEY'",
                    type_="authentication_error",
                    code="invalid_api_key",
                )
        if scope["method"] == "POST":
            given = (headers.get("content-type") or [""])[0]
            if given.partition(";")[0].strip().lower() != JSON_TYPE:
                return ApiError(
                    415,
                    f"Content-Type {given!r} is not accepted: send the body as JSON with 'Content-Type: {JSON_TYPE}'",
                    code="unsupported_media_type",
                )
        return None


_HOST = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]*)(?::\d{1,5})?")  # name, optional port; an IPv6 name in brackets


def _host_name(host: str) -> str | None:
    """The name of a Host header in lower case, without its port ("[::1]:8000" -> "[::1]"); None if malformed."""
    match = _HOST.fullmatch(host)
    return match.group(1).lower() if match else None


def _add_info_routes(app: FastAPI, model_name: str, context: int, metrics) -> None:
    """/health, /v1/models and /metrics."""
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "medusa-trt", "max_model_len": context}],
        }

    @app.get("/metrics")
    async def metrics_text():
        if metrics is None:
            raise ApiError(404, "metrics are off")
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


class _Generate:
    """The two generation routes: a body parsed and checked, a prompt encoded, a request submitted
    to the batcher and answered whole or as server-sent events."""

    def __init__(self, runtime, batcher, config: AppConfig, state):
        self.runtime, self.batcher, self.config, self.state = runtime, batcher, config, state
        self.context = runtime.max_context

    async def completions(self, request: Request):
        parsed = await self.parse(request, CompletionRequest)
        if isinstance(parsed.prompt, str):
            if not parsed.prompt:
                raise ApiError(400, "prompt is empty: send some text", "prompt")
            try:
                ids = self.runtime.codec.encode(parsed.prompt, chat=False)
            except MedusaError as exc:
                raise ApiError(400, str(exc), "prompt") from None
        else:
            ids = parsed.prompt
        return await self.respond(request, parsed, ids, parsed.max_tokens, chat=False)

    async def chat_completions(self, request: Request):
        parsed = await self.parse(request, ChatCompletionRequest)
        if not parsed.messages:
            raise ApiError(400, "messages is empty: send at least one message", "messages")
        if not self.runtime.codec.has_chat_template:
            raise ApiError(
                400, f"the model {self.config.model_name!r} has no chat template: send the prompt to /v1/completions", "messages"
            )
        try:
            messages = check_messages([{"role": m.role, "content": m.text()} for m in parsed.messages], "messages")
            ids = self.runtime.codec.encode_chat(messages, parsed.chat_template_kwargs)
        except TemplateKwargsError as exc:
            raise ApiError(400, str(exc), "chat_template_kwargs") from None
        except MedusaError as exc:
            raise ApiError(400, str(exc), "messages") from None
        max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
        return await self.respond(request, parsed, ids, max_tokens, chat=True)

    async def parse(self, request: Request, kind: type[_Generation]) -> _Generation:
        """The body as ``kind``, refused (400 / 404 naming the field) when too large, malformed or unsupported."""
        limit, name = self.config.max_body_bytes, self.config.model_name
        if int(request.headers.get("content-length") or 0) > limit:
            raise ApiError(
                400,
                f"the request body is larger than {limit} bytes, more than a prompt this model's context of "
                f"{self.context} tokens can hold: send a shorter prompt",
            )
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(400, f"the request body is larger than {limit} bytes: send a shorter prompt")
        try:
            parsed = kind.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        refused = parsed.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], refused[0])
        if parsed.model is not None and parsed.model != name:
            raise ApiError(
                404,
                f"the model {parsed.model!r} does not exist: this server serves {name!r} (GET /v1/models)",
                "model",
                code="model_not_found",
            )
        return parsed

    def prepare(self, parsed: _Generation, ids: list[int], max_tokens: int | None):
        """The batching.Request for prompt ``ids``, checked against the context (400s name the field)."""
        context, defaults = self.context, self.config.defaults
        if len(ids) + 1 > context:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but this model's context is {context} tokens, with room for at "
                "least one new token needed: shorten the prompt",
                "messages" if isinstance(parsed, ChatCompletionRequest) else "prompt",
            )
        room = context - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"this model's context is {context} tokens and the prompt has {len(ids)}, so at most {room} new tokens "
                f"fit; you asked for {max_tokens}: lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        if max_tokens is None:
            max_tokens = min(defaults.max_tokens, room)
        try:
            return make_request(
                ids,
                max_tokens=max_tokens,
                defaults=defaults,
                stop=parsed.stop,
                temperature=parsed.temperature,
                top_p=parsed.top_p,
                top_k=parsed.top_k,
                seed=parsed.seed,
                chat_template=False,
            )
        except RequestError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        except MedusaError as exc:  # SamplingError: its message names the parameter
            raise ApiError(400, str(exc), _param_in(str(exc))) from None

    def submit(self, request, loop: asyncio.AbstractEventLoop):
        """(handle, queue): the request submitted; its events come through ``queue`` on ``loop``."""
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item):  # the batcher's loop thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed (shutdown): nobody reads this request any more
                handle.cancel()

        if self.state.stopping:
            raise _shutting_down()
        try:
            handle = self.batcher.submit(request, sink=sink)
        except EngineError:  # the batcher is closed: the server is stopping
            raise _shutting_down() from None
        except MedusaError as exc:  # a token id out of range
            raise ApiError(400, str(exc), "prompt") from None
        return handle, queue

    async def respond(self, request: Request, parsed: _Generation, ids: list[int], max_tokens: int | None, *, chat: bool):
        job = self.prepare(parsed, ids, max_tokens)
        handle, queue = self.submit(job, asyncio.get_running_loop())
        reply = _Reply(chat=chat, model=self.config.model_name, prompt_tokens=len(ids))
        if getattr(parsed, "return_token_ids", False):
            reply.token_ids, reply.prompt_ids = [], list(ids)
        if parsed.stream:
            usage = parsed.stream_options is not None and parsed.stream_options.include_usage
            return StreamingResponse(
                _stream(handle, queue, reply, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _collect(request, handle, queue, reply)


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: send the request again once it is back", type_="server_error")


def _param_in(message: str) -> str | None:
    """The sampling parameter a SamplingError message starts with."""
    first = message.split(" ", 1)[0]
    return first if first in ("temperature", "top_p", "top_k", "seed") else None


@dataclass
class _Reply:
    """One response being built: ids, token counts, the JSON of each chunk."""

    chat: bool
    model: str
    prompt_tokens: int
    completion_tokens: int = 0
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_ids: list[int] | None = None

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def whole(self, text: str, finish_reason: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids is not None:
            choice |= {"token_ids": self.token_ids, "prompt_token_ids": self.prompt_ids}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(self, text: str | None, finish_reason: str | None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": None,
        }

    def usage_chunk(self) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }


def _finish_reason(reason: str) -> str:
    """The runtime's reasons are OpenAI's (stop: EOS or a stop string; length: max_tokens or the context)."""
    return reason if reason in ("stop", "length") else "stop"


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _stream(handle, queue: asyncio.Queue, reply: _Reply, usage: bool):
    """Server-sent events of one request; cancelled (client gone, server stopping): the row is freed."""
    done = False
    try:
        if reply.chat:
            yield _sse(reply.chunk(None, None, first=True))
        while not done:
            item = await queue.get()
            if isinstance(item, BaseException):  # the engine step failed
                done = True
                yield _sse({"error": {"message": f"generation failed: {item}", "type": "server_error", "param": None, "code": None}})
                break
            reply.completion_tokens += len(item.token_ids)
            if item.finish_reason == "cancelled":  # the server is stopping
                done = True
                yield _sse(_shutting_down().response_body())
                break
            done = item.finish_reason is not None
            if item.text or done:
                yield _sse(reply.chunk(item.text, _finish_reason(item.finish_reason) if done else None))
        if usage:
            yield _sse(reply.usage_chunk())
        yield _sse("[DONE]")
    finally:
        if not done:
            log.info("request %d: the client went away, its row is freed", handle.id)
            handle.cancel()


_GONE = object()  # put in a non-streaming request's queue when its client disconnects


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Put ``_GONE`` in ``queue`` once the client closes the connection. The body is read by now,
    so the server's ``receive()`` blocks until the client goes (or the answer is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_GONE)


async def _collect(request: Request, handle, queue: asyncio.Queue, reply: _Reply) -> JSONResponse:
    """Wait for the whole generation; a client that disconnects meanwhile cancels it at once."""
    text, done = [], False
    watcher = asyncio.ensure_future(_watch_disconnect(request, queue))
    try:
        while not done:
            item = await queue.get()
            if item is _GONE:
                log.info("request %d: the client went away, its row is freed", handle.id)
                break
            if isinstance(item, BaseException):
                done = True
                raise ApiError(500, f"generation failed: {item}", type_="server_error")
            if item.finish_reason == "cancelled":  # ended by the server: it is stopping
                done = True
                raise _shutting_down()
            text.append(item.text)
            reply.completion_tokens += len(item.token_ids)
            if reply.token_ids is not None:
                reply.token_ids += item.token_ids
            done = item.finish_reason is not None
        else:
            return JSONResponse(reply.whole("".join(text), _finish_reason(item.finish_reason)))
        return JSONResponse({}, status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        if not done:
            handle.cancel()
