"""Training an EAGLE-3-style drafter (``exporter/eagle.py``) on the self-distillation data of the Medusa heads.

    python -m medusa_trt.training.eagle --model smollm2-135m --work build/eagle/distill.work \\
        --generate-engine build/smollm2-gen16 --num-prompts 6200 --follow-ups 288 --out build/eagle/drafter

Stages, each resumable from the work folder (a killed run continues where it stopped):
1. sequences: the base model's greedy continuations of the built-in prompts (``training/data.py``'s, shared with
   ``medusa-train``: a work folder written for heads feeds a drafter too);
2. features: one forward of the base's decoder per sequence, the feeding layers' outputs (bfloat16),
   ``eagle/features-NNNNN.safetensors``, one file per ``SHARD`` sequences;
3. training: the unrolled draft steps of the training-time test (``exporter/eagle.ttt_mask``), step k fed its own
   output of step k - 1, a cross-entropy against the base's choice per step weighted ``decay ** k``; a checkpoint
   every ``checkpoint_every`` optimizer steps.

The base's choice after each position of a continuation is the next token (the sequences are its greedy output);
inside the prompt it is unknown (``argmax`` -1) and those positions only feed the others, as context.

The draft vocabulary is the ``draft_vocab`` tokens the base chooses most often on the training sequences (d2t);
a position whose choice lies outside it is left out of the loss (no draft there can be accepted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_trt.exporter.eagle import EagleConfig, EagleDrafter, base_hidden, default_layers, save_drafter, ttt_mask
from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError, fail
from medusa_trt.training.config import TrainConfig, TrainError
from medusa_trt.training.train import learning_rate

log = logging.getLogger(__name__)

SHARD = 256  # sequences per features file
FEATURES = "eagle"  # the work folder's sub-folder of features and checkpoints
CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class EagleTrainConfig:
    out: str  # the drafter folder to write
    work: str  # the work folder: sequences (shared with medusa-train) and features
    draft_vocab: int = 8192  # tokens the drafter proposes: the base's most frequent choices
    layers: tuple[int, ...] | None = None  # the base's feeding layers; None: exporter.eagle.default_layers
    steps: int = 4  # unrolled draft steps per position (the training-time test's length)
    decay: float = 0.8  # weight of step k: decay ** k
    epochs: int = 3
    batch_tokens: int = 2048  # padded positions per optimizer step (whole sequences)
    lr: float = 2e-3
    warmup_steps: int = 20
    holdout: float = 0.05  # fraction of sequences kept for the accuracy report
    seed: int = 0
    checkpoint_every: int = 25  # optimizer steps
    bf16: bool = True  # bfloat16 autocast on the CPU (AVX512-BF16 or AMX)
    max_sequences: int | None = None  # the first N sequences only (None: all)
    generate: bool = True  # False: train on the sequences the work folder holds, generate none

    def __post_init__(self):
        if self.steps < 1 or self.epochs < 1 or self.batch_tokens < 1 or self.draft_vocab < 1:
            raise TrainError("--steps, --epochs, --batch-tokens and --draft-vocab must be 1 or more")
        if not 0 < self.decay <= 1:
            raise TrainError(f"--decay {self.decay} must be in (0, 1]")


# ----------------------------------------------------------------------------- stage 2: features


def _shard_file(work: Path, index: int) -> Path:
    return work / FEATURES / f"features-{index:05d}.safetensors"


@torch.no_grad()
def cache_features(base, sequences: list, work: Path, layers: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Per sequence: ``ids`` (T,) int64, ``hidden`` (T, len(layers) H) bfloat16 and ``argmax`` (T,) int64, the
    base's choice after each position (-1 in the prompt); shards already written are read, the rest computed and
    written whole."""
    from safetensors.torch import load_file, save_file

    (work / FEATURES).mkdir(parents=True, exist_ok=True)
    groups = [sequences[i : i + SHARD] for i in range(0, len(sequences), SHARD)]
    out = []
    for g, group in enumerate(tqdm(groups, desc="base features", unit=f"{SHARD} seq", disable=None)):
        file = _shard_file(work, g)
        key = json.dumps(["choices", list(layers), [len(s.ids) for s in group], [s.start for s in group], [s.ids[:4] for s in group]])
        if file.is_file():
            stored = load_file(str(file))
            if bytes(stored["key"].tolist()).decode() == key:
                out += _split(stored)
                continue
        rows = []
        for s in group:
            hidden = base_hidden(base.model, torch.tensor([s.ids]), layers)
            rows.append({"ids": torch.tensor(s.ids), "hidden": hidden[0].to(torch.bfloat16), "argmax": choices(s.ids, s.start)})
        joined = {
            "ids": torch.cat([r["ids"] for r in rows]),
            "hidden": torch.cat([r["hidden"] for r in rows]),
            "argmax": torch.cat([r["argmax"] for r in rows]),
            "lengths": torch.tensor([len(r["ids"]) for r in rows]),
            "key": torch.tensor(list(key.encode()), dtype=torch.uint8),
        }
        with durable.staged_file(file) as tmp:
            save_file(joined, str(tmp))
        out += rows
    return out


