"""How far apart two fp32 computations of the same dot products may be when a GEMM library is free
to run them in another order, and the checks built on that.

A GEMM picks its kernel (blocking, SIMD width, FMA or not, split-K) by shape and CPU, so the
same logits computed as one [M, H] x [H, V] product or as n [M/n, H] x [H, V] products may
round differently in the last bits, and which bits move changes from machine to machine. Two
code paths that multiply the same operands in different shapes are compared here with the
standard worst-case forward error bound for a dot product of length n (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., eq. 3.5)::

    |fl(a . b) - a . b| <= gamma_n * sum_i |a_i| |b_i|,   gamma_n = n u / (1 - n u),   u = 2^-24

It holds for every summation order (blocked, pairwise, with or without FMA), so it holds on
every machine; two paths each within it of the exact value are within twice it of each other.
The probabilistic ``sqrt(n) * u * scale`` rule of thumb is tighter but not a bound: a test built
on it fails, now and then, on some CPU. This bound is still far below a real bug: for H = 64 it
allows 2 * 64 * 2^-24 ~ 7.6e-6 of ``sum |a_i| |b_i|``, where a wrong weight row, a swapped head
or a missing block moves a logit by a sizeable fraction of it.

Where the operands of the differing product are bit-identical in both paths (the block outputs
and the lm_head), :func:`fp32_tolerance` with :func:`dot_magnitude` is the whole bound. Where an
earlier stage ran in other shapes too, :func:`linear_error` and :func:`silu_residual_error`
carry that stage's bound forward through the next (first order in u, which is all that matters
at these sizes).
"""

from __future__ import annotations

import torch

U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest): torch.finfo(torch.float32).eps / 2


