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
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from medusa_trt.runtime import durable
from medusa_trt.training.config import GENERATE_CONTEXT, TrainConfig, TrainError
from medusa_trt.training.distributed import SINGLE, Cluster
from medusa_trt.training.workdir import (
    CACHE,
    HIDDEN,
    STATES,
    check_data,
    data_fingerprint,
    generate_engine_meta,
    open_workdir,
    sequences_file,
    sequences_files,
    short_sha256,
)

log = logging.getLogger(__name__)

IGNORE = -100  # target of a position whose future token lies past the sequence
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


def read_sequences(work: Path, *, repair: bool = True) -> dict[tuple[str, int], dict]:
    """Finished records of the work folder's sequences files (every rank's) by key (("prompt", i) or
    ("follow_up", j)); an unfinished last line (the run was killed while writing it) is cut off so that
    appending continues cleanly, or with ``repair=False`` (another rank may be appending) only skipped."""
    done = {}
    for file in sequences_files(Path(work)):
        raw = file.read_bytes()
        *lines, tail = raw.split(b"\n")  # tail: b"" when the file ends with a newline
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
        if tail and repair:
            log.warning("%s: dropping its unfinished last record (the run was stopped while writing it)", file)
            with open(file, "r+b") as f:
                f.truncate(len(raw) - len(tail))
    return done


def _read_all(config: TrainConfig, cluster: Cluster) -> dict[tuple[str, int], dict]:
    """Every rank's records, read by all ranks once every rank has finished writing: rank 0 first
    cuts off what a killed writer left unfinished (of any rank, of this world size or an earlier one)."""
    cluster.barrier()
    if cluster.main:
        read_sequences(config.workdir)
    cluster.barrier()
    return read_sequences(config.workdir, repair=False)


def build_sequences(base, config: TrainConfig, cluster: Cluster = SINGLE) -> list[Sample]:
    """The training sequences, first turns in prompt order then follow-ups; those not generated
    yet are, split over the ranks (item i to rank i mod N), each appended to the rank's own file
    as it finishes (with its hidden states). The result is the same on every rank, for any world size."""
    check_data(base, config)
    prompts = read_prompts(config)
    tokenizer = base.tokenizer
    if config.teacher_forced:
        seqs = [Sample(tokenizer(t)["input_ids"], 1) for t in prompts]
        return [s for s in seqs if len(s.ids) > config.num_heads + 2]
    done = _read_all(config, cluster)
    keys = [("prompt", i) for i in range(len(prompts))]
    todo = [(k, text) for k, text in zip(keys, prompts) if k not in done]
    if todo:
        _generate(base, config, todo[cluster.rank :: cluster.world], done, cluster)
        done = _read_all(config, cluster)
    follow = [("follow_up", j) for j in range(config.follow_ups) if ("prompt", j) in done]  # a skipped first turn has none
    todo = [k for k in follow if k not in done]
    if todo:
        mine = [(k, _follow_up(base, done[("prompt", k[1])], prompts[k[1]], k[1])) for k in todo[cluster.rank :: cluster.world]]
        _generate(base, config, mine, done, cluster)
        done = _read_all(config, cluster)
    return [Sample.from_record(done[k]) for k in keys + follow if k in done]


def _follow_up(base, first: dict, prompt: str, index: int) -> list[dict]:
    """The second-turn conversation on first-turn record ``first`` (messages, user last)."""
    from medusa_trt.training.prompts import follow_up_conversation

    eos = set(base.eos_token_ids)
    answer = [t for t in first["ids"][first["start"] :] if t not in eos]
    return follow_up_conversation(prompt, base.tokenizer.decode(answer, skip_special_tokens=True), index)


def _generate_runtime(base, config: TrainConfig, cluster: Cluster):
    """The plain-decoding runtime that writes the continuations: ``--generate-engine``, else the torch model."""
    from medusa_trt.exporter.wrapper import MedusaModel
    from medusa_trt.runtime import MedusaRuntime

    if not config.generate_engine:
        if is_sharded(base):
            raise TrainError(
                "--fsdp: the sharded base model cannot generate the continuations; write them with --teacher URL "
                "(an OpenAI-compatible server of the model) or --generate-engine, or run without --fsdp on a GPU that holds the model"
            )
        model = MedusaModel(base, None)
        context = min(GENERATE_CONTEXT, model.max_positions or GENERATE_CONTEXT)  # a 512-position model gets 512
        device = {"device": str(cluster.device)} if cluster.device.type != "cpu" else {}
        return MedusaRuntime(model, tree="chain-0", max_batch=config.generate_batch, max_context=context, **device)
    meta = generate_engine_meta(config.generate_engine)
    if (meta.vocab_size, meta.hidden_size) != (base.model.config.vocab_size, base.model.config.hidden_size):
        raise TrainError(f"--generate-engine {config.generate_engine} was exported from another model ({meta.model})")
    return MedusaRuntime(config.generate_engine, max_batch=min(config.generate_batch, meta.max_batch)).plain()


