"""``medusa-train``: train Medusa heads by self-distillation with the base model frozen.

    medusa-train --model smollm2-135m --out assets/heads [--heads 4] [--layers 1] [--shared-lm-head] [--decay 0.8]

    torchrun --nproc-per-node 8 $(which medusa-train) --model DIR --out heads --teacher http://127.0.0.1:8000

Interrupt it at any time: rerun the same command and it continues from its work folder
(``<out>.work/``: generated sequences, cached hidden states, checkpoints), on any number of
processes. A rerun with settings that change the data or the training is refused, naming them;
``--restart`` discards what no longer matches instead. Under torchrun every rank runs this same
command (``training/distributed.py``).
"""

from __future__ import annotations

import sys

from medusa_trt.cli.common import USER_ERRORS, VERBOSE_HELP, Parser, entry, fail, setup_logging
from medusa_trt.training.config import TrainConfig


def build_parser() -> Parser:
    p = Parser(prog="medusa-train", description="Train Medusa heads on a frozen base model (self-distillation).")
    p.add_argument("--model", required=True, help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    p.add_argument("--out", required=True, help="heads folder to write")
    p.add_argument("--heads", type=int, default=TrainConfig.num_heads, help="number of heads")
    p.add_argument("--layers", type=int, default=TrainConfig.num_layers, help="residual blocks per head")
    p.add_argument("--shared-lm-head", action="store_true", help="project with the frozen base lm_head (small heads)")
    p.add_argument(
        "--head-input",
        default=TrainConfig.head_input,
        choices=["hidden", "hidden+next", "hidden+path"],
        help="hidden+next: next-token-aware heads, which also read the embedding of the base model's next token; "
        "hidden+path: sequential heads, head k also reads the k-1 tokens drafted above it",
    )
    p.add_argument("--head-layer", type=int, help="decoder layer feeding the heads (default: final hidden state)")
    p.add_argument("--decay", type=float, default=TrainConfig.decay, help="loss weight of head k is decay^k")
    p.add_argument("--data", help="prompts (.jsonl turns[0]/prompt/text or .txt lines); default: the built-in prompts")
    p.add_argument("--teacher-forced", action="store_true", help="--data is corpus text whose own tokens are the labels")
    p.add_argument("--num-prompts", type=int, default=TrainConfig.num_prompts, help="first-turn prompts (the built-in pool holds 6954)")
    p.add_argument(
        "--follow-ups",
        type=int,
        default=TrainConfig.follow_ups,
        help="second turns on the model's own answers to the first N prompts (a follow-up question, or a task over the answer)",
    )
    p.add_argument("--generate-engine", help="an exported .onnx engine of the same model to write the continuations (faster on CPU)")
    p.add_argument("--new-tokens", type=int, default=TrainConfig.new_tokens, help="continuation length per prompt")
    p.add_argument(
        "--generate-batch", type=int, default=TrainConfig.generate_batch, help="rows generating at once (at most the engine's --max-batch)"
    )
    p.add_argument("--epochs", type=int, default=TrainConfig.epochs, help="passes over the data (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="positions per optimizer step, over all processes")
    p.add_argument("--lr", type=float, default=TrainConfig.lr, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed, help="heads' initialization, data order and holdout split")
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every, help="optimizer steps between checkpoints")
    p.add_argument(
        "--restart",
        action="store_true",
        help="discard work-folder progress made with other settings instead of refusing "
        "(progress made with these settings is kept: resuming is exact)",
    )
    p.add_argument("--work", help="work folder (default: <out>.work): generated sequences, hidden states, checkpoints")
    p.add_argument("--generate-only", action="store_true", help="stop after generating the data (rerun without it to train)")
    p.add_argument(
        "--bf16", action="store_true", help="train the heads' matmuls in bfloat16 autocast on the CPU (faster with AVX512-BF16 or AMX)"
    )
    p.add_argument(
        "--device",
        help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu); under torchrun each process takes GPU LOCAL_RANK",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun, shard the frozen base over the GPUs (FSDP2); chosen anyway when it does not fit one GPU",
    )
    p.add_argument(
        "--teacher",
        metavar="URL",
        help="an OpenAI-compatible server of --model (vLLM, SGLang, TGI, trtllm-serve, medusa-serve; e.g. http://host:8000/v1) "
        "writes the continuations",
    )
    p.add_argument(
        "--teacher-concurrency", type=int, default=TrainConfig.teacher_concurrency, help="requests in flight to --teacher, per process"
    )
    p.add_argument("--precompute", action="store_true", help="stop after the data and its hidden states (rerun without it to train)")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


@entry("medusa-train")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    cluster, code = _train(args)
    if cluster is not None and cluster.distributed:
        cluster.leave(code)  # a torchrun rank ends here, without the interpreter's finalization (Cluster.leave)
    return code


def _train(args):
    """The command after its arguments: (the Cluster, None before it started; the exit status)."""
    cluster, ended = None, False
    try:
        import torch

        from medusa_trt.training.checks import check_inputs
        from medusa_trt.training.distributed import Cluster, load_base
        from medusa_trt.training.train import run

        config = TrainConfig(
            out=args.out,
            num_heads=args.heads,
            num_layers=args.layers,
            shared_lm_head=args.shared_lm_head,
            head_input=args.head_input,
            head_layer=args.head_layer,
            decay=args.decay,
            data=args.data,
            teacher_forced=args.teacher_forced,
            num_prompts=args.num_prompts,
            follow_ups=args.follow_ups,
            generate_batch=args.generate_batch,
            generate_engine=args.generate_engine,
            new_tokens=args.new_tokens,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            bf16=args.bf16,
            work=args.work,
            device=args.device,
            fsdp=args.fsdp,
            teacher=args.teacher,
            teacher_concurrency=args.teacher_concurrency,
        )
        check_inputs(config)  # before the model loads: a bad file costs no waiting
        cluster = Cluster.start(config.device)
        teacher = None
        if config.teacher is not None:  # before the model loads: a bad URL costs no waiting
            from medusa_trt.training.teacher import Teacher

            teacher = Teacher.connect(config.teacher, config.teacher_concurrency)
        torch.manual_seed(args.seed)
        base = load_base(args.model, config, cluster)
        if teacher is not None:
            teacher.check_tokenizer(base)
        metrics = run(base, config, restart=args.restart, generate_only=args.generate_only, precompute=args.precompute, cluster=cluster)
        ended = True
    except USER_ERRORS as exc:
        return cluster, fail("medusa-train", exc)
    finally:
        if cluster is not None:
            cluster.stop(together=ended)
    if not cluster.main:
        return cluster, 0
    if args.generate_only or args.precompute:
        what = " and their hidden states" if args.precompute else ""
        print(f"wrote {config.workdir}: {metrics['sequences']} sequences{what}, {metrics['labelled_positions']} labelled positions")
        return cluster, 0
    losses = metrics["loss_first"][:1] + metrics["loss_last"][-1:]
    loss = f", loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""
    speed = f", {metrics['positions_per_s']:.0f} positions/s" if metrics.get("positions_per_s") else ""
    print(
        f"wrote {args.out}: {metrics['sequences']} sequences, {metrics['train_positions']} positions, {metrics['steps']} steps{loss}{speed}"
    )
    held = metrics.get("holdout")
    if held:
        print("holdout top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in held["top1"]))
        print("holdout top-5 accuracy per head: " + ", ".join(f"{a:.3f}" for a in held["top5"]))
    return cluster, 0


if __name__ == "__main__":
    sys.exit(main())
