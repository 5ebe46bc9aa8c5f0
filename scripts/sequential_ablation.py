"""Ablation: next-token-aware heads vs sequential (Hydra-style) heads, on the same data and epochs.

Sequential heads (``--head-input hidden+path``): head k also reads the k - 1 tokens drafted above
its node, so at decode time they fire once per depth. Whether that pays on this machine is
decided by what they accept: this script measures it offline, on held-out sequences.

Data: the work folder of a ``medusa-train --generate-only`` run over ``--data`` prompts whose
first ``--eval-prompts`` are held out (sequences from prompts the shipped heads never saw: the
built-in pool's prompts past the 6,200 the shipped run used), the rest trained on (the first
1,200 prompts of the shipped run). About 15 min of generation and 25 min of training here:

    .venv/bin/python scripts/sequential_ablation.py --write-prompts build/seq_prompts.jsonl
    .venv/bin/medusa-export --model smollm2-135m --max-batch 32 --out build/gen2-b32.onnx
    .venv/bin/medusa-train --model smollm2-135m --out build/heads-seq --work build/seq.work --generate-engine build/gen2-b32.onnx \
        --data build/seq_prompts.jsonl --num-prompts 1954 --new-tokens 192 --generate-batch 16 --generate-only -v
    .venv/bin/python scripts/sequential_ablation.py --work build/seq.work --eval-prompts 754 \
        --epochs 1 --out docs/sequential-ablation.json

Variants, trained with the same settings, seed and batch order (4 heads, 1 block, shared
``lm_head``, bf16): ``next-aware`` and ``sequential`` from scratch; ``sequential+shipped-head1``:
head 1 copied from the shipped heads and frozen, heads 2-4 sequential (what could ship without
redoing the 1M-position run); and the shipped heads themselves, untrained here. Each is scored on
the held-out positions: top-1 / top-5 per head (sequential heads read the base model's own path,
i.e. teacher forcing: along the path a tree accepts, the drafted tokens are those) and the
tokens per step the heads alone would accept with the shipped heads template (the longest
template path matching the ranks of the true tokens, plus the bonus token) and with a top-1 chain.
Writes JSON and a PNG; variant heads are saved to ``build/seq-ablation/<variant>/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from medusa_trt.exporter.heads import HeadsConfig, init_heads, load_heads, save_heads
from medusa_trt.exporter.models import load_base_model
from medusa_trt.training.config import TrainConfig
from medusa_trt.training.data import IGNORE, Sample, cache_hidden, read_sequences
from medusa_trt.training.train import teacher_path, train_steps
from medusa_trt.training.workdir import CHECKPOINT, SEQUENCES

log = logging.getLogger("sequential_ablation")
SHIPPED = "assets/smollm2-135m-medusa"
TEMPLATE = "assets/smollm2-135m-medusa/template.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work", default="build/seq.work", help="work folder of a medusa-train --generate-only run")
    p.add_argument("--eval-prompts", type=int, default=754, help="the first N prompts' sequences are held out")
    p.add_argument("--max-train", type=int, help="train on at most this many sequences (default: all finished)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="next-aware,sequential,sequential+shipped-head1,shipped")
    p.add_argument("--out", default="docs/sequential-ablation.json")
    p.add_argument("--write-prompts", type=Path, help="only write the prompts file (held-out prompts first) and stop")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.write_prompts:
        write_prompts(args.write_prompts)
        return

    work = Path(args.work)
    records = read_sequences(work)
    keys = sorted(k for k in records if k[0] == "prompt")
    held_keys = [k for k in keys if k[1] < args.eval_prompts]
    train_keys = [k for k in keys if k[1] >= args.eval_prompts][: args.max_train]
    if not held_keys or not train_keys:
        raise SystemExit(f"sequential_ablation: {work / SEQUENCES} has {len(held_keys)} held-out and {len(train_keys)} training sequences")
    samples = [Sample.from_record(records[k]) for k in held_keys + train_keys]
    base = load_base_model(args.model)
    data = TrainConfig(
        out=str(work.with_suffix("")),
        work=str(work),
        shared_lm_head=True,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        bf16=True,
    )
    cached = cache_hidden(base, samples, data)
    is_held = cached["sequence"] < len(held_keys)
    train_idx, held_idx = torch.nonzero(~is_held).squeeze(1), torch.nonzero(is_held).squeeze(1)
    template = json.loads(Path(TEMPLATE).read_text())
    report = {
        "held_out_sequences": len(held_keys),
        "train_sequences": len(train_keys),
        "train_positions": len(train_idx),
        "held_out_positions": len(held_idx),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "template": template["name"],
        "variants": {},
    }
    for name in args.variants.split(","):
        started = time.perf_counter()
        heads, trained = _variant(name, base, cached, train_idx, data)
        heads.eval()
        scores = score(heads, cached, held_idx, template)
        report["variants"][name] = {
            "head_input": heads.config.head_input,
            "seconds": round(time.perf_counter() - started),
            **trained,
            **scores,
        }
        log.info(
            "%s: top-1 %s, template tokens/step %.3f, chain %.3f",
            name,
            [round(a, 3) for a in scores["top1"]],
            scores["template_tokens_per_step"],
            scores["chain_tokens_per_step"],
        )
        out = Path(args.out)
        out.write_text(json.dumps(report, indent=2) + "\n")  # after every variant: a stopped run keeps what it measured
    _plot(report, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


def _variant(name: str, base, cached, train_idx, data: TrainConfig) -> tuple:
    """(heads, training summary) of one variant: the shipped heads as they are, or heads trained here (and saved)."""
    embed, lm_head = base.model.get_input_embeddings(), base.model.get_output_embeddings()
    cfg = base.model.config
    if name == "shipped":
        return load_heads(SHIPPED, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=lm_head, embed=embed), {}
    head_input = "hidden+next" if name == "next-aware" else "hidden+path"
    config = HeadsConfig(
        num_heads=4,
        num_layers=1,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        shared_lm_head=True,
        base_model="smollm2-135m",
        head_input=head_input,
    )
    heads = init_heads(config, lm_head, seed=0, embed=embed)
    frozen = ()
    if name == "sequential+shipped-head1":
        shipped = load_heads(SHIPPED, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=lm_head, embed=embed)
        heads.heads[0].load_state_dict(shipped.heads[0].state_dict())
        frozen = (0,)
    trained = _train(heads, frozen, cached, train_idx, data, Path(f"build/seq-ablation/{name}.work"))
    save_heads(heads, f"build/seq-ablation/{name}")
    return heads, trained


SHIPPED_PROMPTS = 6200  # the shipped heads' run took the pool's first 6,200 (docs/training.md)


def write_prompts(path: Path, train: int = 1200) -> None:
    """The pool's prompts past the shipped run's (held out), then its first ``train`` (trained on), as JSONL."""
    from medusa_trt.training.prompts import builtin_pool, training_prompts

    pool = training_prompts(len(builtin_pool()))  # the whole pool, in the seeded order
    rows = pool[SHIPPED_PROMPTS:] + pool[:train]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in rows))
    tmp.replace(path)
    print(f"wrote {path}: {len(pool) - SHIPPED_PROMPTS} held-out prompts, then {train} to train on")


def _train(heads, frozen, cached, train_idx, data: TrainConfig, work: Path) -> dict:
    """One training run of ``heads`` (heads in ``frozen`` keep their weights), resumable in ``work``."""
    import dataclasses

    for k in frozen:
        heads.heads[k].requires_grad_(False)
    config = dataclasses.replace(data, out=str(work.with_suffix("")), work=str(work), head_input=heads.config.head_input)
    work.mkdir(parents=True, exist_ok=True)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    total, step, history = math.ceil(len(train_idx) / config.batch_size) * config.epochs, 0, []
    checkpoint = work / CHECKPOINT
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    heads.train()
    started = time.perf_counter()
    with tqdm(total=total, initial=step, desc=f"training {work.stem}", unit="step", disable=None) as bar:
        train_steps(heads, optimizer, config, cached, train_idx, step, history, bar)
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": total, "history": history}, checkpoint)
    return {"steps": total, "train_seconds": round(time.perf_counter() - started), "loss_last": history[-1]}


@torch.no_grad()
def score(heads, cached, idx, template: dict, chunk: int = 512) -> dict:
    """Top-1 / top-5 per head and heads-alone tokens per step (template, top-1 chain) on positions ``idx``."""
    top_k = int(template["top_k"])
    paths = {tuple(p) for p in template["paths"]}
    depth_max = max(len(p) for p in paths)
    ranks = []
    for i in range(0, len(idx), chunk):
        sel = idx[i : i + chunk]
        t = cached["targets"][sel]  # (c, n)
        logits = heads(
            cached["hidden"][sel].float(), cached["next"][sel] if heads.config.reads_next else None, teacher_path(heads, t)
        )  # (c, n, V)
        top = logits.topk(max(top_k, 5), dim=-1).indices  # (c, n, k)
        hit = top == t[..., None]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(t, 10**6))  # (c, n): rank of the true token
        rank[t == IGNORE] = 10**6
        ranks.append(rank.numpy())
    rank = np.concatenate(ranks)  # (N, n)
    valid = cached["targets"][idx].numpy() != IGNORE
    counts = valid.sum(0).clip(min=1)
    accepted = np.zeros(len(rank))
    for row, r in enumerate(rank):  # the longest template path whose ranks match the true tokens'
        d = 0
        while d < depth_max and tuple(int(x) for x in r[: d + 1]) in paths:
            d += 1
        accepted[row] = d
    chain = np.cumprod(rank[:, :depth_max] == 0, axis=1).sum(1)
    return {
        "top1": ((rank == 0) & valid).sum(0).__truediv__(counts).tolist(),
        "top5": ((rank < 5) & valid).sum(0).__truediv__(counts).tolist(),
        "template_tokens_per_step": float(1 + accepted.mean()),
        "chain_tokens_per_step": float(1 + chain.mean()),
    }


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, metric in zip(axes[:2], ("top1", "top5")):
        for name, v in report["variants"].items():
            heads = range(1, len(v[metric]) + 1)
            ax.plot(heads, v[metric], marker="o", label=name)
        ax.set_title(f"held-out {metric.replace('top', 'top-')}")
        ax.set_xlabel("head")
        ax.set_xticks(list(heads))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7)
    names = list(report["variants"])
    x = np.arange(len(names))
    axes[2].bar(x - 0.2, [report["variants"][n]["template_tokens_per_step"] for n in names], 0.4, label="template")
    axes[2].bar(x + 0.2, [report["variants"][n]["chain_tokens_per_step"] for n in names], 0.4, label="top-1 chain")
    axes[2].set_xticks(x, names, rotation=20, fontsize=7)
    axes[2].set_title("heads alone: tokens / step (offline)")
    axes[2].legend(fontsize=7)
    fig.suptitle(
        f"SmolLM2-135M heads: {report['train_positions']:,} training positions, {report['held_out_positions']:,} held out "
        f"(unseen prompts), {report['epochs']} epoch(s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
