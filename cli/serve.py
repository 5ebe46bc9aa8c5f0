"""``medusa-serve`` and ``medusa-triton-repo``: argument parsing; the servers are ``medusa_trt.serving``'s.

    medusa-serve build/smollm2-135m-medusa [--port 8000] [--api-key KEY]   an engine, OpenAI-compatible HTTP (--api openai)
    medusa-serve build/triton [--port-grpc 8001 --port-http 8000 --port-metrics 8002]   a Triton model repository
    medusa-serve build/smollm2-135m-medusa --api triton                     an engine under Triton (repository in its run folder)
    medusa-serve --make-stub-env DIR                                        the Triton stub's numpy<2 venv
    medusa-triton-repo --engine build/smollm2-135m-medusa --out build/triton

``medusa-serve TARGET`` serves an engine (a folder, .onnx or .plan) with the OpenAI API unless
``--api triton``; a Triton model repository (medusa-triton-repo) is served by Triton. Options that
the chosen path would ignore are refused. Bad input is one ``medusa-serve: error: ...`` line and
exit status 2; SIGTERM or Ctrl-C stop the server (exit 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from medusa_trt.cli.common import (
    USER_ERRORS,
    VERBOSE_HELP,
    Parser,
    add_backend_arg,
    drafter_list,
    entry,
    fail,
    non_negative_int,
    positive_int,
    setup_logging,
)
from medusa_trt.serving.openai_server import API_KEY_VAR, OpenAIServerConfig, looks_like_engine
from medusa_trt.serving.schema import DEFAULT_MAX_TOKENS_LIMIT, TRITON_MODEL_NAME, EngineOptions, ServeDefaults
from medusa_trt.serving.triton import (
    GRPC_PORT,
    HTTP_PORT,
    METRICS_PORT,
    STUB_ENV_VAR,
    STUB_FOLDER,
    ServeConfig,
    ServeError,
    TritonServer,
    make_stub_env,
)

# options of one path only: given on the other, they would be ignored, so they are refused
TRITON_ONLY = ("model", "port_grpc", "port_http", "port_metrics", "python_env", "log_verbose", "log_file", "startup_timeout")
OPENAI_ONLY = ("port", "api_key", "shutdown_timeout")
ENGINE_ONLY = (
    "model_name",
    "tree",
    "draft",
    "max_batch",
    "max_context",
    "backend",
    "threads",
    "max_tokens",
    "max_tokens_limit",
    "temperature",
    "top_p",
)
TRITON_ENGINE_ONLY = ("request_timeout", "chat_template")


def port(text: str) -> int:
    """argparse type: a TCP port, 0 for a free one."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


CHAT_TEMPLATE = {"auto": None, "on": True, "off": False}  # --chat-template -> ServeDefaults.chat_template


def add_engine_arguments(g, triton: str = "") -> None:
    """The flags both servers take: the engine's options (``EngineOptions``) and a request's defaults
    (``ServeDefaults``). Every default is None, read by ``engine_options`` / ``serve_defaults``: a flag
    left out takes the dataclass's default, and medusa-serve tells a flag given from one left out.
    ``triton``: the prefix of the help of the flags only Triton serves."""
    d = ServeDefaults
    g.add_argument("--tree", help="the heads' template: preset, chain-N or JSON file (default: the engine's)")
    g.add_argument(
        "--draft",
        type=drafter_list,
        metavar="DRAFTERS",
        help="drafters merged into each step's tree: a comma-separated subset of heads,lookup,recycle, or none "
        "(plain decoding; default: every drafter the engine supports)",
    )
    g.add_argument("--max-batch", type=positive_int, help="concurrent sequences (default: the engine's)")
    g.add_argument("--max-context", type=positive_int, help="default: the engine's")
    add_backend_arg(g)
    g.add_argument(
        "--threads",
        type=positive_int,
        help="the backend's threads: ONNX Runtime intra-op, OpenVINO inference, native's OpenMP step (default: its own)",
    )
    g.add_argument("--max-tokens", type=positive_int, help=f"max_tokens of a request that sends none (default {d.max_tokens})")
    g.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        help=f"a request asking for more new tokens is refused (default: {DEFAULT_MAX_TOKENS_LIMIT}, or the context if smaller)",
    )
    g.add_argument("--temperature", type=float, help=f"temperature of a request that sends none (default {d.temperature:g}: greedy)")
    g.add_argument("--top-p", type=float, help=f"top_p of a request that sends none (default {d.top_p:g})")
    g.add_argument(
        "--request-timeout",
        type=float,
        help=f"{triton}seconds from arrival after which a request ends with finish_reason "
        "timeout; a request may ask for less with its timeout_s input "
        f"(default {d.request_timeout:g}: none)",
    )
    g.add_argument(
        "--chat-template",
        choices=list(CHAT_TEMPLATE),
        help=f"{triton}apply the chat template to text_input (default auto: the engine's default)",
    )


def engine_options(args, path) -> EngineOptions:
    return EngineOptions(
        path,
        tree=args.tree,
        drafters=args.draft,
        max_batch=args.max_batch,
        max_context=args.max_context,
        backend=args.backend,
        threads=args.threads,
    )


