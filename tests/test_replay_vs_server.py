"""The replay-against-server latency check (bench/replay_vs_server.py) in quick mode: behaviour only.

A tiny trace on its own clock against a real CPU server, a profile measured on a stock server first,
then the same trace through the replayer priced by that profile. Checked: the profile is measured
(positive rates), every call was served and compared, both sides' TTFTs are positive, the JSON has
every section. Never the agreement itself: that is the full run's finding, reported in bench/README.
"""

from __future__ import annotations

import json

import pytest

from bench_module import load_bench

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


def test_quick_run_compares_every_call(tmp_path):
    bench = load_bench("replay_vs_server")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "replay_vs_server.json").read_text())
    for key in ("profile", "measured", "ttft_s", "resume_ttft_s", "ttft_ratio_replay_over_server", "ttft_spearman",
                "cached_tokens", "jct_s", "calls"):
        assert key in result, key
    profile = result["profile"]
    assert profile["prefill_tokens_per_s"] > 0 and profile["decode_s_per_token"] > 0
    assert len(result["measured"]["prefill_points_s"]) == len(bench.MODES["quick"]["prompt_lengths"])
    assert result["server_failures"] == 0
    assert result["calls_compared"] == result["calls_in_trace"] == len(result["calls"]) > 0
    assert all(c["server_ttft_s"] > 0 and c["replay_ttft_s"] > 0 for c in result["calls"])
    assert any(c["resume"] for c in result["calls"])
    assert result["jct_s"]["server"] > 0 and result["jct_s"]["replay"] > 0
    # SGLang's HiCache driven offline (the replay's sglang-hicache) against the real server, same trace.
    h = result["hicache_offline"]
    assert h["calls_compared"] == result["calls_in_trace"]
    assert h["computed_tokens"]["server"] > 0 and h["computed_tokens"]["replay"] > 0
    assert h["computed_ratio_replay_over_server"] == round(h["computed_tokens"]["replay"]
                                                           / h["computed_tokens"]["server"], 4)
    assert isinstance(h["within_5_percent"], bool)


def test_prefill_fit_never_gives_a_non_positive_rate():
    """A noisy tiny-model measurement (CI saw TTFT fall with prompt length) must still give the server a
    profile it accepts: the fit falls back to the longest prompt's own rate and says so."""
    fit_prefill = load_bench("replay_vs_server").fit_prefill
    slope, overhead, how = fit_prefill([(n, 0.005 + n * 1e-5) for n in (128, 512, 1024)])
    assert how == "least squares" and slope == pytest.approx(1e-5) and overhead == pytest.approx(0.005)
    slope, overhead, how = fit_prefill([(128, 0.030), (512, 0.020), (1024, 0.012)])
    assert how.startswith("longest prompt") and slope == pytest.approx(0.012 / 1024) and overhead == 0.0
    slope, _, how = fit_prefill([(128, 0.02), (512, 0.02), (1024, 0.02)])
    assert how.startswith("longest prompt") and slope > 0
