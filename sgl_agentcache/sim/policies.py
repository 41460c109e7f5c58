"""The replayed systems: ours, the baselines B0-B5 and a clairvoyant heuristic (pure rules).

Every system runs the same cache code on the same trace with the same device pool and the same host
tier (``replay(..., host_tokens=)``): SGLang's own ``UnifiedRadixCache`` for B0 and B5 (*reference*
systems: stock SGLang has no host tier, so they run with none, and B0 is the denominator of every
ratio), our ``AgentRadixCache`` for the rest. They differ in

- ``ranking``: how leaves are ordered for eviction (``sgl_agentcache.sim.rankings``; None: ours, the
  lifecycle rank);
- ``hints``: whether lifecycle hints (stable prefix, fork point, close) and closes reach the cache
  (the others get session/branch ownership only, which their pause rules need to find a paused
  branch's KV); ``quotas`` are ours;
- ``pause_rule``: what happens when a call ends in a tool call (:class:`PauseOrder`), from what the
  system may know (:class:`PauseView`). Only a ``clairvoyant`` system is also handed the trace's
  future (:class:`Future`): the replayer passes None to every other, so they cannot read it.

Mechanisms (``docs/anchors.md``; formulas checked against the papers and their public code):

- B1* ``sglang-hicache`` / ``sglang-hicache-wt``: SGLang's own HiCache, its code (``UnifiedRadixCache`` with
  ``init_hicache``: host pool, cache controller, ``direct`` io) driven offline (``server/scheduler/offline.py``), the
  host pool sized to the same host budget; write-back and write-through.
- B2 ``infercept``: InferCept's min-waste rule with pipelined, budgeted swap (paper §4), on SGLang's own
  HiCache write-back (evicted nodes go to the same host pool: without it InferCept, built on a vLLM with no
  host cache, recomputed 1.4-4x stock's tokens wherever a host tier was given -- a strawman); a swap
  demotes the paused branch's suffix into HiCache's host pool (``server/scheduler/hicache_moves.py``): a pause is
  swapped (offloaded) while the swap budget -- what the host link moves while the GPU computes --
  has room, else preserved or discarded, whichever wastes less memory-time (preserve: expected
  remaining interception x tokens; discard with chunked recompute: ``C (C/2 + C_other) / prefill
  rate``). The interception time is InferCept's online estimate (here the learned mean), never the
  trace's.
- B3 ``continuum``: Continuum's TTL, ``tau* = argmax_tau F(tau) (eta T + PrefillOrReload(r)) - tau``
  (v6 Eq. 2: the cost of holding memory, ``MemUsage(r)/M x tau``, and both benefit terms carry the
  same ``MemUsage(r)/M``, which cancels), with the per-tool empirical CDF after 100 samples, the global
  one after 100 in all, else the Exp(1) cold start (``ln B`` when ``B > 1 s``); ``T`` the mean queueing
  delay of returning calls that lost KV, ``eta = -Corr(k, N - k)`` over finished sessions. Expiry
  unpins (back to LRU). With a host tier, evicted KV goes to SGLang's HiCache host pool (write-back), as
  in Continuum's evaluation it goes to LMCache's DRAM offload, and PrefillOrReload is the reload time. ``continuum-2s`` is the public
  fork's fixed rule (pin 2 s when the tool's running mean is at most 2 s). Only Continuum's cache side
  runs here: its program-level FCFS scheduling does not, so the results label it "LRU write-back + TTL
  pin", not Continuum.
- B4 ``kvflow``: KVFlow's steps-to-execution eviction over its agent step graph (``sim/stepgraph.py``:
  the structure seen so far -- running branches, tool stops, spawned workers, ends; no times, and no
  trace future: it once counted each branch's remaining calls) on SGLang's own HiCache write-back (as
  KVFlow itself is built on SGLang's HiCache), with prefetch through HiCache's load path of the agents
  whose next step is within ``load_ahead_step`` (2).
- B5 ``session-radix``: SGLang's ``--enable-session-radix-cache`` soft protection (reference, no host).
- ours (``agentcache``): lifecycle rank, quotas and closes, our pause policy (learned latency
  distributions) and a prefetch at the tool class's learned median (into free memory only), on SGLang's
  own HiCache write-back (``--enable-hierarchical-cache``), as we recommend deploying it: our lifecycle
  decides what HiCache's host pool holds and deletes (``AgentRadixCache.init_hicache``), pauses are advice
  over HiCache's moves, a prefetch uses HiCache's load path.
- ours, inferred (``agentcache-inferred``, on HiCache too): the same cache with no client hint at all: sessions,
  branches, forks, stable prefixes and tool pauses inferred from the calls as ``AGENTCACHE_INFER=chat``
  infers them from chat requests (``sim/inferred.py``): idle closes that keep the KV cached, edits
  inferred, no client close. ``agentcache-inferred-v1`` is that inference as it first shipped (idle
  closes free, edits read as forks), ``agentcache-inferred-no-edits`` keeps the KV on idle closes but
  reads edits as forks, and ``agentcache-inferred+closes`` adds the trace's own branch closes (what a
  harness's explicit hint would say): they exist for the attribution study
  (``bench/inference_attribution.py``), not as systems.
- ``clairvoyant``: Belady on true next use (on both of HiCache's tiers), release of what is never used
  again, an exact prefetch one transfer before the true return. A heuristic that reads the future, *not*
  a bound: the bound is the LP in ``sim/bound.py``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Protocol

from sgl_agentcache.policy.pause import PauseAction
from sgl_agentcache.sim.rankings import LruRanking, NextUseRanking, StepsRanking


@dataclass(frozen=True)
class PauseView:
    """What a realistic pause rule may look at: the present and the past, never the trace's future."""

    now: float  # replay time of the pause
    tokens: int  # the movable suffix the cache reports
    latency: object  # learned LatencyModel of (tenant, tool class)
    observations: list[float]  # tool durations seen so far for this (tenant, tool class)
    all_observations: list[float]  # durations seen so far for any tool of the tenant
    prefill_s: float  # re-prefilling the suffix
    transfer_s: float  # one-way host<->device copy of the suffix
    tokens_per_s_link: float  # what the host link moves per second (tokens)
    running_tokens: int  # KV of requests in flight
    queue_s: float  # mean queueing delay of recent returning calls that had lost KV
    memoryfulness: float  # Continuum's eta from finished sessions (1 before there are any)
    host_tokens: int  # host tier capacity (0: nothing can be offloaded)
    join: object | None = None  # a lead with running subagents: their JoinWait (policy/join.py), for rules
    # that price joins (``prices_joins``)


