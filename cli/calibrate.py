"""``medusa-calibrate``: measure head accuracy and step latency on this machine, write the best tree.

    medusa-calibrate --engine build/model.onnx --prompts ../shared/data/spec_bench_dev.jsonl --out build/tree.json
    medusa-calibrate --model smollm2-135m --heads DIR --prompts FILE.jsonl --out build/tree.json   # torch backend

Writes the chosen tree (``{"name": "calibrated-<T>", "paths": ..., "top_k": ...}``, what
``--tree`` and ``load_tree`` read), a plot beside it (``.png``) and a report (``.report.json``:
accuracy, latencies, the whole curve, the choice and the config). Bad input prints one
``medusa-calibrate: error: ...`` line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from medusa_trt.cli.common import USER_ERRORS, fail, setup_logging
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger("medusa_trt.cli.calibrate")

def build_parser() -> argparse.ArgumentParser:
    from medusa_trt.training.calibrate import CalibrateConfig

    d = CalibrateConfig()
    p = argparse.ArgumentParser(prog="medusa-calibrate", description="Choose the Medusa tree with the highest expected tokens/s on this hardware.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine", help="an exported .onnx engine; it carries its heads (ONNX Runtime)")
    source.add_argument("--model", help="smollm2-135m, a Hugging Face folder, or a .gguf file (torch backend; needs --heads)")
    p.add_argument("--heads", help="Medusa heads folder, with --model")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL: turns[0] is the prompt")
    p.add_argument("--out", required=True, help="tree JSON to write; the plot (.png) and report (.report.json) go beside it")
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="greedy tokens decoded per prompt")
    p.add_argument("--max-nodes", type=int, default=d.max_nodes, help="largest tree considered, root included")
    p.add_argument("--top-k", type=int, default=d.top_k, help="ranks considered per head")
    p.add_argument("--context", type=int, default=d.context, help="committed tokens the step latency is timed over")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls per tree size (median kept)")
    p.add_argument("--threads", type=int, help="intra-op threads for ONNX Runtime")
    p.add_argument("--device", help="torch backend: cpu or cuda (default: cpu)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _runtime(args):
    from medusa_trt.runtime import MedusaRuntime

    if args.engine:
        if args.heads or args.device:
            raise MedusaError("--heads and --device go with --model; an engine carries its heads and runs on ONNX Runtime")
        return MedusaRuntime(args.engine, max_batch=1, threads=args.threads)
    if not args.heads:
        raise MedusaError("--model needs --heads: calibration measures the Medusa heads' accuracy")
    from medusa_trt.cli.common import load_model

    device = args.device or "cpu"
    return MedusaRuntime(load_model(args.model, args.heads, None, None, device), max_batch=1, device=device)


def calibrate(args):
    """Measure and choose; returns (report dict, acc, choice, best chain). Writes nothing."""
    from medusa_trt.cli.bench import read_prompts
    from medusa_trt.runtime.tree import compile_tree
    from medusa_trt.training import calibrate as cal

    if args.limit is not None and args.limit < 1:
        raise MedusaError(f"--limit must be >= 1, got {args.limit}")
    config = cal.CalibrateConfig(max_nodes=args.max_nodes, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                                 context=args.context, repeats=args.repeats)
    prompts = read_prompts(args.prompts, args.limit)
    runtime = _runtime(args).with_tree("chain-0")  # plain decoding; the heads still propose every step
    if not runtime.num_heads:
        raise cal.CalibrationError("the engine has no Medusa heads, so there is no tree to calibrate: export it with --heads")
    top_k = min(config.top_k, cal.engine_top_k(runtime))
    if top_k < config.top_k:
        log.warning("the engine's heads return top-%d proposals only: calibrating over %d ranks (export with a wider "
                    "tree such as mc_sim_7b_63 for more)", top_k, top_k)
    max_nodes = min(config.max_nodes, runtime.backend.max_tokens or config.max_nodes, runtime.max_context - 1)
    if max_nodes < config.max_nodes:
        log.warning("the engine takes at most %d tokens per step: trees up to %d nodes", max_nodes, max_nodes)
    sizes = cal.step_sizes(max_nodes)
    context = max(min(config.context, runtime.max_context - sizes[-1]), 0)
    if context < config.context:
        log.warning("max_context %d: timing steps over %d context tokens instead of %d", runtime.max_context, context, config.context)

    ids = [runtime.codec.encode(p, chat=runtime.is_chat) for p in prompts]
    hits = cal.measure_head_hits(runtime, ids, config.max_new_tokens, top_k)
    acc = cal.head_accuracy(hits, top_k)
    step_ms = cal.measure_step_ms(runtime, sizes, context=context, repeats=config.repeats)
    heads_ms = cal.measure_heads_ms(runtime, top_k, config.repeats)
    choice = cal.pick_tree(acc, step_ms, max_nodes, heads_ms)
    chain = cal.best_chain(acc, step_ms, max_nodes, heads_ms)
    tree = compile_tree([list(p) for p in choice.paths], max_depth=runtime.num_heads, name=f"calibrated-{choice.num_nodes}")
    report = {
        "engine": args.engine, "model": args.model, "heads": args.heads, "backend": runtime.backend.name,
        "prompts_file": str(args.prompts), "prompts": len(prompts), "positions": int(hits.shape[0]),
        "config": dataclasses.asdict(config) | {"top_k_used": top_k, "max_nodes_used": max_nodes, "context_used": context},
        "acc": acc.tolist(), "step_ms": {str(k): v for k, v in step_ms.items()}, "heads_ms": heads_ms,
        "tree": json.loads(tree.to_json()), "choice": choice.to_dict(), "best_chain": chain.to_dict(),
    }
    return report, acc, choice, chain


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader never sees half a file


def _plot(acc, choice, chain, path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("matplotlib not installed: no plot (pip install matplotlib)")
        return
    from medusa_trt.training.calibrate import plot_calibration

    plot_calibration(acc, choice, path, chain=chain)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        out = Path(args.out)
        if not out.parent.is_dir():
            raise MedusaError(f"cannot write {out}: folder {out.parent} does not exist")
        if out.suffix != ".json":
            raise MedusaError(f"--out {out} must end in .json")
        report, acc, choice, chain = calibrate(args)
        plot_path, report_path = out.with_suffix(".png"), out.with_suffix(".report.json")
        _write(out, json.dumps(report["tree"]))
        _write(report_path, json.dumps(report, indent=2))
        _plot(acc, choice, chain, plot_path)
    except USER_ERRORS as exc:
        return fail("medusa-calibrate", exc)
    chain_t = chain.num_nodes
    print(f"head-1 accuracy: top-1 {acc[0, 0]:.2f}, top-{acc.shape[1]} {acc[0].sum():.2f} "
          f"({report['positions']} positions, {report['prompts']} prompts)")
    print(f"chosen tree {report['tree']['name']}: {choice.num_nodes} nodes, {choice.expected_tokens_per_step:.2f} tokens/step, "
          f"{choice.expected_tokens_per_s:.1f} tokens/s expected")
    print(f"best chain chain-{chain_t - 1}: {chain_t} nodes, {chain.expected_tokens_per_step:.2f} tokens/step, "
          f"{chain.expected_tokens_per_s:.1f} tokens/s expected")
    print(f"wrote {out}, {plot_path} and {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
