"""The resumable work folder of head training (``<out>.work/`` unless ``--work`` says otherwise).

What a work folder may be resumed with is written down in it: ``fingerprint.json`` holds everything
that determines the sequences (model identity, prompts file content, new tokens, chat template,
generate engine); the cache carries its own key (fingerprint, sequences, head layer, heads), and the
checkpoint the training configuration. A run with other settings is refused, naming the setting,
unless ``restart`` discards what no longer matches. The work folder is created with the first
progress (a finished sequence, the cache, a checkpoint) and never left without any.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pickle
import shutil
from pathlib import Path

import torch

from medusa_trt.runtime import durable
from medusa_trt.training.config import TrainConfig, TrainError, flag

log = logging.getLogger(__name__)

# the work folder's files
FINGERPRINT = "fingerprint.json"
SEQUENCES = "sequences.jsonl"
HIDDEN = "hidden"  # subfolder of the hidden states recorded while generating
STATES = "states"  # subfolder of the hidden states of a forward pass, one shard per SHARD_SEQUENCES sequences
CACHE = "cache.safetensors"  # the forward pass's states of earlier versions (read, no longer written)
CHECKPOINT = "checkpoint.pt"
# TrainConfig fields a checkpoint is not tied to: the work folder stands for --out, the fingerprint
# for the data file and engine by content and identity, and the generate batch changes no token
# (and the generating teacher), and where it runs, or on how many ranks, changes no step: the global batch order is fixed
_NOT_TRAINING = ("out", "work", "data", "generate_engine", "generate_batch", "device", "fsdp", "teacher", "teacher_concurrency")


def sequences_file(work: Path, rank: int) -> Path:
    """The sequences file rank ``rank`` appends to: ``sequences.jsonl`` (rank 0, and every earlier
    version), ``sequences.rank<N>.jsonl`` for the others, so no two processes append to one file."""
    return work / (SEQUENCES if rank == 0 else f"sequences.rank{rank}.jsonl")


def sequences_files(work: Path) -> list[Path]:
    """Every rank's sequences file in ``work`` (of this run's world size or an earlier one), rank 0 first."""
    ranks = sorted(int(p.name[len("sequences.rank") : -len(".jsonl")]) for p in work.glob("sequences.rank*.jsonl") if _rank_file(p.name))
    return [p for p in [work / SEQUENCES, *(sequences_file(work, r) for r in ranks)] if p.is_file()]


def _rank_file(name: str) -> bool:
    middle = name.removeprefix("sequences.rank").removesuffix(".jsonl")
    return name.startswith("sequences.rank") and name.endswith(".jsonl") and middle.isdigit() and middle == str(int(middle))


def _shard_name(stem: str) -> bool:
    """A hidden-state shard's stem: ``0000064`` (rank 0), ``0000064-r3`` (rank 3), ``<key>-0000002`` (states/)."""
    head, _, tail = stem.partition("-")
    return stem.isdigit() or (head.isdigit() and tail[:1] == "r" and tail[1:].isdigit()) or (head.isalnum() and tail.isdigit())


def _path_identity(path: Path) -> str:
    """Resolved path, size and modification time of a file, or of every file in a folder: cheap, and
    changes when the file is replaced."""
    path = path.expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return str(path) + " " + " ".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def short_sha256(data: bytes) -> str:
    """The first 16 hex digits of the SHA-256 of ``data``: the keys of the work folder."""
    return hashlib.sha256(data).hexdigest()[:16]


