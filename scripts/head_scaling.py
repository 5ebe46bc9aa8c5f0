"""How head accuracy grows with self-distillation data, on one fixed held-out set.

Reads the work folder ``medusa-train`` left for the shipped heads (``<heads>.work/cache.safetensors``,
the cached hidden states of every sequence) and its ``train_config.json``. Keeps the same held-out
sequences the shipped run held out, trains heads on a fraction of the remaining sequences (same
settings, bf16), and reports top-1/top-5 per head on the held-out positions for: those heads, the
shipped heads (all the training sequences) and, if given, older heads.

    .venv/bin/python scripts/head_scaling.py --fraction 0.25 --old build/old-heads --out docs/head-scaling.json

(``build/old-heads``: the heads shipped before, ``git show b4143e1:assets/smollm2-135m-medusa/heads.safetensors``
and ``heads.json`` into one folder.)

About 8 minutes on 2 cores for a quarter of the data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from medusa_trt.exporter.heads import load_heads
from medusa_trt.exporter.models import load_base_model
from medusa_trt.training.config import TrainConfig
from medusa_trt.training.data import split_holdout
from medusa_trt.training.train import head_accuracy, train_heads
from medusa_trt.training.workdir import CACHE

log = logging.getLogger("head_scaling")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="the base model the heads were trained on")
    p.add_argument("--heads", default="assets/smollm2-135m-medusa", help="the shipped heads folder (its .work folder must exist)")
    p.add_argument("--fraction", type=float, default=0.25, help="share of the training sequences for the smaller run")
    p.add_argument("--old", action="append", default=[], help="other heads folders to score on the same positions")
    p.add_argument("--out", default="docs/head-scaling.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    heads_dir = Path(args.heads)
    config = TrainConfig(**json.loads((heads_dir / "train_config.json").read_text()))
    cache_file = config.workdir / CACHE
    if not cache_file.is_file():
        raise SystemExit(f"head_scaling: {cache_file} missing: run docs/training.md's medusa-train command first")
    base = load_base_model(args.model)
    cached = load_file(str(cache_file))
    train_idx, held_idx = split_holdout(cached, config)  # the shipped run's split
    train_seqs = cached["sequence"][train_idx].unique()  # (S,)
    order = torch.randperm(len(train_seqs), generator=torch.Generator().manual_seed(config.seed + 1))
    chosen = train_seqs[order[: max(1, int(len(train_seqs) * args.fraction))]]
    keep = torch.isin(cached["sequence"], chosen)
    subset = {k: v[keep] for k, v in cached.items()}  # training positions only: nothing held out inside
    small = dataclasses.replace(config, out=str(Path("build") / f"heads-{args.fraction:g}"), holdout=0.0, bf16=True)
    small.workdir.mkdir(parents=True, exist_ok=True)
    heads, metrics = train_heads(base, small, subset)

    lm_head = base.model.get_output_embeddings()
    size = dict(hidden_size=base.model.config.hidden_size, vocab_size=base.model.config.vocab_size, lm_head=lm_head)
    hidden, targets = cached["hidden"][held_idx], cached["targets"][held_idx]
    report = {"held_out_positions": len(held_idx), "runs": {}}
    report["runs"][f"{args.fraction:g} of the training sequences"] = {
        "train_positions": metrics["train_positions"],
        **head_accuracy(heads, hidden, targets),
    }
    shipped_metrics = json.loads((heads_dir / "metrics.json").read_text())
    report["runs"][f"shipped ({heads_dir})"] = {
        "train_positions": shipped_metrics["train_positions"],
        **head_accuracy(load_heads(heads_dir, **size).eval(), hidden, targets),
    }
    for old in args.old:
        report["runs"][old] = head_accuracy(load_heads(old, **size).eval(), hidden, targets)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for name, run in report["runs"].items():
        print(
            f"{name}: top-1 "
            + " / ".join(f"{a:.3f}" for a in run["top1"])
            + ", top-5 "
            + " / ".join(f"{a:.3f}" for a in run["top5"])
            + (f" ({run['train_positions']} training positions)" if "train_positions" in run else "")
        )
    print(f"on {len(held_idx)} held-out positions; wrote {args.out}")


if __name__ == "__main__":
    main()
