"""Medusa head training by self-distillation, base model frozen.

Stages, each resumable from what it left in the work folder ``<out>.work/``:
  1. sequences: the base model's own greedy continuation of each prompt (labels are the model's
     tokens, not a corpus's), appended to ``sequences.jsonl`` as they finish; or, with
     ``teacher_forced``, corpus text tokenized as is;
  2. cache: the heads' input hidden state at every labelled position, computed once
     (``cache.safetensors``), so epochs cost only the heads;
  3. training: AdamW on the heads alone, loss = sum over heads k (1-based) of decay^k x
     cross-entropy of head k against the token k+1 steps ahead; checkpoints every N steps
     (``checkpoint.pt``: heads, optimizer, step) so an interrupted run continues exactly.
The data order is a function of (seed, epoch), so a resumed run gives the same heads as an
uninterrupted one.

What a work folder may be resumed with is written down in it: ``fingerprint.json`` holds everything
that determines the sequences (model identity, prompts file content, new tokens, chat template,
generate engine); the cache carries its own key (fingerprint, sequences, head layer, heads), and the
checkpoint the training configuration. A run with other settings is refused, naming the setting,
unless ``restart`` discards what no longer matches. The work folder is created with the first
progress (a finished sequence, the cache, a checkpoint) and never left without any.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads, save_heads
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

IGNORE = -100  # target of a position whose future token lies past the sequence


class TrainError(MedusaError):
    """Training cannot run as configured."""


# least value of each whole-number setting
_AT_LEAST = {"num_heads": 1, "num_layers": 1, "num_prompts": 1, "follow_ups": 0, "new_tokens": 1, "generate_batch": 1, "epochs": 1,
             "batch_size": 1, "warmup_steps": 0, "seed": 0, "checkpoint_every": 1}
_MAX_SEED = 2**32 - 1  # the batch order's generator is seeded with seed * 1000 + epoch
# the command-line flag of a TrainConfig field, for messages
_FLAGS = {"num_heads": "--heads", "num_layers": "--layers", "warmup_steps": "warmup steps", "generate_batch": "generate batch",
          "weight_decay": "weight decay", "holdout": "holdout", "chat_template": "chat template"}
GENERATE_CONTEXT = 1024  # prompt + continuation tokens of the self-distillation runtime (at most the model's positions)


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


@dataclass(frozen=True)
class TrainConfig:
    out: str  # heads folder to write (ours: heads.json + heads.safetensors)
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # project with the frozen base lm_head (a few MB of heads) instead of own projections
    head_input: str = "hidden"  # "hidden+next": next-token-aware heads (they also read the next token's embedding)
    head_layer: int | None = None  # decoder layer feeding the heads; None: final hidden state
    decay: float = 0.8  # weight of head k is decay^k: far heads matter less and are harder
    data: str | None = None  # prompts file (.jsonl with turns[0]/prompt/text, or .txt, one per line); None: built-in prompts
    teacher_forced: bool = False  # data is corpus text whose own tokens are the labels (no generation)
    num_prompts: int = 400  # built-in prompts used (or the first N of --data)
    follow_ups: int = 0  # second turns on the model's own first answers (the first N), generated after the first turns
    new_tokens: int = 128  # continuation length per prompt
    chat_template: bool = True  # wrap prompts in the model's chat template when it has one
    generate_batch: int = 16  # rows generating at once
    generate_engine: str | None = None  # an exported .onnx engine of the same base model: faster self-distillation on CPU
    epochs: int = 3
    batch_size: int = 256  # positions per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    holdout: float = 0.05  # fraction of sequences kept for the accuracy report
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps
    work: str | None = None  # work folder (default <out>.work); one folder can feed several trainings of the same data
    bf16: bool = False  # heads' matmuls in bfloat16 autocast (about 2x faster on CPUs with AVX512-BF16/AMX); loss in fp32

    def __post_init__(self):
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TrainError(f"{_flag(name)} {value} must be a whole number >= {least}")
        if self.seed > _MAX_SEED:
            raise TrainError(f"--seed {self.seed} must be at most {_MAX_SEED}")
        if self.head_layer is not None and (isinstance(self.head_layer, bool) or not isinstance(self.head_layer, int) or self.head_layer < 0):
            raise TrainError(f"--head-layer {self.head_layer} must be a decoder layer index >= 0 (leave it out for the final hidden state)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"--lr {self.lr} must be a positive number, e.g. 1e-3")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise TrainError(f"weight decay {self.weight_decay} must be a number >= 0")
        if not 0.0 < self.decay <= 1.0:
            raise TrainError(f"--decay {self.decay} must be in (0, 1]")
        if not 0.0 <= self.holdout < 1.0:
            raise TrainError(f"holdout {self.holdout} must be in [0, 1): the fraction of sequences kept for the accuracy report")
        if self.teacher_forced and self.data is None:
            raise TrainError("--teacher-forced needs --data: a corpus whose own tokens are the labels")
        from medusa_trt.exporter.heads import HEAD_INPUTS

        if self.head_input not in HEAD_INPUTS:
            raise TrainError(f"--head-input {self.head_input} is not one of {', '.join(HEAD_INPUTS)}")
        if self.follow_ups > self.num_prompts:
            raise TrainError(f"--follow-ups {self.follow_ups} exceeds --num-prompts {self.num_prompts}: each follow-up "
                             "continues one first-turn conversation; pass at most that many")
        if self.follow_ups and self.teacher_forced:
            raise TrainError("--follow-ups needs generated answers: drop it with --teacher-forced")

    @property
    def workdir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(str(self.out) + ".work")


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits [P, n, V], targets int64 [P, n] (IGNORE where absent).

    Returns (sum_k decay^k * CE_k, per-head CE [n]); k is 1-based and CE_k is the mean over the
    positions that have a target for head k (0 for a head with none)."""
    P, n, V = head_logits.shape
    # one cross-entropy over the flattened (position, head) rows: indexing the valid rows of each
    # head instead copies the logits and scatters their gradient back (half the step's time)
    losses = F.cross_entropy(head_logits.reshape(P * n, V).float(), targets.reshape(P * n), ignore_index=IGNORE,
                             reduction="none").view(P, n)  # (P, n), 0 where the target is absent
    counts = (targets != IGNORE).sum(0).clamp(min=1)  # (n,)
    per_head = losses.sum(0) / counts  # (n,)
    weights = decay ** torch.arange(1, n + 1, dtype=per_head.dtype, device=per_head.device)  # (n,)
    return (weights * per_head).sum(), per_head.detach()


