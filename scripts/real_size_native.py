"""The native step on models of real size (a benchmark, not a test): random weights of real shapes, exported as plain
engines (no heads) for native in fp32, int8-channel and int4, then each engine's one- and eight-token steps side by
side with its own memory floor (``engine_step_ab.py --floor``: its packed weights read once at the bandwidth measured
in the same run).

    .venv/bin/python scripts/real_size_native.py --shape llama-1b --shape qwen-0.5b --root build/real-size export
    .venv/bin/python scripts/real_size_native.py --shape llama-1b --shape qwen-0.5b --root build/real-size time \\
        --out docs/results/real-size-native.json

``export`` saves each shape once as a safetensors folder with the stories260K tokenizer (its model vocabulary is the
shape's; only a step's timing is measured, never text) and exports ``SHAPE/fp32/model.onnx`` (``--no-verify``: a 1B
model's verification would hold a second copy), then quantizes copies of it; folders that exist are reused.
``time`` runs engine_step_ab.py on each shape's engines, native, in one process each.

A 7B-class shape (``llama-7b``) does not fit this machine's memory in fp32 (27 GB): its checkpoint is written a shard
at a time in bf16 and exported with ``--stream-weights`` (``exporter/streamed.py``) as int8-channel and int4, in a child
process, then opened on native in another; each child's peak memory beside the engine's weights goes to
``SHAPE/memory.json``:

    .venv/bin/python scripts/real_size_native.py --shape llama-7b export
    .venv/bin/python scripts/real_size_native.py --shape llama-7b time --rounds 3 --out docs/results/real-size-7b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from medusa_trt.exporter.external_data import data_path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"

COMMON = dict(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
SHAPES = {  # transformers config overrides: the public checkpoints' shapes
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0)),  # Llama-3.2-1B
    "qwen-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, use_sliding_window=False)),  # Qwen2.5-0.5B
    "qwen-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, use_sliding_window=False)),  # Qwen2.5-1.5B
    # routed experts: Qwen3-30B-A3B's router (128 experts, 8 a token) over 4 of its 48 layers, at half its hidden size
    # and expert width (the whole model's 30B parameters do not fit this machine's memory in fp32)
    "qwen3-moe-mini": ("qwen3_moe", dict(vocab_size=151936, hidden_size=1024, moe_intermediate_size=384, intermediate_size=3072,
                                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "pythia-1b": ("gpt_neox", dict(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=8, rotary_pct=0.25, tie_word_embeddings=False)),  # Pythia-1B (GPT-NeoX)
    # gpt-oss-20b's router (32 experts, 4 a token), attention (64-wide heads, 8 q heads a kv head, sinks, 128-token windows
    # every other layer, YaRN) and vocabulary over 4 of its 24 layers, at hidden 1024 (its 2880 does not fit in fp32)
    "gpt-oss-mini": ("gpt_oss", dict(vocab_size=201088, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                                     num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False,
                                     layer_types=["sliding_attention", "full_attention"] * 2)),
    # Llama-2-7B: its fp32 weights (27 GB) exceed this machine's memory, so its checkpoint is written a shard at a time
    # (bf16, as published) and exported streamed (exporter/streamed.py), int8-channel only
    "llama-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)),
}  # fmt: skip
MODES = ("fp32", "int8-channel", "int4")
STREAMED = {"llama-7b": ("int8-channel", "int4")}  # shapes exported streamed: their modes
SHARD_BYTES = 2 << 30  # a streamed shape's checkpoint shards (bf16)
MAX_CONTEXT = 512

log = logging.getLogger("real_size_native")


def make_model(folder: Path, shape: str) -> None:
    """Random weights of ``shape`` (initializer range 0.02, norms and biases perturbed) saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_trt.exporter import load_base_model

    if (folder / "config.json").is_file():
        log.info("%s exists: reused", folder)
        return
    model_type, overrides = SHAPES[shape]
    if shape in STREAMED:
        write_streamed(folder, AutoConfig.for_model(model_type, **(COMMON | overrides)))
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(COMMON | overrides)))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder, max_shard_size="1GB")
    load_base_model(STORIES).tokenizer.save_pretrained(folder)
    log.info("%s: %.2fB parameters", shape, sum(p.numel() for p in model.parameters()) / 1e9)


def write_streamed(folder: Path, config) -> None:
    """Random bf16 weights of ``config`` written shard by shard (never the whole model in memory): the names and shapes
    of the model built weightless, matrices N(0, 0.02), norms 1 + N(0, 0.1); then the index, config and tokenizer."""
    import torch
    from safetensors.torch import save_file

    from medusa_trt.exporter import load_base_model
    from medusa_trt.exporter.models import _weightless

    model = _weightless(config, torch.bfloat16, {})
    params = dict(model.named_parameters())  # a tied weight once
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, total = {}, {}, 0, 0
    for i, (name, p) in enumerate(params.items()):
        values = torch.randn(p.shape, generator=generator) * (0.1 if p.ndim == 1 else 0.02) + (1.0 if p.ndim == 1 else 0.0)
        shard[name] = values.to(torch.bfloat16)
        size += shard[name].nbytes
        if size >= SHARD_BYTES or i == len(params) - 1:
            file = f"part-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            total += size
            log.info("%s: %s written (%.1f GB)", folder, file, size / 1e9)
            shard, size = {}, 0
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(folder)
    load_base_model(STORIES).tokenizer.save_pretrained(folder)
    log.info("%s: %.2fB parameters", folder, sum(p.numel() for p in params.values()) / 1e9)


