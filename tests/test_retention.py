"""The retention policy (pure): bands and value per token on both tiers, what an offload displaces,
the learned host reuse rate, the prefetch gate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_agentcache.lifecycle import UNTAGGED_STATE, BranchKey, NodeClass, NodeState
from sgl_agentcache.policy.retention import (
    DEFAULT_DEVICE_REUSE,
    Band,
    RetentionModel,
    device_rank,
    displaced_host_seconds,
    host_band,
    learned_rate,
    prefetch_worthwhile,
)

B = BranchKey("|", "s", "b")
#: The seed profile's shape: 4k tokens/s prefill, 64 KiB per token, 25 GB/s host->device.
MODEL = RetentionModel(prefill_tokens_per_s=4000.0, h2d_bytes_per_s=25e9, bytes_per_token=65536)
VALUES = MODEL.device_values()  # as the cache ranks its device leaves


def rank(state, session_ref=0, last=0.0, **flags):
    return device_rank(VALUES, state, session_ref, last, **flags)


def test_device_order_is_ended_trim_scratch_session_stable_pinned_then_refs_then_recency():
    nodes = {
        "stable_old": rank(NodeState(NodeClass.STABLE), 0, 1.0),
        "session_ref": rank(NodeState(NodeClass.SESSION, B), 2, 0.5),
        "session_new": rank(NodeState(NodeClass.SESSION, B), 0, 9.0),
        "session_old": rank(NodeState(NodeClass.SESSION, B), 0, 2.0),
        "scratch_ref": rank(NodeState(NodeClass.SCRATCH, B), 1, 0.1),
        "scratch_new": rank(NodeState(NodeClass.SCRATCH, B), 0, 8.0),
        "untagged_mid": rank(NodeState(), 0, 4.0),
        "dead_stable": rank(NodeState(NodeClass.STABLE, None, terminated=True), 5, 99.0),
        "dead_scratch": rank(NodeState(NodeClass.SCRATCH, B, terminated=True), 0, 50.0),
        "over_quota_session": rank(NodeState(NodeClass.SESSION, B), 0, 0.0, over_quota=True),
        "pinned_scratch": rank(NodeState(NodeClass.SCRATCH, B), 0, 0.0, kept=True),
    }
    assert sorted(nodes, key=nodes.get) == [
        "dead_scratch", "dead_stable", "over_quota_session", "untagged_mid", "scratch_new",
        "scratch_ref", "session_old", "session_new", "session_ref", "stable_old", "pinned_scratch"]
    assert [b.name for b in sorted(Band)] == ["ENDED", "TRIM", "VALUED", "PROTECTED", "PINNED"]


@given(st.lists(st.floats(allow_nan=False), min_size=2, max_size=20))
def test_untagged_traffic_keeps_stock_lru_order(times):
    assert sorted(times, key=lambda t: rank(UNTAGGED_STATE, 0, t)) == sorted(times)


def test_ended_beats_a_pin_and_a_pin_beats_the_quota():
    """A terminated node is ENDED whatever else holds (kept, over quota); a pinned (applied KEEP)
    branch within the quota is PINNED; a live branch over its quota is TRIM even when kept (the
    caps bound pins, the quota bounds what a branch holds under pressure)."""
    assert rank(NodeState(NodeClass.STABLE, B, terminated=True), 0, 5.0, kept=True, over_quota=True)[0] is Band.ENDED
    assert rank(NodeState(NodeClass.SESSION, B), 0, 5.0, kept=True)[0] is Band.PINNED
    assert rank(NodeState(NodeClass.SESSION, B), 0, 5.0, kept=True, over_quota=True)[0] is Band.TRIM
    valued = rank(NodeState(NodeClass.SESSION, B), 0, 5.0)
    assert valued[0] is Band.VALUED and valued[1] == pytest.approx(VALUES[NodeClass.SESSION])
    assert rank(NodeState(NodeClass.SESSION, B), 0, 5.0, over_quota=True)[1] == 0.0  # no value outside VALUED


def test_value_per_token_is_reuse_times_the_cost_a_loss_would_add():
    recompute, reload = 1 / 4000.0, 65536 / 25e9
    assert MODEL.recompute_s == pytest.approx(recompute) and MODEL.reload_s == pytest.approx(reload)
    p = DEFAULT_DEVICE_REUSE[NodeClass.SESSION]
    assert MODEL.device_value(NodeClass.SESSION) == pytest.approx(p * recompute)  # lost: re-prefill
    assert MODEL.device_value(NodeClass.SESSION, spills=True) == pytest.approx(p * reload)  # lost: reload
    assert MODEL.host_value() == pytest.approx(MODEL.host_reuse * (recompute - reload))
    assert MODEL.device_values() == {cls: MODEL.device_value(cls) for cls in NodeClass}


def test_a_host_copy_that_saves_nothing_is_worth_nothing_and_never_prefetched():
    slow_link = RetentionModel(prefill_tokens_per_s=1e6, h2d_bytes_per_s=1e9, bytes_per_token=65536)
    assert not slow_link.host_copies_pay() and slow_link.host_value() == 0.0
    # priced as kept on host when evicted (spills), a device unit is still worth its re-prefill: no copy is made
    assert slow_link.device_value(NodeClass.SESSION, spills=True) == slow_link.device_value(NodeClass.SESSION)
    assert displaced_host_seconds(slow_link, 10_000, 0) == 0.0
    assert not prefetch_worthwhile(slow_link, 100, 10_000)


def test_host_bands_trim_first_protected_last():
    assert host_band(low_value=True, protected=False) < host_band(low_value=False, protected=False) \
        < host_band(low_value=False, protected=True)
    assert host_band(low_value=True, protected=True) is Band.TRIM  # a low-value entry is never protected


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_an_offload_costs_host_value_only_past_the_free_room_and_more_for_more(tokens, free, more):
    cost = displaced_host_seconds(MODEL, tokens, free)
    assert cost >= 0.0
    if tokens <= free:
        assert cost == 0.0
    assert displaced_host_seconds(MODEL, tokens + more, free) >= cost
    assert displaced_host_seconds(MODEL, tokens, free + more) <= cost


@given(st.integers(0, 1 << 30), st.integers(0, 1 << 30), st.floats(0.0, 1.0))
def test_learned_rate_is_a_probability_pulled_toward_the_prior(reused, lost, prior):
    rate = learned_rate(reused, lost, prior)
    assert 0.0 <= rate <= 1.0
    assert min(prior, reused / (reused + lost) if reused + lost else prior) - 1e-9 <= rate \
        <= max(prior, reused / (reused + lost) if reused + lost else prior) + 1e-9
    assert learned_rate(0, 0, prior) == pytest.approx(prior)


def test_learned_rate_follows_the_outcomes():
    assert learned_rate(1_000_000, 0) > 0.99 and learned_rate(0, 1_000_000) < 0.01


def test_prefetch_fills_free_memory_only():
    assert prefetch_worthwhile(MODEL, 100, 100) and not prefetch_worthwhile(MODEL, 101, 100)
    assert not prefetch_worthwhile(MODEL, 0, 100)


@pytest.mark.parametrize("kwargs", [
    {"prefill_tokens_per_s": 0.0, "h2d_bytes_per_s": 1.0, "bytes_per_token": 1},
    {"prefill_tokens_per_s": 1.0, "h2d_bytes_per_s": -1.0, "bytes_per_token": 1},
    {"prefill_tokens_per_s": 1.0, "h2d_bytes_per_s": 1.0, "bytes_per_token": 0},
    {"prefill_tokens_per_s": 1.0, "h2d_bytes_per_s": 1.0, "bytes_per_token": 1, "host_reuse": 1.5},
    {"prefill_tokens_per_s": 1.0, "h2d_bytes_per_s": 1.0, "bytes_per_token": 1,
     "device_reuse": {NodeClass.STABLE: 0.9}},
])
def test_bad_rates_are_refused(kwargs):
    with pytest.raises(ValueError):
        RetentionModel(**kwargs)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        learned_rate(-1, 0)
    with pytest.raises(ValueError):
        displaced_host_seconds(MODEL, -1, 0)
