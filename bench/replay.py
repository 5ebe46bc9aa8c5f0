"""Offline replay: what each drafter set would accept on real greedy outputs, without an engine.

For each prompt the base model's greedy continuation is generated once (plain decoding on the
torch backend), then one forward pass over prompt + continuation gives every position's hidden
state, hence the heads' top-k there. The replay walks the continuation as the runtime would: at
each step the sequence's drafters (the runtime's own objects: ``medusa_trt.runtime.drafting``)
propose, ``build_tree`` merges them under the cost model, and the runtime's greedy rule, with the
true continuation as the base model's choice, picks the longest matching tree path. Its tokens/step equal the runtime's greedy figure
up to float ties (the recycle table sees only on-path successors here, so its figure is a lower
bound). Use it to calibrate priors, budgets and drafter sets before running the benchmark.

    .venv/bin/python -m medusa_trt.bench.replay --model smollm2-135m --heads assets/smollm2-135m-medusa \\
        --tree mc_sim_7b_63 --prompts spec_bench_dev.jsonl --every 3 --max-new-tokens 128 \\
        --draft heads --draft lookup --draft heads,lookup --draft heads,lookup,recycle --out docs/results/replay.json

``--engine DIR`` budgets and models the speed-up with that engine folder's own step cost and heads call
(drafting.json) instead of the default table; ``--variant NAME:FIELD=VALUE,...`` (repeatable) replays
each drafter set again under a changed ``DraftingConfig`` (``lookup.max_ngram=4``, ``max_depth=12``,
``recycle.widths=4-2-1-1``), in the same pass over the cached continuations.

Needs the export extra (torch, transformers): the heads run on the torch model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from medusa_trt.exporter import load_medusa
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.acceptance import greedy
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.drafting import CostModel, Drafting, DraftingConfig, HeadsProposer, Observed, build_tree
from medusa_trt.runtime.drafting.stats import AcceptanceStats
from medusa_trt.runtime.engine_folder import read_drafting, step_cost_table
from medusa_trt.runtime.errors import MedusaError, fail
from medusa_trt.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class ReplayError(MedusaError):
    """A replay option or engine folder the replay cannot use; the message says what to change."""


def _prompts(path: Path, every: int, limit: int | None) -> list[str]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [r["turns"][0] if "turns" in r else r["prompt"] for r in rows][::every]
    return texts[:limit] if limit else texts


@torch.no_grad()
def head_topk(model, ids: list[int], top_k: int, expansion=None, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The heads' top-k at every position of ``ids`` (one causal forward pass): ids int64 [L, D, K]
    and their softmax probabilities float32 [L, D, K]; next-token-aware heads read the token that
    follows each position in ``ids`` (the greedy choice). Sequential heads expand ``expansion``
    (the runtime's template) at every position: [L, P, K], one row per expanded node. Positions
    before ``start - 1`` (inside the prompt: never a step's accepted node) are left zero."""
    spec = model.kv_spec
    n = len(ids)
    empty = torch.zeros((0, spec.num_layers, 1, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
    _, hidden, _, _, _ = model(
        torch.tensor([ids]),
        torch.arange(n)[None],
        torch.tril(torch.ones(n, n, dtype=torch.bool))[None],
        torch.zeros(1, dtype=torch.int64),
        empty,
        empty,
    )
    following = torch.tensor(ids[1:] + ids[-1:])  # (L,) the base model's next token at each position (the last: unused)
    first = max(start - 1, 0)  # the heads run at the positions before the continuation's tokens only
    top = model.propose(hidden[0, first:], following[first:], expansion, top_k).float().log_softmax(dim=-1).topk(top_k, dim=-1)
    ids_out = np.zeros((n, *top.indices.shape[1:]), dtype=np.int64)  # (L, D | P, K); rows before `first` unused
    probs = np.zeros(ids_out.shape, dtype=np.float32)
    ids_out[first:], probs[first:] = top.indices.numpy(), top.values.exp().numpy()
    return ids_out, probs


def engine_cost(folder: Path) -> tuple[CostModel, float]:
    """An engine folder's measured step cost (drafting.json ``step_cost``) and its heads call, both
    relative to a one-token step."""
    raw = read_drafting(folder)
    table = step_cost_table(raw.get("step_cost"))
    if table is None:
        raise ReplayError(f"{folder} has no step_cost in drafting.json: time it with medusa-calibrate --engine {folder}")
    return CostModel(table), float(raw.get("heads_cost", 0.0))


def parse_variant(spec: str, base: DraftingConfig) -> tuple[str, DraftingConfig]:
    """``NAME:FIELD=VALUE,...`` as (NAME, ``base`` with those fields changed): FIELD is a field of
    ``DraftingConfig`` or ``lookup.`` / ``recycle.`` and one of theirs; VALUE an int, or ints joined by
    '-' for a tuple (``recycle.widths=4-2-1-1``)."""
    name, sep, body = spec.partition(":")
    if not name or not sep or not body:
        raise ReplayError(f"--variant {spec!r} is not NAME:FIELD=VALUE[,FIELD=VALUE]")
    config = base
    for item in body.split(","):
        field, eq, text = item.partition("=")
        try:
            value = tuple(int(v) for v in text.split("-")) if "-" in text else int(text)
        except ValueError:
            value = None
        if not eq or value is None:
            raise ReplayError(f"--variant {spec!r}: {item!r} is not FIELD=INT or FIELD=INT-INT-...")
        outer, _, inner = field.rpartition(".")
        try:
            if outer:  # a field of the lookup / recycle config
                config = dataclasses.replace(config, **{outer: dataclasses.replace(getattr(config, outer), **{inner: value})})
            else:
                config = dataclasses.replace(config, **{inner: value})
        except (AttributeError, TypeError) as exc:
            raise ReplayError(f"--variant {spec!r}: no field {field!r} in DraftingConfig ({exc})") from exc
    return name, config


def modelled_speedup(steps: np.ndarray, nodes: np.ndarray, cost: CostModel, heads: float) -> float:
    """Tokens per unit of plain-step cost: each step of ``nodes`` tokens costs ``cost(nodes)`` one-token
    steps plus the heads call ``heads`` (0 for sets without the heads), plain decoding 1 per token."""
    return float(steps.sum() / (cost.cost(nodes) + heads).sum())


class _Tallied(AcceptanceStats):
    """Acceptance statistics that also count [accepted, tested] per key into a shared tally."""

    def __init__(self, tally: dict, prior):
        super().__init__(prior)
        self.tally = tally

    def update(self, key: tuple, accepted: bool) -> None:
        super().update(key, accepted)
        counts = self.tally.setdefault(key, [0, 0])
        counts[0] += accepted
        counts[1] += 1


def replay(
    runtime: MedusaRuntime,
    prompt: list[int],
    continuation: list[int],
    topk: np.ndarray,
    names: tuple[str, ...],
    cost: CostModel,
    config: DraftingConfig | None = None,
    confidence: np.ndarray | None = None,
    tally: dict | None = None,
    extra=None,
    prior=None,
    extra_depth: int = 0,
) -> tuple[list[int], list[int]]:
    """Tokens emitted per step and nodes per step when drafting with ``names`` (and ``config``)
    along the true continuation; ``confidence`` [L, D, K] keys the heads' drafts by their
    probabilities as the runtime does (None: by rank). ``tally`` gathers [accepted, tested] per
    statistics key over every call (what a prior table is fitted to). ``extra(anchor, max_depth)``, if
    given, adds a drafter outside the runtime's set: its ``Fragment`` below the root that follows position
    ``anchor`` of prompt + continuation, merged with the others; ``prior`` then estimates its keys (a
    ``(key) -> float`` tried before the drafters' own) and ``extra_depth`` its deepest draft."""
    drafting = runtime.with_drafters(names).drafting
    if config is not None:
        drafting = Drafting(drafting.names, drafting.template, config, engine_max_nodes=drafting.max_nodes)
    history = list(prompt) + continuation[:1]
    proposers = drafting.proposers(None)  # the runtime's own; the heads' proposals come from ``topk``
    heads = next((p for p in proposers if isinstance(p, HeadsProposer)), None)
    for p in proposers:
        p.start(0, list(prompt), sampled=False)
    own = drafting.prior if prior is None else (lambda key: prior(key) if prior(key) is not None else drafting.prior(key))
    stats = AcceptanceStats(own) if tally is None else _Tallied(tally, own)
    steps, nodes, pos = [], [], 0  # continuation[pos] is the root
    depth_cap = max(drafting.max_depth, extra_depth if extra is not None else 0)
    while pos + 1 < len(continuation):
        room = len(continuation) - pos - 1
        if heads is not None:  # heads at the last committed node (the root's parent)
            heads.set_proposals(0, topk[len(prompt) + pos - 1], None if confidence is None else confidence[len(prompt) + pos - 1])
        proposals = [p.propose(0, history, min(room, depth_cap)) for p in proposers]
        fragments = [p.fragment for p in proposals if p is not None]
        if extra is not None:
            fragments.append(extra(len(prompt) + pos - 1, min(room, depth_cap)))
        tree = build_tree(history[-1], fragments, stats, max_nodes=drafting.max_nodes, cost=cost)
        truth = np.array(continuation + [-1])  # the base model's choice after each node is the continuation's next token
        path = greedy(tree, truth[np.minimum(pos + tree.depth + 1, len(continuation))]).path
        stats.learn(tree, path)  # the runtime's own update
        emitted = len(path)  # accepted drafts + the bonus
        new = continuation[pos + 1 : pos + 1 + emitted]
        truth = np.array(continuation[pos : pos + len(new) + 1])
        history.extend(new)
        seen = [Observed(0, 0, history, path[-1], tree, truth[:-1], truth[1:, None], SamplingParams(), None)]
        for p in proposers:
            if p is not heads:
                p.observe(seen, np.array([history[-1]]), None)  # on-path successors only
        steps.append(len(new))
        nodes.append(tree.num_nodes)
        pos += len(new)
    return steps, nodes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_trt.bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default="assets/smollm2-135m-medusa")
    p.add_argument("--tree", default="mc_sim_7b_63", help="the heads' template")
    p.add_argument("--prompts", type=Path, required=True, help="Spec-Bench style JSONL (turns[0] or prompt)")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--draft", action="append", help="comma-separated drafter set; repeatable (default: several)")
    p.add_argument("--out", type=Path)
    p.add_argument("--cache", type=Path, help="keep the greedy outputs and head top-k here (.npz) and reuse them on the next run")
    p.add_argument(
        "--heads-keys",
        choices=("confidence", "rank", "both"),
        default="confidence",
        help="key the heads' drafts by their probabilities (the runtime's way), by rank (before), or a row of each",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        help="the heads draft from token ids 0..N-1 only, as an engine exported with --draft-vocab N (give it its own --cache)",
    )
    p.add_argument("--engine", type=Path, help="an engine folder whose drafting.json step cost and heads call the budget uses")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:FIELD=VALUE,... a DraftingConfig change replayed beside the defaults (lookup.max_ngram=4, max_depth=12); repeatable",
    )
    p.add_argument(
        "--tally", type=Path, help="write [accepted, tested] per statistics key over the whole replay (JSON): what priors are fitted to"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _run(args)
    except MedusaError as exc:
        return fail(p.prog, exc)


def _run(args: argparse.Namespace) -> int:
    """The replay ``main`` parsed: every drafter set (and variant) over the same cached greedy outputs."""
    sets = [
        tuple(x for x in d.split(",") if x and x != "none")
        for d in (args.draft or ["heads", "lookup", "recycle", "heads,lookup", "heads,lookup,recycle"])
    ]
    model = load_medusa(args.model, args.heads)
    model.draft_vocab = args.draft_vocab
    runtime = MedusaRuntime(model, tree=args.tree, max_context=1024, max_batch=1)
    plain = runtime.plain()
    cost, heads_cost = engine_cost(args.engine) if args.engine else (runtime.drafting.cost, 0.0)
    base = dataclasses.replace(runtime.drafting.config, cost=cost)
    configs = {"": base} | dict(parse_variant(v, base) for v in args.variant)
    modes = {"confidence": ("",), "rank": (":rank",), "both": ("", ":rank")}[args.heads_keys]
    rows = [  # (label, drafter set, heads keys, variant)
        ((",".join(names) or "none") + mode + (f"@{v}" if v else ""), names, mode, v)
        for names in sets
        for mode in (modes if "heads" in names else ("",))
        for v in configs
    ]
    results = {label: [] for label, *_ in rows}
    calls_heads = {label: "heads" in names for label, names, *_ in rows}  # steps that pay the heads call
    tally: dict = {}
    cached = dict(np.load(args.cache, allow_pickle=True)) if args.cache and args.cache.is_file() else {}
    saved = {}
    for i, text in enumerate(tqdm(_prompts(args.prompts, args.every, args.limit), desc="replay", unit="prompt")):
        if f"ids{i}" in cached:
            ids, continuation, topk, conf = (cached[f"{k}{i}"] for k in ("ids", "cont", "topk", "conf"))
            ids, continuation = ids.tolist(), continuation.tolist()
        else:
            ids = runtime.codec.encode(text, chat=runtime.is_chat)
            if len(ids) + args.max_new_tokens > runtime.max_context:
                continue  # the runtime's context (the benchmark skips these too)
            out = plain.generate(ids, max_new_tokens=args.max_new_tokens)
            continuation = [int(t) for t in out.token_ids]
            topk, conf = head_topk(model, ids + continuation, runtime.tree.top_k, runtime._info.expansion, len(ids))
            heads_rows = runtime.drafting.template.rows
            topk, conf = topk[:, :heads_rows], conf[:, :heads_rows]
        saved |= {f"ids{i}": np.array(ids), f"cont{i}": np.array(continuation), f"topk{i}": topk, f"conf{i}": conf}
        for label, names, mode, variant in rows:
            results[label].append(
                replay(
                    runtime,
                    ids,
                    continuation,
                    topk,
                    names,
                    cost,
                    configs[variant],
                    confidence=None if mode else conf,
                    tally=tally if label == "heads,lookup,recycle" else None,
                )
            )
    if args.cache and not cached:
        np.savez(args.cache, **saved)
    table = {}
    for name, per_prompt in results.items():
        steps = np.array([x for s, _ in per_prompt for x in s])
        nodes = np.array([x for _, n in per_prompt for x in n])
        modelled = modelled_speedup(steps, nodes, cost, heads_cost if calls_heads[name] else 0.0)
        table[name] = {
            "tokens_per_step": float(steps.mean()),
            "mean_nodes": float(nodes.mean()),
            "modelled_vs_plain": float(modelled),
            "steps": int(len(steps)),
            "tokens": int(steps.sum()),
        }
        print(f"{name:28s} {steps.mean():.3f} tokens/step  {nodes.mean():5.1f} nodes  modelled {modelled:.2f}x plain  ({len(steps)} steps)")
    for path, payload in (
        (args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "results": table}),
        (args.tally, [[list(k), v] for k, v in sorted(tally.items(), key=lambda kv: str(kv[0]))]),
    ):
        if path:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(payload, indent=1))
            tmp.replace(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