def choices(ids: list[int], start: int) -> torch.Tensor:
    """(T,) the base's greedy choice after each position of a sequence whose continuation starts at ``start``: the
    next token from ``start - 1`` on, -1 before (the prompt, not the base's choice) and at the end."""
    out = torch.full((len(ids),), -1, dtype=torch.long)
    first = max(start - 1, 0)
    out[first : len(ids) - 1] = torch.tensor(ids[first + 1 :])
    return out


def _split(stored: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    lengths = stored["lengths"].tolist()
    return [
        {"ids": i, "hidden": h, "argmax": a}
        for i, h, a in zip(stored["ids"].split(lengths), stored["hidden"].split(lengths), stored["argmax"].split(lengths))
    ]


def draft_vocabulary(rows: list[dict[str, torch.Tensor]], vocab_size: int, size: int) -> torch.Tensor:
    """(size,) int64: the ``size`` token ids the base chooses most often over ``rows``, in id order (d2t)."""
    chosen = torch.cat([r["argmax"] for r in rows])
    counts = torch.bincount(chosen[chosen >= 0], minlength=vocab_size)
    return counts.topk(size).indices.sort().values


# ----------------------------------------------------------------------------- stage 3: training


def _batches(rows: list[dict], batch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Sequence indices grouped by length so that each batch pads to at most ``batch_tokens`` positions, shuffled."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    batches, current, longest = [], [], 0
    for i in order:
        n = len(rows[i]["ids"])
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def _pad(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (B, T), hidden (B, T, 3H) float32, argmax (B, T) and valid (B, T) bool, padded at the end."""
    T = max(len(r["ids"]) for r in rows)
    B, width = len(rows), rows[0]["hidden"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    hidden = torch.zeros(B, T, width)
    argmax = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(rows):
        n = len(r["ids"])
        ids[b, :n], hidden[b, :n], argmax[b, :n], valid[b, :n] = r["ids"], r["hidden"].float(), r["argmax"], True
    return ids, hidden, argmax, valid


def ttt_forward(drafter: EagleDrafter, ids, hidden, argmax, valid, t2d: torch.Tensor, steps: int):
    """The unrolled draft steps over a padded batch: per step k, (g (B, T, H), target draft ids (B, T), mask (B, T)
    of anchors that count). Anchor t at step k reads token ids[t + k + 1] and is scored against the base's choice
    after it, argmax[t + k + 1]; the logits are the caller's, at the anchors that count (``step_logits``)."""
    from medusa_trt.exporter.eagle import DraftKeys

    B, T = ids.shape
    features = drafter.features(hidden)
    keys = values = None
    out = []
    anchors = torch.arange(T)
    for k in range(steps):
        shift = k + 1
        tokens = torch.zeros_like(ids)
        tokens[:, : T - shift] = ids[:, shift:]
        targets = torch.zeros_like(ids)
        targets[:, : T - shift] = argmax[:, shift:]
        counts = torch.zeros_like(valid)
        counts[:, : T - shift] = valid[:, shift:]
        draft_targets = torch.where(targets >= 0, t2d[targets.clamp(min=0)], -1)
        counts &= draft_targets >= 0
        positions = (anchors + k).expand(B, T)
        cache = DraftKeys(keys, values)
        g = drafter.step(tokens, features, positions, ttt_mask(T, k), cache)
        keys = cache.new_keys if keys is None else torch.cat([keys, cache.new_keys], dim=2)
        values = cache.new_values if values is None else torch.cat([values, cache.new_values], dim=2)
        out.append((g, draft_targets.clamp(min=0), counts))
        features = g
    return out


def step_logits(drafter: EagleDrafter, g: torch.Tensor, targets: torch.Tensor, counts: torch.Tensor):
    """The logits (N, draft_vocab) and targets (N,) of the N anchors that count: the lm_head runs on those only."""
    return drafter.logits(g[counts]), targets[counts]


def ttt_loss(drafter: EagleDrafter, results, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted cross-entropy over the steps, and each step's top-1 accuracy over its counted anchors."""
    loss, accuracy = 0.0, []
    for k, (g, targets, counts) in enumerate(results):
        logits, wanted = step_logits(drafter, g, targets, counts)
        if not len(wanted):
            accuracy.append(0.0)
            continue
        loss = loss + decay**k * F.cross_entropy(logits.float(), wanted)
        accuracy.append(float((logits.argmax(-1) == wanted).float().mean()))
    return loss, accuracy


@torch.no_grad()
def evaluate(drafter: EagleDrafter, rows: list[dict], t2d: torch.Tensor, config: EagleTrainConfig) -> list[float]:
    """Top-1 accuracy per unrolled step over ``rows`` (teacher tokens, own features)."""
    right = [0.0] * config.steps
    total = [0.0] * config.steps
    for batch in _batches(rows, config.batch_tokens, torch.Generator().manual_seed(0)):
        ids, hidden, argmax, valid = _pad([rows[i] for i in batch])
        for k, (g, targets, counts) in enumerate(ttt_forward(drafter, ids, hidden, argmax, valid, t2d, config.steps)):
            logits, wanted = step_logits(drafter, g, targets, counts)
            right[k] += float((logits.argmax(-1) == wanted).sum())
            total[k] += len(wanted)
    return [round(r / max(t, 1), 4) for r, t in zip(right, total)]


def train(base, rows: list[dict], config: EagleTrainConfig, work: Path) -> tuple[EagleDrafter, dict]:
    """Train (or continue) the drafter on ``rows`` (``cache_features``); the checkpoint lives in the work folder."""
    hf = base.model.config
    layers = config.layers or default_layers(hf.num_hidden_layers)
    if config.draft_vocab > hf.vocab_size:
        raise TrainError(f"--draft-vocab {config.draft_vocab} exceeds the model's vocabulary of {hf.vocab_size}: pass at most that")
    d2t = draft_vocabulary(rows, hf.vocab_size, config.draft_vocab)
    t2d = torch.full((hf.vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    drafter = EagleDrafter(EagleConfig(hf.hidden_size, hf.vocab_size, config.draft_vocab, layers, str(base.name)), base.model)
    drafter.init_from_base(d2t)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed)).tolist()
    held = set(order[: int(round(len(rows) * config.holdout))])
    train_rows = [r for i, r in enumerate(rows) if i not in held]
    held_rows = [r for i, r in enumerate(rows) if i in held]
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    per_epoch = len(_batches(train_rows, config.batch_tokens, torch.Generator().manual_seed(0)))
    total = per_epoch * config.epochs
    checkpoint = work / FEATURES / CHECKPOINT
    step, history = 0, []
    fingerprint = json.dumps([dataclasses.asdict(config) | {"out": None, "work": None}, len(rows)], default=list)
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["fingerprint"] == fingerprint:
            drafter.load_state_dict(saved["drafter"])
            optimizer.load_state_dict(saved["optimizer"])
            step, history = saved["step"], saved["history"]
            log.info("resuming from step %d of %d", step, total)
        else:
            log.warning("%s is from other settings: starting again", checkpoint)

    def save():
        with durable.staged_file(checkpoint) as tmp:
            torch.save(
                {
                    "fingerprint": fingerprint,
                    "drafter": drafter.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "history": history,
                },
                tmp,
            )

    drafter.train()
    started, first = time.perf_counter(), step
    positions = 0
    with tqdm(total=total, initial=step, desc="training drafter", unit="step", disable=None) as bar:
        while step < total:
            epoch, offset = divmod(step, per_epoch)
            batches = _batches(train_rows, config.batch_tokens, torch.Generator().manual_seed(config.seed * 1000 + epoch))
            for batch in batches[offset:]:
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(config, step, total)
                ids, hidden, argmax, valid = _pad([train_rows[i] for i in batch])
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                    results = ttt_forward(drafter, ids, hidden, argmax, valid, t2d, config.steps)
                loss, accuracy = ttt_loss(drafter, results, config.decay)
                if torch.is_tensor(loss):  # else no anchor of the batch counts (all prompt): nothing to learn from
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    optimizer.step()
                step += 1
                positions += int(valid.sum())
                history.append(round(float(loss.detach() if torch.is_tensor(loss) else loss), 4))
                bar.update()
                bar.set_postfix(loss=f"{history[-1]:.3f}", acc0=f"{accuracy[0]:.3f}")
                if step % config.checkpoint_every == 0:
                    save()
                    log.info("step %d of %d: loss %.3f, top-1 per step %s", step, total, history[-1], [round(a, 3) for a in accuracy])
    save()
    seconds = time.perf_counter() - started
    drafter.eval()
    metrics = {
        "steps": step,
        "train_sequences": len(train_rows),
        "train_positions": sum(len(r["ids"]) for r in train_rows),
        "holdout_sequences": len(held_rows),
        "positions_per_s": round(positions / seconds, 1) if step > first else None,
        "loss_first": history[:5],
        "loss_last": history[-5:],
        "holdout_top1_per_step": evaluate(drafter, held_rows, t2d, config) if held_rows else None,
    }
    return drafter, metrics


def run(base, config: EagleTrainConfig, data: TrainConfig) -> dict:
    """Every stage; writes the drafter folder (eagle.json, eagle.safetensors, metrics.json) and returns the metrics."""
    from medusa_trt.exporter.eagle import check_drafter_out
    from medusa_trt.training.data import Sample, build_sequences, read_sequences

    check_drafter_out(config.out)  # before the work, not after it
    if config.generate:
        sequences = build_sequences(base, data)
    else:  # first turns in prompt order, then follow-ups, as build_sequences orders them
        done = read_sequences(Path(config.work))
        sequences = [Sample.from_record(done[k]) for k in sorted(done, key=lambda k: (k[0] != "prompt", k[1]))]
    if config.max_sequences:
        sequences = sequences[: config.max_sequences]
    layers = config.layers or default_layers(base.model.config.num_hidden_layers)
    rows = cache_features(base, sequences, Path(config.work), layers)
    drafter, metrics = train(base, rows, config, Path(config.work))
    save_drafter(drafter, config.out, extra={"metrics.json": json.dumps(metrics, indent=1) + "\n"})
    log.info("wrote %s: %s", config.out, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from medusa_trt.exporter.models import load_base_model

    p = argparse.ArgumentParser(prog="python -m medusa_trt.training.eagle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--generate-engine")
    p.add_argument("--num-prompts", type=int, default=6200)
    p.add_argument("--follow-ups", type=int, default=288)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--max-sequences", type=int)
    p.add_argument("--no-generate", action="store_true", help="train on the sequences the work folder holds")
    for f in ("draft_vocab", "steps", "epochs", "batch_tokens", "checkpoint_every"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(EagleTrainConfig, f))
    p.add_argument("--lr", type=float, default=EagleTrainConfig.lr)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        base = load_base_model(args.model)
        data = TrainConfig(
            out=args.out,
            work=args.work,
            num_heads=4,
            head_input="hidden+next",
            shared_lm_head=True,
            num_prompts=args.num_prompts,
            follow_ups=args.follow_ups,
            new_tokens=args.new_tokens,
            generate_engine=args.generate_engine,
        )
        config = EagleTrainConfig(
            out=args.out,
            work=args.work,
            max_sequences=args.max_sequences,
            generate=not args.no_generate,
            lr=args.lr,
            **{f: getattr(args, f) for f in ("draft_vocab", "steps", "epochs", "batch_tokens", "checkpoint_every")},
        )
        run(base, config, data)
    except MedusaError as exc:
        return fail(p.prog, exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
