"""The real model on the GPU beside transformers, one run (the GPU check's second command; not a test).

SmolLM2-135M-Instruct (its GGUF, joined from the parts ``make gpu-parts`` wrote) with the heads trained for it
(``assets/smollm2-135m-medusa``), bf16, greedy, the same prompt token ids for every row:

  * transformers ``generate``, plain and with prompt lookup (``prompt_lookup_num_tokens``), batch 1: the peer
    everyone has;
  * this project's torch backend (the Triton tree-attention kernel on CUDA), plain and with the default drafters
    (heads, lookup, recycle; the heads' own tree), batch 1 and batch ``--batch``;
  * for each: new tokens, tok/s, tokens a step (the project's rows), and whether each drafted output equals the
    project's own plain output. Where one does not, the first token that differs is checked as a near tie: the logits
    of a plain forward over the prompt and the plain output up to there, the two tokens' logit gap against ``--tie``
    (bf16 kernels of different widths round differently; a gap above it would be a bug and fails the run).

The project's rows run eager and, on CUDA, with the verify step captured as CUDA graphs (``cuda_graph=True``: one a
(batch, tokens) bucket, replayed). A row whose graph fails to capture or replay says why on its row; the others still
run, and the command then exits 1.

    python scripts/gpu_compare.py --model build/gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts build/gpu-parts/prompts.jsonl --out build/gpu-check/gpu-compare.json

``--dry-run`` (``make gpu-check-dry``, no GPU): the same rows on the CPU in float32 over 3 prompts and 12 tokens,
transformers included, so that what runs on the GPU machine cannot fail on an import or a changed signature.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("gpu_compare")

HEADS = "assets/smollm2-135m-medusa"
CONTEXT = 1024  # positions a sequence may fill: prompts longer than this less the new tokens are left out


@dataclass
class Row:
    name: str
    batch: int
    outputs: list[list[int]] = field(default_factory=list)  # new token ids a prompt
    seconds: float = 0.0
    steps: int = 0  # the project's rows: engine steps after the prompt (0: not counted)
    note: str = ""
    failed: str = ""  # why the row stopped (a CUDA graph that did not capture or replay); its figures are then partial

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "batch": self.batch,
            "new_tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else None,
            "note": self.note,
            "failed": self.failed or None,
        }


def read_prompts(path: Path, every: int) -> list[str]:
    """First turns of a Spec-Bench style jsonl ({"turns": [...]}, or {"prompt": ...}): every ``every``-th."""
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            texts.append(record["turns"][0] if "turns" in record else record["prompt"])
    return texts[::every]


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def hf_generate(model, new_tokens: int, eos: tuple[int, ...], device: str, **extra):
    """transformers' own generate on the wrapped model's base (its own attention), one prompt: -> (new ids, 0 steps)."""
    import torch

    def run(group: list[list[int]]) -> tuple[list[list[int]], int]:
        (ids,) = group
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.base.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=list(eos) or None,
                pad_token_id=eos[0] if eos else 0,
                **extra,
            )
        return [out[0, len(ids) :].tolist()], 0

    return run


def project_generate(runtime, new_tokens: int):
    """This project's runtime over a group of prompts (its rows at once, up to its batch): -> (new ids, engine steps)."""

    def run(group: list[list[int]]) -> tuple[list[list[int]], int]:
        results = runtime.generate(group, max_new_tokens=new_tokens)
        return [list(r.token_ids) for r in results], sum(r.stats.steps for r in results)

    return run


def timed(row: Row, run, group: list[list[int]], device: str) -> None:
    if row.failed:
        return
    synchronize(device)
    start = time.perf_counter()
    try:
        outputs, steps = run(group)
    except Exception as exc:  # a graph that fails to replay: reported on its row, the other rows go on
        row.failed = f"{type(exc).__name__}: {exc}"
        return
    synchronize(device)
    row.seconds += time.perf_counter() - start
    row.outputs += outputs
    row.steps += steps


