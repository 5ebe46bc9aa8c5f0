"""Hardware-aware tree calibration: pick the Medusa tree that maximises expected tokens per second.

Two measurements, one model:

  * head accuracy   ``acc[k, i]`` = P(head k's rank-i proposal is the true token), from real greedy
                    decoding on the engine (``measure_head_hits`` -> ``head_accuracy``);
  * step latency    ``step_ms[T]`` = one engine call on T tree tokens over a committed context
                    (``measure_step_ms``), interpolated between the measured sizes.

Under the independence assumption of the Medusa paper a node (path ``[r1, ..., rd]``) is accepted
with probability ``prod_d acc[d-1, r_d]`` and the expected accepted drafted tokens of a tree is the
sum of that over its nodes. ``grow_trees`` builds the paper's greedy "optimized tree" one node at a
time; ``pick_tree`` scores every grown size by ``(1 + E[accepted]) / (step_ms(T) + heads_ms)`` (no heads
call for T = 1, plain decoding) and
keeps the best. Flat verify cost (a GPU far from saturation) favours big trees; cost that grows with
T (a CPU) favours small ones.

Terms: T is tree tokens per step, root included (``len(paths) + 1``); K is ranks per head; D the
number of heads. numpy only at import (the measuring functions take a built ``MedusaRuntime``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.step_cost import measure, median_ms
from medusa_trt.runtime.tree import chain_paths

log = logging.getLogger(__name__)


class CalibrationError(MedusaError):
    """Calibration cannot run on what it was given (no heads, no positions, bad sizes); the message says what to do."""


@dataclass(frozen=True)
class CalibrateConfig:  # saved in the report beside the tree it produced
    max_nodes: int = 64  # largest tree considered, root included (an engine's max_tokens caps it)
    top_k: int = 10  # ranks considered per head: the published trees use top-10 (an engine's heads output caps it)
    max_new_tokens: int = 64  # greedy tokens decoded per prompt to measure head accuracy
    context: int = 256  # committed tokens the step latency is timed over (mid-length generation)
    repeats: int = 5  # timed engine calls per tree size; the median is kept

    def __post_init__(self):
        for name in ("max_nodes", "top_k", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise CalibrationError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.context < 0:
            raise CalibrationError(f"context must be >= 0, got {self.context}")


@dataclass(frozen=True)
class Choice:
    paths: tuple[tuple[int, ...], ...]  # the chosen tree, in the order nodes were added
    num_nodes: int  # T = len(paths) + 1
    expected_tokens_per_step: float  # 1 + E[accepted drafted tokens]
    expected_tokens_per_s: float  # expected_tokens_per_step / (step_ms(T) + heads_ms) * 1e3
    curve: tuple[tuple[int, float, float], ...]  # every candidate: (T, tokens_per_step, tokens_per_s), ascending T

    def to_dict(self) -> dict:
        return {
            "paths": [list(p) for p in self.paths],
            "num_nodes": self.num_nodes,
            "expected_tokens_per_step": self.expected_tokens_per_step,
            "expected_tokens_per_s": self.expected_tokens_per_s,
            "curve": [list(c) for c in self.curve],
        }


# ----------------------------------------------------------------- the model (pure)


def head_accuracy(hits: np.ndarray, top_k: int | None = None) -> np.ndarray:
    """acc [n_heads, K] float64: acc[k, i] = fraction of positions where head k's true token was its rank i.

    hits: int [N, n_heads], the 0-based rank of the true token in head k's top-K list, -1 when it was
    not in the list. K = ``top_k``, or the largest rank seen + 1 when not given."""
    hits = np.asarray(hits)
    if hits.ndim != 2 or not np.issubdtype(hits.dtype, np.integer):
        raise CalibrationError(f"hits must be an int array [positions, heads], got {hits.dtype} {hits.shape}")
    if hits.shape[0] == 0:
        raise CalibrationError("no decoding positions were measured: give more or longer prompts, or raise max_new_tokens")
    K = int(top_k) if top_k is not None else max(int(hits.max()) + 1, 1)
    if hits.min() < -1 or hits.max() >= K:
        raise CalibrationError(f"hits hold ranks in [{hits.min()}, {hits.max()}] but must lie in [-1, {K - 1}] for top_k={K}")
    n, heads = hits.shape
    acc = np.zeros((heads, K), dtype=np.float64)  # (D, K)
    for k in range(heads):
        found = hits[:, k][hits[:, k] >= 0]  # (M,) misses (-1) count only in the denominator
        acc[k] = np.bincount(found, minlength=K)[:K] / n
    return acc


def _check_acc(acc) -> np.ndarray:
    acc = np.asarray(acc, dtype=np.float64)
    if acc.ndim != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
        raise CalibrationError(f"acc must be [heads, K] with at least one head and one rank, got shape {acc.shape}")
    if acc.min() < 0 or (acc.sum(axis=1) > 1 + 1e-9).any():
        raise CalibrationError("acc rows must be probabilities of exclusive ranks: non-negative, summing to at most 1")
    return acc


def node_probability(path, acc: np.ndarray) -> float:
    """P(node accepted) = prod over its path of acc[depth - 1, rank] (heads independent)."""
    p = 1.0
    for depth, rank in enumerate(path):
        p *= acc[depth, rank]
    return float(p)


def expected_accept(paths, acc) -> float:
    """Expected accepted drafted tokens per step: sum over nodes of P(node accepted).

    Greedy verification accepts at most one child per level and a head's ranks are exclusive
    events, so the expected length of the accepted path is exactly this sum under independence."""
    acc = _check_acc(acc)
    D, K = acc.shape
    total = 0.0
    for path in paths:
        if len(path) > D or max(path) >= K:
            raise CalibrationError(
                f"tree path {list(path)} needs {len(path)} heads and rank {max(path)}, but acc "
                f"covers {D} heads and top-{K}: measure more ranks or use a smaller tree"
            )
        total += node_probability(path, acc)
    return total


def grow_trees(acc, max_nodes: int) -> list[list[list[int]]]:
    """The greedy "optimized tree" of the Medusa paper, one node at a time.

    Start from the root alone; repeatedly add, among the next unused rank of every node (root
    included) that is shallower than the number of heads, the one most likely to be accepted (ties:
    shallower, then smaller path). Returns trees with 1, 2, ... up to ``max_nodes`` nodes, root
    included: ``trees[i]`` has i + 1 nodes and ``trees[0] == []``; fewer when the heads x ranks run out.
    Each tree lists its paths in the order they were added, so it is prefix-closed."""
    acc = _check_acc(acc)
    if max_nodes < 1:
        raise CalibrationError(f"max_nodes must be >= 1, got {max_nodes}")
    D, K = acc.shape
    added: list[tuple[int, ...]] = []
    prob = {(): 1.0}  # node -> P(accepted)
    next_rank = {(): 0}  # node -> its next unused child rank
    while len(added) + 1 < max_nodes:
        frontier = [parent + (r,) for parent, r in next_rank.items() if r < K and len(parent) < D]
        if not frontier:
            break
        best = max(frontier, key=lambda p: (prob[p[:-1]] * acc[len(p) - 1, p[-1]], -len(p), tuple(-i for i in p)))
        added.append(best)
        prob[best] = prob[best[:-1]] * acc[len(best) - 1, best[-1]]
        next_rank[best[:-1]] += 1
        next_rank[best] = 0
    return [[list(p) for p in added[:n]] for n in range(len(added) + 1)]


def step_cost(step_ms: dict[int, float], tokens: int) -> float:
    """Engine step latency at T tokens: linear between measured sizes, clamped at the ends."""
    if not step_ms:
        raise CalibrationError("step_ms is empty: time at least one tree size")
    sizes = np.array(sorted(step_ms), dtype=np.float64)
    return float(np.interp(tokens, sizes, [step_ms[int(s)] for s in sizes]))


def choose(trees, acc, step_ms: dict[int, float], heads_ms: float = 0.0) -> Choice:
    """Score each candidate tree by expected tokens/s and keep the best (ties: the smaller tree)."""
    acc = _check_acc(acc)
    if not trees:
        raise CalibrationError("no candidate trees to choose from")
    if any(v <= 0 for v in step_ms.values()) or heads_ms < 0:
        raise CalibrationError("step latencies must be > 0 ms and heads_ms >= 0")
    curve = []
    for paths in trees:
        T = len(paths) + 1
        per_step = 1.0 + expected_accept(paths, acc)
        overhead = heads_ms if T > 1 else 0.0  # the root-only tree is plain decoding: no proposals to make
        curve.append((T, per_step, per_step / (step_cost(step_ms, T) + overhead) * 1e3))
    best = max(range(len(trees)), key=lambda i: (curve[i][2], -curve[i][0]))
    order = sorted(range(len(trees)), key=lambda i: curve[i][0])
    return Choice(
        paths=tuple(tuple(p) for p in trees[best]),
        num_nodes=curve[best][0],
        expected_tokens_per_step=curve[best][1],
        expected_tokens_per_s=curve[best][2],
        curve=tuple(curve[i] for i in order),
    )


def pick_tree(acc, step_ms: dict[int, float], max_nodes: int, heads_ms: float = 0.0) -> Choice:
    """The grown tree (1..max_nodes nodes) with the highest expected tokens/s on this hardware."""
    return choose(grow_trees(acc, max_nodes), acc, step_ms, heads_ms)


def best_chain(acc, step_ms: dict[int, float], max_nodes: int, heads_ms: float = 0.0) -> Choice:
    """The same choice among chains (each head's top-1 stacked, chain-0 = plain decoding), for comparison."""
    acc = _check_acc(acc)
    longest = min(acc.shape[0], max_nodes - 1)
    return choose([chain_paths(n) for n in range(longest + 1)], acc, step_ms, heads_ms)


def step_sizes(max_nodes: int) -> list[int]:
    """Tree sizes worth timing: powers of two below max_nodes, and max_nodes itself."""
    sizes = [1 << i for i in range(max_nodes.bit_length()) if (1 << i) < max_nodes]
    return sizes + [max_nodes]


# ----------------------------------------------------------------- measuring on an engine


def measure_step_ms(runtime, sizes, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median latency (ms) of ``runtime.backend.step`` on T chain-masked tokens over ``context``
    committed cache slots, for each T in ``sizes``; batch 1. Timed by ``runtime.step_cost.measure``
    (the engine's own step-cost curve, made non-decreasing); nothing is committed."""
    backend = runtime.backend
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 1:
        raise CalibrationError(f"tree sizes to time must be >= 1, got {sizes}")
    limit = getattr(backend, "max_tokens", None)
    if limit is not None and sizes[-1] > limit:
        raise CalibrationError(f"cannot time {sizes[-1]} tokens per step: the engine takes at most {limit}; lower --max-nodes")
    if context < 0 or context + sizes[-1] > backend.max_context:
        raise CalibrationError(
            f"timing {sizes[-1]} tokens over a {context}-token context needs max_context >= "
            f"{context + sizes[-1]}, the engine has {backend.max_context}: lower the context or --max-nodes"
        )
    cost = measure(backend, sizes=sizes, context=context, repeats=repeats)
    out = {T: cost.table[T] * cost.step_ms for T in sizes}
    for T, ms in out.items():
        log.info("step over %d context tokens, T=%d: %.3f ms", context, T, ms)
    return out


def measure_heads_ms(runtime, top_k: int, repeats: int = 5) -> float:
    """Median latency (ms) of one ``backend.propose`` call (the heads at the accepted node), which
    the loop pays once per step whatever the tree."""
    backend = runtime.backend
    if getattr(backend, "meta", None) is not None:  # an engine: runtime.step_cost.measure times its heads after a step
        cost = measure(backend, sizes=(1,), context=0, repeats=repeats, top_k=top_k)
        return cost.heads * cost.step_ms
    # the torch backend carries no EngineMeta, whose heads runtime.step_cost.measure does not time: time them here
    one = np.zeros((1, 1), dtype=np.int64)
    out = backend.step(one, one, np.ones((1, 1, 1), dtype=bool), np.zeros(1, dtype=np.int64))
    root = np.zeros(1, dtype=np.int64)  # (1,) the next token, read by next-token-aware heads (its value does not change the cost)
    return median_ms(lambda: backend.propose(out, np.zeros(1, dtype=np.int64), top_k, root), repeats)


def engine_top_k(runtime) -> int:
    """Most proposals per head the runtime's backend returns (an ONNX engine records it; torch: the vocabulary)."""
    meta = getattr(runtime.backend, "meta", None)
    return int(meta.top_k) if meta is not None else int(runtime.backend.model.vocab_size)


def greedy_proposals(runtime, prompt: list[int], max_new_tokens: int, top_k: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding (one token per step, as ``with_tree("chain-0")``) straight on the backend.

    Returns the generated tokens t_0..t_{n-1} and proposals int64 [n, n_heads, K]: row i holds the
    heads' top-K made when t_i was emitted (at the hidden state of the token before t_i: the last
    prompt token for i = 0, else t_{i-1}). Head k (0-based) of row i guesses t_{i+1+k}."""
    backend, max_context = runtime.backend, runtime.max_context
    if not prompt:
        raise CalibrationError("an empty prompt cannot be decoded: remove it from the prompts file")
    if len(prompt) + 1 > max_context:
        raise CalibrationError(f"prompt of {len(prompt)} tokens leaves no room in max_context {max_context}")
    eos = runtime.eos
    chunk = min(runtime.config.prefill_chunk, getattr(backend, "max_tokens", None) or runtime.config.prefill_chunk)
    length = 0
    for start in range(0, len(prompt), chunk):  # prefill, chain-masked, every prompt token committed
        piece = np.array([prompt[start : start + chunk]], dtype=np.int64)  # (1, W)
        width = piece.shape[1]
        positions = length + np.arange(width, dtype=np.int64)[None, :]  # (1, W)
        mask = np.tril(np.ones((width, width), dtype=bool))[None]  # (1, W, W)
        out = backend.step(piece, positions, mask, np.array([length], dtype=np.int64))
        target = out.argmax  # (1, W)
        backend.commit(out, np.arange(width, dtype=np.int64)[None, :], np.array([width]), np.array([length], dtype=np.int64))
        length += width
    tokens = [int(target[0, width - 1])]
    # the root of each proposal is the token just emitted (next-token-aware heads read it)
    # copy: the backend reuses its buffer
    proposals = [np.array(backend.propose(out, np.array([width - 1]), top_k, np.array(tokens[-1:], dtype=np.int64)).ids[0])]
    one = np.ones((1, 1, 1), dtype=bool)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos and length + 1 < max_context:
        lengths = np.array([length], dtype=np.int64)
        out = backend.step(np.array([[tokens[-1]]], dtype=np.int64), lengths[:, None], one, lengths)
        target = out.argmax  # (1, 1)
        backend.commit(out, np.zeros((1, 1), dtype=np.int64), np.array([1]), lengths)
        length += 1
        tokens.append(int(target[0, 0]))
        root = np.array(tokens[-1:], dtype=np.int64)  # (1,)
        proposals.append(np.array(backend.propose(out, np.zeros(1, dtype=np.int64), top_k, root).ids[0]))  # (n_heads, K)
    return tokens, np.stack(proposals).astype(np.int64)  # (n, n_heads, K)


def hits_from_proposals(tokens: list[int], proposals: np.ndarray, expansion=None, num_heads: int | None = None) -> np.ndarray:
    """hits int64 [N, n_heads] from one decoded sequence: the rank of t_{i+1+k} in row i's head k
    list, -1 when absent. Rows whose last head's target lies past the sequence are dropped.

    Sequential heads (``expansion``: their template's ``drafting.sequential.Expansion``; proposals
    [n, P, K], one row per expanded node): head k's list is the one below the expanded node the
    true tokens t_{i+1}..t_{i+k} lead to; where they leave the template (a miss above, or a node
    that is not expanded) head k's hit is -1, as no tree of the template could hold it."""
    if expansion is None:
        heads = proposals.shape[1]
    else:
        heads = num_heads or int(expansion.depth.max()) + 1
        child = {(int(expansion.parent[r]), int(expansion.rank[r])): r for r in range(1, expansion.rows)}
    rows = max(len(tokens) - heads, 0)  # row i needs t_{i + heads}
    hits = np.full((rows, heads), -1, dtype=np.int64)
    for i in range(rows):
        row = 0  # sequential heads: the expanded node the true path has reached
        for k in range(heads):
            match = np.flatnonzero(proposals[i, k if expansion is None else row] == tokens[i + 1 + k])
            if not match.size:
                if expansion is None:
                    continue
                break
            hits[i, k] = match[0]
            if expansion is not None:
                row = child.get((row, int(match[0])), -1)
                if row < 0:
                    break
    return hits


def measure_head_hits(runtime, prompts_ids, max_new_tokens: int, top_k: int) -> np.ndarray:
    """hits int64 [N, n_heads] over greedy decoding of every prompt (see ``hits_from_proposals``)."""
    from tqdm.auto import tqdm

    if not runtime.num_heads:
        raise CalibrationError("the engine has no Medusa heads, so there is no tree to calibrate: export it with --heads")
    top_k = min(top_k, engine_top_k(runtime))
    parts = []
    for ids in tqdm(prompts_ids, desc="head accuracy", unit="prompt", disable=None):
        if len(ids) + 1 > runtime.max_context:
            log.warning("skipping a prompt of %d tokens: max_context is %d", len(ids), runtime.max_context)
            continue
        tokens, proposals = greedy_proposals(runtime, list(ids), max_new_tokens, top_k)
        parts.append(hits_from_proposals(tokens, proposals, runtime._info.expansion, runtime.num_heads))
    return np.concatenate(parts) if parts else np.zeros((0, runtime.num_heads), dtype=np.int64)


# ----------------------------------------------------------------- plot


def plot_calibration(acc, choice: Choice, path, *, chain: Choice | None = None) -> None:
    """Left: each head's cumulative top-k accuracy; right: expected tokens/s against tree size,
    the chosen size marked (and the chains' curve when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = _check_acc(acc)
    ranks = np.arange(1, acc.shape[1] + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k, row in enumerate(acc):
        left.plot(ranks, np.cumsum(row), marker="o", markersize=3, label=f"head {k + 1}")
    left.set(xlabel="top-k", ylabel="P(true token in top-k)", ylim=(0, 1), title="Medusa head accuracy")
    left.legend(fontsize=8)
    sizes, _, rates = zip(*choice.curve)
    right.plot(sizes, rates, label="greedy tree")
    if chain is not None:
        c_sizes, _, c_rates = zip(*chain.curve)
        right.plot(c_sizes, c_rates, marker="s", markersize=4, linestyle="--", color="#999999", label="chain")
    right.plot(
        [choice.num_nodes],
        [choice.expected_tokens_per_s],
        "r*",
        markersize=12,
        label=f"chosen: T={choice.num_nodes}, {choice.expected_tokens_per_step:.2f} tok/step",
    )
    right.set(xlabel="tree tokens T (root included)", ylabel="expected tokens / s", title="Tree size vs throughput")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate(runtime, prompts: list[str], config: CalibrateConfig, sources: dict) -> tuple[dict, np.ndarray, Choice, Choice]:
    """What ``medusa-calibrate`` measures and chooses on ``runtime`` over ``prompts``: returns (report,
    acc, choice, best chain); ``sources`` (engine, model, heads, prompts_file) go into the report as
    given. Writes nothing (``write_calibration`` does)."""
    from medusa_trt.runtime.tree import compile_tree

    runtime = runtime.with_tree("chain-0")  # plain decoding; the heads still propose every step
    if not runtime.num_heads:
        raise CalibrationError("the engine has no Medusa heads, so there is no tree to calibrate: export it with --heads")
    top_k = min(config.top_k, engine_top_k(runtime))
    if top_k < config.top_k:
        log.warning(
            "the engine's heads return top-%d proposals only: calibrating over %d ranks (export with a wider "
            "tree such as mc_sim_7b_63 for more)",
            top_k,
            top_k,
        )
    max_nodes = min(config.max_nodes, runtime.backend.max_tokens or config.max_nodes, runtime.max_context - 1)
    if max_nodes < config.max_nodes:
        log.warning("the engine takes at most %d tokens per step: trees up to %d nodes", max_nodes, max_nodes)
    sizes = step_sizes(max_nodes)
    context = max(min(config.context, runtime.max_context - sizes[-1]), 0)
    if context < config.context:
        log.warning("max_context %d: timing steps over %d context tokens instead of %d", runtime.max_context, context, config.context)

    ids = [runtime.codec.encode(p, chat=runtime.is_chat) for p in prompts]
    hits = measure_head_hits(runtime, ids, config.max_new_tokens, top_k)
    acc = head_accuracy(hits, top_k)
    step_ms = measure_step_ms(runtime, sizes, context=context, repeats=config.repeats)
    heads_ms = measure_heads_ms(runtime, top_k, config.repeats)
    choice = pick_tree(acc, step_ms, max_nodes, heads_ms)
    chain = best_chain(acc, step_ms, max_nodes, heads_ms)
    tree = compile_tree([list(p) for p in choice.paths], max_depth=runtime.num_heads, name=f"calibrated-{choice.num_nodes}")
    report = {
        "engine": sources.get("engine"),
        "model": sources.get("model"),
        "heads": sources.get("heads"),
        "backend": runtime.backend.name,
        "prompts_file": sources.get("prompts_file"),
        "prompts": len(prompts),
        "positions": int(hits.shape[0]),
        "config": dataclasses.asdict(config) | {"top_k_used": top_k, "max_nodes_used": max_nodes, "context_used": context},
        "acc": acc.tolist(),
        "step_ms": {str(k): v for k, v in step_ms.items()},
        "heads_ms": heads_ms,
        "tree": json.loads(tree.to_json()),
        "choice": choice.to_dict(),
        "best_chain": chain.to_dict(),
    }
    return report, acc, choice, chain


def _plot(acc, choice, chain, path: Path) -> bool:
    """The calibration plot at ``path``; False (and a warning) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("matplotlib not installed: no plot (pip install matplotlib)")
        return False
    plot_calibration(acc, choice, path, chain=chain)
    return True


def write_calibration(out: Path, report: dict, acc, choice, chain) -> list[Path]:
    """The tree at ``out``, its medusa_choices list, report and plot beside it, each whole or not at all; returns what was written."""
    from medusa_trt.exporter.interop import medusa_choices_json
    from medusa_trt.runtime.durable import staged_files as staged

    report_path, plot_path = out.with_suffix(".report.json"), out.with_suffix(".png")
    choices_path = out.with_suffix(".medusa_choices.json")  # the same tree as a plain list (TensorRT-LLM's --medusa_choices)
    try:
        with staged(out, report_path, plot_path, choices_path) as (tmp_tree, tmp_report, tmp_plot, tmp_choices):
            tmp_tree.write_text(json.dumps(report["tree"]))
            tmp_choices.write_text(medusa_choices_json(report["tree"]["paths"]) + "\n")
            tmp_report.write_text(json.dumps(report, indent=2))
            plotted = _plot(acc, choice, chain, tmp_plot)
    except OSError as exc:  # a full disk, a folder that went away: nothing was left behind
        raise MedusaError(
            f"cannot write {out}: {exc.strerror or exc}: check the folder (free space, permissions) or pick another --out"
        ) from exc
    return [out, choices_path, report_path] + ([plot_path] if plotted else [])
