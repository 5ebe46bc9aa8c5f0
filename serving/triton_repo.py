"""A Triton Inference Server model repository that serves an exported engine.

    write_triton_repo(TritonRepoConfig(engine="build/model.onnx", repo="build/triton"))
    write_triton_repo(TritonRepoConfig(engine=EngineOptions("build/model.onnx", max_batch=4), repo="build/triton",
                                       defaults=ServeDefaults(max_tokens=64)))

reads the engine's metadata first (without loading its graph) and refuses, naming the limit and
the fix, what the server could not serve: more rows or context than the engine was exported
for, a tree its heads cannot propose, a missing heads graph or a file of another size than the
export recorded. Then it writes, whole (a staging folder beside it, swapped in by ``runtime/durable.py``):

    build/triton/medusa/config.pbtxt     Python backend, decoupled (streaming), the parameters below
    build/triton/medusa/1/model.py       serving/triton_model.py, copied as is

The engine (a folder or an .onnx / .plan file with its siblings) is referenced by its path
relative to the model's folder (``../../smollm2``), so the repository and the engine move
together (a container mount of their common parent, a copy of both); with ``copy_engine`` it is
copied into ``medusa/engine/`` instead (hard links where the file system allows: no extra space),
which makes the repository self-contained. Relative paths are resolved against the model's
folder when the server loads the model; never an absolute path.
``max_batch_size`` is 0: the runtime batches requests itself (continuous batching), so Triton
must hand them over one by one, as they come.

Per-request limits recorded in config.pbtxt: ``max_tokens_limit`` (a request asking for more
new tokens is refused, as OpenAI-like servers do: one client cannot hold a row for the whole
context) and ``request_timeout`` (seconds from arrival after which a request ends with
finish_reason "timeout"; a request may ask for a shorter one with its ``timeout_s`` input).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from medusa_trt.runtime import durable
from medusa_trt.runtime.engine import ENGINE_SUFFIXES, EngineError, EngineFiles, EngineMeta, check_tree_fits, engine_meta
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.serving.schema import TRITON_INPUTS, TRITON_MODEL_NAME, TRITON_OUTPUTS, EngineOptions, ServeDefaults

log = logging.getLogger(__name__)

MODEL_FILE = Path(__file__).with_name("triton_model.py")


class TritonRepoError(MedusaError):
    """The repository cannot be written as asked; the message says what to change."""


@dataclass(frozen=True)
class TritonRepoConfig:
    engine: EngineOptions | str | os.PathLike  # the engine (.onnx for ONNX Runtime, .plan for TensorRT, a folder) and its options;
    # a path alone: EngineOptions(path), the engine's own settings
    repo: str | os.PathLike  # the model repository folder (created; other models in it are kept)
    model_name: str = TRITON_MODEL_NAME
    defaults: ServeDefaults = field(default_factory=ServeDefaults)  # of a request that sends none, and the per-request limits
    overwrite: bool = False  # replace an existing model folder of the same name
    copy_engine: bool = False  # copy the engine into <model>/engine/ (self-contained) instead of referencing it relatively

    def __post_init__(self):
        object.__setattr__(self, "engine", EngineOptions.of(self.engine))  # frozen: set once, here
        if not self.model_name or "/" in self.model_name or self.model_name.startswith("."):
            raise TritonRepoError(f"model name {self.model_name!r} must be a plain folder name")


def _engine(engine: str | os.PathLike) -> tuple[Path, EngineMeta]:
    """The engine's absolute path and metadata, after checking the files the runtime will open."""
    path = Path(engine).expanduser().resolve()
    if path.suffix not in ENGINE_SUFFIXES and not path.is_dir():
        if path.exists():
            raise TritonRepoError(f"engine {path} is neither .onnx, .plan nor an engine folder: pass what medusa-export wrote")
        raise TritonRepoError(f"engine {path} does not exist: export one with medusa-export --out {engine}")
    files = EngineFiles.locate(path)
    if not files.step.is_file():
        raise TritonRepoError(f"engine {files.step} does not exist: export one with medusa-export --out {engine}")
    if not (files.tokenizer / "tokenizer.json").is_file():
        raise TritonRepoError(f"engine {path} has no tokenizer ({files.tokenizer}/tokenizer.json): export it again")
    if files.is_plan and not files.sidecar.is_file():
        raise TritonRepoError(f"TensorRT engine {path} has no metadata sidecar {files.sidecar.name}: build it with medusa-export")
    meta = engine_meta(path)
    try:
        files.check_heads(meta.num_heads)  # the runtime's own check
    except EngineError as exc:
        raise TritonRepoError(str(exc)) from exc
    from medusa_trt.runtime.manifest import check_manifest

    check_manifest(files)  # sizes only (the server checks the sha256 sums once at load)
    return path, meta