# ----------------------------------------------------------------------------- inputs


def check_inputs(config: TrainConfig) -> None:
    """Every file the configuration names, checked before anything is loaded or written."""
    out = Path(config.out)
    if not out.parent.is_dir():
        raise TrainError(f"cannot write {out}: folder {out.parent} does not exist")
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} is a file: pass a folder path for the heads")
    if config.workdir.exists() and not config.workdir.is_dir():
        raise TrainError(f"{config.workdir} (the work folder of --out {out}) is a file: remove it or pass another --out")
    if config.generate_engine is not None and not Path(config.generate_engine).exists():
        raise TrainError(f"--generate-engine {config.generate_engine} does not exist: pass an .onnx engine exported from --model")
    if not _read_prompts(config):
        raise TrainError(f"--data {config.data} holds no prompts: one per line (.txt) or one JSON object per line (.jsonl)")


def check_model(base, config: TrainConfig) -> None:
    """What the configuration asks of the base model, checked right after loading it."""
    cfg = base.model.config
    layers = getattr(cfg, "num_hidden_layers", None)
    if config.head_layer is not None and layers is not None and not config.head_layer < layers:
        raise TrainError(f"--head-layer {config.head_layer} is out of range: {base.name} has decoder layers 0..{layers - 1} "
                         "(leave it out for the final hidden state)")
    if config.follow_ups and not (config.chat_template and getattr(base, "is_chat", False)):
        raise TrainError(f"--follow-ups needs a chat model with its chat template: {base.name} has none; drop --follow-ups")
    context = min(GENERATE_CONTEXT, getattr(cfg, "max_position_embeddings", None) or GENERATE_CONTEXT)
    if not config.teacher_forced and config.new_tokens >= context:
        raise TrainError(f"--new-tokens {config.new_tokens} leaves no room for the prompt: {base.name} generates at most "
                         f"{context} tokens per sequence; pass fewer")


