"""Compare a TensorRT plan with the ONNX graph it was built from, through polygraphy.

polygraphy's ``Comparator.run`` gives every runner the same feeds and ``Comparator.compare_accuracy``
checks each float output against a tolerance of its own (``SimpleCompareFunc``, elementwise: an
element fails when it exceeds both its atol and its rtol). The feeds come from the engine's
metadata alone, so any pair of runners over graphs of one engine can be compared:

* step graph: a prefill of two right-padded prompts of 7 and 4 tokens (fewer when a step takes
  fewer) under a chain mask over an empty cache, then a step of the engine's default tree over a
  7-slot cache with ragged lengths 7 and 4;
* heads graph: two hidden states (and the next tokens, for heads that read them).

The id outputs (next_ids, next_topk, head_topk) are not compared: a logit tie within the float
tolerance may order them differently; the token-identity tests on a GPU check the tokens.

``build_engines`` calls ``compare_plan`` on each plan it builds (ONNX Runtime runner against a
TensorRT runner); tests pass two ONNX Runtime runners to ``compare_runners``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.exporter.errors import TensorRTBuildError
from medusa_trt.runtime import key_slots
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEAD_LOGITS,
    HEADS_INPUTS,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    NEW_KEY,
    NEW_VALUE,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    TREE_MASK,
)
from medusa_trt.runtime.engine import EngineMeta
from medusa_trt.runtime.tree import compile_tree

log = logging.getLogger(__name__)

PREFILL_TOKENS = 7  # the longer prompt of the prefill; the other is 4 (as the ONNX verification)
STEP_COMPARED = (LOGITS, HIDDEN, NEW_KEY, NEW_VALUE)  # float outputs of the step graph
HEADS_COMPARED = (HEAD_LOGITS,)
FEED_DTYPES = {"fp32": np.float32, "fp16": np.float16}  # numpy has no bfloat16


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float  # of the first runner's (the ONNX graph's) values


# Per engine dtype, applied to every compared output: TensorRT picks other kernels and
# accumulation orders than ONNX Runtime, so fp16 differs by a few of its ulps at logit scale (the
# ONNX export itself differs from torch by about 2.5e-2 in fp16 on stories260K).
TOLERANCES = {"fp32": Tolerance(atol=1e-3, rtol=1e-3), "fp16": Tolerance(atol=1e-1, rtol=2e-2)}


class PlanMismatchError(TensorRTBuildError):
    """The TensorRT plan disagrees with its ONNX graph beyond the tolerance (or could not be compared)."""


@dataclass(frozen=True)
class PlanComparison:
    """One graph's comparison: the largest abs difference of each compared output over all feeds."""

    graph: str  # "step" or "heads"
    max_abs: Mapping[str, float]  # output -> max abs difference, over every feed
    failed: tuple[str, ...]  # outputs with an element beyond both its atol and rtol
    tolerances: Mapping[str, Tolerance]
    skipped: str | None = None  # why the plan was not compared (nothing else is set then)

    @property
    def passed(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """One line, as ``medusa-export`` prints it."""
        if self.skipped:
            return f"{self.graph} plan not compared against ONNX Runtime: {self.skipped}"
        worst = max(self.max_abs.values(), default=0.0)
        tol = {(t.atol, t.rtol) for t in self.tolerances.values()}
        tol_text = ", ".join(f"atol {a:g} rtol {r:g}" for a, r in sorted(tol))
        detail = ", ".join(f"{k} {v:.2e}" for k, v in self.max_abs.items())
        verdict = "verified against ONNX Runtime" if self.passed else f"DIFFERS from ONNX Runtime in {', '.join(self.failed)}"
        return f"{self.graph} plan {verdict}: max abs difference {worst:.2e} ({tol_text}; {detail})"


# ----------------------------------------------------------------------------- feeds


def step_feeds(meta: EngineMeta, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A prefill and a tree step for the step graph, from the engine's limits and default tree.

    The prefill's cache holds one slot that cache_lengths 0 hides (an empty cache to the graph,
    without a zero-sized tensor for runners that copy inputs to a device)."""
    dtype = FEED_DTYPES[meta.dtype]
    gen = np.random.default_rng(seed)
    batch = min(2, meta.max_batch)
    tree = compile_tree(meta.tree)
    nodes = min(tree.num_nodes, meta.max_tokens)
    width = max(1, min(PREFILL_TOKENS, meta.max_tokens, meta.max_context - nodes))
    counts = np.array([width, max(1, width * 4 // PREFILL_TOKENS)][:batch], dtype=np.int64)  # (B,) ragged
    kv = (meta.num_layers, batch, meta.num_kv_heads, meta.head_dim)

    def cache(slots: int) -> np.ndarray:
        return gen.standard_normal((slots, *kv)).astype(dtype)  # (S, layers, B, Hkv, D)

    chain = np.tril(np.ones((width, width), dtype=bool))
    prefill = {
        INPUT_IDS: gen.integers(0, meta.vocab_size, size=(batch, width)).astype(np.int64),  # (B, W)
        POSITION_IDS: np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width)).copy(),  # (B, W)
        TREE_MASK: np.broadcast_to(chain, (batch, width, width)).copy(),  # (B, W, W)
        CACHE_LENGTHS: np.zeros(batch, dtype=np.int64),  # (B,)
        PAST_KEY: cache(1),
        PAST_VALUE: cache(1),
    }
    mask = tree.mask[:nodes, :nodes]  # a prefix of the node order keeps every node's ancestors
    step = {
        INPUT_IDS: gen.integers(0, meta.vocab_size, size=(batch, nodes)).astype(np.int64),  # (B, T)
        POSITION_IDS: (counts[:, None] + tree.depth[None, :nodes]).astype(np.int64),  # (B, T)
        TREE_MASK: np.broadcast_to(mask, (batch, nodes, nodes)).copy(),  # (B, T, T)
        CACHE_LENGTHS: counts,  # (B,)
        PAST_KEY: cache(width),
        PAST_VALUE: cache(width),
    }
    if meta.key_slots:  # an ONNX Runtime graph with key slots: the new keys' slots, and a view that holds them
        for feeds in (prefill, step):
            key_slots.add_to_feeds(feeds)
    return [prefill, step]


def heads_feeds(meta: EngineMeta, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Two hidden states (and their next tokens) for the heads graph."""
    gen = np.random.default_rng(seed)
    batch = min(2, meta.max_batch)
    feeds = {HEADS_INPUTS[0]: gen.standard_normal((batch, meta.hidden_size)).astype(FEED_DTYPES[meta.dtype])}  # (B, H)
    if meta.reads_roots:
        feeds[NEXT_INPUT] = gen.integers(0, meta.vocab_size, size=batch).astype(np.int64)  # (B,)
    return [feeds]


# ----------------------------------------------------------------------------- comparison


def _simple_compare(tolerances: Mapping[str, Tolerance]):
    from polygraphy import comparator

    # SimpleCompareFunc in newer polygraphy, which deprecates CompareFunc.simple (the only form in 0.49)
    make = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple
    return make(
        atol={name: t.atol for name, t in tolerances.items()},  # per output
        rtol={name: t.rtol for name, t in tolerances.items()},
        find_output_func=lambda name, _index, _result: [name] if name in tolerances else [],  # ids: not compared
    )


def _per_iteration(accuracy) -> list:
    """[iteration] -> {output: OutputCompareResult} of the one runner pair and compare function.
    polygraphy 0.49 returns one AccuracyResult; later versions a list of them, one per function."""
    if not hasattr(accuracy, "keys"):
        accuracy = next(iter(accuracy))
    return next(iter(accuracy.values()))


def compare_runners(
    runners: Sequence, feeds: Sequence[Mapping[str, np.ndarray]], tolerances: Mapping[str, Tolerance], *, graph: str
) -> PlanComparison:
    """Run two polygraphy runners on ``feeds`` and compare the outputs named in ``tolerances``,
    the first runner's values as the reference."""
    from polygraphy.comparator import Comparator
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    if len(runners) != 2:
        raise ValueError(f"compare two runners, not {len(runners)}")
    quiet = G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.CRITICAL  # polygraphy prints to stdout
    try:
        with G_LOGGER.verbosity(quiet):
            results = Comparator.run(list(runners), data_loader=[dict(f) for f in feeds])
            accuracy = Comparator.compare_accuracy(results, compare_func=_simple_compare(tolerances))
    except PolygraphyException as exc:
        raise PlanMismatchError(
            f"polygraphy could not compare the {graph} graphs ({' '.join(str(exc).split())[:300]}): run medusa-export with -v for its log"
        ) from exc
    iterations = _per_iteration(accuracy)
    missing = [name for name in tolerances if any(name not in it for it in iterations)]
    if missing:
        raise PlanMismatchError(f"the {graph} graphs lack outputs {missing}: build the plan again from the medusa-export ONNX graph")
    max_abs = {name: max(float(np.max(it[name].max_absdiff)) for it in iterations) for name in tolerances}
    failed = tuple(name for name in tolerances if not all(bool(it[name]) for it in iterations))
    result = PlanComparison(graph=graph, max_abs=max_abs, failed=failed, tolerances=dict(tolerances))
    log.info("%s", result.summary())
    return result


def require_match(result: PlanComparison, plan: Path) -> PlanComparison:
    """Raise ``PlanMismatchError`` naming the outputs beyond tolerance; else return ``result``."""
    if result.failed:
        detail = ", ".join(
            f"{k} {result.max_abs[k]:.3g} (atol {result.tolerances[k].atol:g}, rtol {result.tolerances[k].rtol:g})" for k in result.failed
        )
        raise PlanMismatchError(
            f"{plan.name} disagrees with its ONNX graph beyond tolerance in {detail}: build with --dtype fp32 (or a "
            "newer TensorRT), or pass --no-verify to keep it anyway"
        )
    return result


def onnx_providers() -> list[str]:
    """CUDA for the ONNX Runtime side when onnxruntime-gpu sees a GPU (the ONNX graph runs beside
    the plan), else CPU."""
    import onnxruntime as ort

    return ["cuda", "cpu"] if "CUDAExecutionProvider" in ort.get_available_providers() else ["cpu"]


def compare_plan(
    plan: Path, onnx_path: Path, meta: EngineMeta, *, graph: str, tolerances: Mapping[str, Tolerance] | None = None
) -> PlanComparison:
    """Compare a built ``plan`` (TensorRT runner) with the ``onnx_path`` it came from (ONNX Runtime
    runner) on the feeds of ``graph`` ("step" or "heads"); raises ``PlanMismatchError`` beyond tolerance."""
    if meta.dtype not in FEED_DTYPES:
        return PlanComparison(
            graph=graph,
            max_abs={},
            failed=(),
            tolerances={},
            skipped=f"{meta.dtype} has no numpy type and no kernels in ONNX Runtime's CPU provider; an fp16 build compares",
        )
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    names = STEP_COMPARED if graph == "step" else HEADS_COMPARED
    tolerances = tolerances or {name: TOLERANCES[meta.dtype] for name in names}
    feeds = step_feeds(meta) if graph == "step" else heads_feeds(meta)
    runners = [
        OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=onnx_providers())),
        TrtRunner(EngineFromBytes(Path(plan).read_bytes())),
    ]
    return require_match(compare_runners(runners, feeds, tolerances, graph=graph), Path(plan))
