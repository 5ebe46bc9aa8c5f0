"""``medusa-calibrate``: measure head accuracy and step latency on this machine, write the best tree.

    medusa-calibrate --engine build/model.onnx --prompts ../shared/data/spec_bench_dev.jsonl --out build/tree.json
    medusa-calibrate --model smollm2-135m --heads DIR --prompts FILE.jsonl --out build/tree.json   # torch backend

Writes the chosen tree (``{"name": "calibrated-<T>", "paths": ..., "top_k": ...}``, what
``--tree`` and ``load_tree`` read), a plot beside it (``.png``), a report (``.report.json``:
accuracy, latencies, the whole curve, the choice and the config) and the tree as a plain
``medusa_choices`` list (``.medusa_choices.json``, what TensorRT-LLM's ``--medusa_choices``
takes); each file is written whole or not at all. Bad input prints one
``medusa-calibrate: error: ...`` line and exits 2, before any engine or model loads.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from medusa_trt.bench.files import check_out
from medusa_trt.bench.prompts import read_prompts
from medusa_trt.cli.common import USER_ERRORS, VERBOSE_HELP, Parser, entry, fail, non_negative_int, positive_int, setup_logging
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger("medusa_trt.cli.calibrate")


def build_parser() -> Parser:
    from medusa_trt.training.calibrate import CalibrateConfig

    d = CalibrateConfig()
    p = Parser(prog="medusa-calibrate", description="Choose the Medusa tree with the highest expected tokens/s on this hardware.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine", help="an exported engine (folder, .onnx or .plan); it carries its heads")
    source.add_argument("--model", help="smollm2-135m, a Hugging Face folder, or a .gguf file (torch backend; needs --heads)")
    p.add_argument("--heads", help="Medusa heads folder, with --model")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (UTF-8): turns[0] is the prompt")
    p.add_argument("--out", required=True, help="tree JSON to write; the plot (.png) and report (.report.json) go beside it")
    p.add_argument("--limit", type=positive_int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens, help="greedy tokens decoded per prompt")
    p.add_argument("--max-nodes", type=positive_int, default=d.max_nodes, help="largest tree considered, root included")
    p.add_argument("--top-k", type=positive_int, default=d.top_k, help="ranks considered per head")
    p.add_argument("--context", type=non_negative_int, default=d.context, help="committed tokens the step latency is timed over")
    p.add_argument("--repeats", type=positive_int, default=d.repeats, help="timed calls per tree size (median kept)")
    p.add_argument("--threads", type=positive_int, help="intra-op threads of ONNX Runtime (--engine) or torch (--model)")
    p.add_argument("--device", help="with --model: cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def check_options(args) -> None:
    """Refuse options that do not go with the chosen backend (they would be silently ignored)."""
    if args.engine and (args.heads or args.device):
        raise MedusaError("--heads and --device go with --model; an engine carries its heads and runs on ONNX Runtime")
    if args.model and not args.heads:
        raise MedusaError("--model needs --heads: calibration measures the Medusa heads' accuracy")
    if args.device and args.device != "cpu" and args.device.partition(":")[0] != "cuda":
        raise MedusaError(f"--device {args.device}: pass cpu or cuda (cuda:N for another GPU)")


def _runtime(args):
    from medusa_trt.runtime import MedusaRuntime

    if args.engine:
        return MedusaRuntime(args.engine, max_batch=1, threads=args.threads)
    from medusa_trt.cli.common import load_model

    device = args.device or ("cuda" if _cuda_visible(default=False) else "cpu")
    if device != "cpu" and not _cuda_visible():
        raise MedusaError(f"--device {device}: torch sees no CUDA GPU here; pass --device cpu")
    model = load_model(args.model, args.heads, None, None, device)  # imports torch, or says which extra to install
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return MedusaRuntime(model, max_batch=1, device=device)


def _cuda_visible(default: bool = True) -> bool:
    try:
        import torch
    except ImportError:
        return default  # load_model says which extra to install
    return torch.cuda.is_available()


def is_engine_folder(engine: str) -> bool:
    from medusa_trt.runtime.engine import EngineFiles

    return Path(engine).is_dir() and EngineFiles.locate(engine).folder is not None


@entry("medusa-calibrate")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        out = check_out(args.out, ".json", (".png", ".report.json", ".medusa_choices.json"))  # before any measuring
        check_options(args)
        from medusa_trt.training.calibrate import CalibrateConfig, calibrate, write_calibration

        config = CalibrateConfig(
            max_nodes=args.max_nodes, top_k=args.top_k, max_new_tokens=args.max_new_tokens, context=args.context, repeats=args.repeats
        )
        sources = {"engine": args.engine, "model": args.model, "heads": args.heads, "prompts_file": str(args.prompts)}
        prompts = read_prompts(args.prompts, args.limit)  # before the engine loads
        report, acc, choice, chain = calibrate(_runtime(args), prompts, config, sources)
        written = write_calibration(out, report, acc, choice, chain)
        if args.engine and is_engine_folder(args.engine):  # the folder's drafting budget follows what was just measured
            from medusa_trt.exporter.engine_folder import record_step_cost

            written.append(record_step_cost(args.engine, {int(k): v for k, v in report["step_ms"].items()}, report["heads_ms"]))
    except USER_ERRORS as exc:
        return fail("medusa-calibrate", exc)
    chain_t = chain.num_nodes
    print(
        f"head-1 accuracy: top-1 {acc[0, 0]:.2f}, top-{acc.shape[1]} {acc[0].sum():.2f} "
        f"({report['positions']} positions, {report['prompts']} prompts)"
    )
    print(
        f"chosen tree {report['tree']['name']}: {choice.num_nodes} nodes, {choice.expected_tokens_per_step:.2f} tokens/step, "
        f"{choice.expected_tokens_per_s:.1f} tokens/s expected"
    )
    print(
        f"best chain chain-{chain_t - 1}: {chain_t} nodes, {chain.expected_tokens_per_step:.2f} tokens/step, "
        f"{chain.expected_tokens_per_s:.1f} tokens/s expected"
    )
    print("wrote " + ", ".join(str(p) for p in written))
    sys.stdout.flush()  # a closed pipe (| head) surfaces here, where entry() turns it into a quiet exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