def data_fingerprint(base, config: TrainConfig) -> dict:
    """Everything that determines the sequences (and with them the cached hidden states), keyed by
    the flag a user changes, so a difference can be named."""
    from medusa_trt.exporter.models import BUILTIN_MODELS
    from medusa_trt.training.prompts import pool_digest

    cfg = base.model.config
    name = str(base.name)
    builtin = name in BUILTIN_MODELS or not Path(name).expanduser().exists()
    files = "" if builtin else " " + short_sha256(_path_identity(Path(name)).encode())
    fingerprint = {
        "--model": name if builtin else str(Path(name).expanduser().resolve()),
        "model files": f"{type(base.model).__name__} vocab {cfg.vocab_size} hidden {cfg.hidden_size} layers "
        f"{getattr(cfg, 'num_hidden_layers', '?')}" + files,
        # a file by content, wherever it lies
        "--data": f"built-in prompts (--seed {config.seed}, pool {pool_digest()})"
        if config.data is None
        else f"a file with sha256 {short_sha256(Path(config.data).read_bytes())}",
        "--teacher-forced": config.teacher_forced,
    }
    if not config.teacher_forced:
        engine = config.generate_engine
        fingerprint |= {
            "--new-tokens": config.new_tokens,
            "chat template": config.chat_template,
            "--generate-engine": engine and _engine_labels(engine),
        }
        if config.teacher is not None:  # (only then: work folders of earlier versions keep their fingerprint)
            fingerprint["--teacher"] = "an OpenAI-compatible server of --model"
    return fingerprint


def generate_engine_meta(engine: str):
    """The ``--generate-engine`` ONNX engine's metadata, read from its graph file alone (no weights, no session)."""
    from medusa_trt.runtime.engine import EngineError
    from medusa_trt.runtime.engine import engine_meta as read_engine_meta

    try:
        return read_engine_meta(Path(engine))
    except (EngineError, OSError) as exc:
        raise TrainError(f"--generate-engine {engine}: {exc}") from exc


def _engine_labels(engine: str) -> str:
    """What of a generating engine decides its tokens and hidden states: the model and the step
    graph's arithmetic. Another export of the same model and precision resumes the same data (a
    faster graph, other batch limits, other heads: plain generation runs no heads)."""
    meta = generate_engine_meta(engine)
    step_quantization = "none" if meta.quantization == "heads-int8" else meta.quantization
    return f"{meta.model} {meta.architecture} {meta.dtype} quantization {step_quantization}"


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in dict.fromkeys([*new, *old]) if old.get(k) != new.get(k)]
    return "; ".join(f"{k} was {old.get(k)}, now {new.get(k)}" for k in keys)


def _read_json(file: Path) -> dict | None:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _has_progress(work: Path) -> bool:
    return work.is_dir() and any(p.name != FINGERPRINT for p in work.iterdir())


def _training_view(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _NOT_TRAINING}


# ----------------------------------------------------------------------------- checkpoint


def checkpoint_differences(checkpoint: Path, config: TrainConfig) -> str | None:
    """None when the checkpoint continues ``config``'s training, else what differs."""
    try:  # mmap: only the small config is read, not the heads and optimizer state
        stored = torch.load(checkpoint, mmap=True, weights_only=False)["config"]
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        return f"it cannot be read ({type(exc).__name__})"
    old, new = _training_view(stored), _training_view(dataclasses.asdict(config))
    return None if old == new else _differences({flag(k): v for k, v in old.items()}, {flag(k): v for k, v in new.items()})


def stale_checkpoint_error(checkpoint: Path, why: str) -> TrainError:
    """The refusal of a checkpoint written by another training configuration (``why``: what differs)."""
    return TrainError(
        f"{checkpoint} was written by another configuration ({why}): pass --restart to train from step 0 on the same data, or another --out"
    )


