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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads, save_heads
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

IGNORE = -100  # target of a position whose future token lies past the sequence


class TrainError(MedusaError):
    """Training cannot run as configured."""


@dataclass(frozen=True)
class TrainConfig:
    out: str  # heads folder to write (ours: heads.json + heads.safetensors)
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # project with the frozen base lm_head (a few MB of heads) instead of own projections
    head_layer: int | None = None  # decoder layer feeding the heads; None: final hidden state
    decay: float = 0.8  # weight of head k is decay^k: far heads matter less and are harder
    data: str | None = None  # prompts file (.jsonl with turns[0]/prompt/text, or .txt, one per line); None: built-in prompts
    teacher_forced: bool = False  # data is corpus text whose own tokens are the labels (no generation)
    num_prompts: int = 400  # built-in prompts used (or the first N of --data)
    new_tokens: int = 128  # continuation length per prompt
    chat_template: bool = True  # wrap prompts in the model's chat template when it has one
    generate_batch: int = 8
    generate_engine: str | None = None  # an exported .onnx engine of the same base model: faster self-distillation on CPU
    epochs: int = 3
    batch_size: int = 256  # positions per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    holdout: float = 0.05  # fraction of sequences kept for the accuracy report
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps
    bf16: bool = False  # heads' matmuls in bfloat16 autocast (about 2x faster on CPUs with AVX512-BF16/AMX); loss in fp32

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise TrainError("--heads and --layers must be >= 1")
        if not 0.0 < self.decay <= 1.0:
            raise TrainError(f"--decay {self.decay} must be in (0, 1]")

    @property
    def workdir(self) -> Path:
        return Path(str(self.out) + ".work")


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits [P, n, V], targets int64 [P, n] (IGNORE where absent).

    Returns (sum_k decay^k * CE_k, per-head CE [n]); k is 1-based and CE_k is the mean over the
    positions that have a target for head k (0 for a head with none)."""
    n = head_logits.shape[1]
    per_head = []
    for k in range(n):
        valid = targets[:, k] != IGNORE
        if valid.any():
            per_head.append(F.cross_entropy(head_logits[valid, k].float(), targets[valid, k]))
        else:
            per_head.append(head_logits.sum() * 0.0)
    per_head = torch.stack(per_head)  # (n,)
    weights = decay ** torch.arange(1, n + 1, dtype=per_head.dtype, device=per_head.device)  # (n,)
    return (weights * per_head).sum(), per_head.detach()


# ----------------------------------------------------------------------------- stage 1: sequences


def _read_prompts(config: TrainConfig) -> list[str]:
    if config.data is None:
        from medusa_trt.training.prompts import training_prompts

        return training_prompts(config.num_prompts, config.seed)
    path = Path(config.data)
    if not path.is_file():
        raise TrainError(f"--data {path} does not exist")
    if "spec_bench" in path.name:
        raise TrainError(f"{path} is the evaluation set: train on other prompts (Spec-Bench is kept for evaluation)")
    texts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            record = json.loads(line)
            texts.append(record["turns"][0] if "turns" in record else record.get("prompt") or record["text"])
        else:
            texts.append(line)
    return texts[: config.num_prompts]


def build_sequences(base, config: TrainConfig) -> list[tuple[list[int], int]]:
    """(token ids, first labelled index) per sequence, appended to the work folder as they finish."""
    work = config.workdir
    work.mkdir(parents=True, exist_ok=True)
    file = work / "sequences.jsonl"
    done = [json.loads(line) for line in file.read_text().splitlines()] if file.is_file() else []
    prompts = _read_prompts(config)
    tokenizer = base.tokenizer
    if config.teacher_forced:
        seqs = [(tokenizer(t)["input_ids"], 1) for t in prompts]
        return [(ids, start) for ids, start in seqs if len(ids) > config.num_heads + 2]
    from medusa_trt.exporter.wrapper import MedusaModel
    from medusa_trt.runtime import MedusaRuntime

    if config.generate_engine:
        runtime = MedusaRuntime(config.generate_engine, tree="chain-0")
        meta = runtime.backend.meta
        if (meta.vocab_size, meta.hidden_size) != (base.model.config.vocab_size, base.model.config.hidden_size):
            raise TrainError(f"--generate-engine {config.generate_engine} was exported from another model ({meta.model})")
    else:
        runtime = MedusaRuntime(MedusaModel(base, None), tree="chain-0", max_batch=config.generate_batch, max_context=1024)
    step = runtime.max_batch
    chat = config.chat_template and runtime.is_chat
    todo = prompts[len(done):]
    with open(file, "a") as sink, tqdm(total=len(prompts), initial=len(done), desc="self-distillation", unit="prompt", disable=None) as bar:
        for i in range(0, len(todo), step):
            batch = [runtime.codec.encode(p, chat=chat) for p in todo[i : i + step]]
            for ids, result in zip(batch, runtime.generate(batch, max_new_tokens=config.new_tokens)):
                record = {"ids": ids + result.token_ids, "start": len(ids)}
                sink.write(json.dumps(record) + "\n")
                done.append(record)
            sink.flush()
            bar.update(len(batch))
    return [(r["ids"], r["start"]) for r in done]


# ----------------------------------------------------------------------------- stage 2: cache


@torch.no_grad()
def cache_hidden(base, sequences: list[tuple[list[int], int]], config: TrainConfig) -> dict[str, torch.Tensor]:
    """Hidden states at labelled positions [N, H] with targets [N, n] and a sequence id [N]."""
    from safetensors.torch import load_file, save_file

    file = config.workdir / "cache.safetensors"
    if file.is_file():
        cached = load_file(str(file))
        if cached["targets"].shape[1] == config.num_heads and int(cached["sequence"].max()) + 1 == len(sequences):
            return cached
    model = base.model
    hidden_parts, target_parts, seq_parts = [], [], []
    for s, (ids, start) in enumerate(tqdm(sequences, desc="caching hidden states", unit="seq", disable=None)):
        tokens = torch.tensor(ids)
        out = model.model(tokens[None], output_hidden_states=config.head_layer is not None)
        hidden = out.last_hidden_state[0] if config.head_layer is None else out.hidden_states[config.head_layer + 1][0]
        first = max(start - 1, 0)  # position whose next token is the first label
        positions = torch.arange(first, len(ids) - 1)  # (P,)
        offsets = positions[:, None] + torch.arange(2, config.num_heads + 2)[None, :]  # (P, n): head k guesses k+1 past the next
        targets = torch.where(offsets < len(ids), tokens[offsets.clamp(max=len(ids) - 1)], IGNORE)
        hidden_parts.append(hidden[positions].float())
        target_parts.append(targets)
        seq_parts.append(torch.full((len(positions),), s))
    cached = {"hidden": torch.cat(hidden_parts), "targets": torch.cat(target_parts), "sequence": torch.cat(seq_parts)}
    tmp = file.with_suffix(".tmp")
    save_file(cached, str(tmp))
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


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, top_k: int = 5, chunk: int = 512) -> dict[str, list[float]]:
    """Top-1 and top-k accuracy per head on (hidden [N, H], targets [N, n])."""
    n = targets.shape[1]
    hits1, hitsk, counts = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for i in range(0, hidden.shape[0], chunk):
        logits = heads(hidden[i : i + chunk])  # (c, n, V)
        t = targets[i : i + chunk]
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
                               base_model=getattr(base, "name", ""))
    heads = init_heads(heads_config, base.model.lm_head, seed=config.seed)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    train_idx, held_idx = _split(cached, config)
    steps_per_epoch = math.ceil(len(train_idx) / config.batch_size)
    total = steps_per_epoch * config.epochs
    checkpoint = config.workdir / "checkpoint.pt"
    step, history = 0, []
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != dataclasses.asdict(config):
            raise TrainError(f"{checkpoint} was written by another configuration: delete {config.workdir} to start over")
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        log.info("resuming from step %d of %d", step, total)
    hidden, targets = cached["hidden"], cached["targets"]
    heads.train()
    with tqdm(total=total, initial=step, desc="training heads", unit="step", disable=None) as bar:
        try:
            step = _steps(heads, optimizer, config, hidden, targets, train_idx, steps_per_epoch, total, step, history, bar, stop_after)
        except KeyboardInterrupt:  # keep every finished step: the next run continues from here
            _save_checkpoint(checkpoint, heads, optimizer, step, history, config)
            raise
        _save_checkpoint(checkpoint, heads, optimizer, step, history, config)
    heads.eval()

    metrics = {"steps": step, "total_steps": total, "loss_first": history[:5], "loss_last": history[-5:],
               "train_positions": len(train_idx), "holdout_positions": len(held_idx)}
    if len(held_idx):
        metrics["holdout"] = head_accuracy(heads, hidden[held_idx], targets[held_idx])
    return heads, metrics


def _steps(heads, optimizer, config, hidden, targets, train_idx, steps_per_epoch, total, step, history, bar, stop_after) -> int:
    """Optimizer steps from ``step`` on; the batch order depends only on (seed, epoch)."""
    checkpoint = config.workdir / "checkpoint.pt"
    while step < total and (stop_after is None or step < stop_after):
        epoch, offset = divmod(step, steps_per_epoch)
        order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))]
        batch = order[offset * config.batch_size : (offset + 1) * config.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = _lr(config, step, total)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            logits = heads(hidden[batch])  # (P, n, V)
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


def run(base, config: TrainConfig) -> dict:
    """All stages; writes the heads folder (with train_config.json and metrics.json) and returns the metrics."""
    out = Path(config.out)
    if not out.parent.is_dir():
        raise TrainError(f"cannot write {out}: folder {out.parent} does not exist")
    torch.manual_seed(config.seed)
    sequences = build_sequences(base, config)
    if not sequences:
        raise TrainError("no training sequences: give more or longer prompts")
    cached = cache_hidden(base, sequences, config)
    heads, metrics = train_heads(base, config, cached)
    metrics["sequences"] = len(sequences)
    save_heads(heads, out)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