@dataclass(frozen=True)
class Future:
    """What the trace says will happen next: for clairvoyant rules only."""

    wait_s: float  # until the branch's next call arrives
    resumes: bool  # whether the branch has a next call at all


@dataclass(frozen=True)
class PauseOrder:
    """A rule's answer at a pause: a forced action or the cache's own policy, and follow-ups."""

    action: PauseAction | None = None  # None with ``latency``: our policy decides with that distribution;
    latency: object | None = None      # None without it: nothing happens (the KV is left to eviction)
    unpin_after_s: float | None = None  # a TTL pin: unpin (not discard) when it expires
    prefetch_after_s: float | None = None  # bring the branch's KV back this long after the pause
    prefetch_evicts: bool = False  # the prefetch may evict (else: free memory only)
    next_use_in_s: float | None = None  # for NextUseRanking (clairvoyant)
    resume_probability: float = 1.0  # with ``latency``: the policy's resume probability (close likelihood)


NOTHING = PauseOrder()


class PauseRule(Protocol):
    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder: ...


@dataclass(frozen=True)
class ReplayPolicy:
    name: str
    label: str
    stock: bool = False  # SGLang's own cache (B0, B5): a reference system, no host tier
    session_radix: bool = False
    ranking: type | None = None  # a class of sim.rankings (None: the lifecycle rank)
    hints: bool = False  # full lifecycle hints and closes
    quotas: bool = False
    clairvoyant: bool = False  # reads the trace's future
    pause_rule: Callable[[], PauseRule] | None = None  # a factory: one rule (with its state) per run
    steps: bool = False  # KVFlow's step graph drives ranking and prefetch
    infer: bool = False  # hints inferred from the calls as AGENTCACHE_INFER=chat does (sim/inferred.py)
    infer_edits: bool = True  # inferred: a divergence from an idle branch is its edit (else a fork)
    infer_keep_on_close: bool = True  # inferred: an idle close keeps the KV as untagged cache (else frees)
    infer_trace_closes: bool = False  # inferred + the trace's own closes (attribution only)
    infer_learn_bounds: bool = True  # inferred: idle and tool-wait bounds learned per namespace (else fixed)
    hicache: str | None = None  # SGLang's own HiCache attached, with this write policy, its host pool the budget

    @property
    def reference(self) -> bool:
        """Stock SGLang without HiCache: compared without a host tier (it has none)."""
        return self.stock and self.hicache is None


