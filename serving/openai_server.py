"""``medusa-serve ENGINE`` (``--api openai``, the default): the OpenAI-compatible server in one process.

    serve_openai(OpenAIServerConfig(engine="build/smollm2-135m-medusa", port=8000), on_ready=print)
    serve_openai(OpenAIServerConfig(engine=EngineOptions("build/e", backend="native", threads=2)))
    serve_openai(OpenAIServerConfig(engine=EngineOptions("build/e", max_batch=4), defaults=ServeDefaults(max_tokens=64)))

loads the engine (every file's sha256 checked once against the export's manifest), starts a
``ContinuousBatcher`` (its loop thread owns the engine) with the serving metrics as its observer,
binds the socket (127.0.0.1 unless ``host`` says otherwise; another host needs ``allow_remote``),
and runs the FastAPI app (``serving.openai_app``) under uvicorn on the asyncio loop of the main
thread. ``on_ready(url, summary)`` is called once the socket listens and the engine is loaded;
``summary`` says how the engine runs (``schema.engine_summary``: "backend native (avx512_vnni, 1 thread), fp32").

Stopping: SIGTERM or Ctrl-C stop accepting connections (a generation request that still comes
on an open connection is a 503), give requests in flight up to ``shutdown_timeout`` seconds, then
close the batcher: the requests still running end there (their rows freed), each stream with an
error event and ``data: [DONE]``, each other request with a JSON 503, both in OpenAI's error shape.
Uvicorn gets ``END_GRACE_S`` more to send those answers before it cancels what is left (a client
that stopped reading); ``serve_openai`` returns 0. The server is one process (uvicorn's workers
are not used: one engine, one batcher); it starts no other process and holds no shared memory,
so a SIGKILL leaves nothing behind but the port, which the kernel frees with the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from medusa_trt.serving.schema import EngineOptions, ServeDefaults, engine_summary
from medusa_trt.serving.triton import ServeError, is_loopback

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'medusa-trt[serve]' (fastapi, uvicorn, prometheus_client)"
API_KEY_VAR = "MEDUSA_TRT_API_KEY"  # the API key without putting it on the command line (which local users can read)
BODY_BYTES_PER_TOKEN = 32  # request bodies are bounded by the context: this much JSON per token of it, plus BODY_SLACK
BODY_SLACK = 64 << 10
END_GRACE_S = 3.0  # seconds after shutdown_timeout for the ended requests to send their last answer


@dataclass(frozen=True)
class OpenAIServerConfig:
    engine: EngineOptions | str | os.PathLike  # the engine and how to run it; a path alone: EngineOptions(path), the engine's settings
    # of a request that sends none (max_tokens is capped by the room its prompt leaves), and the per-request limit;
    # request_timeout and chat_template are Triton's: an OpenAI request has its own fields
    defaults: ServeDefaults = field(default_factory=ServeDefaults)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free one (on_ready says which)
    allow_remote: bool = False  # a host other than loopback, and any Host header name (else loopback names only)
    api_key: str | None = None  # required as a bearer token on /v1 routes; None: $MEDUSA_TRT_API_KEY or no key
    model_name: str | None = None  # what /v1/models lists; None: the engine's folder or file name
    shutdown_timeout: float = 5.0  # seconds requests in flight get on SIGTERM before they are cancelled
    access_log: bool = False

    def __post_init__(self):
        object.__setattr__(self, "engine", EngineOptions.of(self.engine))  # frozen: set once, here
        if not is_loopback(self.host) and not self.allow_remote:
            raise ServeError(
                f"--host {self.host} is not a loopback address: the server would take requests from other machines; "
                "pass --allow-remote to do that on purpose (with --api-key, behind a firewall or a TLS proxy), "
                "or keep the default 127.0.0.1"
            )
        if not 0 <= self.port <= 65535:
            raise ServeError(f"port {self.port} is out of range: pass 0 (a free one) to 65535")
        if self.shutdown_timeout < 0:
            raise ServeError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServeError("--api-key is empty: pass a key, or leave it out")

    @property
    def name(self) -> str:
        return self.model_name or Path(self.engine.path).resolve().name.removesuffix(".onnx").removesuffix(".plan")

    @property
    def allowed_hosts(self) -> tuple[str, ...] | None:
        """The Host header names the app answers: loopback names (and the bound address) unless allow_remote."""
        from medusa_trt.serving.openai_app import LOOPBACK_HOSTS

        if self.allow_remote:
            return None
        bound = f"[{self.host}]" if ":" in self.host else self.host
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, bound.lower())))


def load_app(config: OpenAIServerConfig):
    """(app, batcher, summary): the engine loaded, its batcher started, the app over them, how the engine runs."""
    try:
        from medusa_trt.serving.metrics import MetricsObserver, PrometheusSink
        from medusa_trt.serving.openai_app import AppConfig, build_app
    except ImportError as exc:
        raise ServeError(f"the OpenAI server needs {exc.name}, which is not installed: {INSTALL_HINT}") from exc
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.batching import ContinuousBatcher

    engine = config.engine
    runtime = MedusaRuntime(
        str(engine.path),
        max_batch=engine.max_batch,
        max_context=engine.max_context,
        backend=engine.backend,
        threads=engine.threads,
        tree=engine.tree,
        drafters=engine.drafters,
        verify_checksums=True,
    )
    defaults = config.defaults.for_context(runtime.max_context, clamp_max_tokens=True)
    batcher = ContinuousBatcher(runtime)
    sink = PrometheusSink(config.name, load=batcher.load)
    batcher.observer = MetricsObserver(sink)
    app = build_app(
        runtime,
        batcher.start(),
        AppConfig(
            model_name=config.name,
            defaults=defaults,
            api_key=config.api_key or os.environ.get(API_KEY_VAR) or None,
            max_body_bytes=BODY_SLACK + BODY_BYTES_PER_TOKEN * runtime.max_context,
            allowed_hosts=config.allowed_hosts,
        ),
        sink,
    )
    summary = engine_summary(runtime)
    log.info(
        "serving %s as %r: %s, drafters %s, max_batch %d, max_context %d",
        engine.path,
        config.name,
        summary,
        ",".join(runtime.drafting.names) or "none",
        runtime.max_batch,
        runtime.max_context,
    )
    return app, batcher, summary


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (connections queue in its backlog until uvicorn accepts them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port (0: a free one)") from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def serve_openai(config: OpenAIServerConfig, on_ready: Callable[[str, str], None] = lambda url, summary: None) -> int:
    """Load, listen, serve until SIGTERM / SIGINT; 0 once stopped. Raises ``ServeError`` /
    ``MedusaError`` for what the user can fix (a bad engine, a taken port, a missing extra)."""
    try:
        import uvicorn
    except ImportError as exc:
        raise ServeError(f"the OpenAI server needs uvicorn, which is not installed: {INSTALL_HINT}") from exc
    if not is_loopback(config.host):
        log.warning("the server binds %s: it serves other machines%s", config.host, "" if config.api_key else ", without an API key")
    app, batcher, summary = load_app(config)
    try:
        sock = bind(config.host, config.port)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if not self.should_exit:  # uvicorn accepts from here on
                    on_ready(url, summary)

            async def shutdown(self, sockets=None):
                # uvicorn stops accepting and waits for the requests in flight; at shutdown_timeout the batcher
                # ends those still running (their answers say so), before uvicorn's own timeout would cancel them
                app.state.stopping = True
                loop = asyncio.get_running_loop()
                ending = loop.call_later(config.shutdown_timeout, end_requests, loop)
                try:
                    await super().shutdown(sockets=sockets)
                finally:
                    ending.cancel()

        def end_requests(loop):
            log.info("shutdown: ending the requests still running after %g s", config.shutdown_timeout)
            loop.run_in_executor(None, batcher.close)  # joins the batcher's thread: not on the event loop

        server = Server(
            uvicorn.Config(
                app,
                log_level="info" if log.isEnabledFor(logging.INFO) else "warning",
                access_log=config.access_log,
                timeout_graceful_shutdown=config.shutdown_timeout + END_GRACE_S,
                lifespan="off",
            )
        )
        # uvicorn takes SIGTERM / SIGINT while it runs and, once stopped, raises the signal again to the handler it found:
        # that handler is a no-op here, so a stopped server returns 0 instead of dying of the signal
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sock.close()
    finally:
        batcher.close()  # requests still running end as cancelled
    return 0


def looks_like_engine(path: str | os.PathLike) -> bool:
    """An engine (a .onnx / .plan file, or a folder with an engine config.json), not a Triton repository."""
    from medusa_trt.runtime.engine import ENGINE_SUFFIXES, FOLDER_CONFIG

    path = Path(path)
    return path.suffix in ENGINE_SUFFIXES or (path / FOLDER_CONFIG).is_file()
