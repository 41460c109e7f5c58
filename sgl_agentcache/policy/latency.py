"""Learned tool-latency distributions, one per (tenant, tool class), with calibration statistics.

A :class:`LatencyModel` is an online histogram of durations over log-spaced bins (by default 16 per
decade from 1 ms to 1 h, so one bin is a factor 10^(1/16) ~ 1.155 wide). Within a bin, mass is
spread log-uniformly, which makes cdf, quantile and the integrals behind ``remaining_wait`` exact
closed forms of a piecewise model. Durations outside [min_s, max_s] are clamped into the end bins:
1 ms is below anything a pause decision can act on, and a tool past an hour is the deadline's job.

Decay is by observation count, never by wall time (deterministic on every rank and in replay): each
observation first multiplies every weight by ``decay`` and then adds 1 to its bin, so an observation
k steps old weighs decay^k. The effective memory is 1 / (1 - decay) observations (200 at the default
0.995; half-life ln 2 / -ln(decay) ~ 138). Small ``decay`` follows regime changes fast; the tail
(p99) needs many effective observations, so a long memory serves heavy-tailed classes better.

Cold start: the histogram starts as a log-normal prior (median 2 s, sigma 1.5 by default) worth
``prior_weight`` observations (5); the prior decays like any observation, so data takes over.

Calibration: before each observation updates the model, its PIT value u = F(t) under the current
model is recorded, decayed like the histogram (see :mod:`.calibration`); a calibrated model gives
uniform u.

Close likelihood: a pause ends either in a resume (:meth:`LatencyModel.observe`) or with its branch
ended while it waited -- closed, its session closed, aborted (:meth:`LatencyModel.observe_end`). The
two outcomes are counted with the same count decay, and :meth:`LatencyModel.resume_rate` is the share
of resumes, shrunk toward a prior (a Beta posterior mean): the resume probability a pause decision
uses. A subagent class whose workers are often cancelled mid-tool, or a tool after which agents often
stop, gets a lower one, so keeping its KV is priced for what it is worth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import msgspec

from sgl_agentcache.policy.calibration import CalibrationState, CalibrationStats
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.distributions import LogNormal, remaining_wait, resume_within

__all__ = ["RESUME_PRIOR", "RESUME_PRIOR_WEIGHT", "BookEntry", "BookSnapshot", "LatencyBook", "LatencyConfig",
           "LatencyModel", "LatencySnapshot"]


class LatencyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of every :class:`LatencyModel` (bins, decay, prior)."""

    min_s: float = 1e-3
    max_s: float = 3600.0
    bins_per_decade: int = 16
    decay: float = 0.995
    prior_median_s: float = 2.0
    prior_sigma: float = 1.5
    prior_weight: float = 5.0

    def __post_init__(self) -> None:
        if not (0.0 < self.min_s < self.max_s and math.isfinite(self.max_s)):
            raise ValueError("LatencyConfig needs 0 < min_s < max_s < inf")
        if not (1 <= self.bins_per_decade <= 1000):
            raise ValueError("LatencyConfig.bins_per_decade must be in [1, 1000]")
        if not (0.0 < self.decay <= 1.0):
            raise ValueError("LatencyConfig.decay must be in (0, 1]")
        if not (self.prior_weight > 0.0 and math.isfinite(self.prior_weight)):
            raise ValueError("LatencyConfig.prior_weight must be positive and finite")

    @property
    def bin_ratio(self) -> float:
        """Width of one bin as a ratio: a quantile is resolved to within this factor."""
        return 10.0 ** (1.0 / self.bins_per_decade)

    @property
    def half_life_observations(self) -> float:
        return math.inf if self.decay == 1.0 else math.log(2.0) / -math.log(self.decay)


#: Prior of a tool class's resume rate, and its weight in pauses (how many observed outcomes it counts as).
RESUME_PRIOR = 0.9
RESUME_PRIOR_WEIGHT = 5.0

