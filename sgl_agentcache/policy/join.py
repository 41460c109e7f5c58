"""How long a lead agent waits on its subagents: it resumes when the last of them ends (pure, no clock).

A lead that paused while ``N`` subagents (forks of its branch) run cannot resume before every one of
them has ended. With ``C`` a subagent's lifetime (from its first call to its close; learned per
namespace like a tool class, see ``server/front/coordinator.py``) and ``e_i`` how long subagent ``i`` has run
so far, the lead's wait is ``R = max_i (C_i - e_i | C_i > e_i)``, the ``C_i`` independent::

    P(R <= t) = prod_i P(C - e_i <= t | C > e_i)

Each factor is :func:`~sgl_agentcache.policy.distributions.resume_within` of the lifetime model, so a
subagent the model says should already have ended gets the same Lindy tail a hung tool gets. The wait
of N subagents is stochastically longer than one's, and grows with N: a lead with six workers out
holds its KV longer than one with two, which the pause decision prices (memory-time, and the chance
of a resume before a deadline).

:class:`JoinWait` is a :class:`~sgl_agentcache.policy.distributions.LatencyDistribution` of ``R``
(``elapsed`` counts from the moment the ``e_i`` were read). ``survival_integral`` is numerical (a
trapezoid rule in log time over :data:`GRID_POINTS` points per call, exact at the ends), well inside
the resolution of the learned models it is built from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.distributions import remaining_wait, resume_within

__all__ = ["GRID_POINTS", "LIFETIME_CLASS", "MAX_CHILDREN", "MIN_LIFETIMES", "JoinWait", "Subagents"]

#: Subagents a join may wait on (a lead with more is priced as waiting on this many of its oldest).
MAX_CHILDREN = 64
#: Points of the numerical integral of the survival function.
GRID_POINTS = 160
#: Where the integral stops when asked for [x, inf): past it the lead is priced as resumed. (A day is
#: beyond any retention a pause may have: AGENTCACHE_MAX_RETENTION_S is 600 s by default.)
HORIZON_CAP_S = 86_400.0
_SMALLEST_S = 1e-4  # the grid's first point past 0


class JoinWait:
    """The wait of a join on subagents that have run ``elapsed_s`` seconds each, with lifetimes drawn
    from ``lifetime`` (a distribution with ``survival`` and ``survival_integral``)."""

    def __init__(self, lifetime, elapsed_s: Sequence[float]):
        elapsed = sorted(float(e) for e in elapsed_s)
        if not elapsed:
            raise ValueError("a join waits on at least one subagent")
        if not all(e >= 0.0 and math.isfinite(e) for e in elapsed):
            raise ValueError("subagents' elapsed times must be >= 0 and finite")
        self.lifetime = lifetime
        self.elapsed = tuple(elapsed[:MAX_CHILDREN])  # past the bound, the youngest: the ones just started

    @property
    def children(self) -> int:
        return len(self.elapsed)

    def cdf(self, t: float) -> float:
        if t < 0.0:
            return 0.0
        p = 1.0
        for e in self.elapsed:
            p *= resume_within(self.lifetime, e, t)
            if p == 0.0:
                break
        return p

    def survival(self, t: float) -> float:
        return 1.0 - self.cdf(t)

    def quantile(self, q: float) -> float:
        """Smallest t with cdf(t) >= q, to within 0.1% (bisection in log time)."""
        if q <= 0.0:
            return 0.0
        if q >= 1.0:
            return math.inf
        lo, hi = 0.0, 1.0
        while self.cdf(hi) < q:
            lo, hi = hi, hi * 4.0
            if hi > HORIZON_CAP_S:
                return math.inf
        for _ in range(64):
            mid = math.sqrt(lo * hi) if lo > 0.0 else hi / 1024.0
            if self.cdf(mid) >= q:
                hi = mid
            else:
                lo = mid
            if lo > 0.0 and hi / lo < 1.001:
                break
        return hi

    def survival_integral(self, x: float, y: float) -> float:
        """Integral of the survival function over [x, y] (y may be inf: up to :data:`HORIZON_CAP_S`)."""
        x, y = max(0.0, x), min(y, HORIZON_CAP_S)
        if y <= x:
            return 0.0
        a = max(x, _SMALLEST_S)
        total = min(a, y) - x if a > x else 0.0  # below the grid S is ~1 (at most 0.1 ms of it)
        if y <= a:
            return total
        step = math.log(y / a) / (GRID_POINTS - 1)
        prev_t, prev_s = a, self.survival(a)
        for k in range(1, GRID_POINTS):
            t = a * math.exp(step * k) if k < GRID_POINTS - 1 else y
            s = self.survival(t)
            total += 0.5 * (prev_s + s) * (t - prev_t)
            prev_t, prev_s = t, s
        return total

    def mean(self) -> float:
        return self.survival_integral(0.0, math.inf)

    def remaining_wait(self, elapsed: float, horizon: float = math.inf) -> float:
        return remaining_wait(self, elapsed, horizon)

    def resume_within(self, elapsed: float, horizon: float) -> float:
        return resume_within(self, elapsed, horizon)


#: The pseudo tool class under which subagents' lifetimes are learned in a LatencyBook. Clients cannot
#: name a tool class like it: hints validate tool classes against ``[A-Za-z0-9._:-]``.
LIFETIME_CLASS = "@subagent"
#: Lifetimes a namespace must have observed before a join is priced from them (until then the lead's
#: pause is priced with its own tool class's model, as any pause).
MIN_LIFETIMES = 8
#: Leads tracked at once, in all and per namespace (the least recently started of the namespace over its
#: share is forgotten past it: its join is priced as a plain pause; another namespace's never is).
LEADS_LIMIT = 4096
LEADS_PER_NAMESPACE = 1024

Key = tuple  # (namespace, session, branch)


class Subagents:
    """Which subagents of each lead are running and since when, and their learned lifetimes (pure: the
    caller passes the time, so the HTTP side's clock and the replay's model clock drive the same code).

    A subagent starts at its first call (:meth:`started`) and ends at its close or abort
    (:meth:`ended`), which records its lifetime in ``book`` under :data:`LIFETIME_CLASS` for its
    namespace. :meth:`join` is what a pause of the lead waits on."""

    def __init__(self, book, limit: int = LEADS_LIMIT, namespace_limit: int = LEADS_PER_NAMESPACE):
        self.book = book
        # lead -> {subagent branch: started}, least recently given a subagent first in each namespace
        self.running: NamespacedLRU[Key, dict[str, float]] = NamespacedLRU(limit, namespace_limit)
        self.lead_of: dict[Key, Key] = {}  # subagent -> its lead (only subagents of tracked leads)

    def started(self, namespace: str, session: str, branch: str, lead_branch: str, now: float) -> bool:
        """A call of subagent ``branch`` of ``lead_branch`` arrived; True when it is its first (it started
        now). Bounded: past :data:`MAX_CHILDREN` running subagents of one lead, more are not tracked."""
        me, lead = (namespace, session, branch), (namespace, session, lead_branch)
        if me in self.lead_of:
            return False
        forks = self.running.get(lead)
        if forks is None:
            forks = {}
            for old, old_forks in self.running.put(lead, forks):
                self._unlink(old, old_forks)
        else:
            self.running.touch(lead)
        if len(forks) >= MAX_CHILDREN:
            return False
        forks[branch] = now
        self.lead_of[me] = lead
        return True

    def ended(self, namespace: str, session: str, branch: str, now: float) -> Key | None:
        """Subagent ``branch`` closed (or was aborted): its lifetime is learned; returns its lead (None
        when it was not a tracked subagent)."""
        me = (namespace, session, branch)
        lead = self.lead_of.pop(me, None)
        if lead is None:
            return None
        forks = self.running.get(lead)
        started = forks.pop(branch)
        if not forks:
            self.running.pop(lead)
        self.book.observe(namespace, LIFETIME_CLASS, max(now - started, 0.0))
        return lead

    def session_ended(self, namespace: str, session: str) -> None:
        """Every branch of the session ended at once: nothing is learned (they were cut short)."""
        for lead in [k for k, _ in self.running.namespace_items(namespace) if k[1] == session]:
            self._drop(lead)

    def namespace_ended(self, namespace: str) -> None:
        """A namespace was purged: nothing of it is tracked any more."""
        for lead, forks in self.running.pop_namespace(namespace):
            self._unlink(lead, forks)

    def lead_ended(self, namespace: str, session: str, branch: str) -> None:
        """A lead closed: its subagents keep running, but nothing waits on them any more."""
        self._drop((namespace, session, branch))

    def join(self, namespace: str, session: str, branch: str, now: float) -> JoinWait | None:
        """What a pause of ``branch`` now waits on: its running subagents' remaining lifetimes, or None
        (none running, or fewer than :data:`MIN_LIFETIMES` lifetimes learned in the namespace)."""
        forks = self.running.get((namespace, session, branch))
        if not forks or (namespace, LIFETIME_CLASS) not in self.book:
            return None
        lifetime = self.book.peek(namespace, LIFETIME_CLASS)
        if lifetime.observations < MIN_LIFETIMES:
            return None
        return JoinWait(lifetime, [max(now - started, 0.0) for started in forks.values()])

    def _drop(self, lead: Key) -> None:
        self._unlink(lead, self.running.pop(lead, {}))

    def _unlink(self, lead: Key, forks: dict[str, float]) -> None:
        for branch in forks:
            self.lead_of.pop((lead[0], lead[1], branch), None)