def _read_prompts(config: TrainConfig) -> list[str]:
    """The first ``num_prompts`` prompts; a bad file is named with its line and the fix."""
    if config.data is None:
        from medusa_trt.training.prompts import training_prompts

        try:
            return training_prompts(config.num_prompts, config.seed)
        except ValueError as exc:
            raise TrainError(f"--num-prompts {config.num_prompts}: {exc}; pass fewer, or --data with your own prompts") from exc
    path = Path(config.data)
    if not path.exists():
        raise TrainError(f"--data {path} does not exist: pass a prompts file (.jsonl or .txt, one prompt per line)")
    if not path.is_file():
        raise TrainError(f"--data {path} is not a file: pass a prompts file (.jsonl or .txt, one prompt per line)")
    if "spec_bench" in path.name:
        raise TrainError(f"{path} is the evaluation set: train on other prompts (Spec-Bench is kept for evaluation)")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TrainError(f"cannot read --data {path}: {exc.strerror}") from exc
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    texts: list[str] = []
    for number, data in enumerate(raw.splitlines(), 1):  # bytes split on \n and \r only: JSON strings may hold U+2028
        if len(texts) == config.num_prompts:
            break
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TrainError(f"--data {path} line {number} is not UTF-8 text (byte {exc.start + 1} of the line): "
                             "save the file as UTF-8") from exc
        if not line.strip():
            continue
        texts.append(_prompt_of(line, path, number) if path.suffix == ".jsonl" else line)
    return texts


def _prompt_of(line: str, path: Path, number: int) -> str:
    """The prompt of one .jsonl record: turns[0], prompt or text."""
    where = f"--data {path} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TrainError(f"{where} is not JSON ({exc.msg}): write one JSON object per line, or use a .txt file") from exc
    if not isinstance(record, dict):
        raise TrainError(f"{where} is not a JSON object: write one object per line with turns, prompt or text")
    if "turns" in record:
        turns = record["turns"]
        prompt = turns[0] if isinstance(turns, list) and turns else None
    else:
        prompt = record.get("prompt") or record.get("text")
        if prompt is None:
            raise TrainError(f"{where} has no turns, prompt or text field: give each record one of them")
    if not isinstance(prompt, str):
        raise TrainError(f"{where}: the prompt (turns[0], prompt or text) is not a string")
    return prompt


# ----------------------------------------------------------------------------- work folder

FINGERPRINT = "fingerprint.json"
SEQUENCES = "sequences.jsonl"
CACHE = "cache.safetensors"
CHECKPOINT = "checkpoint.pt"
# TrainConfig fields a checkpoint is not tied to: the work folder stands for --out, the fingerprint
# for the data file and engine by content and identity, and the generate batch changes no token
_NOT_TRAINING = ("out", "work", "data", "generate_engine", "generate_batch")


def _path_identity(path: Path) -> str:
    """Resolved path, size and modification time of a file, or of every file in a folder: cheap, and
    changes when the file is replaced."""
    path = path.expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return str(path) + " " + " ".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def data_fingerprint(base, config: TrainConfig) -> dict:
    """Everything that determines the sequences (and with them the cached hidden states), keyed by
    the flag a user changes, so a difference can be named."""
    from medusa_trt.exporter.models import BUILTIN_MODELS
    from medusa_trt.training.prompts import pool_digest

    cfg = base.model.config
    name = str(base.name)
    builtin = name in BUILTIN_MODELS or not Path(name).expanduser().exists()
    fingerprint = {
        "--model": name if builtin else str(Path(name).expanduser().resolve()),
        "model files": f"{type(base.model).__name__} vocab {cfg.vocab_size} hidden {cfg.hidden_size} layers "
                       f"{getattr(cfg, 'num_hidden_layers', '?')}" + ("" if builtin else " " + _sha256(_path_identity(Path(name)).encode())),
        "--data": f"built-in prompts (--seed {config.seed}, pool {pool_digest()})" if config.data is None  # a file by content, wherever it lies
                  else f"a file with sha256 {_sha256(Path(config.data).read_bytes())}",
        "--teacher-forced": config.teacher_forced,
    }
    if not config.teacher_forced:
        engine = config.generate_engine
        fingerprint |= {"--new-tokens": config.new_tokens, "chat template": config.chat_template,
                        "--generate-engine": engine and _engine_labels(engine)}
    return fingerprint