# ---- ours ----

class OursRule:
    """Our pause policy decides (the cache's ``decide`` with the learned distribution and the class's
    learned resume rate, as the server's coordinator sends them; a lead with running subagents waits on
    their join, and is re-priced when another starts); a prefetch at the wait's learned median, one
    transfer early, into free memory only."""

    prices_joins = True
    prices_idle = True

    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder:
        wait = view.join if view.join is not None else view.latency
        median = wait.quantile(0.5)
        return PauseOrder(latency=wait, prefetch_after_s=max(median - view.transfer_s, 0.0),
                          resume_probability=view.latency.resume_rate())


# ---- B2 InferCept ----

class InferCeptRule:
    """Min-waste with a pipelined swap budget (see the module docstring)."""

    def __init__(self) -> None:
        self.budget = 0.0  # tokens the link can still move without stalling compute
        self.since = 0.0

    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder:
        rate = view.tokens_per_s_link
        self.budget = min(self.budget + (view.now - self.since) * rate, rate)  # refills, at most 1 s worth
        self.since = view.now
        c = view.tokens
        if view.host_tokens > 0 and c <= self.budget:
            self.budget -= c
            return PauseOrder(action=PauseAction.OFFLOAD)
        prefill_rate = c / view.prefill_s if view.prefill_s > 0 else math.inf
        waste_preserve = view.latency.mean() * c
        waste_discard = c * (c / 2 + view.running_tokens) / prefill_rate
        return PauseOrder(action=PauseAction.KEEP if waste_preserve <= waste_discard else PauseAction.DISCARD)


# ---- B3 Continuum ----

#: Samples a CDF needs before Continuum trusts it (per tool, then over every tool).
CONTINUUM_MIN_SAMPLES = 100


def continuum_ttl(observations: list[float], benefit_s: float, cdf: Callable[[float], float]) -> float:
    """``tau* = argmax_{tau in {0} U observed} F(tau) * benefit - tau`` (smallest on ties); with no
    observations the cold-start ``Exp(1)`` CDF gives ``ln(benefit)`` when benefit > 1 s, else 0."""
    if not observations:
        return math.log(benefit_s) if benefit_s > 1.0 else 0.0
    best, best_value = 0.0, 0.0
    for tau in sorted(set(observations)):
        value = cdf(tau) * benefit_s - tau
        if value > best_value:
            best, best_value = tau, value
    return best


class ContinuumRule:
    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder:
        reload_s = view.transfer_s if view.host_tokens > 0 else view.prefill_s
        benefit = view.memoryfulness * view.queue_s + reload_s
        if len(view.observations) > CONTINUUM_MIN_SAMPLES:
            obs = view.observations
        elif len(view.all_observations) > CONTINUUM_MIN_SAMPLES:
            obs = view.all_observations
        else:
            obs = []
        ordered = sorted(obs)
        cdf = lambda t: bisect.bisect_right(ordered, t) / len(ordered)  # noqa: E731 - the empirical CDF
        ttl = continuum_ttl(ordered, benefit, cdf)
        return PauseOrder(action=PauseAction.KEEP, unpin_after_s=ttl) if ttl > 0.01 else NOTHING


class ContinuumFixedRule:
    """The public fork's rule: pin 2 s when the tool's running mean is at most 2 s (unseen: 0)."""

    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder:
        obs = view.observations[-32:]
        average = statistics.fmean(obs) if obs else 0.0
        return PauseOrder(action=PauseAction.KEEP, unpin_after_s=2.0) if average <= 2.0 else NOTHING


