"""Session idleness (policy/idle.py): gaps between a branch's answered call and its next are learned per
namespace; a branch idle past its namespace's usual gap is due for a pause on ``@idle``, priced by the
pause policy with its idle time as elapsed. The server side (coordinator sweep, ingress) is tested in
tests/test_background_pause.py; the replay drives the same class."""

from __future__ import annotations

import pytest

from sgl_agentcache.policy.idle import (DEFAULT_AFTER_S, IDLE_CLASS, MIN_GAPS, PRICE_QUANTILE, REPRICE_FACTOR,
                                        IdleBranches)
from sgl_agentcache.policy.latency import LatencyBook
from sgl_agentcache.policy.pause import PauseAction, PauseInputs, decide


def test_gaps_are_learned_and_set_when_a_branch_is_due():
    book = LatencyBook()
    idle = IdleBranches(book)
    assert idle.after_s("t") == DEFAULT_AFTER_S  # nothing learned yet
    for i in range(MIN_GAPS):
        idle.answered("t", f"s{i}", "main", now=100.0)
        assert idle.arrived("t", f"s{i}", "main", now=102.0) == pytest.approx(2.0)
    model = book.peek("t", IDLE_CLASS)
    assert model.observations == MIN_GAPS and idle.after_s("t") == pytest.approx(model.quantile(PRICE_QUANTILE))
    assert idle.after_s("t") < DEFAULT_AFTER_S / 5 and idle.after_s("other") == DEFAULT_AFTER_S  # per namespace
    assert idle.arrived("t", "never-answered", "main", now=5.0) is None


def test_a_due_branch_is_handed_out_once_per_doubling_of_its_idle_time_and_its_resume_is_learned_by_the_pause():
    book = LatencyBook()
    idle = IdleBranches(book)
    idle.answered("t", "s", "main", now=0.0)
    assert idle.due(now=DEFAULT_AFTER_S - 1) == []
    assert idle.due(now=DEFAULT_AFTER_S + 1) == [(("t", "s", "main"), 0.0, DEFAULT_AFTER_S + 1)]
    assert idle.due(now=DEFAULT_AFTER_S + 50) == []  # handed out already...
    # ...until its idle time has grown REPRICE_FACTOR-fold: then priced again with it (once per step).
    again = REPRICE_FACTOR * (DEFAULT_AFTER_S + 1)
    assert idle.due(now=again - 1) == [] and idle.due(now=again) == [(("t", "s", "main"), 0.0, again)]
    assert idle.due(now=again + 1) == []
    idle.arrived("t", "s", "main", now=200.0)  # the pause on @idle learns this gap when it resumes
    assert (("t", IDLE_CLASS) not in book) or book.peek("t", IDLE_CLASS).observations == 0
    idle.answered("t", "s", "main", now=300.0)  # a new spell: due again later
    assert idle.due(now=300.0 + DEFAULT_AFTER_S + 1)


def test_closes_and_purges_forget_idle_branches_and_the_set_is_bounded():
    idle = IdleBranches(LatencyBook(), limit=3)
    for i in range(5):
        idle.answered("t", f"s{i}", "main", now=float(i))
    assert len(idle.since) == 3 and ("t", "s0", "main") not in idle.since  # the least recent went
    idle.answered("t", "s4", "w", now=5.0)
    idle.ended("t", "s4")  # the whole session
    assert all(k[1] != "s4" for k in idle.since)
    idle.ended("t", "s3", "main")
    idle.namespace_ended("t")
    assert not idle.since and not idle.priced


def test_the_longer_a_session_has_been_idle_the_less_its_kv_is_worth_keeping():
    """The decision conditions the learned gaps on the idle time: a session idle for a minute, in a
    namespace whose users usually come back within seconds, is expected to stay away long (the Lindy
    tail past the learned gaps), so keeping its KV on the device costs more than moving it."""
    book = LatencyBook()
    idle = IdleBranches(book)
    for i in range(50):
        idle.answered("t", f"s{i}", "main", now=0.0)
        idle.arrived("t", f"s{i}", "main", now=1.0 + (i % 5) * 0.5)
    model = idle.model("t")
    base = dict(retained_tokens=4096, bytes_per_token=36 * 1024, latency=model, device_free_tokens=95_000,
                device_evictable_tokens=0, device_total_tokens=100_000, host_free_bytes=10**12,
                h2d_bandwidth_Bps=8 * 2**30, d2h_bandwidth_Bps=8 * 2**30, prefill_tokens_per_s=20_000.0)
    fresh, long_idle = decide(PauseInputs(**base, elapsed_s=0.5)), decide(PauseInputs(**base, elapsed_s=60.0))
    assert fresh.expected_wait_s < long_idle.expected_wait_s
    assert fresh.action is PauseAction.KEEP and long_idle.action is not PauseAction.KEEP
