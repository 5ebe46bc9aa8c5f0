"""Offline replay of an EAGLE-3-style drafter (``exporter/eagle.py``) beside the Medusa heads, on the same greedy
outputs: accepted tokens per step, alone and merged with retrieval and recycled successors by the runtime's own
tree builder, and the speed-up modelled from an engine folder's measured step cost.

    .venv/bin/python -m medusa_trt.bench.eagle_replay --drafter build/eagle/drafter \\
        --cache build/eagle/replay-dev.npz --engine build/smollm2-int8-default --out docs/results/eagle-replay.json

``--cache`` is ``bench/replay.py``'s (its greedy outputs, generated once on the torch model; the Medusa heads' top-k
are computed again, for ``--heads``, which need not be the heads the cache was made with). Per prompt, one
forward of the base gives every position's feeding states, and one causal drafter pass the drafter's step-0 keys
and outputs at every committed position. At each step the draft tree grows as EAGLE-2's does: the ``top_k``
children of each expanded node, then per depth the ``top_k`` nodes of highest path probability expanded again
(one drafter call per depth, those nodes batched, each attending to the committed positions and its own
ancestors: what the drafter's training-time test taught it), ``depth`` calls in all. Rows:

- ``eagle@N``: the N nodes of highest path probability, no budget: what the drafter accepts at a fixed width;
- ``eagle`` and ``eagle,lookup,recycle`` (and the Medusa rows, ``heads`` ...): the drafts merged and budgeted by
  ``build_tree`` under the engine's step cost, as the runtime does each step. The drafter's nodes are keyed
  ``("eagle-p", depth, bucket of its own probability)``, prior: the bucket's probability.

The modelled speed-up charges a row that uses the drafter ``depth`` drafter calls a step, each priced at the
engine's measured heads call times the drafter layer's and the heads' weight bytes (``--call-cost`` overrides).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from medusa_trt.bench.replay import ReplayError, engine_cost, head_topk, modelled_speedup, replay
from medusa_trt.exporter import load_medusa
from medusa_trt.exporter.eagle import DraftKeys, EagleDrafter, base_hidden, load_drafter, ttt_mask
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.drafting import Fragment
from medusa_trt.runtime.drafting.heads import CONFIDENCE_EDGES
from medusa_trt.runtime.errors import MedusaError, fail

log = logging.getLogger(__name__)

KIND = "eagle-p"
PRIOR = np.concatenate([[0.03], (CONFIDENCE_EDGES[:-1] + CONFIDENCE_EDGES[1:]) / 2, [0.95]])  # a bucket's probability


class EaglePass:
    """One sequence's drafter state from a causal pass: step-0 keys, values and outputs at every position."""

    @torch.no_grad()
    def __init__(self, drafter: EagleDrafter, ids: list[int]):
        self.drafter = drafter
        sequence = torch.tensor([ids])
        hidden = base_hidden(drafter.base, sequence, drafter.config.layers)
        T = len(ids)
        tokens = torch.tensor([ids[1:] + ids[-1:]])  # anchor t reads token t + 1
        keys = DraftKeys()
        self.g = drafter.step(tokens, drafter.features(hidden), torch.arange(T)[None], ttt_mask(T, 0), keys)[0]  # (T, H)
        self.keys, self.values = keys.new_keys, keys.new_values  # (1, Hkv, T, D)
        self.out: dict[int, torch.Tensor] = {}  # a tree node's drafter output while its tree grows


def _chain(node: int, parent: list[int]) -> list[int]:
    """``node``'s ancestors from the top, then ``node``."""
    out = [node]
    while parent[out[-1]] >= 0:
        out.append(parent[out[-1]])
    return out[::-1]


@dataclass(frozen=True)
class Grown:
    """Every node a draft tree grew, in the order made: token, parent (-1: the root), log-probability given the
    parent, path log-probability and depth below the root."""

    tokens: list[int]
    parent: list[int]
    own: list[float]
    path: list[float]
    level: list[int]


