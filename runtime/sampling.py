"""Sampling controls: per-sequence parameters, the logits warp, seeded draws (numpy only).

A sequence's randomness comes from its own ``numpy.random.Generator`` seeded with its own seed,
and it is consumed in a fixed order per step (draft draws, acceptance uniforms, the bonus token),
so the same seed gives the same output whatever else shares the batch.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.errors import MedusaError

RULES = ("greedy", "typical", "lossless")
TOP_P_CANDIDATES = 1024  # top-p first looks among this many largest logits; falls back to a full sort


class SamplingError(MedusaError):
    """Sampling parameters that cannot be honoured; the message says which and what to pass."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the top_k most likely tokens; 0: all
    seed: int | None = None  # this sequence's generator; None: fresh entropy (not reproducible)
    acceptance: str | None = None  # greedy | typical | lossless; None: greedy at temperature 0, lossless above
    posterior_threshold: float = 0.09  # typical acceptance: the Medusa reference's defaults, defined once here
    posterior_alpha: float = 0.3

    def __post_init__(self):
        for name in ("temperature", "top_p", "posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise SamplingError(f"{name} must be a number, got {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise SamplingError(f"{name} must be an integer, got {value!r}")
        if self.top_k is None:
            raise SamplingError("top_k must be an integer (0 turns it off), got None")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer (0 turns it off), got {self.top_k}")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer, got {self.seed}")
        if self.acceptance is not None and self.acceptance not in RULES:
            raise SamplingError(f"acceptance {self.acceptance!r} is not one of {', '.join(RULES)}")
        if self.acceptance == "greedy" and self.temperature > 0:
            raise SamplingError(
                "acceptance='greedy' decodes at temperature 0: drop the temperature, "
                "or use acceptance='lossless' (exact) or 'typical' to sample"
            )
        if not 0 < self.posterior_threshold <= 1 or self.posterior_alpha <= 0:
            raise SamplingError("posterior_threshold must be in (0, 1] and posterior_alpha > 0")

    @property
    def rule(self) -> str:
        """The acceptance rule in effect. At temperature 0 every rule is greedy: the base model's
        distribution is a point mass on its argmax, so lossless acceptance is the greedy test."""
        if self.temperature == 0:
            return "greedy"
        return self.acceptance or "lossless"

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sampling distribution after temperature, top-k and top-p: float64 [N, V] from logits [N, V].

    Top-p keeps, in order of decreasing probability, every token whose preceding cumulative mass
    is below top_p (so at least one token, and the one that crosses top_p)."""
    x = np.asarray(logits, dtype=np.float64) / params.temperature  # (N, V)
    x = np.atleast_2d(x)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[:, vocab - params.top_k, None]  # (N, 1)
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        for i in range(probs.shape[0]):
            probs[i] = _top_p(probs[i], params.top_p)
    return probs


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """One row [V]; ties at the cut are broken by token id (a stable, documented order)."""
    vocab = probs.shape[0]
    if vocab > TOP_P_CANDIDATES:
        cand = np.argpartition(-probs, TOP_P_CANDIDATES)[:TOP_P_CANDIDATES]  # the largest, unordered
        if probs[cand].sum() < top_p:
            cand = np.arange(vocab)
    else:
        cand = np.arange(vocab)
    order = cand[np.lexsort((cand, -probs[cand]))]  # decreasing probability, then token id
    before = np.cumsum(probs[order]) - probs[order]  # mass strictly before each token
    keep = order[before < top_p]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def sample(rng: np.random.Generator, probs: np.ndarray) -> int:
    """One token from a distribution [V] (inverse CDF: one uniform per draw)."""
    cdf = np.cumsum(probs)
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(token, probs.shape[0] - 1)


def draw_without_replacement(rng: np.random.Generator, probs: np.ndarray, count: int) -> np.ndarray:
    """``count`` distinct tokens, the i-th drawn from ``probs`` with the first i removed and
    renormalised (sequential sampling without replacement). Draws past the support are -1.
    Each draw's inverse CDF runs over the support only (after top-p a few ids of the vocabulary):
    a zero-mass id never changes the CDF, so the tokens are those of the CDF over every id (but for
    a uniform that rounds onto the CDF's end, where that draw would return the last id, mass or not)."""
    out = np.full(count, -1, dtype=np.int64)
    support = np.flatnonzero(probs)  # (S,) ids with mass, ascending: draws over them equal draws over all V
    left = np.asarray(probs, dtype=np.float64)[support]  # (S,) a copy (zero ids add nothing to the CDF)
    for i in range(count):
        if left.sum() <= 0:
            break
        j = sample(rng, left)
        out[i] = support[j]
        left[j] = 0.0
    return out


def broadcast_params(count: int, sampling=None, **fields) -> list[SamplingParams]:
    """Per-sequence parameters for ``count`` prompts. ``sampling``: one ``SamplingParams`` or a
    list of them; otherwise each field (temperature, top_p, ...) is one value for every prompt or
    a list with one value per prompt."""
    if sampling is not None:
        if fields and any(v is not None for v in fields.values()):
            raise SamplingError("pass either sampling= or temperature/top_p/top_k/seed/acceptance, not both")
        items = [sampling] * count if isinstance(sampling, SamplingParams) else list(sampling)
        if len(items) != count or not all(isinstance(s, SamplingParams) for s in items):
            raise SamplingError(f"sampling= must be one SamplingParams or a list of {count} (one per prompt)")
        return items
    per_prompt: dict[str, list] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise SamplingError(f"{name} has {len(value)} values for {count} prompts: give one value or one per prompt")
            per_prompt[name] = list(value)
        else:
            per_prompt[name] = [value] * count
    return [SamplingParams(**{k: v[i] for k, v in per_prompt.items()}) for i in range(count)]
