"""Medusa head training by self-distillation, base model frozen.

Stages, each resumable from what it left in the work folder ``<out>.work/`` (``training/workdir.py``):
  1. sequences: the base model's own greedy continuation of each prompt (``training/data.py``);
  2. cache: the heads' input hidden state at every labelled position (``training/data.py``);
  3. training (here): AdamW on the heads alone, loss = sum over heads k (1-based) of decay^k x
     cross-entropy of head k against the token k+1 steps ahead; checkpoints every N steps
     (``checkpoint.pt``: heads, optimizer, step) so an interrupted run continues exactly.
The data order is a function of (seed, epoch), so a resumed run gives the same heads as an
uninterrupted one. ``run`` checks the inputs (``training/checks.py``) and the work folder, then runs
the three stages and writes the heads folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads, save_heads
from medusa_trt.training.checks import check_inputs, check_model
from medusa_trt.training.config import TrainConfig, TrainError
from medusa_trt.training.data import IGNORE, build_sequences, cache_hidden, split_holdout
from medusa_trt.training.workdir import (
    CHECKPOINT,
    check_workdir,
    checkpoint_differences,
    drop_if_empty,
    open_workdir,
    save_checkpoint,
    stale_checkpoint_error,
)

log = logging.getLogger(__name__)


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits [P, n, V], targets int64 [P, n] (IGNORE where absent).

    Returns (sum_k decay^k * CE_k, per-head CE [n]); k is 1-based and CE_k is the mean over the
    positions that have a target for head k (0 for a head with none)."""
    P, n, V = head_logits.shape
    # one cross-entropy over the flattened (position, head) rows: indexing the valid rows of each
    # head instead copies the logits and scatters their gradient back (half the step's time)
    losses = F.cross_entropy(head_logits.reshape(P * n, V).float(), targets.reshape(P * n), ignore_index=IGNORE, reduction="none").view(
        P, n
    )  # (P, n), 0 where the target is absent
    counts = (targets != IGNORE).sum(0).clamp(min=1)  # (n,)
    per_head = losses.sum(0) / counts  # (n,)
    weights = decay ** torch.arange(1, n + 1, dtype=per_head.dtype, device=per_head.device)  # (n,)
    return (weights * per_head).sum(), per_head.detach()


def _lr(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(total - config.warmup_steps, 1)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _schedule(config: TrainConfig, train_positions: int) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in all) over ``train_positions`` training positions."""
    steps_per_epoch = math.ceil(train_positions / config.batch_size)
    return steps_per_epoch, steps_per_epoch * config.epochs


def teacher_path(heads: MedusaHeads, targets: torch.Tensor) -> torch.Tensor | None:
    """The path sequential heads read in training (teacher forcing): the base model's own tokens
    at depths 1..n-1, targets [P, n] -> [P, n-1] (IGNORE past a sequence's end read as id 0:
    every head below such a token has no label); None for heads that read no path."""
    if not heads.config.reads_path:
        return None
    return targets[:, : heads.config.num_heads - 1].clamp(min=0)


@torch.no_grad()
def head_accuracy(
    heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, top_k: int = 5, chunk: int = 512, next_ids: torch.Tensor | None = None
) -> dict[str, list[float]]:
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


def _new_heads(base, config: TrainConfig) -> MedusaHeads:
    cfg = base.model.config
    heads_config = HeadsConfig(
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        shared_lm_head=config.shared_lm_head,
        head_layer=config.head_layer,
        base_model=getattr(base, "name", ""),
        head_input=config.head_input,
    )
    return init_heads(heads_config, base.model.get_output_embeddings(), seed=config.seed, embed=base.model.get_input_embeddings())


def _resume(checkpoint: Path, heads: MedusaHeads, optimizer, config: TrainConfig) -> tuple[int, list[float]]:
    """(step, loss history) of the checkpoint, loaded into ``heads`` and ``optimizer``; refused when
    another training configuration wrote it."""
    if (why := checkpoint_differences(checkpoint, config)) is not None:
        raise stale_checkpoint_error(checkpoint, why)
    state = torch.load(checkpoint, weights_only=False)
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["history"]


def train_heads(base, config: TrainConfig, cached: dict[str, torch.Tensor], *, stop_after: int | None = None) -> tuple[MedusaHeads, dict]:
    """Train (or continue training) heads on cached hidden states. ``stop_after`` ends the run
    after that many optimizer steps in total, as an interruption would (tests)."""
    heads = _new_heads(base, config)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    train_idx, held_idx = split_holdout(cached, config)
    _, total = _schedule(config, len(train_idx))
    if not len(train_idx):
        raise TrainError(f"no training positions: all {int(cached['sequence'].max()) + 1} sequences are held out; give more prompts")
    checkpoint = open_workdir(base, config) / CHECKPOINT
    step, history = 0, []
    if checkpoint.is_file():
        step, history = _resume(checkpoint, heads, optimizer, config)
        log.info("resuming from step %d of %d", step, total)
    heads.train()
    with tqdm(total=total, initial=step, desc="training heads", unit="step", disable=None) as bar:
        try:
            step = train_steps(heads, optimizer, config, cached, train_idx, step, history, bar, stop_after)
        except KeyboardInterrupt:  # keep every finished step: the next run continues from here
            save_checkpoint(checkpoint, heads, optimizer, step, history, config)
            raise
        save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    heads.eval()

    metrics = {
        "steps": step,
        "total_steps": total,
        "loss_first": history[:5],
        "loss_last": history[-5:],
        "train_positions": len(train_idx),
        "holdout_positions": len(held_idx),
    }
    if len(held_idx):
        hidden, targets, next_ids = cached["hidden"], cached["targets"], cached["next"]
        metrics["holdout"] = head_accuracy(heads, hidden[held_idx], targets[held_idx], next_ids=next_ids[held_idx])
    return heads, metrics


def train_steps(
    heads: MedusaHeads,
    optimizer,
    config: TrainConfig,
    cached: dict[str, torch.Tensor],
    train_idx: torch.Tensor,
    step: int,
    history: list[float],
    bar,
    stop_after: int | None = None,
) -> int:
    """Optimizer steps from ``step`` to the end of ``config.epochs`` over positions ``train_idx`` of
    ``cached`` (or to ``stop_after``), appending each loss to ``history`` and checkpointing every
    ``config.checkpoint_every`` steps; returns the step reached. The batch order depends only on (seed, epoch)."""
    hidden, targets, next_ids = cached["hidden"], cached["targets"], cached["next"]
    steps_per_epoch, total = _schedule(config, len(train_idx))
    checkpoint = config.workdir / CHECKPOINT
    while step < total and (stop_after is None or step < stop_after):
        epoch, offset = divmod(step, steps_per_epoch)
        order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))]
        batch = order[offset * config.batch_size : (offset + 1) * config.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = _lr(config, step, total)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            logits = heads(
                hidden[batch].float(), next_ids[batch] if heads.config.reads_next else None, teacher_path(heads, targets[batch])
            )  # (P, n, V)
        loss, per_head = medusa_loss(logits, targets[batch], config.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        history.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{history[-1]:.3f}", head1=f"{float(per_head[0]):.3f}")
        if step % config.checkpoint_every == 0:
            save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    return step


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
        drop_if_empty(config)
        raise
    metrics["sequences"] = len(sequences)
    extra = {"train_config.json": json.dumps(dataclasses.asdict(config), indent=2), "metrics.json": json.dumps(metrics, indent=2)}
    save_heads(heads, Path(config.out), extra=extra)  # one folder, swapped in whole with its config and metrics
    return metrics