def serve_defaults(args) -> ServeDefaults:
    return ServeDefaults(
        **_set(
            max_tokens=args.max_tokens,
            max_tokens_limit=args.max_tokens_limit,
            temperature=args.temperature,
            top_p=args.top_p,
            request_timeout=args.request_timeout,
            chat_template=CHAT_TEMPLATE.get(args.chat_template),
        )
    )


def _set(**values) -> dict:
    """The values given (not None): a config's own defaults stand for the rest."""
    return {k: v for k, v in values.items() if v is not None}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="medusa-serve",
        description="Serve an engine with an OpenAI-compatible HTTP API, or a Triton model repository "
        "(medusa-triton-repo) with tritonserver.",
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="ENGINE|REPOSITORY",
        help="an engine folder, .onnx or .plan (medusa-export --out), or a Triton model repository",
    )
    p.add_argument(
        "--api",
        choices=["openai", "triton"],
        help="openai: the OpenAI-compatible HTTP server (the default for an engine); triton: Triton Inference Server "
        "(a repository always is)",
    )
    p.add_argument(
        "--host", default=OpenAIServerConfig.host, help="address every endpoint binds (default: loopback only; others need --allow-remote)"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host other than loopback: the server then takes requests from the network (OpenAI API: protect it with "
        "--api-key); the OpenAI API then also answers Host names other than 127.0.0.1, localhost and [::1] (a proxy's)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    e = p.add_argument_group("an engine (OpenAI API, or --api triton)")
    e.add_argument("--model-name", help=f"the name clients send (default: the engine's folder or file name; Triton: {TRITON_MODEL_NAME})")
    add_engine_arguments(e, triton="Triton: ")
    o = p.add_argument_group("the OpenAI API")
    o.add_argument("--port", type=port, help=f"HTTP port of the API and /metrics (default {OpenAIServerConfig.port}; 0: a free one)")
    o.add_argument(
        "--api-key",
        help=f"clients must send 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_VAR}, "
        "which other local users cannot read on the command line)",
    )
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        help=f"seconds requests in flight get on SIGTERM before they are cancelled (default {OpenAIServerConfig.shutdown_timeout:g})",
    )
    t = p.add_argument_group("Triton")
    t.add_argument("--model", action="append", help="model of the repository to load (repeatable; default: every one)")
    t.add_argument("--port-grpc", type=port, help=f"gRPC port (default {GRPC_PORT}; 0: a free one)")
    t.add_argument("--port-http", type=port, help=f"HTTP port (default {HTTP_PORT}; 0: a free one)")
    t.add_argument("--port-metrics", type=port, help=f"metrics port (default {METRICS_PORT}; 0: a free one)")
    t.add_argument(
        "--python-env",
        help=f"environment (venv) the Python backend stub runs model.py in; needs numpy<2 (default: ${STUB_ENV_VAR}, else "
        f"{STUB_FOLDER} beside this environment, which make install makes, else this one)",
    )
    t.add_argument(
        "--make-stub-env", metavar="DIR", help="make a venv with numpy<2 over this environment's packages for --python-env, then exit"
    )
    t.add_argument("--log-verbose", type=non_negative_int, nargs="?", const=1, help="tritonserver verbose logging level (1 if given bare)")
    t.add_argument("--log-file", help="write the server's output there instead of the terminal")
    t.add_argument(
        "--startup-timeout", type=float, help=f"seconds to wait for the models to load (default {ServeConfig.startup_timeout:g})"
    )
    return p


def _given(args, names) -> list[str]:
    return [_flag(n) for n in names if getattr(args, n) is not None]


def _choose_api(args) -> str:
    """openai or triton, refusing options the chosen path would ignore."""
    if not Path(args.target).exists():
        raise ServeError(
            f"{args.target} does not exist: pass an engine (what medusa-export --out wrote) or a Triton model "
            "repository (what medusa-triton-repo wrote)"
        )
    engine = looks_like_engine(args.target)
    api = args.api or ("openai" if engine else "triton")
    if api == "openai" and not engine:
        raise ServeError(
            f"{args.target} is not an engine (neither a .onnx / .plan file nor a folder with an engine config.json): "
            "pass what medusa-export --out wrote; a Triton model repository is served with --api triton"
        )
    wrong = _given(args, TRITON_ONLY + TRITON_ENGINE_ONLY) if api == "openai" else _given(args, OPENAI_ONLY)
    if api == "triton" and not engine:
        wrong += _given(args, ENGINE_ONLY + TRITON_ENGINE_ONLY)
    if wrong:
        where = (
            "the OpenAI server (they go with --api triton)"
            if api == "openai"
            else "a Triton server (they go with the OpenAI API)"
            if set(wrong) & {_flag(n) for n in OPENAI_ONLY}
            else "a repository, whose models carry their own options (medusa-triton-repo)"
        )
        raise ServeError(f"{', '.join(wrong)} would be ignored by {where}: drop {'it' if len(wrong) == 1 else 'them'}")
    return api


def _or(value, default):
    return default if value is None else value


@entry("medusa-serve")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if args.make_stub_env:
        try:
            folder = make_stub_env(args.make_stub_env)
        except (*USER_ERRORS, subprocess.CalledProcessError) as exc:
            return fail("medusa-serve", exc)
        print(f"wrote {folder}: pass --python-env {folder} (or set {STUB_ENV_VAR}={folder})")
        return 0
    if not args.target:
        parser.error("an engine (medusa-export --out DIR) or the model repository is required")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the server as Ctrl-C does, loading or serving
    try:
        if _choose_api(args) == "openai":
            return _serve_openai(args)
        server = TritonServer(_triton_config(args), inherit_output=args.log_file is None)
        return _serve(server, args.target)
    except USER_ERRORS as exc:
        return fail("medusa-serve", exc)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _serve_openai(args) -> int:
    from medusa_trt.serving.openai_server import serve_openai

    config = OpenAIServerConfig(
        engine=engine_options(args, args.target),
        defaults=serve_defaults(args),
        host=args.host,
        allow_remote=args.allow_remote,
        api_key=args.api_key,
        model_name=args.model_name,
        access_log=args.verbose,
        **_set(port=args.port, shutdown_timeout=args.shutdown_timeout),
    )

    def ready(url: str, summary: str) -> None:
        print(
            f"medusa-serve: serving {args.target} as {config.name!r} (OpenAI API, {summary}, pid {os.getpid()})\n"
            f"  OpenAI   {url}/v1\n  metrics  {url}/metrics\nCtrl-C stops it.",
            flush=True,
        )

    try:
        code = serve_openai(config, on_ready=ready)
    except KeyboardInterrupt:  # while the engine loads
        return 130
    print("medusa-serve: stopped", file=sys.stderr, flush=True)
    return code


def _triton_config(args) -> ServeConfig:
    ports = dict(
        grpc_port=_or(args.port_grpc, GRPC_PORT) or None,
        http_port=_or(args.port_http, HTTP_PORT) or None,
        metrics_port=_or(args.port_metrics, METRICS_PORT) or None,
    )
    common = dict(
        host=args.host,
        allow_remote=args.allow_remote,
        python_env=args.python_env,
        log_file=args.log_file,
        **ports,
        **_set(log_verbose=args.log_verbose, startup_timeout=args.startup_timeout),
    )
    if not looks_like_engine(args.target):
        return ServeConfig(repo=args.target, models=tuple(args.model or ()), **common)
    from medusa_trt.serving.triton_repo import TritonRepoConfig

    if args.model:
        raise ServeError("--model picks models of a repository: an engine is served as one model, named by --model-name")
    model = TritonRepoConfig(
        engine=engine_options(args, args.target), repo="", model_name=args.model_name or TRITON_MODEL_NAME, defaults=serve_defaults(args)
    )
    return ServeConfig(engine=model, **common)


def _serve(server: TritonServer, target: str) -> int:
    try:
        server.start()  # stops what it started if interrupted
    except KeyboardInterrupt:
        return 130
    print(
        f"medusa-serve: serving {target} (tritonserver pid {server.pid})\n"
        f"  gRPC     {server.grpc_address}\n  HTTP     {server.http_url}\n  metrics  {server.metrics_url}\n"
        "Ctrl-C stops it.",
        flush=True,
    )
    try:
        while server.wait(0.5) is None:
            pass
        code = server.stop()
        print(f"medusa-serve: error: tritonserver exited on its own with status {code}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("medusa-serve: stopping", file=sys.stderr, flush=True)
        code = server.stop()
        return 0 if code == 0 else 1


def build_repo_parser() -> argparse.ArgumentParser:
    p = Parser(prog="medusa-triton-repo", description="Write a Triton model repository that serves an exported engine.")
    p.add_argument(
        "--engine",
        required=True,
        help="an exported engine folder, .onnx or .plan (referenced by its path relative to the "
        "repository's model folder unless --copy-engine)",
    )
    p.add_argument(
        "--copy-engine",
        action="store_true",
        help="copy the engine into the model folder (hard links where possible): a self-contained repository",
    )
    p.add_argument("--out", required=True, help="the model repository folder (created; other models in it are kept)")
    p.add_argument("--model-name", default=TRITON_MODEL_NAME, help="the model's name in the repository, which clients send")
    add_engine_arguments(p)
    p.add_argument("--force", action="store_true", help="replace an existing model folder of the same name")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


@entry("medusa-triton-repo")
def repo_main(argv: list[str] | None = None) -> int:
    args = build_repo_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        from medusa_trt.serving.triton_repo import TritonRepoConfig, write_triton_repo  # no torch: works in the lean install

        folder = write_triton_repo(
            TritonRepoConfig(
                engine=engine_options(args, args.engine),
                repo=args.out,
                model_name=args.model_name,
                defaults=serve_defaults(args),
                overwrite=args.force,
                copy_engine=args.copy_engine,
            )
        )
    except USER_ERRORS as exc:
        return fail("medusa-triton-repo", exc)
    print(f"wrote {folder}/config.pbtxt, {folder.name}/1/model.py: serve it with medusa-serve {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