def _engine_meta(engine: str):
    """An ONNX engine's metadata, read from its graph file alone (no weights, no session)."""
    from medusa_trt.runtime.engine import engine_meta as read_engine_meta
    from medusa_trt.runtime.engine import EngineError

    try:
        return read_engine_meta(Path(engine))
    except (EngineError, OSError) as exc:
        raise TrainError(f"--generate-engine {engine}: {exc}") from exc


def _engine_labels(engine: str) -> str:
    """What of a generating engine decides its tokens and hidden states: the model and the step
    graph's arithmetic. Another export of the same model and precision resumes the same data (a
    faster graph, other batch limits, other heads: plain generation runs no heads)."""
    meta = _engine_meta(engine)
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


def _checkpoint_differences(checkpoint: Path, config: TrainConfig) -> str | None:
    """None when the checkpoint continues ``config``'s training, else what differs."""
    try:  # mmap: only the small config is read, not the heads and optimizer state
        stored = torch.load(checkpoint, mmap=True, weights_only=False)["config"]
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        return f"it cannot be read ({type(exc).__name__})"
    old, new = _training_view(stored), _training_view(dataclasses.asdict(config))
    return None if old == new else _differences({_flag(k): v for k, v in old.items()}, {_flag(k): v for k, v in new.items()})


def check_workdir(base, config: TrainConfig, *, restart: bool = False) -> None:
    """Refuse a work folder whose progress was made with other settings, naming them; with
    ``restart``, discard that progress instead (what matches is kept: resuming is exact)."""
    _check_data(base, config, restart=restart)
    checkpoint = config.workdir / CHECKPOINT
    if checkpoint.is_file() and (why := _checkpoint_differences(checkpoint, config)) is not None:
        if not restart:
            raise TrainError(f"{checkpoint} was written by another configuration ({why}): pass --restart to train "
                             "from step 0 on the same data, or another --out")
        log.warning("--restart: discarding %s (%s)", checkpoint, why)
        checkpoint.unlink()


def _check_data(base, config: TrainConfig, *, restart: bool = False) -> None:
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
            raise TrainError(f"{work} holds data from another configuration ({why}): pass --restart to discard it, "
                             "or another --out")
        log.warning("--restart: discarding %s (%s)", work, why)
    shutil.rmtree(work)


def _open_workdir(base, config: TrainConfig) -> Path:
    """The work folder, created with its fingerprint when the first progress is about to be written."""
    work = config.workdir
    if not (work / FINGERPRINT).is_file():
        work.mkdir(parents=True, exist_ok=True)
        tmp = work / (FINGERPRINT + ".tmp")
        tmp.write_text(json.dumps(data_fingerprint(base, config), indent=2))
        os.replace(tmp, work / FINGERPRINT)
    return work


def _drop_if_empty(config: TrainConfig) -> None:
    """A work folder without progress (a run stopped before its first sequence) is removed."""
    work = config.workdir
    if work.is_dir() and not _has_progress(work):
        shutil.rmtree(work)


# ----------------------------------------------------------------------------- stage 1: sequences


class Sample(NamedTuple):
    """One training sequence: token ids (prompt + the model's continuation), the first labelled
    index, and where its recorded hidden states lie (a shard of ``hidden/``), if they were."""

    ids: list[int]
    start: int
    shard: str | None = None
    offset: int = 0  # its first row in the shard


def _record_key(record: dict, line: int) -> tuple[str, int]:
    """("prompt", i) for a first turn, ("follow_up", j) for a second; records written before keys
    existed were one per prompt, in order."""
    if "follow_up" in record:
        return "follow_up", record["follow_up"]
    return "prompt", record.get("prompt", line - 1)


def _read_sequences(file: Path) -> dict[tuple[str, int], dict]:
    """Finished records of ``sequences.jsonl`` by key; an unfinished last line (the run was killed
    while writing it) is cut off so that appending continues cleanly."""
    if not file.is_file():
        return {}
    raw = file.read_bytes()
    *lines, tail = raw.split(b"\n")  # tail: b"" when the file ends with a newline
    done = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("ids"), list) and isinstance(record.get("start"), int)):
            raise TrainError(f"{file} line {number} is not a sequence record (the file is damaged): pass --restart to "
                             "generate the sequences again")
        done[_record_key(record, number)] = record
    if tail:
        log.warning("%s: dropping its unfinished last record (the run was stopped while writing it)", file)
        with open(file, "r+b") as f:
            f.truncate(len(raw) - len(tail))
    return done