def check_against_engine(config: TritonRepoConfig, meta: EngineMeta, engine: Path) -> int:
    """Refuse, naming the limit and the fix, what the engine cannot serve; the effective
    per-request max_tokens limit."""
    options = config.engine
    try:
        meta.check_limits(options.max_batch, options.max_context, built=EngineFiles.locate(engine).is_plan)  # the runtime's own checks
        if options.tree is not None:
            _check_tree(options.tree, meta)
        if options.drafters is not None:
            _check_drafters(options.drafters, meta)
        return config.defaults.for_context(options.max_context or meta.max_context).max_tokens_limit
    except MedusaError as exc:
        raise TritonRepoError(f"{engine.name}: {exc}") from exc


def check_engine_config(config: TritonRepoConfig) -> int:
    """What ``write_triton_repo`` checks of the engine and the options, without writing anything
    (medusa-serve --api triton ENGINE refuses a bad one before starting a server); the limit."""
    engine, meta = _engine(config.engine.path)
    return check_against_engine(config, meta, engine)


def _check_tree(tree: str, meta: EngineMeta) -> None:
    from medusa_trt.runtime.tree import load_tree

    compiled = load_tree(tree, max_depth=meta.num_heads)  # InvalidTreeError names the path and the fix
    check_tree_fits(compiled, top_k=meta.top_k, max_tokens=meta.max_tokens)  # the runtime's own check


def _check_drafters(drafters: tuple[str, ...], meta: EngineMeta) -> None:
    """The runtime's own drafter check, without a graph loaded: unknown names are refused, and a drafter
    this engine cannot run (the heads of an engine without heads) names itself and the fix."""
    from medusa_trt.runtime.drafting import Drafting, DraftingConfig

    # no heads template here: with heads, one is built when the server loads; without, none can be
    Drafting(drafters, None, DraftingConfig(), engine_max_nodes=None, available_only=bool(meta.num_heads))


def check_repo_path(repo: str | os.PathLike) -> Path:
    """The repository folder (absolute): an existing folder, or a new one whose parent exists."""
    repo = Path(repo).expanduser().resolve()
    if repo.exists() and not repo.is_dir():
        raise TritonRepoError(f"{repo} exists and is not a folder: choose a folder for the model repository")
    if not repo.exists() and not repo.parent.is_dir():
        raise TritonRepoError(f"cannot create the model repository {repo}: its parent folder {repo.parent} does not exist; create it first")
    return repo


def _tree_value(tree: str | None) -> str:
    if tree is None:
        return ""
    return str(Path(tree).resolve()) if Path(tree).is_file() else tree


