"""The replayer's policies: ours, the baselines B0-B5 and the clairvoyant oracle B6 (pure rules).

Every policy runs the same cache code: SGLang's own ``UnifiedRadixCache`` for B0 and B5, our
``AgentRadixCache`` for the rest, which differ only in

- ``ranking``: how leaves are ordered for eviction ("lifecycle" ours; "lru" stock order; "next_use"
  furthest expected next use first);
- ``hints``: whether the lifecycle hints (stable prefix, fork point, close) and closes reach the cache
  (baselines on our cache get session/branch ownership only, which they need to find a paused
  branch's KV; quotas are ours, so baselines run without them);
- ``on_pause``: what happens when a call ends in a tool call, as a :class:`PauseOrder` computed from
  what that policy may know (:class:`PauseView`): the learned latency distribution for the realistic
  policies, the trace's true duration and future for the oracle;
- prefetch: when, if ever, a host copy is brought back ahead of the returning call.

The mechanisms follow ``docs/anchors.md``: InferCept's min-waste preserve / swap / discard (code form:
preserve waste = remaining time x tokens, discard and swap waste = time x tokens of the running batch),
Continuum's TTL ``tau* = argmax_{tau in {0} U observed} F(tau) * Benefit - tau`` and the public fork's
fixed 2 s rule, KVFlow's steps-to-execution eviction with overlapped prefetch, HiCache's
write-through with reactive load-back, and SGLang's session-radix soft protection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from sgl_agentcache.policy.pause import PauseAction

#: How early a "tool nearly done" signal reaches the server before the tool returns, for the policies
#: that act on one (a harness-level estimate, e.g. a progress callback; oracle prefetch is exact).
NEARLY_DONE_LEAD_S = 0.2


@dataclass(frozen=True)
class PauseView:
    """What a pause rule may look at (the oracle also reads ``true_*``)."""

    tokens: int  # movable suffix the cache reports
    latency: object  # learned LatencyModel of (tenant, tool class)
    observations: list[float]  # durations seen so far for this (tenant, tool class)
    prefill_s: float  # re-prefilling the suffix
    transfer_s: float  # one-way host<->device copy of the suffix
    running_tokens: int  # KV of requests in flight (InferCept's batch)
    queue_s: float  # recent mean queueing delay of returning turns (Continuum's Q_evicted)
    true_duration_s: float  # oracle only
    resumes: bool  # oracle only: the branch has a next call


@dataclass(frozen=True)
class PauseOrder:
    """A policy's answer at a pause: a forced action or the cache's own policy, and follow-ups."""

    action: PauseAction | None = None  # None with ``latency``: our policy decides with that distribution;
    latency: object | None = None      # None without it: nothing happens (the KV is left to eviction)
    write_through: bool = False
    unpin_after_s: float | None = None  # Continuum TTL: unpin (not discard) when it expires
    prefetch_after_s: float | None = None  # issue a prefetch this long after the pause
    next_use_in_s: float | None = None  # for "next_use" ranking


NOTHING = PauseOrder()


@dataclass(frozen=True)
class ReplayPolicy:
    name: str
    label: str
    stock: bool = False  # SGLang's own cache (B0, B5)
    session_radix: bool = False
    ranking: str = "lifecycle"
    hints: bool = False  # full lifecycle hints and closes
    quotas: bool = False
    on_pause: Callable[[PauseView], PauseOrder] | None = None


def _ours(view: PauseView) -> PauseOrder:
    lead = max(view.true_duration_s - NEARLY_DONE_LEAD_S, 0.0)  # the harness says "nearly done"
    return PauseOrder(latency=view.latency, prefetch_after_s=lead if view.true_duration_s > NEARLY_DONE_LEAD_S
                      else None)


def _write_through(view: PauseView) -> PauseOrder:
    return PauseOrder(action=PauseAction.OFFLOAD, write_through=True)


def _infercept(view: PauseView) -> PauseOrder:
    """Min-waste (token-seconds of memory that serve no decoding): preserve, swap or discard."""
    remaining = view.latency.mean()
    batch = max(view.running_tokens, 1)
    waste = {PauseAction.KEEP: remaining * view.tokens,
             PauseAction.OFFLOAD: view.transfer_s * (batch + view.tokens),
             PauseAction.DISCARD: view.prefill_s * (batch + view.tokens)}
    return PauseOrder(action=min(waste, key=lambda a: (waste[a], a.value)))


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


def _continuum(view: PauseView) -> PauseOrder:
    obs = view.observations[-1000:]
    cdf = lambda t: sum(o <= t for o in obs) / len(obs)  # noqa: E731 - the empirical CDF
    ttl = continuum_ttl(obs, view.queue_s + view.prefill_s, cdf)  # Benefit = eta * Q_evicted + prefill, eta = 1
    return PauseOrder(action=PauseAction.KEEP, unpin_after_s=ttl) if ttl > 0.0 else NOTHING


def _continuum_2s(view: PauseView) -> PauseOrder:
    obs = view.observations[-32:]
    average = sum(obs) / len(obs) if obs else math.inf
    return PauseOrder(action=PauseAction.KEEP, unpin_after_s=2.0) if average <= 2.0 else NOTHING


def _kvflow(view: PauseView) -> PauseOrder:
    expected = view.latency.mean()
    return PauseOrder(action=PauseAction.OFFLOAD, write_through=True, next_use_in_s=expected,
                      prefetch_after_s=max(expected - view.transfer_s, 0.0))


def _oracle(view: PauseView) -> PauseOrder:
    """Knows the future: drop what is never used again; otherwise keep a host copy as insurance,
    let Belady (true next use) order the device, and restore exactly one transfer before the return."""
    if not view.resumes:
        return PauseOrder(action=PauseAction.RELEASE, next_use_in_s=math.inf)
    return PauseOrder(action=PauseAction.OFFLOAD, write_through=True, next_use_in_s=view.true_duration_s,
                      prefetch_after_s=max(view.true_duration_s - view.transfer_s, 0.0))


POLICIES: dict[str, ReplayPolicy] = {p.name: p for p in (
    ReplayPolicy("stock", "B0 SGLang LRU", stock=True),
    ReplayPolicy("stock+host", "B1 LRU + host write-through", ranking="lru", on_pause=_write_through),
    ReplayPolicy("infercept", "B2 InferCept min-waste", ranking="lru", on_pause=_infercept),
    ReplayPolicy("continuum", "B3 Continuum TTL (CDF)", ranking="lru", on_pause=_continuum),
    ReplayPolicy("continuum-2s", "B3' Continuum fixed 2 s", ranking="lru", on_pause=_continuum_2s),
    ReplayPolicy("kvflow", "B4 KVFlow steps-to-execution + prefetch", ranking="next_use", on_pause=_kvflow),
    ReplayPolicy("session-radix", "B5 SGLang session-radix", stock=True, session_radix=True),
    ReplayPolicy("agentcache", "ours: lifecycle + pause policy", hints=True, quotas=True, on_pause=_ours),
    ReplayPolicy("oracle", "B6 clairvoyant (Belady + exact prefetch; a bound for these mechanisms, "
                           "not an optimum)", ranking="next_use", hints=True, on_pause=_oracle),
)}