def is_sharded(base) -> bool:
    """Whether the base model's layers are sharded over the ranks (``--fsdp``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in base.model.parameters())


def _generate(base, config: TrainConfig, todo: list[tuple[tuple[str, int], object]], done: dict, cluster: Cluster = SINGLE) -> None:
    """Greedy continuations of ``todo`` ((key, prompt text or conversation) pairs: this rank's share),
    written as they finish to this rank's own sequences file. From a runtime: every ``SHARD_SEQUENCES``
    a shard of their hidden states (float16), then their records. Plain decoding over
    ``generate_batch`` rows that refill in waves: on the 2-core CPU, wide plain batches write more
    tokens per second than drafting does (101 vs 61 tokens/s at 16 rows, whose steps already cost
    10 ms a row; drafting pays at one row). From ``--teacher``: each record as it comes (no states)."""
    if not todo:
        return
    if config.teacher is not None:
        from medusa_trt.training.teacher import generate_with_teacher

        return generate_with_teacher(base, config, todo, lambda: _sink(base, config, cluster), done)
    runtime = _generate_runtime(base, config, cluster)
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
    if not kept:
        return
    sink, new_tokens, finished, started = None, 0, 0, time.perf_counter()
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
                sink = sink or _sink(base, config, cluster)  # the work folder appears with the first finished shard
                sink.write_shard(pending, done)
                pending = []
                log.info("%d of %d sequences written, %.0f new tokens/s", finished, len(kept), new_tokens / (time.perf_counter() - started))


class _Sink:
    """Where one rank writes its sequences: its own file, and hidden-state shards named by the
    records before them in that file (a shard left by a kill before its records were written is
    overwritten by the next): ``0000064`` for rank 0, ``0000064-r3`` for rank 3."""

    def __init__(self, work: Path, rank: int):
        self.work, self.rank = work, rank
        self.file = sequences_file(work, rank)
        self.count = len(self.file.read_bytes().split(b"\n")) - 1 if self.file.is_file() else 0  # finished records

    def write_records(self, records: list[dict], done: dict) -> None:
        """Append ``records`` (one line each, flushed): what is written survives any later kill."""
        with open(self.file, "a") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
                done[_record_key(record, 0)] = record
            out.flush()
            os.fsync(out.fileno())
        self.count += len(records)

    def write_shard(self, pending: list[tuple[dict, np.ndarray]], done: dict) -> None:
        """Hidden states first, then the records."""
        from safetensors.numpy import save_file

        name = f"{self.count:07d}" + (f"-r{self.rank}" if self.rank else "")
        folder = self.work / HIDDEN
        folder.mkdir(exist_ok=True)
        rows, offset = [], 0
        for record, hidden in pending:
            record |= {"shard": name, "offset": offset}
            rows.append(hidden.astype(np.float16))
            offset += len(hidden)
        with durable.staged_file(folder / f"{name}.safetensors") as tmp:
            save_file({"hidden": np.concatenate(rows)}, str(tmp))
        self.write_records([record for record, _ in pending], done)


def _sink(base, config: TrainConfig, cluster: Cluster) -> _Sink:
    return _Sink(open_workdir(base, config), cluster.rank)


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
    """The heads' input hidden states of one sequence [L, H], float32 on the CPU."""
    device = base.model.get_input_embeddings().weight.device
    out = base.model.get_decoder()(
        torch.tensor(ids, device=device)[None], output_hidden_states=head_layer is not None
    )  # any family's decoder
    return (out.last_hidden_state[0] if head_layer is None else out.hidden_states[head_layer + 1][0]).float().cpu()  # (L, H)


def _labelled(sample: Sample, hidden: torch.Tensor) -> torch.Tensor:
    """The rows of a sequence's states [L, H] at its labelled positions (the prompt's last token on)."""
    return hidden[max(sample.start - 1, 0) : len(sample.ids) - 1]


def _probe_ok(base, sample: Sample, stored: torch.Tensor, config: TrainConfig, cluster: Cluster, what: str) -> bool:
    """Whether stored states are the heads' input of ``config`` on this base, checked against one
    forward pass of ``sample`` (another head layer, model or an int8 engine differ). Every rank runs
    it (a sharded base runs its forward passes together) and all must agree."""
    want = _labelled(sample, _forward_hidden(base, sample.ids, config.head_layer))
    ok = stored.shape == want.shape
    err = float((stored.float() - want).norm() / want.norm().clamp(min=1e-12)) if ok else float("inf")
    ok = cluster.all_ok(ok and err <= 1e-2)
    if not ok:
        log.warning("the %s are not the heads' input of this configuration (relative difference %.3g): computing them again", what, err)
    return ok


def _recorded_hidden(base, sequences: list[Sample], config: TrainConfig, cluster: Cluster = SINGLE) -> list[torch.Tensor] | None:
    """Per sequence its recorded hidden states [P, H] (float16), when every sequence has them and
    they pass ``_probe_ok``; else None."""
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
    return parts if _probe_ok(base, sequences[0], parts[0], config, cluster, "recorded hidden states") else None


def _all_labels(sequences: list[Sample], num_heads: int) -> dict[str, torch.Tensor]:
    """Targets [N, n], the next token [N] and the sequence index [N] of every labelled position."""
    target_parts, next_parts, seq_parts = [], [], []
    for s, sample in enumerate(sequences):
        positions, targets, nxt = _labels(sample.ids, sample.start, num_heads)
        target_parts.append(targets)
        next_parts.append(nxt)
        seq_parts.append(torch.full((len(positions),), s))
    return {"targets": torch.cat(target_parts), "next": torch.cat(next_parts), "sequence": torch.cat(seq_parts)}


def _state_dtype(base) -> torch.dtype:
    """Stored hidden states: bfloat16 from a bfloat16 base (its range), else float16."""
    return torch.bfloat16 if base.model.dtype == torch.bfloat16 else torch.float16


@torch.no_grad()
def cache_hidden(base, sequences: list[Sample], config: TrainConfig, cluster: Cluster = SINGLE) -> dict[str, torch.Tensor]:
    """Hidden states at labelled positions [N, H] (float32) with targets [N, n], the next token [N] and a
    sequence id [N]: the states recorded while generating where there are, else a forward pass per
    sequence on this rank's device, written in shards (``states/<key>-<group>.safetensors``, float16
    or bfloat16, one per ``SHARD_SEQUENCES`` sequences, group g by rank g mod N). Shards are named by
    the data, not the ranks: a run of any world size reuses those finished, and every shard is checked
    against the base (``_probe_ok``) before reuse."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    key = short_sha256(json.dumps(["next", data_fingerprint(base, config), config.head_layer, config.num_heads, sequences]).encode())
    labels = _all_labels(sequences, config.num_heads)
    recorded = _recorded_hidden(base, sequences, config, cluster)
    if recorded is not None:
        return {"hidden": torch.cat(recorded).float()} | labels  # (N, H) float32, as the forward pass gives
    file = config.workdir / CACHE  # written by earlier versions
    if file.is_file():
        with safe_open(str(file), "pt") as f:
            stored = (f.metadata() or {}).get("key")
        if stored == key:
            return load_file(str(file))
    groups = [sequences[i : i + SHARD_SEQUENCES] for i in range(0, len(sequences), SHARD_SEQUENCES)]
    files = [config.workdir / STATES / f"{key}-{g:07d}.safetensors" for g in range(len(groups))]
    cluster.barrier()
    if files[0].is_file() and not _probe_ok(
        base, sequences[0], _labelled(sequences[0], _stored(files[0])), config, cluster, "stored states"
    ):
        cluster.barrier()
        if cluster.main:
            for f in files:
                f.unlink(missing_ok=True)
        cluster.barrier()
    todo = [g for g in range(len(groups)) if not files[g].is_file()]  # the same on every rank: read after a barrier
    mine = todo[cluster.rank :: cluster.world]
    passes = [sum(len(groups[g]) for g in todo[r :: cluster.world]) for r in range(cluster.world)]  # forward passes per rank
    if todo:
        open_workdir(base, config)
        (config.workdir / STATES).mkdir(exist_ok=True)
    for g in tqdm(mine, desc="caching hidden states", unit=f"{SHARD_SEQUENCES} seq", disable=None):
        group = groups[g]
        rows = [_labelled(s, _forward_hidden(base, s.ids, config.head_layer)) for s in group]
        with durable.staged_file(files[g]) as tmp:
            save_file({"hidden": torch.cat(rows).to(_state_dtype(base))}, str(tmp), metadata={"key": key})
    if is_sharded(base):  # every rank's forward passes run together: a rank with fewer runs one-token ones
        for _ in range(max(passes) - passes[cluster.rank]):
            _forward_hidden(base, sequences[0].ids[:1], config.head_layer)
    cluster.barrier()
    hidden = torch.cat([_stored(f) for f in files]).float()
    return {"hidden": hidden} | labels


def _stored(file: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(file))["hidden"]


def split_holdout(cached: dict[str, torch.Tensor], config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Train / holdout position indices of ``cached`` (``cache_hidden``), split by whole sequences (seeded)."""
    count = int(cached["sequence"].max()) + 1
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed))
    held = order[: int(round(count * config.holdout))] if count > 1 else order[:0]
    is_held = torch.isin(cached["sequence"], held)
    return torch.nonzero(~is_held).squeeze(1), torch.nonzero(is_held).squeeze(1)
