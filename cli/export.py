"""``medusa-export``: trace base model + heads into an ONNX engine, or build a TensorRT one.

    medusa-export --model smollm2-135m --heads DIR --out build/model.onnx [--tree mc_sim_7b_63]
    medusa-export --model smollm2-135m --heads DIR --out build/engine.plan --attention plugin --dtype fp16

Writes model.onnx (+ .data), model.heads.onnx and model.tokenizer/ beside each other, checks them
against torch and prints the max abs difference. With ``--out engine.plan`` it writes engine.onnx
that way, then builds engine.plan, engine.heads.plan and the metadata sidecar engine.plan.json with
TensorRT; without TensorRT or a GPU it stops there with one line saying what to install (the ONNX
files stay, no .plan is written). Bad input: one error line, exit status 2, nothing left on disk.
Ctrl-C (exit 130) or SIGTERM (exit 143) removes the staging folder too; one killed outright
(SIGKILL) is removed by the next export to the same name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medusa_trt.cli.common import USER_ERRORS, entry, fail, setup_logging
from medusa_trt.runtime.contract import DEFAULT_SUCCESSORS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="medusa-export", description="Export a Medusa model to an ONNX or TensorRT engine.")
    p.add_argument("--model", required=True, help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--heads", help="Medusa heads folder (ours or FasterDecoding/Medusa); none: plain decoding only")
    heads.add_argument("--untrained-heads", type=int, metavar="N", help="N untrained heads (identity blocks + shared lm_head)")
    p.add_argument("--head-layer", type=int, help="decoder layer whose output feeds the heads")
    p.add_argument("--out", required=True, help="engine path: .onnx (ONNX Runtime) or .plan (TensorRT; the .onnx is written beside it)")
    p.add_argument("--tree", help="default tree of the engine: preset, chain-N or JSON file")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-context", type=int, help="committed + new tokens per sequence (default: 1024, or the model's positions if fewer)")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens per step (tree nodes, prefill chunk)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="weights, KV cache and logits (bf16: .plan only)")
    p.add_argument("--attention", default="onnx", choices=["onnx", "plugin"],
                   help="onnx: standard ops; plugin: one medusa_trt::TreeAttention node per layer (TensorRT plugin, CPU fallback for ONNX Runtime)")
    p.add_argument("--opset", type=int, default=23)
    p.add_argument("--successors", type=int, default=DEFAULT_SUCCESSORS,
                   help=f"k of the step graph's top-k output that the recycle drafter learns from (default {DEFAULT_SUCCESSORS}; 0: none)")
    p.add_argument("--quantize", choices=["int8", "heads-int8"],
                   help="ONNX Runtime int8: int8 = dynamic int8 on every weight matmul (faster, output differs from fp32 "
                        "and a row's output depends on its batch); heads-int8 = the heads graph only, one activation scale per row "
                        "(drafts cost less, output identical to fp32, same samples solo or batched)")
    p.add_argument("--timing-cache", help="TensorRT timing cache file, reused between builds (default: timing.cache beside the .plan)")
    p.add_argument("--no-verify", action="store_true", help="skip the checker and the ONNX Runtime vs torch comparison")
    p.add_argument("--triton-repo", metavar="DIR", help="also write a Triton model repository serving the engine (see medusa-triton-repo, medusa-serve)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@entry("medusa-export")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from medusa_trt.exporter.cancel import Cancelled, signals_unwind

    try:
        with signals_unwind():
            return _export(args)
    except Cancelled as exc:
        print(f"medusa-export: {exc.word}", file=sys.stderr)
        return exc.code


def _export(args) -> int:
    try:
        from medusa_trt.cli.common import load_model
        from medusa_trt.exporter.onnx_export import ExportConfig, ExportError, check_output_path, export_onnx
        from medusa_trt.exporter.tensorrt_build import TensorRTConfig, onnx_beside

        if args.untrained_heads is not None and args.untrained_heads < 0:
            raise ExportError(f"--untrained-heads {args.untrained_heads} is negative: pass 1 or more (0 or none: a plain engine)")

        if args.triton_repo:  # before the export's minutes, not after
            from medusa_trt.exporter.triton_repo import check_repo_path

            check_repo_path(args.triton_repo)
        out = Path(args.out)
        trt_config = TensorRTConfig(plan=out, timing_cache=args.timing_cache) if out.suffix == ".plan" else None
        onnx_out = onnx_beside(out) if trt_config else out
        if trt_config is None and args.dtype == "bf16":
            raise ExportError("--dtype bf16 is for TensorRT engines (--out *.plan): ONNX Runtime's CPU provider has no bf16 kernels; use fp32 or fp16")
        if trt_config is not None and args.quantize:
            raise ExportError(f"--quantize {args.quantize} makes ONNX Runtime's dynamic int8 graph, which TensorRT does not build: drop it for a .plan")
        check_output_path(onnx_out)
        config = ExportConfig(out=onnx_out, tree=args.tree, max_batch=args.max_batch, max_context=args.max_context, max_tokens=args.max_tokens,
                              dtype=args.dtype, opset=args.opset, quantize=args.quantize, verify=not args.no_verify, attention=args.attention,
                              successors=args.successors)
        model = load_model(args.model, args.heads, args.untrained_heads, args.head_layer, device="cpu")
        result = export_onnx(model, config)
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    print(f"wrote {result.files.step}" + (f", {result.files.heads.name}" if result.files.heads.exists() else "") + f", {result.files.tokenizer.name}/")
    if result.diffs:
        checked = {k: v for k, v in result.diffs.items() if k not in result.loose}
        detail = ", ".join(f"{k} {v:.2e}" for k, v in result.diffs.items())
        note = f"; int8 drafts ({', '.join(result.loose)}) not held to it" if result.loose else ""
        print(f"verified against torch: max abs difference {max(checked.values()):.2e} (tolerance {result.tolerance:g}{note}; {detail})")
    if trt_config is None:
        return _triton_repo(args.triton_repo, result.files.step)
    sys.stdout.flush()
    try:
        from medusa_trt.exporter.tensorrt_build import build_engines

        files = build_engines(result.files.step, trt_config)
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    print(f"wrote {files.step}" + (f", {files.heads.name}" if files.heads.exists() else "") + f", {files.sidecar.name}")
    return _triton_repo(args.triton_repo, files.step)


def _triton_repo(repo: str | None, engine: Path) -> int:
    """--triton-repo: the repository medusa-triton-repo writes, for the engine just built (replacing an older one)."""
    if repo is None:
        return 0
    try:
        from medusa_trt.exporter.triton_repo import TritonRepoConfig, write_triton_repo

        folder = write_triton_repo(TritonRepoConfig(engine=engine, repo=repo, overwrite=True))
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    print(f"wrote {folder}/config.pbtxt, {folder.name}/1/model.py: serve it with medusa-serve {repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
