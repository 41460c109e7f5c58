"""Tool-latency distributions: the protocol the pause policy reads, and two closed-form families.

Durations are seconds. ``T`` is a tool call's total duration. The policy asks *conditional* questions:
the tool has run for ``elapsed`` seconds without returning, so what is left is
``R = T - elapsed | T > elapsed``, and it needs

- ``remaining_wait(elapsed, horizon)`` = E[min(R, horizon)] (``horizon`` = inf gives E[R]), and
- ``resume_within(elapsed, horizon)`` = P(R <= horizon).

Both follow from the survival function S and its integral: E[min(R, h)] = (integral of S from e to
e + h) / S(e) and P(R <= h) = 1 - S(e + h) / S(e); :func:`remaining_wait` and :func:`resume_within`
compute them for any object with ``survival`` and ``survival_integral``.

When a model says the tool should already have returned (S(elapsed) ~ 0) it has no information left
about R. Answering R = 0 would make a tool that never returns look about to return forever, so the
conditional quantities fall back to a *Lindy* tail instead: R has survival (e / (e + r))^2 (a Pareto
tail with E[R] = elapsed), i.e. the longer it has hung, the longer it is expected to hang.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Protocol, runtime_checkable

import msgspec

#: Below this survival probability a model is considered to have no information about the remaining wait.
NO_INFORMATION = 1e-12

_SQRT2 = math.sqrt(2.0)
_STD_NORMAL = NormalDist()


@runtime_checkable
class LatencyDistribution(Protocol):
    """What the pause policy needs to know about a tool's duration T (seconds)."""

    def cdf(self, t: float) -> float:
        """P(T <= t)."""

    def survival(self, t: float) -> float:
        """P(T > t)."""

    def quantile(self, q: float) -> float:
        """Smallest t with P(T <= t) >= q."""

    def remaining_wait(self, elapsed: float, horizon: float = math.inf) -> float:
        """E[min(T - elapsed, horizon) | T > elapsed]."""

    def resume_within(self, elapsed: float, horizon: float) -> float:
        """P(T - elapsed <= horizon | T > elapsed)."""


def lindy_remaining_wait(elapsed: float, horizon: float) -> float:
    """E[min(R, horizon)] when R has survival (e / (e + r))^2: e*h / (e + h); e for h = inf."""
    if elapsed <= 0.0:
        return 0.0
    if math.isinf(horizon):
        return elapsed
    return elapsed * horizon / (elapsed + horizon)


def lindy_resume_within(elapsed: float, horizon: float) -> float:
    """P(R <= horizon) when R has survival (e / (e + r))^2."""
    if elapsed <= 0.0:
        return 1.0
    if math.isinf(horizon):
        return 1.0
    return 1.0 - (elapsed / (elapsed + horizon)) ** 2


def remaining_wait(dist, elapsed: float, horizon: float = math.inf) -> float:
    """E[min(T - e, h) | T > e] for ``dist`` with ``survival`` and ``survival_integral`` (see module doc)."""
    elapsed = max(0.0, elapsed)
    if horizon <= 0.0:
        return 0.0
    s = dist.survival(elapsed)
    if s <= NO_INFORMATION:
        return lindy_remaining_wait(elapsed, horizon)
    value = dist.survival_integral(elapsed, elapsed + horizon) / s
    return min(max(value, 0.0), horizon)  # clip rounding noise: 0 <= E[min(R, h)] <= h


def resume_within(dist, elapsed: float, horizon: float) -> float:
    """P(T - e <= h | T > e) for ``dist`` with ``survival`` (see module doc)."""
    elapsed = max(0.0, elapsed)
    if horizon < 0.0:
        return 0.0
    s = dist.survival(elapsed)
    if s <= NO_INFORMATION:
        return lindy_resume_within(elapsed, horizon)
    return min(max(1.0 - dist.survival(elapsed + horizon) / s, 0.0), 1.0)


def _norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z, accurate far into the upper tail."""
    return 0.5 * math.erfc(z / _SQRT2)


class LogNormal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Log-normal durations: ln T ~ Normal(ln median_s, sigma^2). Also the latency model's prior."""

    median_s: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median_s > 0.0 and math.isfinite(self.median_s)):
            raise ValueError(f"LogNormal median_s must be positive and finite, got {self.median_s}")
        if not (0.0 < self.sigma <= 10.0):
            raise ValueError(f"LogNormal sigma must be in (0, 10], got {self.sigma}")

    def _z(self, t: float) -> float:
        return (math.log(t) - math.log(self.median_s)) / self.sigma

    def cdf(self, t: float) -> float:
        return 0.0 if t <= 0.0 else _norm_sf(-self._z(t))

    def survival(self, t: float) -> float:
        return 1.0 if t <= 0.0 else _norm_sf(self._z(t))

    def quantile(self, q: float) -> float:
        if q <= 0.0:
            return 0.0
        if q >= 1.0:
            return math.inf
        return self.median_s * math.exp(self.sigma * _STD_NORMAL.inv_cdf(q))

    def mean(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2.0)

    def _upper_partial_mean(self, x: float) -> float:
        """E[T * 1{T > x}] = mean * P(Z > z(x) - sigma)."""
        if x <= 0.0:
            return self.mean()
        if math.isinf(x):
            return 0.0
        return self.mean() * _norm_sf(self._z(x) - self.sigma)

    def survival_integral(self, x: float, y: float) -> float:
        """Integral of S over [x, y]: y S(y) - x S(x) + E[T 1{x < T <= y}] (integration by parts)."""
        x = max(0.0, x)
        if y <= x:
            return 0.0
        y_term = 0.0 if math.isinf(y) else y * self.survival(y)
        return y_term - x * self.survival(x) + self._upper_partial_mean(x) - self._upper_partial_mean(y)

    def remaining_wait(self, elapsed: float, horizon: float = math.inf) -> float:
        return remaining_wait(self, elapsed, horizon)

    def resume_within(self, elapsed: float, horizon: float) -> float:
        return resume_within(self, elapsed, horizon)


class PointMass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool whose duration is known exactly (the seed article's worked example declares its pauses)."""

    duration_s: float

    def __post_init__(self) -> None:
        if not (self.duration_s >= 0.0 and math.isfinite(self.duration_s)):
            raise ValueError(f"PointMass duration_s must be >= 0 and finite, got {self.duration_s}")

    def cdf(self, t: float) -> float:
        return 1.0 if t >= self.duration_s else 0.0

    def survival(self, t: float) -> float:
        return 0.0 if t >= self.duration_s else 1.0

    def quantile(self, q: float) -> float:
        return self.duration_s

    def survival_integral(self, x: float, y: float) -> float:
        return max(0.0, min(y, self.duration_s) - max(0.0, x))

    def remaining_wait(self, elapsed: float, horizon: float = math.inf) -> float:
        return remaining_wait(self, elapsed, horizon)

    def resume_within(self, elapsed: float, horizon: float) -> float:
        return resume_within(self, elapsed, horizon)
