"""``medusa-export``: trace base model + heads into an ONNX engine, or build a TensorRT one.

    medusa-export --model smollm2-135m --heads DIR --out build/model.onnx [--tree mc_sim_7b_63]
    medusa-export --model smollm2-135m --heads DIR --out build/engine.plan --attention plugin --dtype fp16

    medusa-export --model smollm2-135m --heads DIR --out build/smollm2     # one engine folder (config.json, ...)

With ``--out DIR`` (no .onnx / .plan suffix) everything goes into one folder (``runtime/engine_folder.py``;
``--backend tensorrt`` adds the plans to it). Otherwise it
writes model.onnx (+ .data), model.heads.onnx and model.tokenizer/ beside each other, checks them
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

from medusa_trt.cli.common import USER_ERRORS, VERBOSE_HELP, Parser, entry, fail, setup_logging
from medusa_trt.exporter.builder import BACKENDS, BuildConfig, Built, build
from medusa_trt.exporter.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from medusa_trt.exporter.quantize import MODES as QUANTIZE_MODES
from medusa_trt.runtime.contract import DEFAULT_SUCCESSORS


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="medusa-export", description="Export a Medusa model to an ONNX or TensorRT engine.")
    p.add_argument("--model", required=True, help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--heads", help="Medusa heads folder (ours or FasterDecoding/Medusa); none: plain decoding only")
    heads.add_argument("--untrained-heads", type=int, metavar="N", help="N untrained heads (identity blocks + shared lm_head)")
    p.add_argument("--head-layer", type=int, help="decoder layer whose output feeds the heads")
    p.add_argument(
        "--out",
        required=True,
        help="engine path: a folder (one folder holding everything, config.json at its top), "
        "model.onnx (ONNX Runtime) or engine.plan (TensorRT; the .onnx is written beside it)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="engine folder only: what runs it (config.json's backend); tensorrt also builds model.plan / heads.plan in it. Default: "
        "native where it runs the engine, exactly and faster than onnxruntime here (timed at export), else onnxruntime; "
        "for a file the suffix decides",
    )
    p.add_argument(
        "--step-cost",
        metavar="FILE",
        help="engine folder only: the drafting budget's verify-cost table, from a "
        "medusa-calibrate report (.report.json, its step_ms); default: the runtime's",
    )
    p.add_argument(
        "--tree",
        help="default tree of the engine: preset, chain-N or JSON file (default: the heads folder's export.json, "
        "else a chain over the heads)",
    )
    p.add_argument("--max-batch", type=int, default=BuildConfig.max_batch, help="sequences per step the engine is built and checked for")
    p.add_argument("--max-context", type=int, help="committed + new tokens per sequence (default: 1024, or the model's positions if fewer)")
    p.add_argument("--max-tokens", type=int, default=BuildConfig.max_tokens, help="most new tokens per step (tree nodes, prefill chunk)")
    p.add_argument(
        "--dtype", default=BuildConfig.dtype, choices=["fp32", "fp16", "bf16"], help="weights, KV cache and logits (bf16: .plan only)"
    )
    p.add_argument(
        "--attention",
        default=BuildConfig.attention,
        choices=["onnx", "plugin"],
        help="onnx: standard ops; plugin: one medusa_trt::TreeAttention node per layer (TensorRT plugin, CPU fallback for ONNX Runtime)",
    )
    p.add_argument(
        "--no-key-slots",
        action="store_true",
        help="append the new keys after the cache as engines before key slots did: a verify step then equals a plain "
        "step to float rounding only (default for ONNX Runtime engines: key slots, bit for bit; TensorRT: appended)",
    )
    p.add_argument(
        "--no-logits-gate",
        action="store_true",
        help="compute the lm_head on every step, as engines before the gate did (default for ONNX Runtime engines: a "
        "prompt's chunks before its last skip it; same output, docs/benchmarks.md; TensorRT: always computed)",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=BuildConfig.opset,
        help="ONNX opset of the graphs, 18 to %(default)s (the default has native attention ops)",
    )
    p.add_argument(
        "--successors",
        type=int,
        default=BuildConfig.successors,
        help=f"k of the step graph's top-k output that the recycle drafter learns from (default {DEFAULT_SUCCESSORS}; 0: none)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="the heads draft from the first N token ids only (a byte-level BPE gives its most frequent tokens the lowest "
        "ids): a smaller heads projection to read after every verify step; output unchanged (default: the heads folder's "
        "export.json, else the whole vocabulary)",
    )
    p.add_argument(
        "--quantize",
        choices=[*QUANTIZE_MODES, "none"],
        help="ONNX Runtime weight quantization: int8 = dynamic int8 on every weight matmul of the step graph (faster, output "
        "differs from fp32 and a row's output depends on its batch); heads-int8 = the heads graph only, one activation "
        "scale per row (drafts cost less, output identical to fp32, same samples solo or batched); int4 = 4-bit "
        "block-wise weights (MatMulNBits) in both graphs; int8-channel = int8 weights with one scale per output "
        "column in both graphs; int8-block = 8-bit block-wise MatMulNBits in both graphs; none = fp32 graphs. "
        "Every mode but int8 keeps drafted output identical to the engine's own plain output. Default: the heads "
        "folder's export.json, else none",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help=f"--quantize int4 / int8-block: weights per block sharing a scale, a power of two >= 16 (default {DEFAULT_BLOCK_SIZE})",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        help=f"--quantize int4 / int8-block: MatMulNBits compute type, 0 / 1 fp32 (dequantized weights), "
        f"2 fp16, 3 bf16, 4 int8 activations (default {DEFAULT_ACCURACY_LEVEL})",
    )
    p.add_argument("--timing-cache", help="TensorRT timing cache file, reused between builds (default: timing.cache beside the .plan)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checker, the ONNX Runtime vs torch comparison and (.plan) the TensorRT vs ONNX one",
    )
    p.add_argument(
        "--stream-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read the weights from the model's safetensors one tensor at a time as the engine is written, so a model "
        "larger than memory exports (fp32 or --quantize int8-channel; not checked against torch). Default: where its "
        "fp32 weights exceed half the memory available",
    )
    p.add_argument(
        "--triton-repo",
        metavar="DIR",
        help="also write a Triton model repository serving the engine (see medusa-triton-repo, medusa-serve)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def build_config(args) -> BuildConfig:
    """The ``BuildConfig`` of the command line."""
    return BuildConfig(
        model=args.model,
        out=args.out,
        heads=args.heads,
        untrained_heads=args.untrained_heads,
        head_layer=args.head_layer,
        backend=args.backend,
        step_cost=args.step_cost,
        tree=args.tree,
        max_batch=args.max_batch,
        max_context=args.max_context,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        attention=args.attention,
        key_slots=not args.no_key_slots,
        gate_logits=not args.no_logits_gate,
        opset=args.opset,
        successors=args.successors,
        draft_vocab=args.draft_vocab,
        quantize=args.quantize,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
        timing_cache=args.timing_cache,
        verify=not args.no_verify,
        stream_weights=args.stream_weights,
    )


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
        config = build_config(args)
        if args.triton_repo:  # before the export's minutes, not after
            from medusa_trt.serving.triton_repo import check_repo_path

            check_repo_path(args.triton_repo)
        built = build(config, report=_print_stage)
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    return triton_repo_option(args.triton_repo, built.engine)


def _print_stage(built: Built) -> None:
    """What medusa-export prints as each stage of ``exporter.build`` finishes."""
    if built.tensorrt is not None:
        files = built.tensorrt
        print(f"wrote {files.step}" + (f", {files.heads.name}" if files.heads.exists() else "") + f", {files.sidecar.name}")
        for comparison in built.comparisons:
            print(comparison.summary())
    elif built.onnx is not None:
        _print_onnx(built.onnx)
        if built.plan.tensorrt is not None:
            sys.stdout.flush()  # before the TensorRT build's minutes
    elif built.plan.taken:
        print(f"from {built.plan.defaults_file}: " + ", ".join(f"{k} {v}" for k, v in built.plan.taken.items()))


def _print_onnx(result) -> None:
    """The ONNX engine's files and its check against torch."""
    files = result.files
    if result.model:
        print(f"exported {result.model}")
    if files.folder is not None:
        print(
            f"wrote {files.folder}/ (config.json, {files.step.name}"
            + (f", {files.heads.name}" if files.heads.exists() else "")
            + ", tokenizer, generation_config.json, drafting.json)"
        )
        if result.backend_choice is not None:  # the backend the export chose (exporter/backend_choice.py), and why
            print(result.backend_choice.summary())
        _print_step_cost(files.folder)
    else:
        print(f"wrote {files.step}" + (f", {files.heads.name}" if files.heads.exists() else "") + f", {files.tokenizer.name}/")
    if result.diffs:
        checked = {k: v for k, v in result.diffs.items() if k not in result.loose}
        detail = ", ".join(f"{k} {v:.2e}" for k, v in result.diffs.items())
        note = f"; int8 drafts ({', '.join(result.loose)}) not held to it" if result.loose else ""
        worst = max(checked.values())
        if result.strict:
            print(f"verified against torch: max abs difference {worst:.2e} (tolerance {result.tolerance:g}{note}; {detail})")
        else:  # a lossy quantization: its error, measured, never called verified
            print(
                f"{result.precision} changes the model's numbers: max logit difference {worst:.2e} against the torch model, "
                f"the same top-1 token at {result.top1:.0%} of the checked positions ({detail}). Drafting on it "
                "still gives its own plain output token for token; its text can differ from the unquantized model's"
            )
    if result.backend is not None:
        print(
            f"engine: {result.precision}, backend {result.backend} (medusa-run --engine {files.folder} runs it; "
            "--backend onnxruntime|openvino|native picks another for one run)"
        )
    else:
        print(f"engine: {result.precision}, backend onnxruntime unless --backend says otherwise (a folder records the export's choice)")


def _print_step_cost(folder) -> None:
    """What the drafting budget will weigh trees with: the step cost drafting.json records."""
    from medusa_trt.runtime.engine_folder import read_drafting

    drafting = read_drafting(folder)
    table = drafting.get("step_cost")
    if table:
        costs = ", ".join(f"{k}: {float(v):.2f}" for k, v in sorted(table.items(), key=lambda kv: int(kv[0])))
        print(
            f"drafting budget: step cost by tokens per step {costs}; heads call {float(drafting.get('heads_cost') or 0):.2f} "
            "(relative to a one-token step, timed here)"
        )


def triton_repo_option(repo: str | None, engine: Path) -> int:
    """--triton-repo: the repository medusa-triton-repo writes, for the engine just built (replacing an older one)."""
    if repo is None:
        return 0
    try:
        from medusa_trt.serving.triton_repo import TritonRepoConfig, write_triton_repo

        folder = write_triton_repo(TritonRepoConfig(engine=engine, repo=repo, overwrite=True))
    except USER_ERRORS as exc:
        return fail("medusa-export", exc)
    print(f"wrote {folder}/config.pbtxt, {folder.name}/1/model.py: serve it with medusa-serve {repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