def draft_tree(state: EaglePass, anchor: int, *, top_k: int, depth: int, nodes: int, max_depth: int) -> Fragment:
    """EAGLE-2's tree below the root at ``anchor + 1`` (the committed positions end at ``anchor``): the ``nodes``
    drafts of highest path probability out of ``depth`` levels, keyed by their own probability."""
    return select(grow_tree(state, anchor, top_k=top_k, depth=min(depth, max_depth)), nodes)


@torch.no_grad()
def grow_tree(state: EaglePass, anchor: int, *, top_k: int, depth: int) -> Grown:
    """The ``depth`` levels of EAGLE-2's expansion below the root at ``anchor + 1``: one drafter call a level."""
    drafter, d2t = state.drafter, state.drafter.d2t
    tokens: list[int] = []
    parent: list[int] = []
    own: list[float] = []  # log-probability given the parent
    path: list[float] = []  # log-probability of the path from the root
    level: list[int] = []  # depth below the root
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # an expanded node's key and value (1, Hkv, 1, D)

    def children(of: list[int], logp: torch.Tensor, d: int) -> list[int]:
        best = logp.topk(top_k)  # (n, top_k)
        made = []
        for q, p in enumerate(of):
            for value, index in zip(best.values[q].tolist(), best.indices[q].tolist()):
                made.append(len(tokens))
                tokens.append(int(d2t[index]))
                parent.append(p)
                own.append(value)
                path.append(value + (path[p] if p >= 0 else 0.0))
                level.append(d)
        return made

    newest = children([-1], drafter.logits(state.g[anchor][None]).float().log_softmax(-1), 1)
    committed = anchor + 1
    for d in range(1, depth):
        frontier = sorted(newest, key=lambda i: -path[i])[:top_k]
        chains = [_chain(i, parent) for i in frontier]
        above = sorted({a for c in chains for a in c[:-1]})  # expanded ancestors, each once
        slot = {a: committed + j for j, a in enumerate(above)}
        n = len(frontier)
        mask = torch.full((1, 1, n, committed + len(above) + n), float("-inf"))
        mask[..., :committed] = 0.0
        for q, chain in enumerate(chains):
            for a in chain[:-1]:
                mask[0, 0, q, slot[a]] = 0.0
            mask[0, 0, q, committed + len(above) + q] = 0.0
        keys = DraftKeys(
            torch.cat([state.keys[:, :, :committed], *[kv[a][0] for a in above]], dim=2),
            torch.cat([state.values[:, :, :committed], *[kv[a][1] for a in above]], dim=2),
        )
        features = torch.stack([state.g[anchor] if parent[i] < 0 else state.out[parent[i]] for i in frontier])
        g = drafter.step(torch.tensor([[tokens[i] for i in frontier]]), features[None], torch.full((1, n), anchor + d), mask, keys)[0]
        for q, i in enumerate(frontier):
            kv[i] = (keys.new_keys[:, :, q : q + 1], keys.new_values[:, :, q : q + 1])
            state.out[i] = g[q]
        newest = children(frontier, drafter.logits(g).float().log_softmax(-1), d + 1)
    state.out.clear()
    return Grown(tokens, parent, own, path, level)


def select(grown: Grown, nodes: int) -> Fragment:
    """The ``nodes`` drafts of highest path probability (ancestors first on ties), keyed by their own probability."""
    tokens, parent, own, path, level = grown.tokens, grown.parent, grown.own, grown.path, grown.level
    order = sorted(range(len(tokens)), key=lambda i: (-path[i], level[i]))
    kept: dict[int, int] = {}
    for i in order:
        if len(kept) == nodes:
            break
        if parent[i] < 0 or parent[i] in kept:  # a node whose parent was cut (a tie) stays out
            kept[i] = len(kept)
    chosen = sorted(kept, key=lambda i: (level[i], kept[i]))  # parents first
    index = {i: j for j, i in enumerate(chosen)}
    bucket = np.searchsorted(CONFIDENCE_EDGES, np.exp([own[i] for i in chosen]), side="right")
    return Fragment(
        "eagle",
        np.array([tokens[i] for i in chosen], dtype=np.int64),
        np.array([index[parent[i]] if parent[i] >= 0 else -1 for i in chosen], dtype=np.int64),
        tuple((KIND, level[i], int(b)) for i, b in zip(chosen, bucket)),
        np.full(len(chosen), -1, dtype=np.int64),
    )