def gamma(n: int, u: float = U32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained fp32 roundings."""
    if n * u >= 1:
        raise ValueError(f"reduction length {n} is too long for a gamma_n bound at u = {u:g}")
    return n * u / (1 - n * u)


def dot_magnitude(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i |x_i| |w_i|`` for every output of ``x @ w.T`` (x [..., H], w [V, H] -> [..., V]), in float64."""
    return x.detach().double().abs() @ w.detach().double().abs().T


def fp32_tolerance(reduction: int, magnitude: torch.Tensor | float) -> torch.Tensor | float:
    """Largest difference two fp32 evaluations (any order) of dot products of length ``reduction``
    may show, elementwise: ``2 gamma_n * magnitude`` with ``magnitude = sum |a_i| |b_i|``."""
    return 2 * gamma(reduction) * magnitude


def linear_error(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, x_error: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Elementwise bound on how far two fp32 evaluations of ``F.linear(x, w, bias)`` (x [..., H],
    w [V, H] -> [..., V]), each in any order, can be apart when their inputs differ by at most
    ``x_error`` (elementwise): ``2 gamma_n (|x| |w|^T + |bias|) + (1 + gamma_n) x_error |w|^T``,
    n = H (+ 1 for the bias add). The second term is the exact product's change, plus its rounding."""
    g = gamma(x.shape[-1] + (bias is not None))
    magnitude = dot_magnitude(x, w) + (bias.detach().double().abs() if bias is not None else 0.0)
    spread = torch.as_tensor(x_error, dtype=torch.float64).expand(x.shape)
    return 2 * g * magnitude + (1 + g) * dot_magnitude(spread, w)


SILU_LIPSCHITZ = 1.0999  # max |d/dz z sigmoid(z)|, at z ~ 2.40
SILU_ULPS = 4  # rounding of one fp32 silu: exp (Sleef, <= 1 ulp), the add, the divide, with headroom


def silu_residual_error(x: torch.Tensor, z: torch.Tensor, z_error: torch.Tensor | float) -> torch.Tensor:
    """Bound on how far two fp32 evaluations of ``x + silu(z)`` (a ResBlock; x the same in both)
    can be apart when their ``z`` differ by at most ``z_error``: silu's slope times the spread,
    plus both evaluations' rounding of the silu and of the add."""
    s = torch.nn.functional.silu(z.detach().double())
    y = x.detach().double() + s
    return SILU_LIPSCHITZ * torch.as_tensor(z_error, dtype=torch.float64) + 2 * U32 * (SILU_ULPS * s.abs() + y.abs())


def assert_close_fp32(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    reduction: int | None = None,
    magnitude: torch.Tensor | float | None = None,
    tolerance: torch.Tensor | float | None = None,
    msg: str = "",
) -> None:
    """``actual`` and ``expected`` agree within ``fp32_tolerance(reduction, magnitude)`` (or a
    ``tolerance`` built with :func:`linear_error`) everywhere; otherwise fail naming the worst
    element (the one furthest past its own allowance) and how many are off."""
    assert (tolerance is None) == (reduction is not None and magnitude is not None), "pass reduction and magnitude, or tolerance"
    assert actual.shape == expected.shape, f"{msg}: shapes differ, {tuple(actual.shape)} vs {tuple(expected.shape)}"
    bound = f"the fp32 bound for a reduction of {reduction} (2 gamma_n sum|a||b|)" if tolerance is None else "the propagated fp32 bound"
    tolerance = fp32_tolerance(reduction, magnitude) if tolerance is None else tolerance
    allowed = torch.as_tensor(tolerance, dtype=torch.float64).expand(actual.shape)
    diff = (actual.detach().double() - expected.detach().double()).abs()
    over = diff > allowed
    if not over.any() and torch.isfinite(diff).all():
        return
    worst = torch.where(allowed > 0, diff / allowed, torch.where(diff > 0, torch.inf, 0.0))
    worst = torch.where(torch.isnan(diff), torch.inf, worst)
    at = tuple(int(i) for i in torch.unravel_index(worst.argmax(), actual.shape))
    raise AssertionError(
        f"{msg + ': ' if msg else ''}{int((over | ~torch.isfinite(diff)).sum())} of {actual.numel()} elements differ beyond "
        f"{bound}; worst at {at}: {actual[at].item():.9g} vs "
        f"{expected[at].item():.9g}, off by {diff[at].item():.3g} where {allowed[at].item():.3g} is allowed"
    )


def assert_same_top_ids(
    actual: torch.Tensor, expected: torch.Tensor, *, k: int = 1, tolerance: torch.Tensor | float, msg: str = ""
) -> None:
    """The top-``k`` token ids of each row (last axis) are the same, rank by rank, except where the
    two ids' logits tie, in both tensors, within the rounding ``tolerance`` (elementwise, as
    :func:`fp32_tolerance` gives it): as with ``conftest.assert_greedy_identical``, greedy may pick
    either of a tie.

    Why 2 * tolerance: with |a - b| <= t elementwise, sorting moves each rank's value by at most
    max t, so ``actual`` at the id ``expected`` ranks r-th lies within 2 max t of ``actual``'s r-th value."""
    got, want = actual.topk(k, dim=-1).indices, expected.topk(k, dim=-1).indices  # (..., k)
    if torch.equal(got, want):
        return
    allowed = torch.as_tensor(tolerance, dtype=torch.float64).expand(actual.shape).amax(-1, keepdim=True)  # (..., 1)
    a, b = actual.detach().double(), expected.detach().double()
    # (..., k): how far the two ids at each rank are from a tie, in either tensor's own logits
    gap = torch.maximum((a.gather(-1, want) - a.gather(-1, got)).abs(), (b.gather(-1, want) - b.gather(-1, got)).abs())
    bad = (got != want) & (gap > 2 * allowed)
    if not bad.any():
        return
    at = tuple(int(i) for i in bad.nonzero()[0])
    row = at[:-1]
    raise AssertionError(
        f"{msg + ': ' if msg else ''}top-{k} ids differ in {int(bad.sum())} places beyond a tie; first at row {row} rank {at[-1]}: "
        f"{got[row].tolist()} vs {want[row].tolist()}, logit gap {gap[at].item():.3g} where a tie is {2 * allowed[row].item():.3g}"
    )