@lru_cache(maxsize=16)
def _edges(min_s: float, max_s: float, bins_per_decade: int) -> tuple[float, ...]:
    n = max(1, math.ceil(math.log10(max_s / min_s) * bins_per_decade - 1e-9))
    ratio = 10.0 ** (1.0 / bins_per_decade)
    return tuple(min_s * ratio**i for i in range(n + 1))


class LatencySnapshot(msgspec.Struct, frozen=True):
    """Everything needed to restore a model, plus its headline numbers (for stats endpoints)."""

    config: LatencyConfig
    prior: LogNormal
    observations: int
    weights: list[float]
    calibration: CalibrationState
    p50_s: float
    p95_s: float
    p99_s: float
    mean_s: float
    resumed: float = 0.0  # decayed count of pauses that ended in a resume
    ended: float = 0.0  # decayed count of pauses whose branch ended instead


class LatencyModel:
    """Online, exponentially decaying, log-binned duration distribution (see the module docstring).

    Implements :class:`~sgl_agentcache.policy.distributions.LatencyDistribution`.
    """

    def __init__(self, config: LatencyConfig | None = None, prior: LogNormal | None = None):
        self.config = config or LatencyConfig()
        self.prior = prior or LogNormal(self.config.prior_median_s, self.config.prior_sigma)
        self._edges = _edges(self.config.min_s, self.config.max_s, self.config.bins_per_decade)
        self._log_ratio = math.log(self._edges[1] / self._edges[0])
        cdfs = [0.0] + [self.prior.cdf(e) for e in self._edges[1:-1]] + [1.0]  # end bins take the tails
        self.weights = [self.config.prior_weight * (b - a) for a, b in zip(cdfs, cdfs[1:])]
        self.observations = 0
        self._cal = CalibrationState()
        self.resumed = 0.0
        self.ended = 0.0
        self._tails: list[float] | None = None  # tails[i] = sum(weights[i:]), rebuilt after a change

    # -- learning ---------------------------------------------------------------------------------
    def observe(self, duration_s: float) -> float:
        """Record one completed tool call; returns its PIT value under the model *before* the update."""
        if not (duration_s >= 0.0 and math.isfinite(duration_s)):
            raise ValueError(f"a tool duration must be >= 0 and finite, got {duration_s}")
        u = self.cdf(duration_s)
        d = self.config.decay
        self._cal.record(u, d)
        if d != 1.0:
            self.weights = [w * d for w in self.weights]
        self.weights[self._bin(duration_s)] += 1.0
        self._tails = None
        self.observations += 1
        self._outcome(resumed=True)
        return u

    def observe_end(self) -> None:
        """A pause on this tool ended without a resume: its branch was closed or aborted while it waited
        (the duration is censored, so the histogram is left alone)."""
        self._outcome(resumed=False)

    def _outcome(self, *, resumed: bool) -> None:
        d = self.config.decay
        self.resumed, self.ended = self.resumed * d + resumed, self.ended * d + (not resumed)

    def resume_rate(self, prior: float = RESUME_PRIOR, prior_weight: float = RESUME_PRIOR_WEIGHT) -> float:
        """Share of this tool's pauses that ended in a resume, shrunk toward ``prior`` (Beta posterior
        mean); the resume probability of the next pause."""
        if not (0.0 <= prior <= 1.0 and prior_weight > 0.0):
            raise ValueError("resume_rate needs a prior in [0, 1] and a positive prior weight")
        return (self.resumed + prior * prior_weight) / (self.resumed + self.ended + prior_weight)

    def reset_calibration(self) -> None:
        self._cal = CalibrationState()

    def calibration(self) -> CalibrationStats:
        """PIT statistics of the observations recorded since creation or the last reset."""
        return self._cal.stats()

    # -- the distribution -------------------------------------------------------------------------
    def _bin(self, t: float) -> int:
        if t <= self._edges[0]:
            return 0
        return min(int(math.log(t / self._edges[0]) / self._log_ratio), len(self.weights) - 1)

    def _tail_sums(self) -> list[float]:
        """sum(weights[i:]) for every i (and 0 past the end), kept until the weights change: cdf and
        survival are then O(1), which a join of several subagents (policy/join.py) evaluates often."""
        if self._tails is None:
            tails, acc = [0.0] * (len(self.weights) + 1), 0.0
            for i in range(len(self.weights) - 1, -1, -1):
                acc += self.weights[i]
                tails[i] = acc
            tails[0] = math.fsum(self.weights)
            self._tails = tails
        return self._tails

    def _total(self) -> float:
        return self._tail_sums()[0]

    def cdf(self, t: float) -> float:
        return 1.0 - self.survival(t)

    def survival(self, t: float) -> float:
        if t <= self._edges[0]:
            return 1.0
        if t >= self._edges[-1]:
            return 0.0
        tails = self._tail_sums()
        i = self._bin(t)
        partial = self.weights[i] * math.log(self._edges[i + 1] / t) / self._log_ratio
        return min(max((tails[i + 1] + partial) / tails[0], 0.0), 1.0)

    def quantile(self, q: float) -> float:
        if q <= 0.0:
            return self._edges[0]
        target, acc = min(q, 1.0) * self._total(), 0.0
        for i, w in enumerate(self.weights):
            if w > 0.0 and acc + w >= target:
                frac = min(max((target - acc) / w, 0.0), 1.0)
                return self._edges[i] * math.exp(frac * self._log_ratio)
            acc += w
        return self._edges[-1]

    def tail(self) -> tuple[float, float, float]:
        """(p50, p95, p99) in seconds."""
        return self.quantile(0.5), self.quantile(0.95), self.quantile(0.99)

    def mean(self) -> float:
        return self.survival_integral(0.0, math.inf)

    def survival_integral(self, x: float, y: float) -> float:
        """Integral of S over [x, y]. Inside bin [a, b] with mass m and mass `above` beyond it,
        S(t) W = above + m ln(b/t) / ln(b/a), whose antiderivative is above t + m (t ln(b/t) + t) / ln(b/a)."""
        x = max(0.0, x)
        lo, hi = self._edges[0], self._edges[-1]
        below = max(0.0, min(y, lo) - x)  # S = 1 below the first edge
        x, y = max(x, lo), min(y, hi)  # S = 0 above the last edge
        if y <= x:
            return below
        total, acc = self._total(), 0.0
        first, last = self._bin(x), self._bin(y)
        above = math.fsum(self.weights[first + 1:])
        for i in range(first, last + 1):
            a, b = self._edges[i], self._edges[i + 1]
            u, v = max(x, a), min(y, b)
            if i > first:
                above -= self.weights[i]
            if v > u:
                m = self.weights[i] / self._log_ratio
                acc += max(above, 0.0) * (v - u) + m * (v * math.log(b / v) + v - u * math.log(b / u) - u)
        return below + acc / total

    def remaining_wait(self, elapsed: float, horizon: float = math.inf) -> float:
        return remaining_wait(self, elapsed, horizon)

    def resume_within(self, elapsed: float, horizon: float) -> float:
        return resume_within(self, elapsed, horizon)

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> LatencySnapshot:
        p50, p95, p99 = self.tail()
        return LatencySnapshot(config=self.config, prior=self.prior, observations=self.observations,
                               weights=list(self.weights), calibration=self._cal.copy(),
                               p50_s=p50, p95_s=p95, p99_s=p99, mean_s=self.mean(),
                               resumed=self.resumed, ended=self.ended)

    @classmethod
    def from_snapshot(cls, snap: LatencySnapshot) -> "LatencyModel":
        model = cls(snap.config, snap.prior)
        if len(snap.weights) != len(model.weights):
            raise ValueError("latency snapshot does not match its config's bins")
        model.weights = list(snap.weights)
        model._tails = None
        model.observations = snap.observations
        model._cal = snap.calibration.copy()
        model.resumed, model.ended = snap.resumed, snap.ended
        return model