def export(root: Path, shape: str) -> None:
    from medusa_trt.cli.export import main as export_main
    from medusa_trt.exporter.quantize import QuantizeConfig, quantize_engine
    from medusa_trt.runtime.engine import EngineFiles, read_meta
    from medusa_trt.runtime.manifest import write_manifest

    model = root / shape / "model"
    make_model(model, shape)
    if shape in STREAMED:
        export_streamed(root, shape)
        return
    fp32 = root / shape / "fp32" / "model.onnx"
    if not fp32.is_file():
        fp32.parent.mkdir(parents=True, exist_ok=True)
        argv = ["--model", str(model), "--out", str(fp32), "--max-batch", "1", "--max-context", str(MAX_CONTEXT), "--no-verify"]
        if export_main(argv) != 0:
            raise SystemExit(f"export of {shape} failed")
    for mode in MODES[1:]:
        folder = root / shape / mode
        if (folder / "model.onnx").is_file():
            continue
        shutil.copytree(fp32.parent, folder)
        files = EngineFiles.locate(folder / "model.onnx")
        meta = dataclasses.replace(read_meta(files.step), quantization=mode)
        quantize_engine(files, meta, QuantizeConfig(mode))
        write_manifest(files)
        log.info("%s %s written", shape, mode)


def _peak(argv: list[str]) -> int:
    """Run ``argv`` (a child process); its peak resident memory in bytes, or SystemExit where it fails."""
    child = subprocess.Popen(argv)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({child.returncode})")
    return usage.ru_maxrss * 1024


LOAD = (  # a child process: open the engine on native (its buffers allocated) and step it once
    "import sys; from pathlib import Path; import numpy as np; "
    "from medusa_trt.runtime.backends.native_backend import open_native; "
    "b = open_native(Path(sys.argv[1]), max_batch=1, threads=int(sys.argv[2])); "
    "print(b.kernel.describe(), flush=True)"
)


def export_streamed(root: Path, shape: str) -> None:
    """Each of the shape's STREAMED modes exported with --stream-weights in a child process, then opened on native
    in another; the weights' bytes and each child's peak memory go to SHAPE/memory.json."""
    record = root / shape / "memory.json"
    memory = json.loads(record.read_text()) if record.is_file() else {}  # an export reused keeps its measured peak
    for mode in STREAMED[shape]:
        out = root / shape / mode / "model.onnx"
        if out.is_file():
            log.info("%s exists: reused (its export's memory is not measured again)", out)
            export_peak = None
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            argv = ["--model", str(root / shape / "model"), "--out", str(out), "--quantize", mode, "--stream-weights"]
            argv += ["--max-batch", "1", "--max-context", str(MAX_CONTEXT)]
            code = "import sys; from medusa_trt.cli.export import main; sys.exit(main(sys.argv[1:]))"
            export_peak = _peak([sys.executable, "-c", code, *argv])
        weights = data_path(out).stat().st_size
        load_peak = _peak([sys.executable, "-c", LOAD, str(out), "2"])
        export_peak = export_peak or memory.get(mode, {}).get("export_peak_bytes")
        memory[mode] = {"weights_bytes": weights, "export_peak_bytes": export_peak, "load_peak_bytes": load_peak}
        said = f"export peak {export_peak / weights:.2f}x, " if export_peak else ""
        log.info("%s %s: weights %.2f GB; %snative load peak %.2fx", shape, mode, weights / 1e9, said, load_peak / weights)
    record.write_text(json.dumps(memory, indent=1) + "\n")


def time_shape(root: Path, shape: str, rounds: int, threads: int, backends: tuple[str, ...]) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_step_ab import main as ab_main

    out = root / shape / "steps.json"
    name = lambda mode, b: mode + (f"-{b}" if len(backends) > 1 else "")  # noqa: E731
    engines = [(name(mode, b), root / shape / mode / "model.onnx", b) for mode in MODES for b in backends]
    if shape in STREAMED:  # its own modes, on native only: two 7B engines open at once fit this machine, four do not
        engines = [(mode, root / shape / mode / "model.onnx", "native") for mode in STREAMED[shape]]
    argv = [arg for name, path, backend in engines for arg in ("--engine", f"{name}={path}@{backend}")]
    argv += ["--context", "256", "--tokens", "1", "--tokens", "8", "--rounds", str(rounds), "--threads", str(threads), "--floor"]
    print(f"\n## {shape}")
    if ab_main([*argv, "--out", str(out)]) != 0:
        raise SystemExit(f"timing {shape} failed")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("export", "time"))
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a shape (repeat; default llama-1b and qwen-0.5b)")
    p.add_argument("--root", type=Path, default=ROOT / "build" / "real-size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="time: the figures of every shape as one JSON file")
    p.add_argument("--onnxruntime", action="store_true", help="time: each engine on onnxruntime too, beside native")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes = args.shape or ["llama-1b", "qwen-0.5b"]
    if args.what == "export":
        for shape in shapes:
            export(args.root, shape)
        return 0
    backends = ("native", "onnxruntime") if args.onnxruntime else ("native",)
    reports = {shape: time_shape(args.root, shape, args.rounds, args.threads, backends) for shape in shapes}
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "shapes": reports}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