class DraftTrees:
    """One sequence's draft trees: each (anchor, depth room) grown once, each width selected from it once."""

    def __init__(self, state: EaglePass, *, top_k: int, depth: int):
        self.state, self.top_k, self.depth = state, top_k, depth
        self.grown: dict[tuple[int, int], Grown] = {}
        self.memo: dict[tuple[int, int, int], Fragment] = {}

    def __call__(self, anchor: int, room: int, nodes: int) -> Fragment:
        depth = max(min(room, self.depth), 1)
        if (anchor, depth) not in self.grown:
            self.grown[anchor, depth] = grow_tree(self.state, anchor, top_k=self.top_k, depth=depth)
        if (anchor, depth, nodes) not in self.memo:
            self.memo[anchor, depth, nodes] = select(self.grown[anchor, depth], nodes)
        return self.memo[anchor, depth, nodes]


def eagle_prior(key: tuple) -> float | None:
    """The drafter's keys: its own probability's bucket (as a Medusa head's probability is close to its
    acceptance rate); None for other drafters' keys."""
    return float(PRIOR[key[2]]) if key[0] == KIND else None


def _fixed(continuation: list[int], prompt_len: int, tree_of) -> list[int]:
    """Tokens per step along the continuation when every step verifies ``tree_of(anchor)`` alone, unbudgeted."""
    steps, pos = [], 0
    while pos + 1 < len(continuation):
        fragment = tree_of(prompt_len + pos - 1, len(continuation) - pos - 1)
        accepted, at = 0, -1  # the deepest matching path
        while True:
            kids = [i for i in range(fragment.size) if fragment.parent[i] == at]
            hit = (
                next((i for i in kids if fragment.tokens[i] == continuation[pos + 1 + accepted]), None)
                if pos + 1 + accepted < len(continuation)
                else None
            )
            if hit is None:
                break
            accepted, at = accepted + 1, hit
        emitted = min(accepted + 1, len(continuation) - pos - 1)
        steps.append(emitted)
        pos += emitted
    return steps


def weight_bytes(drafter: EagleDrafter, heads_model) -> tuple[int, int]:
    """Parameters read by one drafter call (its layer, fuse and lm_head) and by one heads call (the heads' own
    blocks and the rows of the projection they read)."""
    one_call = sum(p.numel() for m in (drafter.fuse, drafter.layer, drafter.lm_head) for p in m.parameters())
    heads = heads_model.heads
    own = sum(p.numel() for p in heads.parameters())
    projection = 0 if not heads.config.shared_lm_head else (heads_model.draft_vocab or heads.config.vocab_size) * heads.config.hidden_size
    return one_call, own + projection


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_trt.bench.eagle_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default="assets/smollm2-135m-medusa")
    p.add_argument("--tree", default="assets/smollm2-135m-medusa/template.json", help="the Medusa heads' template")
    p.add_argument("--draft-vocab", type=int, default=16384, help="the Medusa heads' draft vocabulary (as the cache was made)")
    p.add_argument("--drafter", type=Path, required=True, help="an EAGLE-3-style drafter folder (training/eagle.py)")
    p.add_argument("--cache", type=Path, required=True, help="bench/replay.py's --cache of the greedy outputs and head top-k")
    p.add_argument("--engine", type=Path, required=True, help="the engine folder whose step cost and heads call price the rows")
    p.add_argument("--top-k", type=int, default=8, help="children per expanded node, and nodes expanded per depth")
    p.add_argument("--depth", type=int, default=6, help="draft depth: drafter calls a step")
    p.add_argument("--nodes", type=int, action="append", help="fixed-width rows (repeatable; default 8, 16, 32)")
    p.add_argument("--budget-nodes", type=int, default=32, help="drafter nodes offered to the budgeted rows")
    p.add_argument("--draft", action="append", help="comma-separated drafter sets for budgeted rows (repeatable)")
    p.add_argument("--call-cost", type=float, help="one drafter call relative to a one-token step (default: from the heads call)")
    p.add_argument("--limit", type=int)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _run(args)
    except MedusaError as exc:
        return fail(p.prog, exc)


