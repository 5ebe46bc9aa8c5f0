"""Peak memory of one export against the bytes of the weights it exports (a benchmark, not a test).

A synthetic Llama of about 1.5B parameters (hidden 2048, 24 layers, intermediate 6656, vocabulary
32000, random weights) is saved once as a sharded safetensors folder (``--model-dir``; kept, so a
rerun skips it), then exported in a child process while this one samples the child's resident
memory (VmRSS and RssAnon from /proc) every ``--interval`` seconds. The child names each stage it
enters (loading, tracing the step graph, saving it, the heads graph, verification, ...), so the
peak is attributed to a stage. A child that passes ``--cap-gib`` is killed: the machine is shared.

    nohup .venv/bin/python scripts/export_memory.py --dtype bf16 --out docs/results/export-memory.json > /tmp/export-memory.log 2>&1 &

bf16 by default: 1.5B parameters are 3.0 GB there and 6.1 GB in fp32, whose 2x (12 GB) plus the
interpreter would come too close to the 14 GiB this shared 24 GiB machine can give one job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"  # its tokenizer; the model's vocabulary is larger

SYNTHETIC = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=6656,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SMALL = SYNTHETIC | dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)


def make_model(folder: Path, dtype: str, small: bool) -> None:
    """Random weights in ``dtype`` saved as safetensors shards of at most 1 GB, with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.exporter import load_base_model

    if (folder / "config.json").is_file():
        logging.info("%s exists: reused", folder)
        return
    torch.manual_seed(0)
    config = LlamaConfig(**(SMALL if small else SYNTHETIC), dtype=dtype_of(dtype))
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_of(dtype))
    logging.info("%.3fB parameters, saving to %s", sum(p.numel() for p in model.parameters()) / 1e9, folder)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="1GB")
    del model
    load_base_model(STORIES).tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def dtype_of(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def child(args) -> None:
    """The export under measurement: each stage's start goes to stdout as ``STAGE <t> <name>``."""
    from medusa_trt.exporter import HeadsConfig, MedusaModel, init_heads, load_base_model, onnx_export, verify

    def mark(name: str) -> None:
        print(f"STAGE {time.time():.3f} {name}", flush=True)

    def staged(module, attr: str, name: str) -> None:
        fn = getattr(module, attr)

        def wrapped(*a, **k):
            mark(name)
            try:
                return fn(*a, **k)
            finally:
                mark("export (between stages)")

        setattr(module, attr, wrapped)

    staged(onnx_export, "_export_step", "tracing the step graph")
    staged(onnx_export, "_export_heads", "tracing the heads graph")
    staged(onnx_export, "_save", "saving a graph")
    staged(onnx_export, "quantize_engine", "quantizing")
    staged(verify, "verify_engine", "verifying")
    mark("loading the model")
    base = load_base_model(args.model_dir, dtype=dtype_of(args.dtype))
    cfg = base.model.config
    heads_config = HeadsConfig(num_heads=4, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, shared_lm_head=True)
    heads = init_heads(heads_config, base.model.lm_head, seed=0, random=True)
    model = MedusaModel(base, heads)
    tensors = {id(p): p for p in [*base.model.parameters(), *heads.parameters()]}.values()  # the shared lm_head once
    weights, params = sum(p.numel() * p.element_size() for p in tensors), sum(p.numel() for p in tensors)
    print(f"WEIGHTS {weights} {params}", flush=True)
    mark("export (between stages)")
    config = onnx_export.ExportConfig(
        out=Path(args.out_dir) / "model.onnx",
        dtype=args.dtype,
        tree="chain-4",
        max_batch=1,
        max_context=args.max_context,
        max_tokens=16,
        verify=not args.no_verify,
    )
    result = onnx_export.export_onnx(model, config)
    mark("done")
    print("DIFFS " + json.dumps(result.diffs), flush=True)


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon of ``pid`` in bytes (absent: it has exited)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def measure(args) -> dict:
    """Run the child, sample it, attribute the peak to the stage it fell in."""
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model-dir",
        str(args.model_dir),
        "--dtype",
        args.dtype,
        "--out-dir",
        str(args.out_dir),
    ]
    command += ["--max-context", str(args.max_context)] + (["--no-verify"] if args.no_verify else [])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.out_dir / "child.log"
    cap = int(args.cap_gib * 2**30)
    samples, stages, killed = [], [], False
    marks_path = args.out_dir / "stages.log"  # the child's STAGE / WEIGHTS / DIFFS lines
    shown = 0
    with open(log_path, "w") as log_file, open(marks_path, "w") as marks:
        proc = subprocess.Popen(command, stdout=marks, stderr=log_file)
        start = time.time()
        while proc.poll() is None:
            s = status(proc.pid)
            if s:
                samples.append((time.time(), s.get("VmRSS", 0), s.get("RssAnon", 0)))
                if s.get("VmRSS", 0) > cap and not killed:
                    logging.error("child passed the %.1f GiB cap: killed", args.cap_gib)
                    proc.send_signal(signal.SIGKILL)
                    killed = True
            lines = marks_path.read_text().splitlines()
            for line in lines[shown:]:
                if line.startswith("STAGE"):
                    rss = (samples[-1][1] if samples else 0) / 2**30
                    logging.info("%6.0f s  %5.2f GiB  %s", time.time() - start, rss, line.split(" ", 2)[2])
            shown = len(lines)
            time.sleep(args.interval)
    lines = marks_path.read_text().splitlines()
    hwm = max((s[1] for s in samples), default=0)
    for line in lines:
        if line.startswith("STAGE"):
            _, t, name = line.split(" ", 2)
            stages.append((float(t), name))
        elif line.startswith("WEIGHTS"):
            weights, params = (int(x) for x in line.split()[1:])
        elif line.startswith("DIFFS"):
            diffs = json.loads(line[6:])
    per_stage: dict[str, dict] = {}
    timeline: list[dict] = []  # each stage as it came: GiB at its start and end, and its peak
    for t, rss, anon in samples:
        index = next((i for i in range(len(stages) - 1, -1, -1) if stages[i][0] <= t), None)
        name = stages[index][1] if index is not None else "starting"
        entry = per_stage.setdefault(name, {"peak_rss": 0, "peak_anon": 0})
        entry["peak_rss"], entry["peak_anon"] = max(entry["peak_rss"], rss), max(entry["peak_anon"], anon)
        if not timeline or timeline[-1]["index"] != index:
            timeline.append({"index": index, "stage": name, "start_s": round(t - samples[0][0], 1), "start_rss": rss, "start_anon": anon})
            timeline[-1] |= {"peak_rss": 0, "peak_anon": 0}
        last = timeline[-1]
        last |= {"end_rss": rss, "end_anon": anon, "peak_rss": max(last["peak_rss"], rss), "peak_anon": max(last["peak_anon"], anon)}
    gib = 2**30
    timeline = [
        {"stage": e["stage"], "start_s": e["start_s"]} | {k: round(e[k] / gib, 2) for k in e if k.endswith(("rss", "anon"))}
        for e in timeline
    ]
    weights = locals().get("weights", 0)
    result = {
        "dtype": args.dtype,
        "parameters": locals().get("params", 0),
        "weights_bytes": weights,
        "peak_rss_bytes": hwm,
        "peak_ratio": hwm / weights if weights else None,
        "per_stage": {
            k: v | {"ratio_rss": v["peak_rss"] / weights if weights else None, "ratio_anon": v["peak_anon"] / weights if weights else None}
            for k, v in per_stage.items()
        },
        "timeline_gib": timeline,
        "seconds": round(samples[-1][0] - samples[0][0], 1) if samples else 0,
        "returncode": proc.returncode,
        "killed_at_cap": killed,
        "verify": not args.no_verify,
        "max_context": args.max_context,
        "diffs": locals().get("diffs"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    return result


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/medusa-export-memory/llama-1.5b"))
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/medusa-export-memory/engine"))
    p.add_argument("--max-context", type=int, default=256)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--small", action="store_true", help="a 2-layer model of hidden 256: try the script in seconds")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--cap-gib", type=float, default=14.0)
    p.add_argument("--out", type=Path, help="append the result to this JSON list")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.child:
        child(args)
        return 0
    if args.small:
        args.model_dir = args.model_dir.with_name(args.model_dir.name + "-small")
    args.model_dir = args.model_dir.with_name(f"{args.model_dir.name}-{args.dtype}")
    args.model_dir.parent.mkdir(parents=True, exist_ok=True)
    make_model(args.model_dir, args.dtype, args.small)
    result = measure(args)
    logging.info(json.dumps(result, indent=1))
    if args.out:
        earlier = json.loads(args.out.read_text()) if args.out.is_file() else []
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(earlier + [result], indent=1) + "\n")
        tmp.replace(args.out)
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
