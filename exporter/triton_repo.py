"""A Triton Inference Server model repository that serves an exported engine.

    write_triton_repo(TritonRepoConfig(engine="build/model.onnx", repo="build/triton"))

writes, atomically (a temporary folder beside it, then one rename):

    build/triton/medusa/config.pbtxt     Python backend, decoupled (streaming), the parameters below
    build/triton/medusa/1/model.py       exporter/triton_model.py, copied as is

The engine is *not* copied (an fp32 SmolLM2 engine is 650 MB): config.pbtxt names it by absolute
path, checked here and again when the server loads the model. To ship a self-contained
repository, copy the engine files into ``medusa/`` and set the ``engine`` parameter to the
relative name (``model.onnx``); relative paths are resolved against the model's folder.
``max_batch_size`` is 0: the runtime batches requests itself (continuous batching), so Triton
must hand them over one by one, as they come.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.engine import EngineFiles
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

MODEL_FILE = Path(__file__).with_name("triton_model.py")

# (name, Triton type, dims, optional): names and types follow Triton's generate endpoints
# (text_input / text_output, max_tokens, ...), so /v2/models/medusa/generate_stream works as is.
INPUTS = [
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("stop", "TYPE_STRING", [-1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("token_ids", "TYPE_INT64", [-1]),
    ("finish_reason", "TYPE_STRING", [1]),
]


class TritonRepoError(MedusaError):
    """The repository cannot be written as asked; the message says what to change."""


@dataclass(frozen=True)
class TritonRepoConfig:
    engine: str | os.PathLike  # an exported .onnx (ONNX Runtime) or .plan (TensorRT) engine
    repo: str | os.PathLike  # the model repository folder (created; other models in it are kept)
    model_name: str = "medusa"
    tree: str | None = None  # preset, chain-N or JSON file; None: the engine's tree ("chain-0": plain decoding)
    max_batch: int | None = None  # concurrent sequences (cache rows); None: the engine's
    max_context: int | None = None  # None: the engine's
    threads: int | None = None  # ONNX Runtime intra-op threads; None: its default
    max_tokens: int = 128  # default max_tokens of a request that sends none
    temperature: float = 0.0  # default sampling of a request that sends none: greedy
    top_p: float = 1.0
    chat_template: bool | None = None  # None: the engine's default (instruct engines apply theirs)
    overwrite: bool = False  # replace an existing model folder of the same name

    def __post_init__(self):
        if not self.model_name or "/" in self.model_name or self.model_name.startswith("."):
            raise TritonRepoError(f"model name {self.model_name!r} must be a plain folder name")
        for name in ("max_batch", "max_context", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TritonRepoError(f"{name} must be >= 1, got {value}")
        if self.max_tokens < 1:
            raise TritonRepoError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise TritonRepoError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")


def check_engine(engine: str | os.PathLike) -> Path:
    """The engine's absolute path, after checking the files the runtime will open are there."""
    path = Path(engine).expanduser().resolve()
    files = EngineFiles.beside(path)
    if path.suffix not in (".onnx", ".plan"):
        raise TritonRepoError(f"engine {path} is neither .onnx nor .plan: pass the file medusa-export wrote")
    if not path.is_file():
        raise TritonRepoError(f"engine {path} does not exist: export one with medusa-export --out {engine}")
    if not (files.tokenizer / "tokenizer.json").is_file():
        raise TritonRepoError(f"engine {path} has no tokenizer beside it ({files.tokenizer}/tokenizer.json): export it again")
    if path.suffix == ".plan" and not files.sidecar.is_file():
        raise TritonRepoError(f"TensorRT engine {path} has no metadata sidecar {files.sidecar.name}: build it with medusa-export")
    return path


def _tree_value(tree: str | None) -> str:
    if tree is None:
        return ""
    from medusa_trt.runtime.tree import load_tree

    load_tree(tree)  # fails here (InvalidTreeError) rather than when the server loads the model
    return str(Path(tree).resolve()) if Path(tree).is_file() else tree


def config_pbtxt(config: TritonRepoConfig, engine: Path) -> str:
    """The model configuration (protobuf text format)."""
    params = {
        "engine": str(engine),
        "tree": _tree_value(config.tree),
        "max_batch": "" if config.max_batch is None else str(config.max_batch),
        "max_context": "" if config.max_context is None else str(config.max_context),
        "threads": "" if config.threads is None else str(config.threads),
        "default_max_tokens": str(config.max_tokens),
        "default_temperature": repr(float(config.temperature)),
        "default_top_p": repr(float(config.top_p)),
        "chat_template": "auto" if config.chat_template is None else str(config.chat_template).lower(),
    }

    def q(text: str) -> str:  # a protobuf text-format string literal
        return json.dumps(text, ensure_ascii=False)

    def dims(d) -> str:
        return "[ " + ", ".join(str(x) for x in d) + " ]"

    inputs = ",\n".join(
        f"  {{ name: {q(n)} data_type: {t} dims: {dims(d)}{' optional: true' if opt else ''} }}" for n, t, d, opt in INPUTS)
    outputs = ",\n".join(f"  {{ name: {q(n)} data_type: {t} dims: {dims(d)} }}" for n, t, d in OUTPUTS)
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

    Atomic: the folder is built under a temporary name in the repository and renamed into place,
    so a server never sees half a model; an existing one is replaced only with ``overwrite``."""
    engine = check_engine(config.engine)
    text = config_pbtxt(config, engine)
    repo = Path(config.repo).expanduser().resolve()
    final = repo / config.model_name
    if final.exists() and not config.overwrite:
        raise TritonRepoError(f"{final} exists: pass --force (overwrite=True) to replace it, or choose another --model-name")
    repo.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{config.model_name}.tmp-", dir=repo))
    old = None
    try:
        (staging / "1").mkdir()
        shutil.copyfile(MODEL_FILE, staging / "1" / "model.py")
        (staging / "config.pbtxt").write_text(text, encoding="utf-8")
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700; the server may run as another user
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{config.model_name}.old-", dir=repo))
            os.rename(final, old / "model")
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and (old / "model").exists() and not final.exists():
            os.rename(old / "model", final)  # put the previous model back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    log.info("wrote %s (engine %s)", final, engine)
    return final
