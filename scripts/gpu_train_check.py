"""The GPU check's training runs: medusa-train's whole CUDA path, on a random model and on the real one.

Without ``--model`` (the first command, ``make gpu-check``): a random Llama (hidden 1024, 4 layers, vocabulary 8192,
bfloat16 on the GPU) with a byte-level BPE tokenizer trained here on the built-in prompts, saved as a Hugging Face
folder: nothing to download, no gguf. Then, on ``cuda``: self-distillation on the GPU (the torch runtime), the heads'
input states, and a few hundred optimizer steps of the heads (fp32 master weights, bf16 autocast), timed; prints
positions per second and writes a JSON report.

With ``--model`` (the second command, ``make gpu-compare``, after the comparison): the real model (SmolLM2's GGUF,
bfloat16 on the GPU) and heads of the shipped heads' settings (``--like``: their ``train_config.json``), trained for
``--seconds`` on the GPU, then the same steps on the same data on this machine's CPU (float32 base, bf16 autocast where
the CPU has it) for ``--cpu-steps``: positions per second on both, their ratio, the loss curve and the held-out
accuracy of each head.

    python scripts/gpu_train_check.py --out build/gpu-check/gpu-train.json [--steps 300]
    python scripts/gpu_train_check.py --model build/gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out build/gpu-check/gpu-train-real.json [--seconds 40] [--cpu-steps 8]

``--dry-run`` (with ``--model``; ``make gpu-check-dry``): the same run with the CPU standing in for the GPU, at toy
sizes, so that what runs on the GPU machine cannot fail on an import or a changed signature.
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


def distill(base, config, cluster):
    """The self-distillation data on the cluster's device: (sequences, their cached heads' inputs, seconds generating)."""
    import torch

    from medusa_trt.training.data import build_sequences, cache_hidden

    started = time.perf_counter()
    sequences = build_sequences(base, config, cluster)
    generate_s = time.perf_counter() - started
    cached = cache_hidden(base, sequences, config, cluster)
    if cluster.device.type == "cuda":
        torch.cuda.synchronize()
    return sequences, cached, generate_s


LIKE = "assets/smollm2-135m-medusa/train_config.json"  # the shipped heads' settings: the real model's run trains those
HEADS_SETTINGS = ("num_heads", "num_layers", "shared_lm_head", "head_input", "head_layer", "decay", "batch_size", "lr", "warmup_steps")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON report to write")
    p.add_argument("--steps", type=int, default=300, help="the random model's optimizer steps to time")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=None, help="prompts generated (default 64, with --model 128)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--model", help="the real model (a GGUF or a Hugging Face folder): train heads like the shipped ones")
    p.add_argument("--like", default=LIKE, help="train_config.json of the heads whose settings the real model's run takes")
    p.add_argument("--seconds", type=float, default=40.0, help="the real model: seconds of training on the device")
    p.add_argument("--cpu-steps", type=int, default=8, help="the real model: the same steps timed on the CPU")
    p.add_argument("--dry-run", action="store_true", help="with --model, no GPU: the CPU stands in for it, toy sizes")
    args = p.parse_args(argv)
    if args.model:
        return real_model(args)
    if args.dry_run:
        p.error("--dry-run is for the real model's run (--model)")
    args.prompts = args.prompts or 64

    import torch

    from medusa_trt.exporter.models import load_base_model
    from medusa_trt.training.config import TrainConfig
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
        sequences, cached, generate_s = distill(base, config, cluster)
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
        "generate_s": round(generate_s, 2),
        "new_tokens_per_s": round(sum(len(s.ids) - s.start for s in sequences) / generate_s, 1),
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


def real_model(args) -> int:
    """Heads like the shipped ones for the real model, on the device for ``--seconds``, then the same steps on the CPU."""
    import dataclasses

    import torch

    from medusa_trt.exporter.models import load_base_model
    from medusa_trt.training.config import TrainConfig
    from medusa_trt.training.distributed import SINGLE, Cluster, base_dtype
    from medusa_trt.training.train import train_heads

    if args.dry_run:
        args.device, args.prompts, args.new_tokens = "cpu", 4, 16
        args.seconds, args.cpu_steps = min(args.seconds, 5.0), min(args.cpu_steps, 2)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_train_check: error: no CUDA GPU here: run it on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    like = json.loads(Path(args.like).read_text())
    cluster = Cluster.start(args.device)
    base = load_base_model(args.model, dtype=base_dtype(cluster.device), device=str(cluster.device))
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(
            out=str(Path(tmp) / "heads"),
            **{k: like[k] for k in HEADS_SETTINGS},
            num_prompts=args.prompts or 128,
            new_tokens=args.new_tokens,
            generate_batch=16 if not args.dry_run else 4,
            epochs=20,  # more than the seconds allow: the run stops there (the cosine schedule then ends high)
            checkpoint_every=100_000,
            device=args.device,
        )
        sequences, cached, generate_s = distill(base, config, cluster)
        sync = torch.cuda.synchronize if cluster.device.type == "cuda" else lambda: None
        # a first call of a few steps gives the device's pace (its first steps warm it up); the second resumes from
        # the work folder's checkpoint and runs the steps the rest of --seconds holds, timed on their own
        deadline = time.perf_counter() + args.seconds
        _, first = train_heads(base, config, cached, stop_after=10 if not args.dry_run else 1, cluster=cluster)
        sync()
        pace = first["positions_per_s"] / config.batch_size  # steps a second
        more = max(1, int((deadline - time.perf_counter()) * pace))
        heads, metrics = train_heads(base, config, cached, stop_after=first["steps"] + more, cluster=cluster)
        sync()
        device_name = torch.cuda.get_device_name(cluster.device) if cluster.device.type == "cuda" else "cpu (dry run)"
        # the same data and settings on the CPU: float32 base, bf16 autocast where this CPU has it (as the shipped
        # heads were trained), this machine's threads
        cpu_bf16 = _cpu_bf16()
        cpu_base = base if cluster.device.type == "cpu" else load_base_model(args.model, dtype=torch.float32, device="cpu")
        cpu_config = dataclasses.replace(config, out=str(Path(tmp) / "cpu-heads"), device="cpu", bf16=cpu_bf16)
        cpu_cached = {k: v.cpu() for k, v in cached.items()}
        _, cpu = train_heads(cpu_base, cpu_config, cpu_cached, stop_after=args.cpu_steps, cluster=SINGLE)
    curve = metrics["loss_curve"]
    report = {
        "model": args.model,
        "device": str(cluster.device),
        "gpu": device_name,
        "base_dtype": str(base.model.dtype),
        "heads": {k: like[k] for k in HEADS_SETTINGS},
        "sequences": len(sequences),
        "generate_s": round(generate_s, 2),
        "new_tokens_per_s": round(sum(len(s.ids) - s.start for s in sequences) / generate_s, 1),
        "steps": metrics["steps"],
        "seconds": args.seconds,
        "positions_per_s": metrics["positions_per_s"],
        "cpu": {"steps": cpu["steps"], "positions_per_s": cpu["positions_per_s"], "bf16": cpu_bf16, "threads": torch.get_num_threads()},
        "vs_cpu": round(metrics["positions_per_s"] / cpu["positions_per_s"], 2),
        "loss_curve": curve,
        "holdout": metrics.get("holdout"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    cpu_way = f"CPU ({report['cpu']['threads']} threads{', bf16 autocast' if cpu_bf16 else ''})"
    print(
        f"heads for {Path(args.model).name} on {device_name}: {len(sequences)} sequences generated "
        f"({report['new_tokens_per_s']:.0f} new tokens/s), {metrics['steps']} steps in {args.seconds:.0f} s, "
        f"{metrics['positions_per_s']:.0f} positions/s; {cpu_way}: {cpu['positions_per_s']:.0f} positions/s "
        f"({report['vs_cpu']:.1f}x)"
    )
    shown = curve[:: max(1, len(curve) // 8)]
    shown += curve[-1:] if shown[-1] != curve[-1] else []
    print("loss by step: " + ", ".join(f"{step} {loss:.2f}" for step, loss in shown))
    if report["holdout"]:
        print("held-out top-1 per head: " + ", ".join(f"{a:.3f}" for a in report["holdout"]["top1"]))
    return 0 if len(curve) > 1 and curve[-1][1] < curve[0][1] else 1


def _cpu_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX), as oneDNN says."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
