"""The real-session study (``sim/sessions.py``, ``bench/real_sessions.py``): sessions are the samples,
every system of a group runs the same trace with the same pool and host bytes, per-session figures add
up to the run's, and intervals are over sessions (issue #39 item 2)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from bench_module import load_bench
from sgl_agentcache.sim.sessions import (DUPLICATES, METRICS, SESSION_FILES, SessionStudyConfig, analyse, group_trace,
                                         groups, session_rows)

ROOT = Path(__file__).resolve().parents[1] / "bench" / "traces" / "kv-cache-tester"


def test_the_sample_is_every_committed_session_once():
    on_disk = sorted(p.name.removesuffix(".json.gz") for p in ROOT.glob("trace_*.json.gz"))
    assert list(SESSION_FILES) == on_disk and len(on_disk) == 39
    # The one duplicate: the same requests under another id, so one session, counted once.
    for copy, original in DUPLICATES.items():
        a, b = (json.loads(gzip.decompress((ROOT / f"{n}.json.gz").read_bytes())) for n in (copy, original))
        assert a["requests"] == b["requests"] and a["id"] != b["id"]
    files = SessionStudyConfig().files
    assert len(files) == 38 and not set(files) & set(DUPLICATES)
    dealt = groups(files, 5)
    assert sorted(f for g in dealt for f in g) == sorted(files) and {len(g) for g in dealt} <= {4, 5}
    assert dealt == groups(files, 5)  # deterministic


def test_per_session_figures_add_up_to_the_run():
    from sgl_agentcache.policy.profiles import PROFILES
    from sgl_agentcache.sim.replay import replay
    from sgl_agentcache.sim.suite import REPLAY_VOCAB, pool_for, scaled_profile

    trace = group_trace(("trace_0019", "trace_0021", "trace_0074"), 64)
    pool = pool_for(trace, "tight")
    result = replay(trace, "agentcache", pool_tokens=pool, host_tokens=pool,
                    profile=scaled_profile(PROFILES["seed"], 64), vocab_size=REPLAY_VOCAB)
    rows = session_rows(result, trace, 0, 1.0)
    assert len(rows) == 3 and sum(r["calls"] for r in rows) == result.requests
    assert sum(r["recomputed_tokens"] for r in rows) == result.recomputed_tokens
    assert all(r["jct_s"] >= r["span_s"] and r["resume_ttft_p99_s"] >= r["resume_ttft_p50_s"] > 0 for r in rows)


def test_analysis_pairs_sessions_and_claims_only_what_its_intervals_exclude():
    def row(policy, session, group, value, host=1.0):
        return {"policy": policy, "host_ratio": host, "session": session, "group": group} | {m: value for m in METRICS}

    rows = [row("hicache", f"s{i}", i % 3, 100.0) for i in range(9)]
    rows += [row("agentcache", f"s{i}", i % 3, 80.0 + i) for i in range(9)]  # ratios 0.80 ... 0.88
    rows += [row("stock", f"s{i}", i % 3, 200.0, host=0.0) for i in range(9)]
    out = {(c["other"], c["metric"]): c for c in analyse(rows)}
    c = out[("hicache", "recomputed_tokens")]
    assert c["sessions"] == 9 and c["ratio"] == pytest.approx(0.84) and c["verdict"] == "better"
    assert c["ci95"][0] < 0.84 < c["ci95"][1] < 1.0 and c["ci95_group_bootstrap"][1] < 1.0
    assert c["total_ratio"] == pytest.approx(sum(80.0 + i for i in range(9)) / 900.0)
    assert out[("stock", "jct_s")]["ratio"] == pytest.approx(0.42)  # ours at host 1x against stock without
    tied = analyse([row("hicache", f"s{i}", 0, 100.0) for i in range(4)]
                   + [row("agentcache", f"s{i}", 0, [90.0, 110.0, 95.0, 105.0][i]) for i in range(4)])
    assert all(c["verdict"] == "tie" for c in tied)


@pytest.mark.timeout(900)
def test_the_benchmark_runs_and_every_system_gets_the_same_memory(tmp_path):
    bench = load_bench("real_sessions")
    assert bench.main(["--quick", "--out", str(tmp_path), "--workers", "1"]) == 0
    report = json.loads((tmp_path / "real_sessions_quick.json").read_text())
    rows = report["rows"]
    for group in {r["group"] for r in rows}:
        mine = [r for r in rows if r["group"] == group]
        assert len({r["pool_tokens"] for r in mine}) == 1
        assert {r["host_tokens"] for r in mine if r["policy"] != "stock"} == {mine[0]["pool_tokens"]}
        assert {r["host_tokens"] for r in mine if r["policy"] == "stock"} == {0}
    sessions = {r["session"] for r in rows}
    assert len(sessions) == 6 and all(r["integrity_ok"] and not r["leaked_tokens"] for r in rows)
    cmp = [c for c in report["comparisons"] if c["other"] == "sglang-hicache" and c["metric"] == "recomputed_tokens"]
    assert len(cmp) == 1 and cmp[0]["sessions"] == 6 and not math.isnan(cmp[0]["ci95"][0])
    assert {c["other"] for c in report["comparisons_inferred"]} == {"sglang-hicache", "agentcache"}
    # Ours (on SGLang's HiCache) against every other system.
    assert {c["other"] for c in report["comparisons"]} == {"stock", "sglang-hicache", "kvflow", "agentcache-inferred"}
