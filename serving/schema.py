"""The request schema and the servers' options, defined once for every front end: the OpenAI app,
the Triton model and the Triton repository writer.

    ServeDefaults    what a request that leaves a field out gets, and the per-request limits
    EngineOptions    the engine a server runs and how (``MedusaRuntime``'s arguments)
    engine_summary   how a loaded engine runs ("backend native (avx512_vnni, 1 thread), fp32"): the servers' banner and log
    max_tokens_limit the most new tokens one request may ask for, for an engine's context
    make_request     one validation from request fields to a ``batching.Request``: a bad field
                     raises ``RequestError`` naming it (the front end answers 400 / INVALID_ARG);
                     at most MAX_STOP_STRINGS stop strings, MAX_STOP_BYTES bytes of them
    TRITON_INPUTS    the Triton model's input tensors (config.pbtxt, model.py and the gRPC client
    TRITON_OUTPUTS   read these; names follow Triton's generate endpoints: text_input, max_tokens ...)

Both servers' configs (``OpenAIServerConfig``, ``TritonRepoConfig``) hold a ``ServeDefaults`` and
an ``EngineOptions``; ``medusa-serve`` and ``medusa-triton-repo`` fill them from the same flags.
numpy-free and light: the lean install's Triton model imports it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from medusa_trt.runtime.backends import ONNX_BACKENDS
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.errors import MedusaError

DEFAULT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS  # max_tokens of a request that sends none: the runtime's
DEFAULT_MAX_TOKENS_LIMIT = 1024  # most new tokens one request may ask for (clipped to the context)
TRITON_MODEL_NAME = "medusa"  # the Triton model's name unless --model-name says otherwise
# stop strings per request: each is looked for after every step, so their number and length are capped
# (OpenAI's API takes up to 4 stop sequences)
MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 1024  # their UTF-8 bytes, all together


class RequestError(MedusaError):
    """A request that cannot be served as sent; ``param`` names the offending field (None: the
    request as a whole). Front ends answer it as a client error with this message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ServeOptionsError(MedusaError):
    """A server option out of range (``ServeDefaults``, ``EngineOptions``); the message names it."""


