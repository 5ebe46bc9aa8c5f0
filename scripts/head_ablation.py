"""Ablation: Medusa heads vs next-token-aware heads on the same data, epochs and seed.

Reads the sequences and recorded hidden states that a ``medusa-train --generate-only`` run has
written so far into its work folder (it may still be running: finished shards only), trains
both kinds of heads on the same training sequences with the same settings, and scores top-1 /
top-5 per head on the same held-out sequences. Writes JSON and a PNG.

    .venv/bin/python scripts/head_ablation.py --work build/distill.work --epochs 2 --out docs/head-ablation.json

Each variant trains in a work folder of its own under ``build/ablation/`` (checkpoints: an
interrupted run continues) and is saved to ``build/ablation/<variant>/``. About 0.4 s per optimizer step of 256 positions on 2 cores (bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

from medusa_trt.exporter.heads import save_heads
from medusa_trt.exporter.models import load_base_model
from medusa_trt.training.config import TrainConfig
from medusa_trt.training.data import Sample, cache_hidden, read_sequences
from medusa_trt.training.train import train_heads
from medusa_trt.training.workdir import SEQUENCES

log = logging.getLogger("head_ablation")

VARIANTS = {"medusa": "hidden", "next-aware": "hidden+next"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work", default="build/distill.work", help="work folder of a medusa-train --generate-only run")
    p.add_argument("--max-sequences", type=int, help="use at most this many finished sequences (default: all)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--out", default="docs/head-ablation.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    work = Path(args.work)
    records = read_sequences(work)
    if not records:
        raise SystemExit(f"head_ablation: {work / SEQUENCES} holds no sequences yet")
    keys = sorted(records, key=lambda k: (k[0] != "prompt", k[1]))[: args.max_sequences]  # first turns by prompt index, then follow-ups
    samples = [Sample.from_record(records[k]) for k in keys]
    base = load_base_model(args.model)
    data = TrainConfig(
        out=str(work.with_suffix("")),
        work=str(work),
        shared_lm_head=True,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        holdout=args.holdout,
        bf16=True,
    )
    cached = cache_hidden(base, samples, data)
    report = {
        "sequences": len(samples),
        "positions": int(cached["hidden"].shape[0]),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "shared_lm_head": True,
        "layers": data.num_layers,
        "variants": {},
    }
    for name, head_input in VARIANTS.items():
        config = dataclasses.replace(data, out=f"build/ablation/{name}", work=f"build/ablation/{name}.work", head_input=head_input)
        Path(config.work).mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        heads, metrics = train_heads(base, config, cached)
        save_heads(heads, config.out)  # export it to decode with it (docs/benchmarks.md's real-decoding rows)
        report["variants"][name] = {
            "head_input": head_input,
            "seconds": round(time.perf_counter() - started),
            **metrics["holdout"],
            "train_positions": metrics["train_positions"],
            "holdout_positions": metrics["holdout_positions"],
            "loss_last": metrics["loss_last"][-1],
        }
        log.info("%s: top-1 %s", name, [round(a, 3) for a in metrics["holdout"]["top1"]])
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, metric in zip(axes, ("top1", "top5")):
        for name, v in report["variants"].items():
            heads = range(1, len(v[metric]) + 1)
            ax.plot(heads, v[metric], marker="o", label=name)
            for k, a in zip(heads, v[metric]):
                ax.annotate(f"{a:.2f}", (k, a), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_title(f"held-out {metric.replace('top', 'top-')}")
        ax.set_xlabel("head (guesses token t+1+k)")
        ax.set_xticks(list(heads))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[0].legend()
    fig.suptitle(f"SmolLM2-135M heads, same data ({report['positions']:,} positions, {report['epochs']} epochs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
