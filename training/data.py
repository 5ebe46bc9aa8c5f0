"""The training data of Medusa heads: what the heads read and what they must guess.

Two stages, each resumable from what it left in the work folder (``training/workdir.py``):
  1. sequences: the base model's own greedy continuation of each prompt (labels are the model's
     tokens, not a corpus's), appended to ``sequences.jsonl`` as they finish, with the hidden states
     recorded while generating (``hidden/``); or, with ``teacher_forced``, corpus text tokenized as is;
  2. cache: the heads' input hidden state at every labelled position with its targets, computed once
     (``cache.safetensors``) where no recorded states serve, so epochs cost only the heads.

The public API (``read_prompts``, ``read_sequences``, ``Sample``, ``build_sequences``, ``cache_hidden``,
``split_holdout``) is what ``medusa-train`` and the ablation scripts share.
"""

from __future__ import annotations

import codecs
import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from medusa_trt.runtime import durable
from medusa_trt.training.config import TrainConfig, TrainError
from medusa_trt.training.workdir import (
    CACHE,
    HIDDEN,
    SEQUENCES,
    check_data,
    data_fingerprint,
    generate_engine_meta,
    open_workdir,
    short_sha256,
)

log = logging.getLogger(__name__)

IGNORE = -100  # target of a position whose future token lies past the sequence
GENERATE_CONTEXT = 1024  # prompt + continuation tokens of the self-distillation runtime (at most the model's positions)
SHARD_SEQUENCES = 64  # sequences per hidden-state shard


# ----------------------------------------------------------------------------- prompts


def read_prompts(config: TrainConfig) -> list[str]:
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
        raw = raw[len(codecs.BOM_UTF8) :]
    texts: list[str] = []
    for number, data in enumerate(raw.splitlines(), 1):  # bytes split on \n and \r only: JSON strings may hold U+2028
        if len(texts) == config.num_prompts:
            break
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TrainError(
                f"--data {path} line {number} is not UTF-8 text (byte {exc.start + 1} of the line): save the file as UTF-8"
            ) from exc
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


# ----------------------------------------------------------------------------- stage 1: sequences


class Sample(NamedTuple):
    """One training sequence: token ids (prompt + the model's continuation), the first labelled
    index, and where its recorded hidden states lie (a shard of ``hidden/``), if they were."""

    ids: list[int]
    start: int
    shard: str | None = None
    offset: int = 0  # its first row in the shard

    @classmethod
    def from_record(cls, record: dict) -> Sample:
        """The sample of one ``sequences.jsonl`` record (as ``read_sequences`` returns them)."""
        return cls(record["ids"], record["start"], record.get("shard"), record.get("offset", 0))


def _record_key(record: dict, line: int) -> tuple[str, int]:
    """("prompt", i) for a first turn, ("follow_up", j) for a second; records written before keys
    existed were one per prompt, in order."""
    if "follow_up" in record:
        return "follow_up", record["follow_up"]
    return "prompt", record.get("prompt", line - 1)


def read_sequences(work: Path) -> dict[tuple[str, int], dict]:
    """Finished records of the work folder's ``sequences.jsonl`` by key (("prompt", i) or ("follow_up", j));
    an unfinished last line (the run was killed while writing it) is cut off so that appending continues cleanly."""
    file = Path(work) / SEQUENCES
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
            raise TrainError(
                f"{file} line {number} is not a sequence record (the file is damaged): pass --restart to generate the sequences again"
            )
        done[_record_key(record, number)] = record
    if tail:
        log.warning("%s: dropping its unfinished last record (the run was stopped while writing it)", file)
        with open(file, "r+b") as f:
            f.truncate(len(raw) - len(tail))
    return done


def build_sequences(base, config: TrainConfig) -> list[Sample]:
    """The training sequences, first turns in prompt order then follow-ups; those not generated
    yet are, each appended to the work folder as it finishes (with its hidden states)."""
    check_data(base, config)
    prompts = read_prompts(config)
    tokenizer = base.tokenizer
    if config.teacher_forced:
        seqs = [Sample(tokenizer(t)["input_ids"], 1) for t in prompts]
        return [s for s in seqs if len(s.ids) > config.num_heads + 2]
    done = read_sequences(config.workdir)
    keys = [("prompt", i) for i in range(len(prompts))]
    todo = [(k, text) for k, text in zip(keys, prompts) if k not in done]
    if todo:
        _generate(base, config, todo, done)
    follow = [("follow_up", j) for j in range(config.follow_ups) if ("prompt", j) in done]  # a skipped first turn has none
    todo = [(k, _follow_up(base, done[("prompt", k[1])], prompts[k[1]], k[1])) for k in follow if k not in done]
    if todo:
        _generate(base, config, todo, done)
    return [Sample.from_record(done[k]) for k in keys + follow if k in done]