def _sample(record: dict) -> Sample:
    return Sample(record["ids"], record["start"], record.get("shard"), record.get("offset", 0))


def build_sequences(base, config: TrainConfig) -> list[Sample]:
    """The training sequences, first turns in prompt order then follow-ups; those not generated
    yet are, each appended to the work folder as it finishes (with its hidden states)."""
    _check_data(base, config)
    prompts = _read_prompts(config)
    tokenizer = base.tokenizer
    if config.teacher_forced:
        seqs = [Sample(tokenizer(t)["input_ids"], 1) for t in prompts]
        return [s for s in seqs if len(s.ids) > config.num_heads + 2]
    done = _read_sequences(config.workdir / SEQUENCES)
    keys = [("prompt", i) for i in range(len(prompts))]
    todo = [(k, text) for k, text in zip(keys, prompts) if k not in done]
    if todo:
        _generate(base, config, todo, done)
    follow = [("follow_up", j) for j in range(config.follow_ups) if ("prompt", j) in done]  # a skipped first turn has none
    todo = [(k, _follow_up(base, done[("prompt", k[1])], prompts[k[1]], k[1])) for k in follow if k not in done]
    if todo:
        _generate(base, config, todo, done)
    return [_sample(done[k]) for k in keys + follow if k in done]


def _follow_up(base, first: dict, prompt: str, index: int) -> list[dict]:
    """The second-turn conversation on first-turn record ``first`` (messages, user last)."""
    from medusa_trt.training.prompts import follow_up_conversation

    eos = set(base.eos_token_ids)
    answer = [t for t in first["ids"][first["start"]:] if t not in eos]
    return follow_up_conversation(prompt, base.tokenizer.decode(answer, skip_special_tokens=True), index)


HIDDEN = "hidden"  # work-folder subfolder of the hidden states recorded while generating
SHARD_SEQUENCES = 64  # sequences per hidden-state shard


def _generate(base, config: TrainConfig, todo: list[tuple[tuple[str, int], object]], done: dict) -> None:
    """Greedy continuations of ``todo`` ((key, prompt text or conversation) pairs), written as they
    finish: every ``SHARD_SEQUENCES`` a shard of their hidden states (float16), then their records.
    Plain decoding over ``generate_batch`` rows that refill in waves: on the 2-core CPU, wide plain
    batches write more tokens per second than drafting does (101 vs 61 tokens/s at 16 rows, whose
    steps already cost 10 ms a row; drafting pays at one row)."""
    from medusa_trt.exporter.wrapper import MedusaModel
    from medusa_trt.runtime import MedusaRuntime

    if config.generate_engine:
        meta = _engine_meta(config.generate_engine)
        if (meta.vocab_size, meta.hidden_size) != (base.model.config.vocab_size, base.model.config.hidden_size):
            raise TrainError(f"--generate-engine {config.generate_engine} was exported from another model ({meta.model})")
        runtime = MedusaRuntime(config.generate_engine, max_batch=min(config.generate_batch, meta.max_batch)).plain()
    else:
        runtime = MedusaRuntime(MedusaModel(base, None), tree="chain-0", max_batch=config.generate_batch, max_context=GENERATE_CONTEXT)
    chat = config.chat_template and runtime.is_chat
    encode = lambda p: runtime.codec.encode(p, chat=chat) if isinstance(p, str) else runtime.codec.encode_chat(p)  # noqa: E731
    batch = [encode(p) for _, p in todo]
    room = runtime.max_context - config.new_tokens
    kept = [(k, ids) for (k, _), ids in zip(todo, batch) if len(ids) <= room]
    if len(kept) < len(todo):
        log.warning("%d prompts leave no room for %d new tokens in %d positions: skipped", len(todo) - len(kept), config.new_tokens,
                    runtime.max_context)
    work, new_tokens, finished, started = None, 0, 0, time.perf_counter()
    pending: list[tuple[dict, np.ndarray]] = []
    with tqdm(total=len(kept), desc="self-distillation", unit="seq", disable=None) as bar:
        results = runtime.completed([ids for _, ids in kept], max_new_tokens=config.new_tokens, chat_template=False, hidden=True)
        for i, result in results:
            (kind, index), ids = kept[i]
            pending.append(({kind: index, "ids": ids + result.token_ids, "start": len(ids)}, result.hidden))
            new_tokens, finished = new_tokens + len(result.token_ids), finished + 1
            bar.update()
            bar.set_postfix(new_tokens_per_s=f"{new_tokens / (time.perf_counter() - started):.0f}")
            if len(pending) == SHARD_SEQUENCES or finished == len(kept):
                work = work or _open_workdir(base, config)  # the work folder appears with the first finished shard
                _write_shard(work, pending, done)
                pending = []
                log.info("%d of %d sequences written, %.0f new tokens/s", finished, len(kept), new_tokens / (time.perf_counter() - started))