class BookEntry(msgspec.Struct, frozen=True):
    tenant: str
    tool_class: str
    model: LatencySnapshot


class BookSnapshot(msgspec.Struct, frozen=True):
    config: LatencyConfig
    limit: int
    forgotten: int
    entries: list[BookEntry]  # namespace by namespace, least recently used first within each
    namespace_limit: int | None = None  # None: ``limit`` (snapshots written before the per-namespace bound)


#: Tool classes one namespace (tenant) may have models for, and all namespaces together.
MODELS_PER_NAMESPACE = 256
MODELS_TOTAL = 4096


class LatencyBook:
    """Latency models keyed by (namespace, tool class), bounded per namespace: tool classes come from
    clients, so the key space must not grow without bound, and one tenant's flood of distinct classes
    must not evict another tenant's learned models. A namespace keeps at most ``namespace_limit`` models
    (its least recently used forgotten first); past ``limit`` for all of them together, the largest
    namespace's least recently used goes (see :class:`~sgl_agentcache.namespaced_lru.NamespacedLRU`).

    ``priors`` optionally gives a tool class its own cold-start prior (say 20 ms for ``local_read``,
    a minute for ``human_approval``); every other class starts from the config's prior.
    """

    def __init__(self, config: LatencyConfig | None = None, limit: int = MODELS_TOTAL,
                 priors: Mapping[str, LogNormal] | None = None, namespace_limit: int | None = MODELS_PER_NAMESPACE):
        if limit < 1:
            raise ValueError("LatencyBook limit must be >= 1")
        self.config = config or LatencyConfig()
        self.priors = dict(priors or {})
        self._models: NamespacedLRU[tuple[str, str], LatencyModel] = NamespacedLRU(limit, namespace_limit)

    @property
    def limit(self) -> int:
        return self._models.limit

    @property
    def namespace_limit(self) -> int:
        return self._models.namespace_limit

    @property
    def forgotten(self) -> int:
        """Models dropped by a bound so far (a purge is not counted)."""
        return self._models.forgotten

    def _fresh(self, tool_class: str) -> LatencyModel:
        return LatencyModel(self.config, self.priors.get(tool_class))

    def model(self, tenant: str, tool_class: str) -> LatencyModel:
        """The model for this key, created from the prior if absent; marks it most recently used."""
        key = (tenant, tool_class)
        model = self._models.get(key)
        if model is None:
            model = self._fresh(tool_class)
            self._models.put(key, model)
        else:
            self._models.touch(key)
        return model

    def peek(self, tenant: str, tool_class: str) -> LatencyModel:
        """The model for this key without creating or touching it (a fresh prior model when absent)."""
        return self._models.get((tenant, tool_class)) or self._fresh(tool_class)

    def observe(self, tenant: str, tool_class: str, duration_s: float) -> float:
        """Record a completed tool call; returns its PIT value (see :meth:`LatencyModel.observe`)."""
        return self.model(tenant, tool_class).observe(duration_s)

    def observe_end(self, tenant: str, tool_class: str) -> None:
        """A pause on this tool ended with its branch (see :meth:`LatencyModel.observe_end`)."""
        self.model(tenant, tool_class).observe_end()

    def forget_namespace(self, tenant: str) -> int:
        """Drop every model learned for ``tenant`` (a purge); returns how many went."""
        return len(self._models.pop_namespace(tenant))

    def items(self, tenant: str | None = None) -> list[tuple[tuple[str, str], LatencyModel]]:
        """((namespace, tool class), model) pairs: every namespace's, or ``tenant``'s only."""
        return self._models.items() if tenant is None else self._models.namespace_items(tenant)

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, key: object) -> bool:
        return key in self._models

    def snapshot(self) -> BookSnapshot:
        return BookSnapshot(self.config, self.limit, self.forgotten,
                            [BookEntry(t, c, m.snapshot()) for (t, c), m in self._models.items()],
                            self.namespace_limit)

    @classmethod
    def from_snapshot(cls, snap: BookSnapshot, priors: Mapping[str, LogNormal] | None = None) -> "LatencyBook":
        book = cls(snap.config, snap.limit, priors, namespace_limit=snap.namespace_limit)
        for e in snap.entries:
            book._models.put((e.tenant, e.tool_class), LatencyModel.from_snapshot(e.model))
        book._models.forgotten = snap.forgotten
        return book
