"""Short GPU benchmark of the torch backend (part of ``make gpu-check``; not a test).

Random-weight models built from configs (the GPU machine has no network and SmolLM2's file is
too large to carry): a SmolLM2-135M-shaped Llama and a ~1B Llama. For each, in one process:
  * verify-step latency for T = 1..64 new tokens over a 256-token context (median of repeats);
  * plain decoding vs Medusa (heads fitted in closed form to the model's own greedy output),
    same model, same prompts: tokens/s, mean accepted tokens per step, speedup, identical tokens.
Then the tree-attention kernel alone: Triton kernel vs the torch reference, one layer, batch 1,
T = 1..64 new tokens over 256 and 4096 committed slots, at SmolLM2 (Hq=9, Hkv=3, D=64) and 1B
(Hq=32, Hkv=4, D=64) head shapes (median host ms per call, synchronised).
Writes a JSON report and prints a readable one.

``--dry-run`` (``make gpu-check-dry``, no GPU): the same steps on the CPU at toy sizes (a 2-layer Llama), up to
the first one that needs CUDA (the kernel timing), where it stops and says so: what runs on the GPU machine
cannot fail on an import, a renamed function or a changed signature.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import numpy as np
import torch

from medusa_trt.exporter import BaseModel, MedusaModel
from medusa_trt.plugins.tree_attention.cases import make_case
from medusa_trt.plugins.tree_attention.kernel import reference_from_spec, tree_attention_triton, triton_importable
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.step_cost import median_ms
from medusa_trt.training.ridge import fit_heads_ridge, greedy_continuations

SHAPES = {
    "smollm2-135m-shaped": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "llama-1b-shaped": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

DRY_RUN_SHAPE = dict(  # --dry-run: the same code at a size two CPU cores run in seconds
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)

ATTENTION_SHAPES = {"smollm2-135m-shaped": (9, 3, 64), "llama-1b-shaped": (32, 4, 64)}  # Hq, Hkv, D


class _NoTokenizer:
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def build(shape: str, dtype: torch.dtype, device: str) -> BaseModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES.get(shape, DRY_RUN_SHAPE), max_position_embeddings=4096, initializer_range=0.05)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    return BaseModel(model=model, tokenizer=_NoTokenizer(), name=shape, eos_token_ids=(), is_chat=False)


def step_latency(model: MedusaModel, context: int, sizes: list[int], repeats: int) -> dict[int, float]:
    runtime = MedusaRuntime(model, tree="chain-0", max_batch=1, max_context=context + 128)
    backend = runtime.backend
    out = {}
    for t in sizes:
        ids = np.random.randint(0, model.vocab_size, size=(1, t))
        pos = context + np.arange(t)[None]
        mask = np.tril(np.ones((t, t), dtype=bool))[None]
        lengths = np.array([context])
        for _ in range(3):
            backend.step(ids, pos, mask, lengths)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.step(ids, pos, mask, lengths)  # returns host argmax: synchronises
            times.append(time.perf_counter() - start)
        out[t] = statistics.median(times) * 1e3
    return out


def decode_compare(base: BaseModel, heads, tree: str, prompts: list[list[int]], new_tokens: int) -> dict:
    model = MedusaModel(base, heads)
    plain = MedusaRuntime(model, tree="chain-0", max_batch=1, max_context=1024)
    medusa = MedusaRuntime(model, tree=tree, max_batch=1, max_context=1024)
    plain.generate(prompts[0], max_new_tokens=8)
    medusa.generate(prompts[0], max_new_tokens=8)
    rows = {"plain": [0, 0.0, []], "medusa": [0, 0.0, []]}
    same = True
    for prompt in prompts:  # interleaved, so drift hits both alike
        a = plain.generate(prompt, max_new_tokens=new_tokens)
        b = medusa.generate(prompt, max_new_tokens=new_tokens)
        same &= a.token_ids == b.token_ids
        for key, r in (("plain", a), ("medusa", b)):
            rows[key][0] += r.stats.new_tokens
            rows[key][1] += r.stats.seconds
            rows[key][2] += r.stats.accepted_per_step
    result = {k: {"tokens_per_s": v[0] / v[1], "mean_accepted": float(np.mean(v[2]))} for k, v in rows.items()}
    result["speedup"] = result["medusa"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    result["identical_tokens"] = bool(same)
    result["tree"] = tree
    return result


def _call_ms(fn, case, out: torch.Tensor, repeats: int) -> float:
    """Median host ms of one synchronised call of a tree-attention implementation on ``case``."""
    return median_ms(lambda: (fn(*case.inputs, layer=case.layer, scale=case.scale, out=out), torch.cuda.synchronize()), repeats)


def attention_latency(heads: tuple[int, int, int], contexts: list[int], sizes: list[int], repeats: int) -> dict:
    """Median ms of one tree-attention call, Triton kernel vs torch reference, bf16, batch 1."""
    num_q_heads, num_kv_heads, head_dim = heads
    out = {}
    for context in contexts:
        rows = {}
        for t in sizes:
            case = make_case(
                cache_lengths=[context],
                num_new=t,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                mask="causal",
                num_layers=2,
                layer=1,
                spare_slots=64,
                dtype=torch.bfloat16,
                device="cuda",
            )
            dest = torch.empty_like(case.query)
            kernel_ms = _call_ms(tree_attention_triton, case, dest, repeats)
            reference_ms = _call_ms(reference_from_spec, case, dest, repeats)
            rows[t] = {"kernel_ms": kernel_ms, "reference_ms": reference_ms, "speedup": reference_ms / kernel_ms}
        out[context] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/gpu-bench.json")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--dry-run", action="store_true", help="no GPU: every step on the CPU at toy sizes, up to the first CUDA call")
    args = p.parse_args()
    if args.dry_run:
        args.device, args.shapes, args.sizes, args.repeats, args.new_tokens = "cpu", ["dry-run"], [1, 2], 2, 12
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA GPU found: run this on a GPU machine")
    logging.basicConfig(level=logging.WARNING)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "models": {}}
    sizes = args.sizes
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        base = build(shape, torch.bfloat16 if args.device == "cuda" else torch.float32, args.device)
        model = MedusaModel(base, None)
        entry = {"dtype": str(base.model.dtype).removeprefix("torch."), "step_ms_ctx256": step_latency(model, 256, sizes, args.repeats)}
        prompts = [rng.integers(0, base.model.config.vocab_size, size=int(n)).tolist() for n in (16, 40, 64, 24)]
        heads = fit_heads_ridge(base.model, greedy_continuations(base.model, prompts[:2] + [p[:8] for p in prompts], 160))
        entry["decode"] = [decode_compare(base, heads, tree, prompts, args.new_tokens) for tree in ("chain-4", "chain-2")]
        report["models"][shape] = entry
        del base, model, heads
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.dry_run:  # everything after this point needs CUDA
        print("gpu_bench: dry run: stopped at the first CUDA call (tree-attention kernel timing, make_case(device='cuda'))")
    elif args.device == "cuda" and triton_importable():
        report["tree_attention"] = {
            shape: attention_latency(ATTENTION_SHAPES[shape], [256, 4096], sizes, args.repeats) for shape in args.shapes
        }
    elif args.device == "cuda":
        print("tree attention kernel timing skipped: triton not installed")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"device: {report['device']}, torch {report['torch']}")
    for shape, entry in report["models"].items():
        steps = "  ".join(f"T={t}: {ms:.2f}" for t, ms in entry["step_ms_ctx256"].items())
        print(f"{shape} ({entry['dtype']}): verify step ms over 256 context: {steps}")
        for d in entry["decode"]:
            print(
                f"  {d['tree']}: plain {d['plain']['tokens_per_s']:.1f} tok/s, medusa {d['medusa']['tokens_per_s']:.1f} tok/s "
                f"({d['medusa']['mean_accepted']:.2f} accepted/step), speedup {d['speedup']:.2f}x, "
                f"identical tokens: {d['identical_tokens']}"
            )
    for shape, contexts in report.get("tree_attention", {}).items():
        for context, rows in contexts.items():
            cells = "  ".join(f"T={t}: {r['kernel_ms']:.3f}/{r['reference_ms']:.3f}" for t, r in rows.items())
            print(f"tree attention {shape} (bf16, one layer) ms kernel/reference over {context} context: {cells}")


if __name__ == "__main__":
    main()
