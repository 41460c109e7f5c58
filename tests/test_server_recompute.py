"""The real-server benchmark (bench/server_recompute.py) in quick mode: behaviour only.

Runs a tiny agent trace (forks, tool pauses, closes, an abort) against fresh stock SGLang, stock SGLang
with its own HiCache (both write policies), our write-back emulation and agentcache CPU servers, and
checks that all served every request without failures, that every backend with a host tier got the
same one, that the JSON carries every section and that
computed = input - cached per backend (and agrees with the server log's own prefill count). Never
timing, never a ratio (that is the full run's claim).
"""

from __future__ import annotations

import json

import pytest

from bench_module import load_bench


def _load_bench():
    return load_bench("server_recompute")


def test_plan_orders_forks_and_resumes():
    bench = _load_bench()
    cfg = bench.MODES["quick"]
    from sgl_agentcache.trace.generators import generate

    trace, dropped = bench.fit_context(generate("branch_heavy", seed=cfg["seed"], **cfg["trace"]),
                                       cfg["context_length"], cfg["output_cap"])
    plan = bench.build_plan(trace)
    assert dropped == 0
    for step in plan:
        assert all(d < step.index for d, _ in step.deps)  # causal: only earlier records
        if step.pred is not None:
            assert any(d == step.pred for d, _ in step.deps)  # a prompt extends a call that has returned
    forks = [s for s in plan if getattr(s.record, "parent_branch", None) and s.pred is not None]
    assert forks and any(s.resume for s in plan)
    assert any(not hasattr(s.record, "blocks") for s in plan)  # events (closes, aborts) are replayed too


@pytest.mark.server
def test_quick_run_serves_everything_on_both_backends(tmp_path):
    bench = _load_bench()
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "server_recompute.json").read_text())
    assert (tmp_path / "server_recompute.png").stat().st_size > 0

    for key in ("benchmark", "mode", "command", "machine", "config", "backends", "comparison", "requests"):
        assert key in result, key
    assert result["mode"] == "quick"
    stats = result["config"]["trace_stats"]
    assert stats["fork_branches"] > 0 and stats["resumes"] > 0 and stats["events"] > 0
    names = {"stock", "stock-lpm", "hicache-wb", "hicache-wb-lpm", "hicache-wt-lpm", "agentcache", "agentcache-lpm",
             "agentcache-admit-lpm"}
    assert set(result["backends"]) == names
    b = result["backends"]
    assert b["stock"]["host_tokens"] == b["stock-lpm"]["host_tokens"] == 0
    assert len({b[n]["host_tokens"] for n in names if not n.startswith("stock")} - {0}) == 1  # equal host bytes
    backends = result["config"]["backends"]
    assert {n for n, x in backends.items() if x["hicache_write_policy"]} == names - {"stock", "stock-lpm"}
    assert all(backends[n]["radix_cache_backend"] == "default" for n in names if n.startswith("hicache"))
    assert len({x["pool_tokens"] for x in b.values()}) == 1  # equal memory
    policies = {n: x["schedule_policy"] for n, x in b.items()}
    assert policies == {n: "lpm" if n.endswith("-lpm") else "fcfs" for n in names}
    cmp = result["comparison"]
    assert set(cmp) == {"agentcache / hicache-wb-lpm", "agentcache / hicache-wt-lpm", "agentcache-lpm / hicache-wb-lpm",
                        "agentcache / hicache-wb", "agentcache / stock", "agentcache / stock-lpm",
                        "agentcache-admit-lpm / hicache-wb-lpm", "agentcache-admit-lpm / agentcache-lpm"}
    for other in cmp.values():
        assert other["extra_failures"] == 0
        for measure in ("computed", "jct", "resume_ttft_p50", "resume_ttft_p99"):
            assert other[measure]["verdict"] in ("better", "worse", "tie") and len(other[measure]["passes"]) == 2

    columns = result["requests"]["columns"]
    for name, b in result["backends"].items():
        rows = [dict(zip(columns, row)) for row in result["requests"][name]]
        assert b["requests"] == b["served"] == stats["requests"] == len(rows), name
        assert b["failures"] == 0 and all(r["status"] == 200 for r in rows), name
        assert b["input_tokens"] == sum(r["input"] for r in rows)
        assert b["cached_tokens"] == sum(r["cached"] for r in rows)
        assert all(r["cached"] <= r["input"] for r in rows)
        assert b["computed_tokens"] == b["input_tokens"] - b["cached_tokens"] > 0
        assert 0 < b["ideal_computed_tokens"] <= b["computed_tokens"]
        assert b["ideal_computed_tokens"] == sum(r["input"] - r["ideal_cached"] for r in rows)
        # The server's own per-batch prefill log counts the same tokens (no retraction on this trace).
        assert b["server_log"]["tracebacks"] == 0
        if b["server_log"]["retractions"] == 0:
            assert b["server_log"]["prefill_new_tokens"] == b["computed_tokens"], name
        assert b["resume_requests"] == stats["resumes"] == len(b["resume_latencies_s"])
        for q in ("p50", "p95", "p99"):
            assert b["resume_latency_s"][q] > 0 and 0 < b["resume_ttft_s"][q] <= b["resume_latency_s"]["p99"] + 1
        assert all(r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["latency_s"] for r in rows)
        assert b["wall_s"] > 0 and 0 < b["jct_s"] <= b["wall_s"] + 1

    for name, b in result["backends"].items():  # two passes, the cache flushed between them
        assert len(b["passes"]) == result["config"]["passes"] == 2 and b["pass_index"] in (0, 1), name
        # Interleaved: each round runs every backend once, the order rotated by one per round.
        assert b["passes"][0]["pass_order"] != b["passes"][1]["pass_order"], name
        assert b["passes"][b["pass_index"]]["computed_tokens"] == b["computed_tokens"], name
        # Flushed: a later pass finds nothing of the earlier one, so it computes at least the ideal.
        assert all(p["computed_tokens"] >= b["ideal_computed_tokens"] and p["failures"] == 0 for p in b["passes"])

    for ours in ("agentcache", "agentcache-lpm", "agentcache-admit-lpm"):  # ours runs on SGLang's HiCache
        assert result["backends"][ours]["agentcache"]["stats"]["hicache"]["attached"] is True, ours
    admit = result["backends"]["agentcache-admit-lpm"]["agentcache"]["stats"]["admission"]
    assert admit["strategy"] == "agent" and admit["passes"] > 0, admit
    assert result["backends"]["agentcache-lpm"]["agentcache"]["stats"]["admission"] == {"strategy": "off"}
    for ours in (result["backends"]["agentcache"], result["backends"]["agentcache-lpm"],
                 result["backends"]["agentcache-admit-lpm"]):
        assert ours["control_errors"] == 0, ours["control_error_samples"]
        for p in ours["passes"]:  # every pause of every pass decided, and the tree clean after each pass
            # (besides the idle sweep's and re-pricings, which the server's clock and pace decide)
            assert sum(p["pause_decisions"].values()) - p["extra_pause_decisions"] == stats["tool_calls"], p
            assert p["check_ok"] is True, p
    for name in ("stock", "hicache-wb", "hicache-wb-lpm", "hicache-wt-lpm"):  # stock SGLang never sees our routes
        assert result["backends"][name]["pause_decisions"] == {}, name