def config_pbtxt(config: TritonRepoConfig, engine: str, max_tokens_limit: int) -> str:
    """The model configuration (protobuf text format); ``engine`` relative to the model's folder."""
    options, defaults = config.engine, config.defaults
    params = {
        "engine": engine,
        "tree": _tree_value(options.tree),
        "drafters": "" if options.drafters is None else (",".join(options.drafters) or "none"),
        "max_batch": "" if options.max_batch is None else str(options.max_batch),
        "max_context": "" if options.max_context is None else str(options.max_context),
        "backend": options.backend or "",
        "threads": "" if options.threads is None else str(options.threads),
        "default_max_tokens": str(defaults.max_tokens),
        "max_tokens_limit": str(max_tokens_limit),
        "request_timeout": repr(float(defaults.request_timeout)),
        "default_temperature": repr(float(defaults.temperature)),
        "default_top_p": repr(float(defaults.top_p)),
        "chat_template": "auto" if defaults.chat_template is None else str(defaults.chat_template).lower(),
    }

    def q(text: str) -> str:  # a protobuf text-format string literal
        return json.dumps(text, ensure_ascii=False)

    def dims(d) -> str:
        return "[ " + ", ".join(str(x) for x in d) + " ]"

    def optional(t) -> str:
        return " optional: true" if t.optional else ""

    inputs = ",\n".join(f"  {{ name: {q(t.name)} data_type: {t.config_type} dims: {dims(t.dims)}{optional(t)} }}" for t in TRITON_INPUTS)
    outputs = ",\n".join(f"  {{ name: {q(t.name)} data_type: {t.config_type} dims: {dims(t.dims)} }}" for t in TRITON_OUTPUTS)
    parameters = ",\n".join(f"  {{ key: {q(k)} value: {{ string_value: {q(v)} }} }}" for k, v in params.items())
    return (
        "# Written by medusa-triton-repo: a medusa-trt engine served by the Python backend.\n"
        "# Decoupled: each request gets a stream of responses (one per engine step with stream=true).\n"
        "# max_batch_size 0: the runtime batches requests itself (continuous batching).\n"
        f"name: {q(config.model_name)}\n"
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy { decoupled: true }\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f"parameters [\n{parameters}\n]\n"
    )


def write_triton_repo(config: TritonRepoConfig) -> Path:
    """Write ``repo/<model_name>/`` (config.pbtxt, 1/model.py); returns the model folder.

    Whole: the folder is staged under a hidden name and swapped into place (``runtime/durable.py``),
    so a server never sees half a model, a failure leaves nothing and a replaced model is removed
    only once the new one is in place; a new repository is built whole beside its place (its parent
    must exist); an existing model is replaced only with ``overwrite``."""
    repo = check_repo_path(config.repo)
    engine, meta = _engine(config.engine.path)
    final = repo / config.model_name
    limit = check_against_engine(config, meta, engine)
    ref = ENGINE_COPY + ("" if engine.is_dir() else "/" + engine.name) if config.copy_engine else os.path.relpath(engine, final)
    text = config_pbtxt(config, ref, limit)
    copy = engine if config.copy_engine else None
    if final.exists() and not config.overwrite:
        raise TritonRepoError(f"{final} exists: pass --force (overwrite=True) to replace it, or choose another --model-name")
    if not repo.exists():
        with durable.staged_folder(repo) as staging:  # a new repository, built whole beside its place
            _stage_model(staging / config.model_name, text, copy)
    else:
        with durable.staged_folder(final) as staging:  # the model folder, swapped in; the old one removed once it is
            _stage_model(staging, text, copy)
    log.info("wrote %s (engine %s)", final, engine)
    return final


ENGINE_COPY = "engine"  # <model>/engine/: the copied engine (copy_engine)


def _stage_model(folder: Path, text: str, engine: Path | None = None) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MODEL_FILE, folder / "1" / "model.py")
    if engine is not None:
        _copy_engine(engine, folder / ENGINE_COPY)
    (folder / "config.pbtxt").write_text(text, encoding="utf-8")
    os.chmod(folder, 0o755)


def _copy_engine(engine: Path, dest: Path) -> None:
    """Every file of the engine (its manifest's list, the manifest too) under ``dest``, same relative
    names; hard links where the file system allows (an fp32 SmolLM2 engine is 650 MB)."""
    from medusa_trt.runtime.manifest import engine_file_list, manifest_path

    files = EngineFiles.locate(engine)
    folder = files.step.parent
    from medusa_trt.runtime.durable import link_files

    link_files(engine_file_list(files) + [p for p in (manifest_path(files),) if p.is_file()], folder, dest)