@torch.no_grad()
def _run(args) -> int:
    if not args.cache.is_file():
        raise ReplayError(f"--cache {args.cache} does not exist: make it with python -m medusa_trt.bench.replay --cache {args.cache}")
    from medusa_trt.runtime import durable

    sets = [
        tuple(x for x in d.split(",") if x)
        for d in (args.draft or ["heads", "heads,lookup,recycle", "eagle", "eagle,lookup,recycle", "eagle,heads,lookup,recycle"])
    ]
    widths = args.nodes or [8, 16, 32]
    model = load_medusa(args.model, args.heads)
    if model.heads is not None and model.heads.config.head_input == "hidden+path":
        raise ReplayError(f"--heads {args.heads}: sequential heads expand a template; replay them with bench/replay.py")
    model.draft_vocab = args.draft_vocab
    runtime = MedusaRuntime(model, tree=args.tree, max_context=1024, max_batch=1)
    drafter = load_drafter(args.drafter, model.base)  # the causal LM
    cost, heads_cost = engine_cost(args.engine)
    call_bytes, heads_bytes = weight_bytes(drafter, model)
    call_cost = args.call_cost if args.call_cost is not None else heads_cost * call_bytes / heads_bytes
    log.info(
        "one drafter call %.3f of a one-token step (%d vs %d weights of the heads call at %.3f)",
        call_cost,
        call_bytes,
        heads_bytes,
        heads_cost,
    )
    cached = dict(np.load(args.cache, allow_pickle=True))
    prompts = sorted(int(k[3:]) for k in cached if k.startswith("ids"))  # replay.py skips prompts too long for its context
    results: dict[str, list] = {}
    base_cfg = runtime.drafting.config
    rows = runtime.drafting.template.rows
    for i in tqdm(prompts[: args.limit], desc="eagle replay", unit="prompt"):
        ids, continuation = cached[f"ids{i}"].tolist(), cached[f"cont{i}"].tolist()
        topk, conf = head_topk(model, ids + continuation, runtime.tree.top_k, None, len(ids))  # this --heads' own
        topk, conf = topk[:, :rows], conf[:, :rows]
        tree_of = DraftTrees(EaglePass(drafter, ids + continuation), top_k=args.top_k, depth=args.depth)

        for n in widths:
            results.setdefault(f"eagle@{n}", []).append((_fixed(continuation, len(ids), lambda a, r, n=n, t=tree_of: t(a, r, n)), None))
        for names in sets:
            uses = "eagle" in names
            own = tuple(x for x in names if x != "eagle")
            steps, nodes = replay(
                runtime,
                ids,
                continuation,
                topk,
                own,
                cost,
                base_cfg,
                confidence=conf,
                extra=(lambda a, room, t=tree_of: t(a, room, args.budget_nodes)) if uses else None,
                prior=eagle_prior if uses else None,
                extra_depth=args.depth if uses else 0,
            )
            results.setdefault(",".join(names), []).append((steps, nodes))
    table = {}
    for name, per_prompt in results.items():
        steps = np.array([x for s, _ in per_prompt for x in s])
        row = {"tokens_per_step": round(float(steps.mean()), 4), "steps": int(len(steps)), "tokens": int(steps.sum())}
        if per_prompt[0][1] is not None:
            nodes = np.array([x for _, n in per_prompt for x in n])
            draft = (heads_cost if "heads" in name.split(",") else 0.0) + (call_cost * args.depth if "eagle" in name.split(",") else 0.0)
            row |= {"mean_nodes": round(float(nodes.mean()), 2), "modelled_vs_plain": round(modelled_speedup(steps, nodes, cost, draft), 4)}
        table[name] = row
        print(
            f"{name:30s} {row['tokens_per_step']:.3f} tokens/step"
            + (f"  {row['mean_nodes']:5.1f} nodes  modelled {row['modelled_vs_plain']:.2f}x plain" if "mean_nodes" in row else "")
        )
    if args.out:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "call_cost": call_cost, "heads_cost": heads_cost, "results": table}
        durable.write_text(args.out, json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