def test_a_subset_of_unknown_backends_is_refused():
    bench = _load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--backends", "stock,nope"])


def test_the_gpu_mode_starts_sglang_with_gpu_flags_and_hicaches_kernel_io(tmp_path):
    """``--gpu`` (bench/gpu/hicache_lifecycle.sh): no CPU engine flags, HiCache's kernel io backend and
    ``page_first`` layout, the same pool and host ratio. Only the command is checked: no GPU here."""
    from types import SimpleNamespace

    bench = _load_bench()
    cfg = bench.MODES["quick"] | {"gpu": True, "pause_via": "hint"}
    model = SimpleNamespace(path=tmp_path / "model")
    cmd = bench.start_server("agentcache-lpm", model, cfg, tmp_path).command()
    assert "--device" not in cmd and "torch_native" not in cmd and "--load-format" in cmd
    at = cmd.index("--hicache-io-backend")
    assert cmd[at + 1] == "kernel" and cmd[cmd.index("--hicache-mem-layout") + 1] == "page_first"
    assert cmd[cmd.index("--max-total-tokens") + 1] == str(cfg["pool_tokens"])
    cpu = bench.start_server("agentcache-lpm", model, cfg | {"gpu": False}, tmp_path).command()
    assert cpu[cpu.index("--device") + 1] == "cpu" and cpu[cpu.index("--hicache-io-backend") + 1] == "direct"


@pytest.mark.server
def test_independent_traces_give_an_interval_over_traces(tmp_path):
    """``--trace-seeds``: several generated traces on the same servers; ratios per trace, and an
    interval whose samples are the traces (not passes of one trace)."""
    bench = _load_bench()
    assert bench.main(["--quick", "--out", str(tmp_path), "--backends", "hicache-wb-lpm,agentcache-lpm",
                       "--passes", "1", "--trace-seeds", "2"]) == 0
    result = json.loads((tmp_path / "server_recompute-seeds2-hicache-wb-lpm+agentcache-lpm.json").read_text())
    seeds = result["seeds"]
    assert seeds["seeds"] == [2, 3] and len(seeds["trace_stats"]) == 2
    assert seeds["trace_stats"][0] != seeds["trace_stats"][1]  # two different traces
    pair = "agentcache-lpm / hicache-wb-lpm"
    for measure in ("computed", "jct", "resume_ttft_p50", "resume_ttft_p99"):
        over = seeds["comparison"][pair][measure]
        assert over["per_trace"] == [s[pair][measure] for s in seeds["per_seed"]]
        assert over["verdict"] in ("better", "worse", "tie") and len(over["per_trace"]) == 2
    # Pass numbers run on across traces: each backend played each trace once, on one server.
    for name in ("hicache-wb-lpm", "agentcache-lpm"):
        assert len(result["backends"][name]["passes"]) == 1
