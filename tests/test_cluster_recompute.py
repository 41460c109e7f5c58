"""The two-worker benchmark (bench/cluster_recompute.py) in quick mode: behaviour only.

Ours (hints through the router, manual routing) and write-back behind cache-aware routing, one pass
each on two fresh workers and a router: every request served, our hints arrived (the workers decided
pauses and processed closes), equal pools and host bytes, computed = input - cached agreeing with the
workers' own logs. Never timing, never a ratio (that is the full run's claim).
"""

from __future__ import annotations

import json

import pytest

from bench_module import load_bench

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


def test_quick_run_serves_everything_through_the_router(tmp_path):
    bench = load_bench("cluster_recompute")
    assert bench.main(["--quick", "--passes", "1", "--systems", "agentcache,hicache-session",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cluster_recompute.json").read_text())
    systems = result["systems"]
    assert set(systems) == {"agentcache", "hicache-session"}
    assert {s["pool_tokens_per_worker"] for s in systems.values()} == {2048}
    assert {s["host_tokens_per_worker"] for s in systems.values()} == {2048}
    # HiCache write-back routed as ours is: by the session's routing key, without a hint.
    assert {s["router_policy"] for s in systems.values()} == {"manual"}
    assert {s["schedule_policy"] for s in systems.values()} == {"fcfs"}
    for name, s in systems.items():
        workers = s["per_worker"]  # each worker's memory and share of the calls, from its log
        assert [w["pool_tokens"] for w in workers] == [2048, 2048] and [w["host_tokens"] for w in workers] == [2048] * 2
        assert sum(w["prefilled_calls"] for w in workers) >= s["requests"]  # each call prefilled at least once
        assert abs(sum(w["share_of_calls"] for w in workers) - 1) < 0.01
        assert max(w["peak_token_usage"] for w in workers) > 0
        assert s["failures"] == 0 and s["control_errors"] == 0, (name, s["control_error_samples"])
        assert s["computed_tokens"] == s["input_tokens"] - s["cached_tokens"]
        assert s["server_log"]["prefill_new_tokens"] >= s["computed_tokens"]  # plus each worker's warm-up
        assert s["server_log"]["tracebacks"] == 0

    assert systems["agentcache"]["agentcache"]["check_ok"]
    # The write-back baseline is SGLang's own HiCache on stock workers (no plugin backend).
    assert result["config"]["systems"]["hicache-session"]["hicache_write_policy"] == "write_back"
    assert result["config"]["systems"]["hicache-session"]["radix_cache_backend"] == "default"
    ours = systems["agentcache"]
    # Every tool call's pause hint reached a worker through the router, and was decided there.
    assert sum(ours["pause_decisions"].values()) == result["config"]["trace_stats"]["tool_calls"] > 0
    assert ours["agentcache"]["stats"]["freed_on_close_tokens"] > 0  # and the closes, through the fan-out
    assert not systems["hicache-session"]["pause_decisions"]  # no hints, no pauses