def save_checkpoint(path: Path, heads, optimizer, step: int, history: list[float], config: TrainConfig) -> None:
    """Heads, optimizer, step, loss history and the training configuration, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "heads": heads.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "history": history,
        "config": dataclasses.asdict(config),
    }
    with durable.staged_file(path) as tmp:
        torch.save(state, tmp)


# ----------------------------------------------------------------------------- refuse, resume or restart


def check_workdir(base, config: TrainConfig, *, restart: bool = False) -> None:
    """Refuse a work folder whose progress was made with other settings, naming them; with
    ``restart``, discard that progress instead (what matches is kept: resuming is exact)."""
    check_data(base, config, restart=restart)
    checkpoint = config.workdir / CHECKPOINT
    if checkpoint.is_file() and (why := checkpoint_differences(checkpoint, config)) is not None:
        if not restart:
            raise stale_checkpoint_error(checkpoint, why)
        log.warning("--restart: discarding %s (%s)", checkpoint, why)
        checkpoint.unlink()


def check_data(base, config: TrainConfig, *, restart: bool = False) -> None:
    """The work folder's sequences and cache, refused (or discarded, with ``restart``, or when
    there is no progress to lose) unless its fingerprint is the configuration's."""
    work = config.workdir
    if not work.exists():
        return
    if not work.is_dir():
        raise TrainError(f"{work} (the work folder of --out {config.out}) is a file: remove it or pass another --out")
    stored, current = _read_json(work / FINGERPRINT), data_fingerprint(base, config)
    if stored == current:
        return
    if _has_progress(work):
        why = _differences(stored, current) if stored is not None else f"it has no readable {FINGERPRINT}"
        if not restart:
            raise TrainError(f"{work} holds data from another configuration ({why}): pass --restart to discard it, or another --out")
        log.warning("--restart: discarding %s (%s)", work, why)
    discard_workdir(work, config)


def open_workdir(base, config: TrainConfig) -> Path:
    """The work folder, created with its fingerprint when the first progress is about to be written."""
    work = config.workdir
    if not (work / FINGERPRINT).is_file():
        work.mkdir(parents=True, exist_ok=True)
        durable.write_text(work / FINGERPRINT, json.dumps(data_fingerprint(base, config), indent=2))
    return work


def drop_if_empty(config: TrainConfig) -> None:
    """A work folder without progress (a run stopped before its first sequence) is removed."""
    work = config.workdir
    if work.is_dir() and not _has_progress(work):
        discard_workdir(work, config)


_WORK_FILES = (FINGERPRINT, SEQUENCES, CACHE, CHECKPOINT)


def _ours(path: Path, work: Path) -> bool:
    """A file a training run writes in ``work``: its own names, the hidden-state shards (``0000012.safetensors``,
    ``.tmp`` of earlier versions), or a staged write of one of them left by a kill (``runtime/durable.py``)."""
    rel = path.relative_to(work)
    if path.is_symlink():
        return False
    if rel.parts in ((HIDDEN,), (STATES,)):
        return path.is_dir()
    if len(rel.parts) == 1:
        if _rank_file(path.name):
            return True
        names = [*_WORK_FILES, *(p.name for p in work.glob("sequences.rank*.jsonl") if _rank_file(p.name))]
        return path.name in names or any(durable.parse_leftover(path, work / n) for n in names)
    stem, _, suffix = path.name.partition(".")
    if len(rel.parts) == 2 and rel.parts[0] in (HIDDEN, STATES):
        if _shard_name(stem) and suffix in ("safetensors", "tmp"):
            return True
        target = path.with_name(path.name[1:].split(".new.")[0])  # .0000012.safetensors.new.PID.N@HOST.safetensors
        return path.name.startswith(".") and durable.parse_leftover(path, target) is not None
    return False


def _foreign(work: Path) -> Path | None:
    """The first file in ``work`` that a training run did not write, else None."""
    return next((p for p in sorted(work.rglob("*")) if not _ours(p, work)), None)


def discard_workdir(work: Path, config: TrainConfig) -> None:
    """Remove a work folder, only if every file in it is one a training run writes; else refuse,
    naming the first other file (``--work`` may name any folder: a user's is never deleted)."""
    if (first := _foreign(work)) is not None:
        raise TrainError(
            f"{work} (the work folder of --out {config.out}) holds {first}, which medusa-train did not write: "
            "pass another --work (or --out), or move or remove it yourself"
        )
    shutil.rmtree(work)
