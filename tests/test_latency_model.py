"""The learned tool-latency model: prior, convergence, decay, heavy tails, calibration, the bounded book."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from sgl_agentcache.policy.distributions import LatencyDistribution, LogNormal, PointMass
from sgl_agentcache.policy.latency import (RESUME_PRIOR, BookSnapshot, LatencyBook, LatencyConfig, LatencyModel,
                                          LatencySnapshot)

BIN = LatencyConfig().bin_ratio  # ~1.155: quantiles are resolved to within one bin


def within_bins(got: float, want: float, bins: float = 1.0) -> bool:
    return abs(math.log(got / want)) <= bins * math.log(BIN)


def empirical_quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def test_models_satisfy_the_protocol_and_agree_on_closed_forms():
    for dist in (LatencyModel(), LogNormal(2.0, 1.5), PointMass(0.05)):
        assert isinstance(dist, LatencyDistribution)
    model, prior = LatencyModel(), LogNormal(2.0, 1.5)
    assert within_bins(model.quantile(0.5), prior.quantile(0.5), 0.01)
    assert model.remaining_wait(0.0) == pytest.approx(prior.mean(), rel=0.01)
    assert model.remaining_wait(0.0, 1.0) == pytest.approx(prior.remaining_wait(0.0, 1.0), rel=0.01)
    for t in (0.01, 0.5, 2.0, 30.0):
        assert model.cdf(t) == pytest.approx(prior.cdf(t), abs=0.01)
        assert model.cdf(t) + model.survival(t) == pytest.approx(1.0)
        assert model.cdf(model.quantile(model.cdf(t))) == pytest.approx(model.cdf(t))


def test_remaining_wait_is_the_conditional_mean_and_falls_back_to_lindy_past_support():
    d = PointMass(5.0)
    assert d.remaining_wait(1.0) == 4.0 and d.remaining_wait(1.0, horizon=2.0) == 2.0
    assert d.resume_within(1.0, 4.0) == 1.0 and d.resume_within(1.0, 3.9) == 0.0
    # Past the point where the model says the tool must have returned: a hung tool is expected to keep hanging.
    assert d.remaining_wait(8.0) == 8.0 and d.resume_within(8.0, 8.0) == pytest.approx(0.75)
    model = LatencyModel()
    assert model.remaining_wait(5000.0) == 5000.0  # beyond the histogram's last edge (1 h)


def test_prior_dominates_with_few_observations():
    model = LatencyModel()
    for _ in range(2):
        model.observe(0.010)
    # 2 observations at 10 ms against a 2 s prior worth 5: the median stays near the prior.
    assert 0.5 < model.quantile(0.5) < 2.0
    assert model.quantile(0.95) > 10.0


def test_converges_to_empirical_quantiles():
    rng, truth = random.Random(1), LogNormal(0.3, 0.5)
    model = LatencyModel()
    xs = [truth.quantile(rng.random()) for _ in range(3000)]
    for x in xs:
        model.observe(x)
    recent = xs[-400:]  # the default decay remembers about the last 200-400 observations
    for q in (0.1, 0.5, 0.9):
        assert within_bins(model.quantile(q), empirical_quantile(recent, q), 1.5), q
        assert within_bins(model.quantile(q), truth.quantile(q), 1.5), q


def test_decay_forgets_an_old_regime():
    model = LatencyModel()  # decay 0.995: half-life ~138 observations
    rng = random.Random(2)
    for _ in range(500):
        model.observe(0.05 * math.exp(rng.gauss(0, 0.2)))
    assert within_bins(model.quantile(0.5), 0.05)
    moved_after = None
    for k in range(1, 400):
        model.observe(5.0 * math.exp(rng.gauss(0, 0.2)))
        if moved_after is None and model.quantile(0.5) > 1.0:
            moved_after = k
    print(f"p50 moved from 50 ms past 1 s after {moved_after} observations of the 5 s regime")
    assert moved_after is not None and moved_after <= 1.2 * model.config.half_life_observations
    assert within_bins(model.quantile(0.5), 5.0)


def _terminal_bench_mix() -> tuple[LogNormal, LogNormal, float]:
    """Fast tools (90%, median 12 ms) and slow ones (10%, median 38.7 s): p50 ~ 13 ms, p99 ~ 180 s."""
    return LogNormal(0.012, 0.6), LogNormal(38.7, 1.2), 0.10


def _mix_quantile(q: float) -> float:
    fast, slow, w = _terminal_bench_mix()
    lo, hi = 1e-6, 1e6
    for _ in range(200):  # bisection on the mixture CDF, in log space
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if (1 - w) * fast.cdf(mid) + w * slow.cdf(mid) < q else (lo, mid)
    return hi


def test_heavy_tailed_mix_p50_and_p99_within_a_bin():
    fast, slow, w = _terminal_bench_mix()
    true_p50, true_p99 = _mix_quantile(0.5), _mix_quantile(0.99)
    assert true_p50 == pytest.approx(0.013, rel=0.05) and true_p99 == pytest.approx(180.0, rel=0.05)
    # A p99 needs many effective observations (1% of them carry it): use a long memory here.
    model, rng = LatencyModel(LatencyConfig(decay=0.9999)), random.Random(3)
    for _ in range(40_000):
        model.observe((slow if rng.random() < w else fast).quantile(rng.random()))
    p50, _, p99 = model.tail()
    print(f"Terminal-Bench-shaped mix: model p50 {p50 * 1e3:.1f} ms (true {true_p50 * 1e3:.1f}), "
          f"p99 {p99:.0f} s (true {true_p99:.0f})")
    assert within_bins(p50, true_p50) and within_bins(p99, true_p99)


def test_calibration_is_ideal_on_draws_from_the_models_own_predictive():
    model, rng = LatencyModel(), random.Random(4)
    for _ in range(2000):
        model.observe(model.quantile(rng.random()))
    cal = model.calibration()
    print("own-predictive calibration:", msgspec.json.encode(cal).decode())
    assert cal.count == 2000
    assert cal.mean_pit == pytest.approx(0.5, abs=0.05)
    assert cal.mean_abs_pit_dev == pytest.approx(0.25, abs=0.03)
    assert cal.frac_above_p90 == pytest.approx(0.10, abs=0.04)
    assert cal.frac_above_p99 < 0.04
    assert cal.max_bin_dev < 0.06


def test_calibration_near_ideal_on_a_stationary_tool_and_clearly_off_after_a_shift():
    rng, tool = random.Random(5), LogNormal(1.0, 0.8)
    model = LatencyModel()
    for _ in range(1000):
        model.observe(tool.quantile(rng.random()))
    model.reset_calibration()
    for _ in range(1000):
        model.observe(tool.quantile(rng.random()))
    same = model.calibration()
    assert same.mean_pit == pytest.approx(0.5, abs=0.06)
    assert same.mean_abs_pit_dev == pytest.approx(0.25, abs=0.04)
    assert same.frac_above_p90 == pytest.approx(0.10, abs=0.05)

    model.reset_calibration()
    slower = LogNormal(10.0, 0.8)  # the tool became 10x slower
    for _ in range(50):
        model.observe(slower.quantile(rng.random()))
    shifted = model.calibration()
    print(f"after a 10x shift: mean PIT {shifted.mean_pit:.2f}, above p90 {shifted.frac_above_p90:.2f}, "
          f"above p99 {shifted.frac_above_p99:.2f}")
    assert shifted.mean_pit > 0.8 and shifted.frac_above_p90 > 0.5 and shifted.frac_above_p99 > 0.1
    assert shifted.mean_abs_pit_dev > 0.35


def test_observe_rejects_bad_durations_and_clamps_extremes():
    model = LatencyModel()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            model.observe(bad)
    model.observe(0.0)
    model.observe(10 * 3600.0)
    assert model.observations == 2


def test_book_is_bounded_lru_and_per_class_priors_apply():
    book = LatencyBook(limit=3, priors={"local_read": LogNormal(0.02, 0.5)})
    for tool in ("a", "b", "c"):
        book.observe("t1", tool, 1.0)
    book.model("t1", "a")  # touch: "b" is now the least recently used
    book.observe("t2", "a", 1.0)
    assert len(book) == 3 and book.forgotten == 1
    assert ("t1", "b") not in book and ("t1", "a") in book and ("t2", "a") in book
    assert within_bins(book.peek("t9", "local_read").quantile(0.5), 0.02, 0.1)
    assert len(book) == 3 and ("t9", "local_read") not in book  # peek creates nothing
    for i in range(100):
        book.observe("t3", f"tool-{i}", 0.5)
    assert len(book) == 3 and book.forgotten == 101


def test_snapshots_round_trip_through_msgspec():
    model, rng = LatencyModel(), random.Random(6)
    for _ in range(300):
        model.observe(LogNormal(0.2, 1.0).quantile(rng.random()))
    snap = model.snapshot()
    for codec in (msgspec.json, msgspec.msgpack):
        back = codec.decode(codec.encode(snap), type=LatencySnapshot)
        assert back == snap
        restored = LatencyModel.from_snapshot(back)
        assert restored.tail() == model.tail() and restored.calibration() == model.calibration()
        assert restored.snapshot() == snap

    book = LatencyBook(limit=8)
    book.observe("t", "remote_read", 0.3)
    book.observe("t", "sandbox", 12.0)
    bsnap = msgspec.json.decode(msgspec.json.encode(book.snapshot()), type=BookSnapshot)
    assert bsnap == book.snapshot()
    again = LatencyBook.from_snapshot(bsnap)
    assert again.snapshot() == book.snapshot()
    assert again.peek("t", "sandbox").tail() == book.peek("t", "sandbox").tail()


def test_a_flood_of_tool_classes_never_evicts_another_tenants_model():
    book = LatencyBook(limit=64, namespace_limit=16)
    for _ in range(50):
        book.observe("acme", "ci_run", 30.0)
    learned = book.peek("acme", "ci_run").quantile(0.5)
    for i in range(5000):
        book.observe("globex", f"flood-{i}", 1.0)
    assert ("acme", "ci_run") in book and book.peek("acme", "ci_run").quantile(0.5) == learned
    assert sum(t == "globex" for (t, _), _ in book.items()) == 16 and len(book.items("acme")) == 1
    for tenant in range(8):  # many tenants past the total: the largest give way, a small one never does
        for i in range(16):
            book.observe(f"t{tenant}", f"tool-{i}", 1.0)
    assert ("acme", "ci_run") in book and len(book) == 64


def test_the_resume_rate_learns_how_often_a_tools_pauses_end_without_a_resume():
    """Close likelihood: resumes and ends (the branch closed or aborted while it waited) are counted with
    the histogram's count decay; the rate starts at its prior and follows the observed share."""
    fresh = LatencyModel()
    assert fresh.resume_rate() == pytest.approx(RESUME_PRIOR)
    always, often_cancelled = LatencyModel(), LatencyModel()
    for i in range(200):
        always.observe(0.5)
        if i % 4 == 0:
            often_cancelled.observe_end()  # a quarter of its pauses end with their branch
        else:
            often_cancelled.observe(0.5)
    assert always.resume_rate() > 0.99
    assert often_cancelled.resume_rate() == pytest.approx(0.75, abs=0.03)
    assert often_cancelled.observations == 150  # an end is not a duration: the histogram is unchanged
    with pytest.raises(ValueError):
        fresh.resume_rate(prior=1.5)
    snap = often_cancelled.snapshot()
    back = LatencyModel.from_snapshot(msgspec.json.decode(msgspec.json.encode(snap), type=LatencySnapshot))
    assert back.resume_rate() == often_cancelled.resume_rate()
    book = LatencyBook()
    book.observe_end("t", "subagents")
    assert book.peek("t", "subagents").resume_rate() < RESUME_PRIOR


def test_a_snapshot_written_before_the_resume_counts_still_loads():
    raw = msgspec.to_builtins(LatencyModel().snapshot())
    del raw["resumed"], raw["ended"]
    back = LatencyModel.from_snapshot(msgspec.convert(raw, LatencySnapshot))
    assert back.resumed == back.ended == 0.0 and back.resume_rate() == pytest.approx(RESUME_PRIOR)