@dataclass(frozen=True)
class ServeDefaults:
    """Per-request defaults and limits of a server (``medusa-serve`` / ``medusa-triton-repo`` flags;
    Triton reads them back from config.pbtxt's parameters).

    Each field is checked here; ``max_tokens`` against the limit once the engine's context is known
    (``for_context``, ``with_limit``: what every server serves with)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # greedy unless the request asks to sample
    top_p: float = 1.0
    chat_template: bool | None = None  # Triton's text_input: None applies the engine's default (instruct engines theirs)
    # a request asking for more new tokens is refused, not clamped; None: DEFAULT_MAX_TOKENS_LIMIT, or the context if smaller
    max_tokens_limit: int | None = None
    request_timeout: float = 0.0  # Triton: seconds from arrival until a request ends with "timeout"; 0: no deadline

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ServeOptionsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ServeOptionsError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:
            raise ServeOptionsError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if not self.request_timeout >= 0 or self.request_timeout == math.inf:
            raise ServeOptionsError(f"request_timeout must be a number of seconds >= 0 (0: none), got {self.request_timeout}")

    def with_limit(self, limit: int) -> ServeDefaults:
        """These defaults under the per-request limit ``limit``; a default max_tokens above it is refused."""
        if self.max_tokens > limit:
            raise ServeOptionsError(
                f"--max-tokens {self.max_tokens} (the default of a request) exceeds the per-request limit "
                f"{limit}: lower --max-tokens or raise --max-tokens-limit"
            )
        return dataclasses.replace(self, max_tokens_limit=limit)

    def for_context(self, context: int, *, clamp_max_tokens: bool = False) -> ServeDefaults:
        """These defaults for an engine of ``context`` tokens: the limit resolved (``max_tokens_limit``);
        ``clamp_max_tokens``: the default max_tokens first cut to the context (the OpenAI server's rule)."""
        limit = max_tokens_limit(context, self.max_tokens_limit)
        clamped = dataclasses.replace(self, max_tokens=min(self.max_tokens, context)) if clamp_max_tokens else self
        return clamped.with_limit(limit)


@dataclass(frozen=True)
class EngineOptions:
    """The engine a server runs and how: ``MedusaRuntime``'s arguments (``medusa-serve`` /
    ``medusa-triton-repo`` flags; Triton reads them back from config.pbtxt's parameters)."""

    path: str | os.PathLike  # an engine folder, .onnx or .plan (medusa-export --out)
    tree: str | None = None  # the heads' template: preset, chain-N or JSON file; None: the engine's ("chain-0": plain decoding)
    drafters: tuple[str, ...] | None = None  # subset of drafting.DRAFTERS; None: every drafter the engine supports; (): plain
    max_batch: int | None = None  # concurrent sequences (cache rows); None: the engine's
    max_context: int | None = None  # None: the engine's
    backend: str | None = None  # what runs an ONNX engine (ONNX_BACKENDS); None: the engine folder's choice, else onnxruntime
    threads: int | None = None  # the backend's threads (ONNX Runtime intra-op, OpenVINO, native's OpenMP step); None: its default

    def __post_init__(self):
        for name in ("max_batch", "max_context", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServeOptionsError(f"{name} must be >= 1, got {value}")
        if self.backend is not None and self.backend not in ONNX_BACKENDS:
            raise ServeOptionsError(f"backend must be one of {', '.join(ONNX_BACKENDS)} (None: the engine's choice), got {self.backend!r}")

    @classmethod
    def of(cls, engine: EngineOptions | str | os.PathLike) -> EngineOptions:
        """``engine`` as options: an ``EngineOptions`` as is, a path with the engine's own settings."""
        return engine if isinstance(engine, EngineOptions) else cls(engine)


def engine_summary(runtime) -> str:
    """How a loaded ``MedusaRuntime`` runs: its backend with its threads and instruction set, and the engine's precision
    ("backend native (avx512_vnni, 1 thread), int8-channel")."""
    return f"backend {runtime.describe()}"


def max_tokens_limit(context: int, asked: int | None = None) -> int:
    """The per-request new-token limit for an engine of ``context`` tokens: ``asked`` (at most the
    context, prompt included), else ``DEFAULT_MAX_TOKENS_LIMIT`` or the context if smaller."""
    if asked is not None and asked > context:
        raise MedusaError(f"--max-tokens-limit {asked} exceeds the context of {context} tokens (prompt included): pass at most {context}")
    return asked or min(DEFAULT_MAX_TOKENS_LIMIT, context)


def make_request(
    prompt,
    *,
    max_tokens: int | None,
    defaults: ServeDefaults,
    stop=None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    chat_template: bool | None = None,
):
    """A ``batching.Request`` from a request's fields (None: the server's default). Raises
    ``RequestError`` (naming the field) for a budget or stop string it cannot serve, and
    ``SamplingError`` for sampling parameters out of range."""
    from medusa_trt.runtime.batching import Request
    from medusa_trt.runtime.sampling import SamplingParams

    max_tokens = defaults.max_tokens if max_tokens is None else max_tokens
    limit = defaults.max_tokens_limit or DEFAULT_MAX_TOKENS_LIMIT  # servers resolve it for their context (for_context)
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > limit:
        raise RequestError(
            f"max_tokens {max_tokens} exceeds this server's limit of {limit} new tokens per request (--max-tokens-limit): ask for fewer",
            "max_tokens",
        )
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise RequestError("stop holds an empty string: remove it", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(stops)} strings: this server takes at most {MAX_STOP_STRINGS}", "stop")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
    if size > MAX_STOP_BYTES:
        raise RequestError(
            f"stop strings hold {size} bytes (UTF-8): this server takes at most {MAX_STOP_BYTES} bytes of them in all", "stop"
        )
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