# ---- B6 clairvoyant ----

class ClairvoyantRule:
    def __call__(self, view: PauseView, future: Future | None) -> PauseOrder:
        if future is None:
            raise RuntimeError("the clairvoyant rule needs the future")
        if not future.resumes:
            return PauseOrder(action=PauseAction.RELEASE, next_use_in_s=math.inf)
        return PauseOrder(next_use_in_s=future.wait_s, prefetch_after_s=max(future.wait_s - view.transfer_s, 0.0),
                          prefetch_evicts=True)


POLICIES: dict[str, ReplayPolicy] = {p.name: p for p in (
    ReplayPolicy("stock", "B0 SGLang LRU (no host tier)", stock=True),
    ReplayPolicy("sglang-hicache", "B1* SGLang's own HiCache, write-back (its code, offline)", stock=True,
                 hicache="write_back"),
    ReplayPolicy("sglang-hicache-wt", "B1* SGLang's own HiCache, write-through (its code, offline)", stock=True,
                 hicache="write_through"),
    ReplayPolicy("infercept", "B2 InferCept min-waste, budgeted swap, on SGLang's HiCache (write-back)",
                 ranking=LruRanking, pause_rule=InferCeptRule, hicache="write_back"),
    ReplayPolicy("continuum", "B3 SGLang HiCache write-back + TTL pin (Continuum's Eq. 2 TTL, not its scheduler)",
                 ranking=LruRanking, pause_rule=ContinuumRule, hicache="write_back"),
    ReplayPolicy("continuum-2s", "B3' SGLang HiCache write-back + 2 s pin (Continuum's public rule, not its scheduler)",
                 ranking=LruRanking, pause_rule=ContinuumFixedRule, hicache="write_back"),
    ReplayPolicy("kvflow", "B4 KVFlow steps-to-execution + prefetch, on SGLang's HiCache (write-back)",
                 ranking=StepsRanking, steps=True, hicache="write_back"),
    ReplayPolicy("session-radix", "B5 SGLang session-radix (no host tier)", stock=True, session_radix=True),
    ReplayPolicy("agentcache", "ours: lifecycle + pause policy on SGLang's HiCache (write-back; its host pool)",
                 hints=True, quotas=True, pause_rule=OursRule, hicache="write_back"),
    ReplayPolicy("agentcache-inferred", "ours, inferred hints (AGENTCACHE_INFER=chat; no client hints)",
                 hints=True, quotas=True, pause_rule=OursRule, infer=True, hicache="write_back"),
    ReplayPolicy("agentcache-inferred-v1", "ours, inferred as first shipped (idle closes free; edits are forks)",
                 hints=True, quotas=True, pause_rule=OursRule, infer=True, infer_edits=False,
                 infer_keep_on_close=False, infer_learn_bounds=False, hicache="write_back"),
    ReplayPolicy("agentcache-inferred-no-edits", "ours, inferred, edits read as forks, fixed bounds (attribution)",
                 hints=True, quotas=True, pause_rule=OursRule, infer=True, infer_edits=False,
                 infer_learn_bounds=False, hicache="write_back"),
    ReplayPolicy("agentcache-inferred-fixed-bounds", "ours, inferred, fixed idle and tool bounds (attribution)",
                 hints=True, quotas=True, pause_rule=OursRule, infer=True, infer_learn_bounds=False,
                 hicache="write_back"),
    ReplayPolicy("agentcache-inferred+closes", "ours, inferred, plus the trace's own branch closes (attribution)",
                 hints=True, quotas=True, pause_rule=OursRule, infer=True, infer_trace_closes=True,
                 hicache="write_back"),
    ReplayPolicy("clairvoyant", "clairvoyant heuristic (Belady + exact prefetch; reads the future, not a bound)",
                 ranking=NextUseRanking, hints=True, clairvoyant=True, pause_rule=ClairvoyantRule,
                 hicache="write_back"),
)}

__all__ = ["CONTINUUM_MIN_SAMPLES", "Future", "NOTHING", "POLICIES", "PauseOrder", "PauseRule", "PauseView",
           "ReplayPolicy", "continuum_ttl"]