def _write_shard(work: Path, pending: list[tuple[dict, np.ndarray]], done: dict) -> None:
    """Hidden states first (a shard named by the records before it: a shard left by a kill before
    its records were written is overwritten by the next), then the records, then flush."""
    from safetensors.numpy import save_file

    name = f"{len(done):07d}"
    folder = work / HIDDEN
    folder.mkdir(exist_ok=True)
    rows, offset = [], 0
    for record, hidden in pending:
        record |= {"shard": name, "offset": offset}
        rows.append(hidden.astype(np.float16))
        offset += len(hidden)
    tmp = folder / f"{name}.tmp"
    save_file({"hidden": np.concatenate(rows)}, str(tmp))
    os.replace(tmp, folder / f"{name}.safetensors")
    with open(work / SEQUENCES, "a") as sink:
        for record, _ in pending:
            sink.write(json.dumps(record) + "\n")
            done[_record_key(record, 0)] = record


# ----------------------------------------------------------------------------- stage 2: cache


def _labels(ids: list[int], start: int, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labelled positions P of one sequence (from the prompt's last token), head targets [P, n]
    and the next token [P] (the base model's own choice, the root the heads will see)."""
    tokens = torch.tensor(ids)
    first = max(start - 1, 0)  # position whose next token is the first label
    positions = torch.arange(first, len(ids) - 1)  # (P,)
    offsets = positions[:, None] + torch.arange(2, num_heads + 2)[None, :]  # (P, n): head k guesses k+1 past the next
    targets = torch.where(offsets < len(ids), tokens[offsets.clamp(max=len(ids) - 1)], IGNORE)
    return positions, targets, tokens[positions + 1]


@torch.no_grad()
def _forward_hidden(base, ids: list[int], head_layer: int | None) -> torch.Tensor:
    out = base.model.model(torch.tensor(ids)[None], output_hidden_states=head_layer is not None)
    return (out.last_hidden_state[0] if head_layer is None else out.hidden_states[head_layer + 1][0]).float()  # (L, H)


def _recorded_hidden(base, sequences: list[Sample], config: TrainConfig) -> list[torch.Tensor] | None:
    """Per sequence its recorded hidden states [P, H] (float16), when every sequence has them and
    they are the heads' input of ``config`` (checked against one forward pass: another head layer
    or an int8 engine differ); else None."""
    if not sequences or any(s.shard is None for s in sequences):
        return None
    from safetensors.numpy import load_file

    shards: dict[str, torch.Tensor] = {}
    parts = []
    for s in sequences:
        if s.shard not in shards:
            file = config.workdir / HIDDEN / f"{s.shard}.safetensors"
            if not file.is_file():
                log.warning("%s is missing: computing the hidden states again", file)
                return None
            shards[s.shard] = torch.from_numpy(load_file(str(file))["hidden"])
        parts.append(shards[s.shard][s.offset : s.offset + len(s.ids) - max(s.start - 1, 0) - 1])
    probe = sequences[0]
    want = _forward_hidden(base, probe.ids, config.head_layer)[max(probe.start - 1, 0) : len(probe.ids) - 1]
    err = float((parts[0].float() - want).norm() / want.norm().clamp(min=1e-12))
    if parts[0].shape != want.shape or err > 1e-2:
        log.warning("the recorded hidden states are not the heads' input of this configuration (relative difference %.3g): "
                    "computing them again", err)
        return None
    return parts


@torch.no_grad()
def cache_hidden(base, sequences: list[Sample], config: TrainConfig) -> dict[str, torch.Tensor]:
    """Hidden states at labelled positions [N, H] with targets [N, n], the next token [N] and a
    sequence id [N]: the states recorded while generating where there are, else a forward pass
    per sequence (saved in the work folder)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    key = _sha256(json.dumps(["next", data_fingerprint(base, config), config.head_layer, config.num_heads, sequences]).encode())
    target_parts, next_parts, seq_parts = [], [], []
    for s, sample in enumerate(sequences):
        positions, targets, nxt = _labels(sample.ids, sample.start, config.num_heads)
        target_parts.append(targets)
        next_parts.append(nxt)
        seq_parts.append(torch.full((len(positions),), s))
    labels = {"targets": torch.cat(target_parts), "next": torch.cat(next_parts), "sequence": torch.cat(seq_parts)}
    recorded = _recorded_hidden(base, sequences, config)
    if recorded is not None:
        return {"hidden": torch.cat(recorded).float()} | labels  # (N, H) float32, as the forward pass gives
    file = config.workdir / CACHE
    if file.is_file():
        with safe_open(str(file), "pt") as f:
            stored = (f.metadata() or {}).get("key")
        if stored == key:
            return load_file(str(file))
        log.info("%s was computed for other sequences, head layer or heads: computing it again", file)
    hidden_parts = []
    for sample in tqdm(sequences, desc="caching hidden states", unit="seq", disable=None):
        hidden_parts.append(_forward_hidden(base, sample.ids, config.head_layer)[max(sample.start - 1, 0) : len(sample.ids) - 1])
    cached = {"hidden": torch.cat(hidden_parts)} | labels
    file = _open_workdir(base, config) / CACHE
    tmp = file.with_suffix(".tmp")
    save_file(cached, str(tmp), metadata={"key": key})
    os.replace(tmp, file)
    return cached


# ----------------------------------------------------------------------------- stage 3: training


def _lr(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(total - config.warmup_steps, 1)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _split(cached: dict[str, torch.Tensor], config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Train / holdout position indices, split by whole sequences (seeded)."""
    count = int(cached["sequence"].max()) + 1
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed))
    held = order[: int(round(count * config.holdout))] if count > 1 else order[:0]
    is_held = torch.isin(cached["sequence"], held)
    return torch.nonzero(~is_held).squeeze(1), torch.nonzero(is_held).squeeze(1)


def teacher_path(heads: MedusaHeads, targets: torch.Tensor) -> torch.Tensor | None:
    """The path sequential heads read in training (teacher forcing): the base model's own tokens
    at depths 1..n-1, targets [P, n] -> [P, n-1] (IGNORE past a sequence's end read as id 0:
    every head below such a token has no label); None for heads that read no path."""
    if not heads.config.reads_path:
        return None
    return targets[:, : heads.config.num_heads - 1].clamp(min=0)


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, top_k: int = 5, chunk: int = 512,
                  next_ids: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Top-1 and top-k accuracy per head on (hidden [N, H], targets [N, n]); ``next_ids`` [N]
    (the next token at each position) for heads that read it."""
    n = targets.shape[1]
    hits1, hitsk, counts = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for i in range(0, hidden.shape[0], chunk):
        nxt = next_ids[i : i + chunk] if heads.config.reads_next else None
        t = targets[i : i + chunk]
        logits = heads(hidden[i : i + chunk].float(), nxt, teacher_path(heads, t))  # (c, n, V)
        valid = t != IGNORE
        top = logits.topk(top_k, dim=-1).indices  # (c, n, k)
        hits1 += ((top[..., 0] == t) & valid).sum(0)
        hitsk += ((top == t[..., None]).any(-1) & valid).sum(0)
        counts += valid.sum(0)
    counts = counts.clamp(min=1)
    return {"top1": (hits1 / counts).tolist(), f"top{top_k}": (hitsk / counts).tolist()}


def train_heads(base, config: TrainConfig, cached: dict[str, torch.Tensor], *, stop_after: int | None = None) -> tuple[MedusaHeads, dict]:
    """Train (or continue training) heads on cached hidden states. ``stop_after`` ends the run
    after that many optimizer steps in total, as an interruption would (tests)."""
    cfg = base.model.config
    heads_config = HeadsConfig(num_heads=config.num_heads, num_layers=config.num_layers, hidden_size=cfg.hidden_size,
                               vocab_size=cfg.vocab_size, shared_lm_head=config.shared_lm_head, head_layer=config.head_layer,
                               base_model=getattr(base, "name", ""), head_input=config.head_input)
    heads = init_heads(heads_config, base.model.lm_head, seed=config.seed, embed=base.model.get_input_embeddings())
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    train_idx, held_idx = _split(cached, config)
    steps_per_epoch = math.ceil(len(train_idx) / config.batch_size)
    total = steps_per_epoch * config.epochs
    if not len(train_idx):
        raise TrainError(f"no training positions: all {int(cached['sequence'].max()) + 1} sequences are held out; give more prompts")
    checkpoint = _open_workdir(base, config) / CHECKPOINT
    step, history = 0, []
    if checkpoint.is_file():
        if (why := _checkpoint_differences(checkpoint, config)) is not None:
            raise TrainError(f"{checkpoint} was written by another configuration ({why}): pass --restart to train "
                             "from step 0 on the same data, or another --out")
        state = torch.load(checkpoint, weights_only=False)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        log.info("resuming from step %d of %d", step, total)
    hidden, targets, next_ids = cached["hidden"], cached["targets"], cached["next"]
    heads.train()
    with tqdm(total=total, initial=step, desc="training heads", unit="step", disable=None) as bar:
        try:
            step = _steps(heads, optimizer, config, hidden, targets, next_ids, train_idx, steps_per_epoch, total, step, history, bar, stop_after)
        except KeyboardInterrupt:  # keep every finished step: the next run continues from here
            _save_checkpoint(checkpoint, heads, optimizer, step, history, config)
            raise
        _save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    heads.eval()

    metrics = {"steps": step, "total_steps": total, "loss_first": history[:5], "loss_last": history[-5:],
               "train_positions": len(train_idx), "holdout_positions": len(held_idx)}
    if len(held_idx):
        metrics["holdout"] = head_accuracy(heads, hidden[held_idx], targets[held_idx], next_ids=next_ids[held_idx])
    return heads, metrics


def _steps(heads, optimizer, config, hidden, targets, next_ids, train_idx, steps_per_epoch, total, step, history, bar, stop_after) -> int:
    """Optimizer steps from ``step`` on; the batch order depends only on (seed, epoch)."""
    checkpoint = config.workdir / CHECKPOINT
    while step < total and (stop_after is None or step < stop_after):
        epoch, offset = divmod(step, steps_per_epoch)
        order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))]
        batch = order[offset * config.batch_size : (offset + 1) * config.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = _lr(config, step, total)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            logits = heads(hidden[batch].float(), next_ids[batch] if heads.config.reads_next else None,
                           teacher_path(heads, targets[batch]))  # (P, n, V)
        loss, per_head = medusa_loss(logits, targets[batch], config.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        history.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{history[-1]:.3f}", head1=f"{float(per_head[0]):.3f}")
        if step % config.checkpoint_every == 0:
            _save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    return step


def _save_checkpoint(path: Path, heads, optimizer, step, history, config) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "history": history,
                "config": dataclasses.asdict(config)}, tmp)
    os.replace(tmp, path)


def run(base, config: TrainConfig, *, restart: bool = False, generate_only: bool = False) -> dict:
    """All stages, resuming from the work folder; writes the heads folder (with train_config.json and
    metrics.json) and returns the metrics. ``restart`` discards work-folder progress made with other
    settings instead of refusing it; ``generate_only`` stops after the sequences (data now, training later)."""
    check_inputs(config)
    check_model(base, config)
    check_workdir(base, config, restart=restart)
    torch.manual_seed(config.seed)
    try:
        sequences = build_sequences(base, config)
        if not sequences:
            raise TrainError("no training sequences: give more or longer prompts")
        if generate_only:
            return {"sequences": len(sequences), "labelled_positions": sum(len(s.ids) - max(s.start - 1, 0) - 1 for s in sequences)}
        cached = cache_hidden(base, sequences, config)
        heads, metrics = train_heads(base, config, cached)
    except BaseException:
        _drop_if_empty(config)
        raise
    metrics["sequences"] = len(sequences)
    out = Path(config.out)
    save_heads(heads, out)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
