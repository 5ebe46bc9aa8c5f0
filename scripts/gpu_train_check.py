"""The GPU check's training run (``make gpu-check``): medusa-train's whole CUDA path on a random model.

A random Llama (hidden 1024, 4 layers, vocabulary 8192, bfloat16 on the GPU) with a byte-level BPE
tokenizer trained here on the built-in prompts, saved as a Hugging Face folder: nothing to download,
no gguf. Then, on ``cuda``: self-distillation on the GPU (the torch runtime), the heads' input states,
and a few hundred optimizer steps of the heads (fp32 master weights, bf16 autocast), timed; prints
positions per second and writes a JSON report.

    python scripts/gpu_train_check.py --out build/gpu-check/gpu-train.json [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def random_model_folder(folder: Path, vocab: int = 8192) -> Path:
    """A random Llama with its own byte-level BPE tokenizer (trained on the built-in prompts)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from medusa_trt.training.prompts import training_prompts

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_prompts(2000), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON report to write")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to time")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=64, help="prompts generated (fewer: a quick run on the CPU)")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)

    import torch

    from medusa_trt.exporter.models import load_base_model
    from medusa_trt.training.config import TrainConfig
    from medusa_trt.training.data import build_sequences, cache_hidden
    from medusa_trt.training.distributed import Cluster, base_dtype
    from medusa_trt.training.train import train_heads

    cluster = Cluster.start(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_model_folder(Path(tmp) / "model")
        base = load_base_model(folder, dtype=base_dtype(cluster.device), device=str(cluster.device))
        batch, new_tokens, prompts = 256, args.new_tokens, args.prompts
        epochs = max(1, -(-args.steps * batch // (prompts * new_tokens)))
        config = TrainConfig(
            out=str(Path(tmp) / "heads"),
            num_prompts=prompts,
            new_tokens=new_tokens,
            generate_batch=16,
            epochs=epochs,
            batch_size=batch,
            holdout=0.0,
            checkpoint_every=100,
            device=args.device,
        )
        started = time.perf_counter()
        sequences = build_sequences(base, config, cluster)
        generated = time.perf_counter()
        cached = cache_hidden(base, sequences, config, cluster)
        torch.cuda.synchronize() if cluster.device.type == "cuda" else None
        train_start = time.perf_counter()
        heads, metrics = train_heads(base, config, cached, cluster=cluster)
        torch.cuda.synchronize() if cluster.device.type == "cuda" else None
        train_s = time.perf_counter() - train_start
    positions = metrics["steps"] * batch
    report = {
        "device": str(cluster.device),
        "gpu": torch.cuda.get_device_name(cluster.device) if cluster.device.type == "cuda" else None,
        "base_dtype": str(base.model.dtype),
        "sequences": len(sequences),
        "generate_s": round(generated - started, 2),
        "new_tokens_per_s": round(sum(len(s.ids) - s.start for s in sequences) / (generated - started), 1),
        "steps": metrics["steps"],
        "train_s": round(train_s, 2),
        "positions_per_s": round(positions / train_s, 1),
        "loss_first": metrics["loss_first"][:1],
        "loss_last": metrics["loss_last"][-1:],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        f"trained heads on {report['device']} ({report['gpu']}): {report['steps']} steps, "
        f"{report['positions_per_s']:.0f} positions/s; generation {report['new_tokens_per_s']:.0f} new tokens/s; "
        f"loss {report['loss_first']} -> {report['loss_last']}"
    )
    ok = metrics["steps"] >= args.steps and report["loss_last"] and report["loss_last"][0] < report["loss_first"][0]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