def project_runtime(model, batch: int, drafters, warm: list[int], *, cuda_graph: bool = False):
    from medusa_trt.runtime import MedusaRuntime

    runtime = MedusaRuntime(model, max_batch=batch, max_context=CONTEXT, drafters=drafters, cuda_graph=cuda_graph)
    runtime.generate(warm, max_new_tokens=4)  # warm-up: the kernels compiled, the buffers made
    return runtime


def compare(model, prompts: list[list[int]], new_tokens: int, batch: int, budget: float, device: str) -> tuple[list[Row], int]:
    """Every row over the same prompts: the batch-1 ways take turns prompt by prompt (drift hits them alike) until
    ``budget`` seconds have passed, then the batched ways run over the prompts done. -> (rows, prompts done)."""
    eos = tuple(model.eos_token_ids)
    ways = []  # (row, run)
    for name, extra in (("transformers generate, plain", {}), ("transformers generate, prompt lookup", {"prompt_lookup_num_tokens": 10})):
        ways.append(
            (
                Row(name, 1, note=f"transformers, {', '.join(f'{k} {v}' for k, v in extra.items()) or 'greedy'}"),
                hf_generate(model, new_tokens, eos, device, **extra),
            )
        )
    batched = []
    for graphs in (False, True) if device == "cuda" else (False,):  # CUDA graphs need CUDA: the dry run has none
        for label, drafters in (("plain", ()), ("drafting", None)):
            for size in (1, batch):
                row = Row(f"medusa-trt {label}, {'CUDA graphs' if graphs else 'eager'}", size)
                run = None
                try:
                    runtime = project_runtime(model, size, drafters, prompts[0], cuda_graph=graphs)
                    row.note = f"backend {runtime.backend.name}" + (f", tree {runtime.tree.name}" if drafters is None else "")
                    run = project_generate(runtime, new_tokens)
                except Exception as exc:  # a capture that fails is reported on its row; the other rows still run
                    row.failed = f"{type(exc).__name__}: {exc}"
                (ways if size == 1 else batched).append((row, run))
    start, done = time.perf_counter(), 0
    for ids in prompts:
        if done and time.perf_counter() - start > budget:
            break
        for row, run in ways:
            timed(row, run, [ids], device)
        done += 1
    for row, run in batched:
        timed(row, run, prompts[:done], device)
    return [row for row, _ in ways + batched], done


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ (a length difference counts at the shorter's end); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_gaps(model, prompts: list[list[int]], got: list[list[int]], want: list[list[int]], device: str) -> list[dict]:
    """For each prompt whose ``got`` differs from ``want``: the first differing token and its logit gap, from a plain
    forward of the base over the prompt and ``want`` up to there (what plain decoding saw choosing that token)."""
    import torch

    gaps = []
    for index, (ids, a, b) in enumerate(zip(prompts, got, want)):
        i = first_difference(a, b)
        if i is None:
            continue
        if i >= min(len(a), len(b)):  # one stopped (EOS) where the other went on: the EOS choice is the tie
            token_a, token_b = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        else:
            token_a, token_b = a[i], b[i]
        x = torch.tensor([ids + b[:i]], device=device)
        with torch.inference_mode():
            logits = model.base(x).logits[0, -1].float()
        pair = [t for t in (token_a, token_b) if t is not None]
        gap = float((logits[pair].max() - logits[pair].min()).item()) if len(pair) == 2 else float("inf")
        gaps.append({"prompt": index, "token": i, "got": token_a, "want": token_b, "logit_gap": gap})
    return gaps


def load(model_path: str, heads: str, device: str, dtype: str):
    import torch

    from medusa_trt.exporter import load_medusa

    return load_medusa(model_path, heads, dtype=getattr(torch, dtype), device=device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="build/gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf", help="the joined GGUF")
    p.add_argument("--heads", default=HEADS)
    p.add_argument("--prompts", type=Path, default=Path("build/gpu-parts/prompts.jsonl"), help="Spec-Bench style jsonl")
    p.add_argument("--every", type=int, default=1, help="every n-th prompt of the file (make gpu-parts already took every third)")
    p.add_argument("--limit", type=int, default=29, help="prompts at most, of those that fit the context")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="the batched rows' batch size (besides batch 1)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds the batch-1 rows may take; then no new prompt starts")
    p.add_argument("--tie", type=float, default=None, help="largest logit gap a divergence may have (default 0.5 bf16, 1e-3 float32)")
    p.add_argument("--out", type=Path, default=Path("build/gpu-check/gpu-compare.json"))
    p.add_argument("--dry-run", action="store_true", help="no GPU: the same rows on the CPU, float32, 3 prompts x 12 tokens")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    device, dtype = ("cpu", "float32") if args.dry_run else ("cuda", "bfloat16")
    if args.dry_run:
        args.limit, args.new_tokens, args.batch = min(args.limit, 3), min(args.new_tokens, 12), 2
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_compare: error: no CUDA GPU here: run it on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    if not args.prompts.is_file():
        print(f"gpu_compare: error: {args.prompts} is missing: make gpu-parts writes it (carry it with the parts)", file=sys.stderr)
        return 2
    if not Path(args.model).is_file():
        print(f"gpu_compare: error: {args.model} is missing: join the parts first (scripts/model_parts.py join)", file=sys.stderr)
        return 2
    tie = args.tie if args.tie is not None else (1e-3 if dtype == "float32" else 0.5)
    started = time.perf_counter()
    model = load(args.model, args.heads, device, dtype)
    from medusa_trt.runtime import MedusaRuntime, PromptError

    texts = read_prompts(args.prompts, args.every)
    encoder, prompts = MedusaRuntime(model, max_batch=1, max_context=CONTEXT), []
    for text in texts:  # those that fit the context with their new tokens, as medusa-bench takes them
        try:
            ids = encoder.encode_prompts(text)[1][0]
        except PromptError:
            continue
        if len(ids) + args.new_tokens <= CONTEXT and len(prompts) < args.limit:
            prompts.append(ids)
    del encoder
    log.warning("loaded in %.1f s; %d prompts, %d new tokens each", time.perf_counter() - started, len(prompts), args.new_tokens)
    rows, done = compare(model, prompts, args.new_tokens, args.batch, args.budget, device)
    prompts = prompts[:done]
    plain = next(r for r in rows if r.name == "medusa-trt plain, eager" and r.batch == 1)
    checks = {}
    for row in rows:
        if row is plain or row.failed:
            continue
        gaps = tie_gaps(model, prompts, row.outputs, plain.outputs, device)
        checks[f"{row.name}, batch {row.batch}"] = {
            "equal": len(prompts) - len(gaps),
            "of": len(prompts),
            "divergences": gaps,
            "all_near_ties": all(g["logit_gap"] <= tie for g in gaps),
        }
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    report = {
        "device": gpu,
        "dtype": dtype,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "tie": tie,
        "rows": [r.summary() for r in rows],
        "equal_to_own_plain": checks,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    base = next(r for r in rows if r.name == "transformers generate, plain").summary()["tokens_per_s"]
    print(f"{gpu}, {dtype}, torch {torch.__version__}: {len(prompts)} prompts x {args.new_tokens} greedy tokens ({args.prompts})")
    print("| row | batch | tok/s | tokens a step | vs transformers plain | = own plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        s = row.summary()
        check = checks.get(f"{row.name}, batch {row.batch}")
        same = "-" if check is None else f"{check['equal']}/{check['of']}"
        if check and check["divergences"]:
            same += " (the others at near ties)" if check["all_near_ties"] else " (not all at near ties)"
        if row.failed:
            print(f"| {row.name} | {row.batch} | - | - | - | failed: {row.failed.splitlines()[0][:200]} |")
            continue
        step = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "-"
        print(f"| {row.name} | {row.batch} | {s['tokens_per_s']:.1f} | {step} | {s['tokens_per_s'] / base:.2f}x | {same} |")
    print(f"report: {args.out} ({report['seconds']} s)")
    if failed := [f"{r.name}, batch {r.batch}" for r in rows if r.failed]:
        print(f"gpu_compare: error: {'; '.join(failed)} failed (their rows say why)", file=sys.stderr)
        return 1
    if not all(c["all_near_ties"] for name, c in checks.items() if name.startswith("medusa-trt")):  # transformers': for the record
        print(
            "gpu_compare: error: a drafted output differs from the project's own plain output at a logit gap above --tie", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
