"""``medusa-export``: trace base model + heads into an ONNX engine (TensorRT .plan later).

    medusa-export --model smollm2-135m --heads DIR --out build/model.onnx [--tree mc_sim_7b_63]

Writes model.onnx (+ .data), model.heads.onnx and model.tokenizer/ beside each other, checks them
against torch and prints the max abs difference. Bad input: one error line, exit status 2,
nothing left on disk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medusa_trt.cli.common import USER_ERRORS, fail, setup_logging
from medusa_trt.runtime.errors import MedusaError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="medusa-export", description="Export a Medusa model to an ONNX engine.")
    p.add_argument("--model", required=True, help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--heads", help="Medusa heads folder (ours or FasterDecoding/Medusa); none: plain decoding only")
    heads.add_argument("--untrained-heads", type=int, metavar="N", help="N untrained heads (identity blocks + shared lm_head)")
    p.add_argument("--head-layer", type=int, help="decoder layer whose output feeds the heads")
    p.add_argument("--out", required=True, help="engine path ending in .onnx")
    p.add_argument("--tree", help="default tree of the engine: preset, chain-N or JSON file")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens per step (tree nodes, prefill chunk)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"])
    p.add_argument("--opset", type=int, default=23)
    p.add_argument("--quantize", choices=["int8"], help="dynamic int8 quantization of the weight matmuls (CPU)")
    p.add_argument("--no-verify", action="store_true", help="skip the checker and the ONNX Runtime vs torch comparison")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        out = Path(args.out)
        if out.suffix == ".plan":
            raise MedusaError("TensorRT engines (.plan) are not built by this version: export --out model.onnx and run it with ONNX Runtime")
        from medusa_trt.cli.common import load_model
        from medusa_trt.exporter.onnx_export import ExportConfig, check_output_path, export_onnx

        check_output_path(out)
        config = ExportConfig(out=out, tree=args.tree, max_batch=args.max_batch, max_context=args.max_context, max_tokens=args.max_tokens,
                              dtype=args.dtype, opset=args.opset, quantize=args.quantize, verify=not args.no_verify)
        model = load_model(args.model, args.heads, args.untrained_heads, args.head_layer, device="cpu")
        result = export_onnx(model, config)
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    print(f"wrote {result.files.step}" + (f", {result.files.heads.name}" if result.files.heads.exists() else "") + f", {result.files.tokenizer.name}/")
    if result.diffs:
        worst = max(result.diffs.values())
        detail = ", ".join(f"{k} {v:.2e}" for k, v in result.diffs.items())
        print(f"verified against torch: max abs difference {worst:.2e} (tolerance {result.tolerance:g}; {detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
