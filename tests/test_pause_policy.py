"""The tool-pause policy: the seed's worked example, monotonicity properties, hysteresis, release rules."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache.policy.distributions import LogNormal, PointMass
from sgl_agentcache.policy.latency import LatencyConfig, LatencyModel
from sgl_agentcache.policy.pause import (
    Incumbent,
    PauseAction,
    PauseDecision,
    PauseInputs,
    Placement,
    PolicyConfig,
    decide,
)
from sgl_agentcache.policy.worked_example import MiB, seed_inputs, seed_worked_example

KEEP, OFFLOAD, DISCARD, RELEASE = PauseAction.KEEP, PauseAction.OFFLOAD, PauseAction.DISCARD, PauseAction.RELEASE
NO_HYSTERESIS = PolicyConfig(hysteresis=0.0, min_switch_gain=0.0)


# -- the seed's worked example ---------------------------------------------------------------------

def test_seed_worked_example_table_and_decisions():
    ex = seed_worked_example()
    print("\n" + ex.text)
    assert ex.cache_mib == 144.0
    row = {(r.pause_s, r.policy): r for r in ex.rows}
    # keep: 144 MiB x 50 ms = 7.2 MiB-s; x 5 s = 720 MiB-s; no transfer, no recompute, immediate resume
    assert row[0.05, "keep"].device_mib_s == pytest.approx(7.2)
    assert row[5.0, "keep"].device_mib_s == pytest.approx(720.0)
    for pause in (0.05, 5.0):
        keep, swap, rc = row[pause, "keep"], row[pause, "swap"], row[pause, "recompute"]
        assert keep.transfer_ms == keep.recompute_ms == keep.resume_delay_ms == 0.0
        # swap: 144 MiB / 8 GiB/s = 17.578125 ms each way, 288 MiB moved; swap-out overlaps the wait
        assert swap.moved_mib == 288.0
        assert swap.transfer_ms == pytest.approx(2 * 17.578125)
        assert swap.resume_delay_ms == pytest.approx(17.578125)
        assert swap.device_mib_s == pytest.approx(144 * 0.017578125)  # HBM held while the swap-out runs
        # recompute: 4096 / 20,000 tokens/s = 204.8 ms
        assert rc.recomputed_tokens == 4096 and rc.device_mib_s == 0.0
        assert rc.recompute_ms == pytest.approx(204.8) and rc.resume_delay_ms == pytest.approx(204.8)
    short, long_ = ex.decisions
    assert short.action is KEEP  # a 50 ms pause: keeping is cheapest
    assert long_.action is OFFLOAD  # a 5 s pause with host memory free: swap
    assert short.retained_bytes == 144 * MiB
    # Without host room the long pause cannot swap; it keeps or recomputes.
    assert decide(seed_inputs(5.0, host_free_bytes=100 * MiB)).action in (KEEP, DISCARD)
    # The decision is loggable as JSON, with its inputs echoed.
    logged = msgspec.json.decode(msgspec.json.encode(long_))
    assert logged["action"] == "offload" and logged["inputs"]["retained_tokens"] == 4096


# -- random inputs ---------------------------------------------------------------------------------

def log_uniform(lo_exp: float, hi_exp: float):
    return st.floats(lo_exp, hi_exp).map(lambda x: 10.0**x)


# Each range mixes a plausible region (where every option gets chosen) with the full valid one.
latencies = (st.builds(LogNormal, log_uniform(-3, 2.8), st.floats(0.1, 3.0))
             | st.builds(PointMass, log_uniform(-3, 2.8)))
previous = st.none() | st.builds(Incumbent, st.sampled_from(list(PauseAction)), st.floats(0.0, 10.0))


@st.composite
def pause_inputs(draw, latency=latencies) -> PauseInputs:
    total = draw(st.integers(1_000, 10_000_000))
    free = draw(st.integers(0, total))
    return PauseInputs(
        retained_tokens=draw(st.integers(128, 200_000) | st.integers(0, 200_000)),
        bytes_per_token=draw(st.sampled_from([2048, 36864, 163840])),
        latency=draw(latency), device_free_tokens=free, device_evictable_tokens=draw(st.integers(0, total - free)),
        device_total_tokens=total, host_free_bytes=draw(st.integers(1 << 34, 1 << 40) | st.integers(0, 1 << 40)),
        h2d_bandwidth_Bps=draw(log_uniform(8, 11)), d2h_bandwidth_Bps=draw(log_uniform(8, 11)),
        prefill_tokens_per_s=draw(log_uniform(2, 6)), elapsed_s=draw(st.just(0.0) | st.floats(0.0, 600.0)),
        deadline_s=draw(st.none() | st.floats(1.0, 3600.0) | st.floats(-10.0, 3600.0)),
        priority=draw(st.integers(-100, 100)),
        resume_probability=draw(st.floats(0.1, 1.0) | st.floats(0.0, 1.0)),
        prefetch_lead_s=draw(st.just(0.0) | st.floats(0.0, 1.0)),
        placement=draw(st.sampled_from(list(Placement))), previous=draw(previous),
        host_displaced_s=draw(st.just(0.0) | st.floats(0.0, 100.0)))


@given(pause_inputs())
def test_decisions_are_feasible_deterministic_and_loggable(i):
    d = decide(i)
    assert d == decide(i)
    assert d.action is RELEASE or d.option(d.action).feasible
    assert all(o.cost >= 0 and o.device_byte_seconds >= 0 and o.resume_penalty_s >= 0 for o in d.options)
    assert msgspec.json.decode(msgspec.json.encode(d), type=PauseDecision) == d
    if i.placement is Placement.NONE:
        assert d.action in (DISCARD, RELEASE)  # nothing left to keep or move


@given(pause_inputs(), st.data())
def test_more_device_pressure_never_makes_keep_more_likely(i, data):
    # (free_lo, evictable_lo) <= (free_hi, evictable_hi) componentwise: "lo" is the higher pressure.
    free_lo = data.draw(st.integers(0, i.device_free_tokens))
    evict_lo = data.draw(st.integers(0, i.device_evictable_tokens))
    tight = dataclasses.replace(i, device_free_tokens=free_lo, device_evictable_tokens=evict_lo)
    if decide(tight).action is KEEP:
        assert decide(i).action is KEEP


@given(pause_inputs(), log_uniform(-3, 2.8), st.floats(1.0, 100.0), st.floats(0.1, 3.0))
def test_a_longer_wait_never_makes_keep_more_likely(i, median, stretch, sigma):
    # elapsed 0: scaling the duration makes the remaining wait stochastically longer.
    short = dataclasses.replace(i, elapsed_s=0.0, latency=LogNormal(median, sigma))
    long_ = dataclasses.replace(short, latency=LogNormal(median * stretch, sigma))
    if decide(long_).action is KEEP:
        assert decide(short).action is KEEP


@settings(max_examples=50)
@given(pause_inputs(), st.lists(st.floats(1e-3, 100.0), min_size=1, max_size=30), st.floats(1.0, 50.0))
def test_a_longer_learned_wait_never_makes_keep_more_likely(i, xs, stretch):
    short_model, long_model = LatencyModel(), LatencyModel()
    for x in xs:
        short_model.observe(x)
        long_model.observe(x * stretch)
    short = dataclasses.replace(i, elapsed_s=0.0, latency=short_model)
    if decide(dataclasses.replace(short, latency=long_model)).action is KEEP:
        assert decide(short).action is KEEP


@given(pause_inputs(), st.floats(1.0, 1000.0))
def test_cheaper_recompute_never_makes_offload_more_likely(i, faster):
    quick = dataclasses.replace(i, prefill_tokens_per_s=i.prefill_tokens_per_s * faster)
    slow_action, quick_action = decide(i).action, decide(quick).action
    if quick_action is OFFLOAD:
        assert slow_action is OFFLOAD
    if slow_action is DISCARD:
        assert quick_action is DISCARD
    assert not (slow_action is DISCARD and quick_action is OFFLOAD)


@given(pause_inputs(), st.floats(0.0, 1000.0))
def test_more_valuable_host_state_in_the_way_never_makes_offload_more_likely(i, more):
    crowded = dataclasses.replace(i, host_displaced_s=i.host_displaced_s + more)
    if decide(crowded, NO_HYSTERESIS).action is OFFLOAD:
        assert decide(i, NO_HYSTERESIS).action is OFFLOAD


def test_host_memory_is_priced_by_what_an_offload_displaces():
    """The same pause offloads into free host room, and discards when its copy would push out host
    entries worth more than re-prefilling it (a 0.5 resume probability, a cheap prefill)."""
    base = dataclasses.replace(seed_inputs(5.0), resume_probability=0.5, prefill_tokens_per_s=200_000.0)
    free = decide(base, NO_HYSTERESIS)
    assert free.action is OFFLOAD and free.option(OFFLOAD).recompute_s == 0.0
    crowded = decide(dataclasses.replace(base, host_displaced_s=base.retained_tokens / 200_000.0), NO_HYSTERESIS)
    assert crowded.action is DISCARD, crowded.reason
    assert crowded.option(OFFLOAD).recompute_s == pytest.approx(base.retained_tokens / 200_000.0)
    on_host = dataclasses.replace(base, placement=Placement.HOST, host_displaced_s=100.0)
    assert decide(on_host, NO_HYSTERESIS).option(OFFLOAD).recompute_s == 0.0  # once on host it is sunk


@given(pause_inputs())
def test_a_full_host_never_gets_a_new_offload(i):
    full = dataclasses.replace(i, host_free_bytes=max(0, i.retained_bytes - 1),
                               placement=Placement.DEVICE if i.placement is Placement.HOST else i.placement)
    assert decide(full).action is not OFFLOAD


@given(pause_inputs(), st.floats(-1e6, 0.0))
def test_a_passed_deadline_releases(i, left):
    assert decide(dataclasses.replace(i, deadline_s=left)).action is RELEASE


# -- hysteresis ------------------------------------------------------------------------------------

def _boundary_pause() -> float:
    """The pause length where the seed example flips from KEEP to OFFLOAD (no hysteresis)."""
    lo, hi = 0.05, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if decide(seed_inputs(mid), NO_HYSTERESIS).action is KEEP else (lo, mid)
    return (lo + hi) / 2


def _changes(config: PolicyConfig, steps: int = 200) -> int:
    rng, boundary = random.Random(7), _boundary_pause()
    prev, actions = None, []
    for _ in range(steps):  # re-evaluated each scheduler step before the swap-out starts: still on device
        noisy = dataclasses.replace(seed_inputs(boundary * rng.uniform(0.95, 1.05)), previous=prev)
        d = decide(noisy, config)
        prev = d.incumbent()
        actions.append(d.action)
    return sum(a is not b for a, b in zip(actions, actions[1:]))


def test_hysteresis_prevents_flip_flopping_on_a_noisy_signal():
    with_h, without = _changes(PolicyConfig()), _changes(NO_HYSTERESIS)
    print(f"decision changes over 200 noisy evaluations at the keep/offload boundary "
          f"({_boundary_pause() * 1e3:.0f} ms): {with_h} with hysteresis, {without} without")
    assert with_h <= 1
    assert without >= 40


def test_hysteresis_still_switches_on_a_real_change():
    d = decide(seed_inputs(0.05))
    assert d.action is KEEP
    later = decide(dataclasses.replace(seed_inputs(5.0), previous=d.incumbent()))
    assert later.action is OFFLOAD and not later.held_by_hysteresis


# -- release rules and placements ------------------------------------------------------------------

def test_release_rules():
    base = seed_inputs(5.0)
    assert decide(dataclasses.replace(base, retained_tokens=16)).action is RELEASE  # below min_tokens
    assert decide(dataclasses.replace(base, resume_probability=0.0)).action is RELEASE
    # A 5 s tool with 1 ms left to its deadline will almost never resume in time.
    assert decide(dataclasses.replace(base, latency=LogNormal(5.0, 0.3), deadline_s=0.001)).action is RELEASE
    assert decide(dataclasses.replace(base, previous=Incumbent(RELEASE, 0.0))).action is RELEASE
    assert "deadline" in decide(dataclasses.replace(base, deadline_s=0.0)).reason


def test_placements():
    on_host = dataclasses.replace(seed_inputs(5.0), placement=Placement.HOST, host_free_bytes=0)
    assert decide(on_host).action is OFFLOAD  # already swapped: staying needs no new host room
    assert decide(on_host).option(OFFLOAD).transfer_s == pytest.approx(0.017578125)  # only the restore left
    gone = dataclasses.replace(seed_inputs(0.05), placement=Placement.NONE)
    assert decide(gone).action is DISCARD
    # Restoring from host needs device room.
    soon = dataclasses.replace(seed_inputs(0.05), placement=Placement.HOST, device_free_tokens=0,
                               device_evictable_tokens=100)
    assert not decide(soon).option(KEEP).feasible


def test_prefetch_lead_hides_the_restore_and_priority_buys_latency_not_memory():
    base = seed_inputs(5.0)
    assert decide(dataclasses.replace(base, prefetch_lead_s=0.02)).option(OFFLOAD).resume_penalty_s == 0.0
    assert decide(dataclasses.replace(base, priority=20)).option(KEEP).cost == decide(base).option(KEEP).cost
    assert decide(dataclasses.replace(base, priority=20)).option(DISCARD).cost > decide(base).option(DISCARD).cost


def test_heavy_tailed_learned_distribution_and_elapsed_time_drive_the_decision():
    model, rng = LatencyModel(LatencyConfig(decay=0.999)), random.Random(8)
    for _ in range(3000):  # 90% fast local reads (~12 ms), 10% long sandbox runs (~40 s)
        model.observe(LogNormal(38.7, 1.2).quantile(rng.random()) if rng.random() < 0.1
                      else LogNormal(0.012, 0.6).quantile(rng.random()))
    fresh = dataclasses.replace(seed_inputs(0.0), latency=model, host_free_bytes=0)
    late = dataclasses.replace(fresh, elapsed_s=2.0)
    # After 2 s the tool is almost surely a long one: the expected remaining wait is far longer.
    assert decide(late).expected_wait_s > 2 * decide(fresh).expected_wait_s
    assert decide(dataclasses.replace(late, host_free_bytes=1 << 40)).action is OFFLOAD
