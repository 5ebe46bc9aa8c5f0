"""The request schema, defined once for every front end: the OpenAI app, the Triton model and the
Triton repository writer.

    ServeDefaults    what a request that leaves a field out gets, and the per-request limits
    max_tokens_limit the most new tokens one request may ask for, for an engine's context
    make_request     one validation from request fields to a ``batching.Request``: a bad field
                     raises ``RequestError`` naming it (the front end answers 400 / INVALID_ARG)
    TRITON_INPUTS    the Triton model's input tensors (config.pbtxt, model.py and the gRPC client
    TRITON_OUTPUTS   read these; names follow Triton's generate endpoints: text_input, max_tokens ...)

numpy-free and light: the lean install's Triton model imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError

DEFAULT_MAX_TOKENS = 128  # max_tokens of a request that sends none
DEFAULT_MAX_TOKENS_LIMIT = 1024  # most new tokens one request may ask for (clipped to the context)


class RequestError(MedusaError):
    """A request that cannot be served as sent; ``param`` names the offending field (None: the
    request as a whole). Front ends answer it as a client error with this message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ServeDefaults:
    """Per-request defaults and limits of a server (``medusa-serve`` / ``medusa-triton-repo`` flags;
    Triton reads them back from config.pbtxt's parameters)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # greedy unless the request asks to sample
    top_p: float = 1.0
    chat_template: bool | None = None  # Triton's text_input: None applies the engine's default (instruct engines theirs)
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT  # a request asking for more new tokens is refused, not clamped
    request_timeout: float = 0.0  # Triton: seconds from arrival until a request ends with "timeout"; 0: no deadline

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_tokens_limit < 1:
            raise MedusaError(f"max_tokens and max_tokens_limit must be >= 1, got {self.max_tokens}, {self.max_tokens_limit}")
        if self.max_tokens > self.max_tokens_limit:
            raise MedusaError(f"--max-tokens {self.max_tokens} (the default of a request) exceeds the per-request limit "
                              f"{self.max_tokens_limit}: lower --max-tokens or raise --max-tokens-limit")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:
            raise MedusaError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if not self.request_timeout >= 0 or self.request_timeout == math.inf:
            raise MedusaError(f"request_timeout must be a number of seconds >= 0 (0: none), got {self.request_timeout}")


def max_tokens_limit(context: int, asked: int | None = None) -> int:
    """The per-request new-token limit for an engine of ``context`` tokens: ``asked`` (at most the
    context, prompt included), else ``DEFAULT_MAX_TOKENS_LIMIT`` or the context if smaller."""
    if asked is not None and asked > context:
        raise MedusaError(f"--max-tokens-limit {asked} exceeds the context of {context} tokens (prompt included): pass at most {context}")
    return asked or min(DEFAULT_MAX_TOKENS_LIMIT, context)


def make_request(prompt, *, max_tokens: int | None, defaults: ServeDefaults, stop=None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None, chat_template: bool | None = None):
    """A ``batching.Request`` from a request's fields (None: the server's default). Raises
    ``RequestError`` (naming the field) for a budget or stop string it cannot serve, and
    ``SamplingError`` for sampling parameters out of range."""
    from medusa_trt.runtime.batching import Request
    from medusa_trt.runtime.sampling import SamplingParams

    max_tokens = defaults.max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > defaults.max_tokens_limit:
        raise RequestError(f"max_tokens {max_tokens} exceeds this server's limit of {defaults.max_tokens_limit} new tokens per request "
                           "(--max-tokens-limit): ask for fewer", "max_tokens")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise RequestError("stop holds an empty string: remove it", "stop")
    sampling = SamplingParams(  # validates; raises SamplingError
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=top_k or 0,
        seed=seed,
    )
    return Request(prompt=prompt, max_new_tokens=max_tokens, stop=stops or None, sampling=sampling, chat_template=chat_template)


# ---------------------------------------------------------------------------------- Triton's tensors


@dataclass(frozen=True)
class TritonTensor:
    name: str
    config_type: str  # config.pbtxt data_type
    wire_type: str  # the client's datatype string
    dtype: str  # numpy dtype of its values ("object": UTF-8 bytes)
    dims: tuple[int, ...]
    optional: bool = False


TRITON_INPUTS = (
    TritonTensor("text_input", "TYPE_STRING", "BYTES", "object", (1,)),
    TritonTensor("max_tokens", "TYPE_INT32", "INT32", "int32", (1,), True),
    TritonTensor("temperature", "TYPE_FP32", "FP32", "float32", (1,), True),
    TritonTensor("top_p", "TYPE_FP32", "FP32", "float32", (1,), True),
    TritonTensor("top_k", "TYPE_INT32", "INT32", "int32", (1,), True),
    TritonTensor("stop", "TYPE_STRING", "BYTES", "object", (-1,), True),
    TritonTensor("seed", "TYPE_UINT64", "UINT64", "uint64", (1,), True),
    TritonTensor("stream", "TYPE_BOOL", "BOOL", "bool", (1,), True),
    TritonTensor("timeout_s", "TYPE_FP32", "FP32", "float32", (1,), True),  # seconds from arrival; at most request_timeout
)
TRITON_OUTPUTS = (
    TritonTensor("text_output", "TYPE_STRING", "BYTES", "object", (-1,)),  # the new text of this response
    TritonTensor("token_ids", "TYPE_INT64", "INT64", "int64", (-1,)),  # its new tokens
    TritonTensor("finish_reason", "TYPE_STRING", "BYTES", "object", (1,)),  # "" until the last response
)
TRITON_INPUT_NAMES = tuple(t.name for t in TRITON_INPUTS)