def _follow_up(base, first: dict, prompt: str, index: int) -> list[dict]:
    """The second-turn conversation on first-turn record ``first`` (messages, user last)."""
    from medusa_trt.training.prompts import follow_up_conversation

    eos = set(base.eos_token_ids)
    answer = [t for t in first["ids"][first["start"] :] if t not in eos]
    return follow_up_conversation(prompt, base.tokenizer.decode(answer, skip_special_tokens=True), index)


def _generate_runtime(base, config: TrainConfig):
    """The plain-decoding runtime that writes the continuations: ``--generate-engine``, else the torch model."""
    from medusa_trt.exporter.wrapper import MedusaModel
    from medusa_trt.runtime import MedusaRuntime

    if not config.generate_engine:
        model = MedusaModel(base, None)
        context = min(GENERATE_CONTEXT, model.max_positions or GENERATE_CONTEXT)  # a 512-position model gets 512
        return MedusaRuntime(model, tree="chain-0", max_batch=config.generate_batch, max_context=context)
    meta = generate_engine_meta(config.generate_engine)
    if (meta.vocab_size, meta.hidden_size) != (base.model.config.vocab_size, base.model.config.hidden_size):
        raise TrainError(f"--generate-engine {config.generate_engine} was exported from another model ({meta.model})")
    return MedusaRuntime(config.generate_engine, max_batch=min(config.generate_batch, meta.max_batch)).plain()


def _generate(base, config: TrainConfig, todo: list[tuple[tuple[str, int], object]], done: dict) -> None:
    """Greedy continuations of ``todo`` ((key, prompt text or conversation) pairs), written as they
    finish: every ``SHARD_SEQUENCES`` a shard of their hidden states (float16), then their records.
    Plain decoding over ``generate_batch`` rows that refill in waves: on the 2-core CPU, wide plain
    batches write more tokens per second than drafting does (101 vs 61 tokens/s at 16 rows, whose
    steps already cost 10 ms a row; drafting pays at one row)."""
    runtime = _generate_runtime(base, config)
    chat = config.chat_template and runtime.is_chat
    encode = lambda p: runtime.codec.encode(p, chat=chat) if isinstance(p, str) else runtime.codec.encode_chat(p)  # noqa: E731
    batch = [encode(p) for _, p in todo]
    room = runtime.max_context - config.new_tokens
    kept = [(k, ids) for (k, _), ids in zip(todo, batch) if len(ids) <= room]
    if len(kept) < len(todo):
        log.warning(
            "%d prompts leave no room for %d new tokens in %d positions: skipped",
            len(todo) - len(kept),
            config.new_tokens,
            runtime.max_context,
        )
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
                work = work or open_workdir(base, config)  # the work folder appears with the first finished shard
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
    with durable.staged_file(folder / f"{name}.safetensors") as tmp:
        save_file({"hidden": np.concatenate(rows)}, str(tmp))
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
    out = base.model.get_decoder()(torch.tensor(ids)[None], output_hidden_states=head_layer is not None)  # any family's decoder
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
        log.warning(
            "the recorded hidden states are not the heads' input of this configuration (relative difference %.3g): computing them again",
            err,
        )
        return None
    return parts


def _all_labels(sequences: list[Sample], num_heads: int) -> dict[str, torch.Tensor]:
    """Targets [N, n], the next token [N] and the sequence index [N] of every labelled position."""
    target_parts, next_parts, seq_parts = [], [], []
    for s, sample in enumerate(sequences):
        positions, targets, nxt = _labels(sample.ids, sample.start, num_heads)
        target_parts.append(targets)
        next_parts.append(nxt)
        seq_parts.append(torch.full((len(positions),), s))
    return {"targets": torch.cat(target_parts), "next": torch.cat(next_parts), "sequence": torch.cat(seq_parts)}


@torch.no_grad()
def cache_hidden(base, sequences: list[Sample], config: TrainConfig) -> dict[str, torch.Tensor]:
    """Hidden states at labelled positions [N, H] with targets [N, n], the next token [N] and a
    sequence id [N]: the states recorded while generating where there are, else a forward pass
    per sequence (saved in the work folder)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    key = short_sha256(json.dumps(["next", data_fingerprint(base, config), config.head_layer, config.num_heads, sequences]).encode())
    labels = _all_labels(sequences, config.num_heads)
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
    file = open_workdir(base, config) / CACHE
    with durable.staged_file(file) as tmp:
        save_file(cached, str(tmp), metadata={"key": key})
    return cached


def split_holdout(cached: dict[str, torch.Tensor], config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Train / holdout position indices of ``cached`` (``cache_hidden``), split by whole sequences (seeded)."""
    count = int(cached["sequence"].max()) + 1
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed))
    held = order[: int(round(count * config.holdout))] if count > 1 else order[:0]
    is_held = torch.isin(cached["sequence"], held)
    return torch.nonzero(~is_held).squeeze(1), torch.nonzero(is_held).squeeze(1)
