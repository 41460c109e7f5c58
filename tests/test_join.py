"""Fork/join in the pause policy: a lead waiting on its subagents resumes when the last one ends.

Pure parts (policy/join.py): the JoinWait distribution against a Monte Carlo of the same model, its
monotonicity in the number and age of subagents, and the Subagents book that learns lifetimes; then the
pause decision a join yields. The server side (coordinator, ingress, the scheduler's pause op) is in
tests/test_background_pause.py and tests/test_lazy_pauses_server.py.
"""

from __future__ import annotations

import math
import random

import pytest

from sgl_agentcache.policy.distributions import LatencyDistribution, LogNormal
from sgl_agentcache.policy.join import LIFETIME_CLASS, MIN_LIFETIMES, JoinWait, Subagents
from sgl_agentcache.policy.latency import LatencyBook, LatencyModel
from sgl_agentcache.policy.pause import PauseAction, PauseInputs, decide


def _learned(median_s: float = 3.0, sigma: float = 0.8, n: int = 400, seed: int = 1) -> LatencyModel:
    model, rng = LatencyModel(), random.Random(seed)
    for _ in range(n):
        model.observe(LogNormal(median_s, sigma).quantile(rng.random()))
    return model


def test_a_join_is_the_maximum_of_its_subagents_remaining_lifetimes():
    """cdf = product of the conditional cdfs; checked against sampling the same learned model."""
    model, rng = _learned(), random.Random(7)
    join = JoinWait(model, [0.0, 0.0, 2.0, 5.0])
    assert isinstance(join, LatencyDistribution) and join.children == 4
    samples = []
    for _ in range(20_000):
        waits = []
        for age in join.elapsed:  # rejection sampling of C | C > age
            c = model.quantile(rng.random())
            while c <= age:
                c = model.quantile(rng.random())
            waits.append(c - age)
        samples.append(max(waits))
    for t in (1.0, 3.0, 8.0):
        assert join.cdf(t) == pytest.approx(sum(s <= t for s in samples) / len(samples), abs=0.015)
    assert join.remaining_wait(0.0) == pytest.approx(sum(samples) / len(samples), rel=0.03)
    median = join.quantile(0.5)
    assert join.cdf(median) >= 0.5 > join.cdf(median * 0.99)


def test_more_subagents_and_younger_ones_mean_a_longer_wait():
    model = _learned()
    waits = [JoinWait(model, [0.0] * n).remaining_wait(0.0) for n in (1, 2, 4, 8)]
    assert waits == sorted(waits) and waits[-1] > 2 * waits[0]
    one = JoinWait(model, [0.0])
    assert one.remaining_wait(0.0) == pytest.approx(model.remaining_wait(0.0), rel=0.02)  # a join of one
    assert JoinWait(model, [0.0, 0.0]).resume_within(0.0, 5.0) < JoinWait(model, [0.0]).resume_within(0.0, 5.0)
    with pytest.raises(ValueError):
        JoinWait(model, [])
    with pytest.raises(ValueError):
        JoinWait(model, [math.nan])


def test_a_subagent_past_every_learned_lifetime_gets_the_lindy_tail_not_zero():
    """One that should have ended long ago (a hung worker) keeps the join open: the longer it has run,
    the longer it is expected to run, as a hung tool is (distributions.py)."""
    model = _learned(median_s=0.5, sigma=0.3)
    hung = JoinWait(model, [4000.0])
    assert hung.remaining_wait(0.0) > 100.0 and hung.resume_within(0.0, 1.0) < 0.01


def test_the_book_learns_lifetimes_and_prices_a_join_only_with_enough_of_them():
    book = LatencyBook()
    subagents = Subagents(book)
    ns, s = "t", "s1"
    assert subagents.started(ns, s, "w0", "main", now=10.0)
    assert not subagents.started(ns, s, "w0", "main", now=11.0)  # its later calls change nothing
    assert subagents.join(ns, s, "main", now=12.0) is None  # no lifetime learned yet
    for i in range(MIN_LIFETIMES):
        subagents.started(ns, s, f"x{i}", "main", now=0.0)
        assert subagents.ended(ns, s, f"x{i}", now=4.0) == (ns, s, "main")
    assert book.peek(ns, LIFETIME_CLASS).observations == MIN_LIFETIMES
    join = subagents.join(ns, s, "main", now=12.0)
    assert join is not None and join.elapsed == (2.0,)  # w0, running for 2 s
    assert subagents.ended(ns, s, "unknown", now=13.0) is None
    subagents.lead_ended(ns, s, "main")  # nothing waits on w0 any more
    assert subagents.join(ns, s, "main", now=13.0) is None and not subagents.running and not subagents.lead_of
    subagents.started(ns, "s2", "w0", "main", now=0.0)
    subagents.session_ended(ns, "s2")
    assert not subagents.running and not subagents.lead_of
    assert subagents.join("another-tenant", s, "main", now=0.0) is None  # lifetimes are per namespace


def test_the_book_is_bounded():
    subagents = Subagents(LatencyBook(), limit=4)
    for i in range(10):
        subagents.started("t", f"s{i}", "w0", "main", now=0.0)
    assert len(subagents.running) == 4 and len(subagents.lead_of) == 4


def _inputs(latency, **over) -> PauseInputs:
    base = dict(retained_tokens=4096, bytes_per_token=36 * 1024, latency=latency, device_free_tokens=2_000,
                device_evictable_tokens=10_000, device_total_tokens=100_000, host_free_bytes=10**12,
                h2d_bandwidth_Bps=8 * 2**30, d2h_bandwidth_Bps=8 * 2**30, prefill_tokens_per_s=20_000.0)
    return PauseInputs(**(base | over))


def test_a_lead_waiting_on_many_subagents_is_less_likely_kept_than_on_one():
    """The decision sees the join's longer wait: with one short-lived worker out the lead's KV is worth
    keeping on the device, with eight of them it is moved to host (same memory pressure)."""
    model = _learned(median_s=3.0, sigma=0.8)
    light = dict(device_free_tokens=95_000, device_evictable_tokens=0)
    one = decide(_inputs(JoinWait(model, [0.0]), **light))
    many = decide(_inputs(JoinWait(model, [0.0] * 8), **light))
    assert one.expected_wait_s < many.expected_wait_s
    assert one.option(PauseAction.KEEP).cost < many.option(PauseAction.KEEP).cost
    assert one.action is PauseAction.KEEP and many.action is PauseAction.OFFLOAD
