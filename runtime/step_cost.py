"""An engine's own step-cost curve, measured: what the drafting budget weighs a tree against.

A verify step of W tokens costs ``table[W]`` one-token steps, and the heads call after it costs
``heads`` more (plain decoding pays neither). Engines differ wildly: fp32 on 2 CPU cores pays
1.3x for 8 tokens, an int4 (MatMulNBits) engine several times that, so one shared table sends
big trees to engines where they cost more than they emit. ``measure`` times the engine itself
(chain steps over a committed context, and one heads call); the exporter writes the result into
an engine folder's ``drafting.json`` and ``medusa-calibrate`` rewrites it there.

``drafting_pays`` is the by-design guard: when no tree could beat plain decoding even with every
draft of its deepest path accepted (min(W, depth + 1) tokens for ``table[W] + heads``, against 1
for ``table[1]``), the runtime drafts nothing on that engine by default, so default drafting is
never slower than plain decoding there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens per step timed (those the engine takes)
CONTEXT = 256  # committed tokens the timed steps attend to (fewer when the engine's context is smaller)
REPEATS = 9  # timed rounds (one call of each size per round), after one warm-up round; the median counts


@dataclass(frozen=True)
class MeasuredCost:
    table: dict[int, float]  # tokens per step -> cost relative to a one-token step
    heads: float = 0.0  # the heads call after a step, relative to a one-token step (0: no heads)
    step_ms: float = 0.0  # the one-token step's median time, for humans


def _isotonic(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a wider step never costs less."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def measure(backend, *, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS, top_k: int = 1) -> MeasuredCost:
    """Time ``backend`` (the step contract): chain steps of each size over ``context`` committed
    slots at batch 1, and one heads call when the engine has heads. Sizes are timed in rounds (one
    call of each per round, after a warm-up round), so a passing disturbance spreads over all of
    them; the per-size medians are then made non-decreasing. Commits nothing (the cache's contents
    do not change the cost)."""
    limit = backend.max_tokens or max(sizes)
    sizes = sorted({s for s in sizes if s <= limit} | {1})
    context = max(0, min(context, backend.max_context - sizes[-1]))
    lengths = np.array([context], dtype=np.int64)  # (1,)
    calls, last = {}, []  # last: the latest step's output, which the heads call reads

    def step(ids, positions, mask):
        last[:] = [backend.step(ids, positions, mask, lengths)]

    for t in sizes:
        ids = np.zeros((1, t), dtype=np.int64)  # (1, T)
        positions = context + np.arange(t, dtype=np.int64)[None, :]  # (1, T)
        mask = np.tri(t, dtype=bool)[None]  # (1, T, T)
        calls[t] = lambda ids=ids, positions=positions, mask=mask: step(ids, positions, mask)
    meta = getattr(backend, "meta", None)
    if meta is not None and meta.num_heads:
        roots = np.zeros(1, dtype=np.int64)
        calls["heads"] = lambda: backend.propose(last[0], np.zeros(1, dtype=np.int64), min(top_k, meta.top_k), roots)
    times: dict = {k: [] for k in calls}
    for round_ in range(repeats + 1):  # round 0 warms up: a new shape pays allocation and planning once
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                times[key].append(time.perf_counter() - start)
    ms = [float(np.median(times[t])) * 1e3 for t in sizes]
    ms = _isotonic(ms)
    heads = float(np.median(times["heads"])) * 1e3 / ms[0] if "heads" in times else 0.0
    cost = MeasuredCost({t: m / ms[0] for t, m in zip(sizes, ms)}, heads, ms[0])
    log.info(
        "step cost over %d context tokens: %s; heads %.2f (one-token step %.2f ms)",
        context,
        ", ".join(f"{t}: {c:.2f}" for t, c in cost.table.items()),
        heads,
        ms[0],
    )
    return cost


def time_steps(backends: dict, context: int, sizes, rounds: int, burst: int = 1, settle: float = 0.0) -> tuple[dict, dict]:
    """{engine: {T: [seconds]}} of chain steps of T tokens after ``context`` committed, and {T: the
    engines' outputs identical}. Round by round every size on every engine, the engines' order
    flipping each round, so a passing disturbance spreads over all of them. ``burst`` > 1: each turn
    is that many steps in a row, the first untimed (an engine's ONNX Runtime pool spins on a core for
    a while after its step, which an engine stepping right after it pays for). ``settle``: seconds of
    sleep before each turn, so the other engine's threads have stopped spinning (each timed as if alone)."""
    names = list(backends)
    calls, same = {}, {}
    for t in sizes:
        ids = (np.arange(t, dtype=np.int64) * 131 + 7)[None] % backends[names[0]].meta.vocab_size  # (1, T)
        calls[t] = (ids, (context + np.arange(t))[None], np.tri(t, dtype=bool)[None], np.array([context]))
        outs = {name: b.step(*calls[t]) for name, b in backends.items()}  # the warm-up step, compared
        first = outs[names[0]]
        same[t] = all(np.array_equal(first.logits(), outs[n].logits()) and np.array_equal(first.argmax, outs[n].argmax) for n in names)
    times = {name: {t: [] for t in sizes} for name in names}
    for round_ in range(rounds):
        for t in sizes:
            for name in names if round_ % 2 == 0 else names[::-1]:
                if settle:
                    time.sleep(settle)
                if burst > 1:
                    backends[name].step(*calls[t])
                for _ in range(max(burst - 1, 1)):
                    start = time.perf_counter()
                    backends[name].step(*calls[t])
                    times[name][t].append(time.perf_counter() - start)
    return times, same


def drafting_pays(cost, heads: float, max_nodes: int, max_depth: int) -> bool:
    """Whether some tree of 2..max_nodes tokens could beat plain decoding if every draft on its
    deepest path were accepted: a tree of W nodes emits at most min(W, max_depth + 1) tokens, for
    cost(W) + heads against 1 for cost(1). ``cost`` a ``CostModel`` (relative, batch 1)."""
    if max_nodes < 2 or max_depth < 1:
        return False
    widths = np.arange(1, max_nodes + 1)
    rel = cost.cost(widths)  # (W,)
    best = np.minimum(widths, max_depth + 1)[1:]
    return bool((best / (rel[1:] + heads) > 1.0 / rel[0]).any())


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls, after one warm-up call."""
    fn()  # warm-up: first calls at a new shape pay allocation and planning
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3
