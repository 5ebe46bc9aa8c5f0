"""What a head-training run is checked against before it works: the files its configuration names
(before the model loads: a bad file costs no waiting) and what it asks of the base model (right after)."""

from __future__ import annotations

from pathlib import Path

from medusa_trt.exporter.heads import check_heads_out
from medusa_trt.training.config import GENERATE_CONTEXT, TrainConfig, TrainError
from medusa_trt.training.data import read_prompts


def check_inputs(config: TrainConfig) -> None:
    """Every file the configuration names, checked before anything is loaded or written."""
    out = Path(config.out)
    if not out.parent.is_dir():
        raise TrainError(f"cannot write {out}: folder {out.parent} does not exist")
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} is a file: pass a folder path for the heads")
    check_heads_out(out)  # replaced at the end only if it holds earlier heads of ours: refused now, not after training
    if config.workdir.exists() and not config.workdir.is_dir():
        raise TrainError(f"{config.workdir} (the work folder of --out {out}) is a file: remove it or pass another --out")
    if config.generate_engine is not None and not Path(config.generate_engine).exists():
        raise TrainError(f"--generate-engine {config.generate_engine} does not exist: pass an .onnx engine exported from --model")
    if not read_prompts(config):
        raise TrainError(f"--data {config.data} holds no prompts: one per line (.txt) or one JSON object per line (.jsonl)")


def check_model(base, config: TrainConfig) -> None:
    """What the configuration asks of the base model, checked right after loading it."""
    cfg = base.model.config
    layers = getattr(cfg, "num_hidden_layers", None)
    if config.head_layer is not None and layers is not None and not config.head_layer < layers:
        raise TrainError(
            f"--head-layer {config.head_layer} is out of range: {base.name} has decoder layers 0..{layers - 1} "
            "(leave it out for the final hidden state)"
        )
    if config.follow_ups and not (config.chat_template and getattr(base, "is_chat", False)):
        raise TrainError(f"--follow-ups needs a chat model with its chat template: {base.name} has none; drop --follow-ups")
    context = min(GENERATE_CONTEXT, getattr(cfg, "max_position_embeddings", None) or GENERATE_CONTEXT)
    if not config.teacher_forced and config.new_tokens >= context:
        raise TrainError(
            f"--new-tokens {config.new_tokens} leaves no room for the prompt: {base.name} generates at most "
            f"{context} tokens per sequence; pass fewer"
        )
