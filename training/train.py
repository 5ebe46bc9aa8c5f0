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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads, save_heads
from medusa_trt.training.checks import check_inputs, check_model
from medusa_trt.training.config import TrainConfig, TrainError
from medusa_trt.training.data import IGNORE, build_sequences, cache_hidden, split_holdout
from medusa_trt.training.distributed import SINGLE, Cluster
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


def medusa_loss(
    head_logits: torch.Tensor, targets: torch.Tensor, decay: float, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits [P, n, V], targets int64 [P, n] (IGNORE where absent).

    Returns (sum_k decay^k * CE_k, per-head CE [n]); k is 1-based and CE_k is the mean over the
    positions that have a target for head k (0 for a head with none). ``counts`` [n]: the positions
    with a target per head in the whole batch, when these P rows are one rank's share of it (each
    rank's CE_k is then its part of the batch's sum)."""
    P, n, V = head_logits.shape
    # one cross-entropy over the flattened (position, head) rows: indexing the valid rows of each
    # head instead copies the logits and scatters their gradient back (half the step's time)
    losses = F.cross_entropy(head_logits.reshape(P * n, V).float(), targets.reshape(P * n), ignore_index=IGNORE, reduction="none").view(
        P, n
    )  # (P, n), 0 where the target is absent
    if counts is None:
        counts = (targets != IGNORE).sum(0)
    counts = counts.clamp(min=1)  # (n,)
    per_head = losses.sum(0) / counts  # (n,)
    weights = decay ** torch.arange(1, n + 1, dtype=per_head.dtype, device=per_head.device)  # (n,)
    return (weights * per_head).sum(), per_head.detach()


def learning_rate(config, step: int, total: int) -> float:
    """Linear warm-up over ``config.warmup_steps``, then a cosine down to 0 at ``total`` (the heads' and the drafter's)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(total - config.warmup_steps, 1)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def loss_curve(history: list[float], points: int = 64) -> list[list[float]]:
    """The loss history as at most ``points`` [steps done, mean loss of the span] pairs, each span the same number of
    optimizer steps (the last one possibly fewer): the curve a report plots, whatever the run's length."""
    span = max(1, math.ceil(len(history) / points))
    spans = [history[i : i + span] for i in range(0, len(history), span)]
    return [[i * span + len(part), sum(part) / len(part)] for i, part in enumerate(spans)]


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
    n, device = targets.shape[1], next(heads.parameters()).device
    hits1, hitsk, counts = torch.zeros(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    for i in range(0, hidden.shape[0], chunk):
        nxt = next_ids[i : i + chunk].to(device) if heads.config.reads_next else None
        t = targets[i : i + chunk].to(device)
        logits = heads(hidden[i : i + chunk].to(device).float(), nxt, teacher_path(heads, t))  # (c, n, V)
        valid = t != IGNORE
        top = logits.topk(top_k, dim=-1).indices  # (c, n, k)
        hits1 += ((top[..., 0] == t) & valid).sum(0)
        hitsk += ((top == t[..., None]).any(-1) & valid).sum(0)
        counts += valid.sum(0)
    counts = counts.clamp(min=1)
    return {"top1": (hits1 / counts).tolist(), f"top{top_k}": (hitsk / counts).tolist()}  # .tolist(): a report, on the host


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
    heads = init_heads(heads_config, base.model.get_output_embeddings(), seed=config.seed, embed=base.model.get_input_embeddings())
    device = base.model.get_input_embeddings().weight.device
    return heads.to(device=device, dtype=torch.float32)  # fp32 master weights beside a bf16 / fp16 base


def _resume(checkpoint: Path, heads: MedusaHeads, optimizer, config: TrainConfig) -> tuple[int, list[float]]:
    """(step, loss history) of the checkpoint, loaded into ``heads`` and ``optimizer``; refused when
    another training configuration wrote it."""
    if (why := checkpoint_differences(checkpoint, config)) is not None:
        raise stale_checkpoint_error(checkpoint, why)
    state = torch.load(checkpoint, weights_only=False, map_location=next(heads.parameters()).device)
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["history"]


def train_heads(
    base, config: TrainConfig, cached: dict[str, torch.Tensor], *, stop_after: int | None = None, cluster: Cluster = SINGLE
) -> tuple[MedusaHeads, dict]:
    """Train (or continue training) heads on cached hidden states. ``stop_after`` ends the run
    after that many optimizer steps in total, as an interruption would (tests). Under torchrun
    every rank calls it; the heads train under DDP and rank 0 writes the checkpoints."""
    heads = _new_heads(base, config)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    train_idx, held_idx = split_holdout(cached, config)
    _, total = _schedule(config, len(train_idx))
    if not len(train_idx):
        raise TrainError(f"no training positions: all {int(cached['sequence'].max()) + 1} sequences are held out; give more prompts")
    checkpoint = config.workdir / CHECKPOINT
    if cluster.main:
        open_workdir(base, config)
    cluster.barrier()  # a checkpoint is read by every rank before any rank can write the next (a step needs them all)
    step, history = 0, []
    if checkpoint.is_file():
        step, history = _resume(checkpoint, heads, optimizer, config)
        log.info("resuming from step %d of %d", step, total)
    heads.train()
    first, started = step, time.perf_counter()
    with tqdm(total=total, initial=step, desc="training heads", unit="step", disable=None if cluster.main else True) as bar:
        try:
            step = train_steps(heads, optimizer, config, cached, train_idx, step, history, bar, stop_after, cluster=cluster)
        except KeyboardInterrupt:  # keep every finished step: the next run continues from here
            if cluster.main:
                save_checkpoint(checkpoint, heads, optimizer, len(history), history, config)
            raise
        seconds = time.perf_counter() - started  # the steps of this run, with their checkpoints
        if cluster.main:
            save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    heads.eval()

    metrics = {
        "steps": step,
        "total_steps": total,
        "loss_first": history[:5],
        "loss_last": history[-5:],
        "loss_curve": loss_curve(history),
        "train_positions": len(train_idx),
        "holdout_positions": len(held_idx),
        "positions_per_s": round((step - first) * config.batch_size / seconds, 1) if step > first else None,
    }
    if len(held_idx):
        hidden, targets, next_ids = cached["hidden"], cached["targets"], cached["next"]
        metrics["holdout"] = head_accuracy(heads, hidden[held_idx], targets[held_idx], next_ids=next_ids[held_idx])
    return heads, metrics


def _autocast(config: TrainConfig, device: torch.device):
    """The heads' matmuls: bf16 (fp16 on GPUs without it) autocast on a GPU, bf16 on the CPU with ``--bf16``."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16)


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
    *,
    cluster: Cluster = SINGLE,
) -> int:
    """Optimizer steps from ``step`` to the end of ``config.epochs`` over positions ``train_idx`` of
    ``cached`` (or to ``stop_after``), appending each loss to ``history`` and checkpointing every
    ``config.checkpoint_every`` steps; returns the step reached. The batch order depends only on (seed, epoch).

    Ranks: each step's global batch (``config.batch_size`` positions) is the same for any world size;
    rank r takes rows r, r+N, ... of it. Its loss is its part of the batch's loss times N (the
    per-head counts are the whole batch's), and DDP averages the gradients over the N ranks: the
    sum of the parts, the one-process gradient up to float reduction order."""
    hidden, targets, next_ids = cached["hidden"], cached["targets"], cached["next"]
    steps_per_epoch, total = _schedule(config, len(train_idx))
    checkpoint = config.workdir / CHECKPOINT
    device = next(heads.parameters()).device
    model = heads
    if cluster.distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(heads, device_ids=[device] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda" and not torch.cuda.is_bf16_supported())
    while step < total and (stop_after is None or step < stop_after):
        epoch, offset = divmod(step, steps_per_epoch)
        order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))]
        batch = order[offset * config.batch_size : (offset + 1) * config.batch_size]  # the global batch
        counts = (targets[batch] != IGNORE).sum(0).to(device)  # (n,) over the whole batch
        mine = batch[cluster.rank :: cluster.world]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, total)
        tgt = targets[mine].to(device)
        with _autocast(config, device):
            logits = model(
                hidden[mine].to(device).float(), next_ids[mine].to(device) if heads.config.reads_next else None, teacher_path(heads, tgt)
            )  # (P, n, V)
        loss, per_head = medusa_loss(logits, tgt, config.decay, counts)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss * cluster.world).backward()
        scaler.step(optimizer)
        scaler.update()
        step += 1
        reported = cluster.all_sum(torch.stack([loss.detach(), per_head[0]]).float())  # the batch's loss: the sum of the parts
        history.append(reported[0].item())  # .item(): the loss history is kept on the host
        bar.update()
        bar.set_postfix(loss=f"{history[-1]:.3f}", head1=f"{float(reported[1]):.3f}")
        if step % config.checkpoint_every == 0 and cluster.main:
            save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    return step


def run(
    base, config: TrainConfig, *, restart: bool = False, generate_only: bool = False, precompute: bool = False, cluster: Cluster = SINGLE
) -> dict:
    """All stages, resuming from the work folder; writes the heads folder (with train_config.json and
    metrics.json) and returns the metrics. ``restart`` discards work-folder progress made with other
    settings instead of refusing it; ``generate_only`` stops after the sequences (data now, training
    later), ``precompute`` after the hidden states too. Under torchrun every rank runs it: rank 0
    checks (and with ``restart`` clears) the work folder first and writes the heads folder last."""
    check_inputs(config)
    check_model(base, config)
    cluster.on_main(lambda: check_workdir(base, config, restart=restart))
    torch.manual_seed(config.seed)
    try:
        sequences = build_sequences(base, config, cluster)
        if not sequences:
            raise TrainError("no training sequences: give more or longer prompts")
        labelled = sum(len(s.ids) - max(s.start - 1, 0) - 1 for s in sequences)
        if generate_only:
            return {"sequences": len(sequences), "labelled_positions": labelled}
        cached = cache_hidden(base, sequences, config, cluster)
        if precompute:
            return {"sequences": len(sequences), "labelled_positions": labelled, "precomputed": True}
        heads, metrics = train_heads(base, config, cached, cluster=cluster)
    except BaseException:
        if cluster.main:
            drop_if_empty(config)
        raise
    metrics["sequences"] = len(sequences)
    metrics["world_size"] = cluster.world
    extra = {"train_config.json": json.dumps(dataclasses.asdict(config), indent=2), "metrics.json": json.dumps(metrics, indent=2)}
    cluster.on_main(lambda: save_heads(heads, Path(config.out), extra=extra))  # one folder, swapped in whole with its config and metrics
    return metrics
