"""The tree-overhead benchmark (bench/tree_overhead.py) in quick mode: behaviour only, never timing.

Checks that every variant played the same driver stream with the same operation counts (the benchmark
asserts it per repetition; here it is checked again on the written JSON), that the JSON carries every
section, that the Rust tree core is either measured or declared unavailable with a reason, and that
every cache passed its integrity check after playback.
"""

from __future__ import annotations

import json

from bench_module import load_bench


def _load_bench():
    return load_bench("tree_overhead")


def test_quick_benchmark_compares_like_with_like_and_writes_every_section(tmp_path):
    bench = _load_bench()
    out = tmp_path / "tree_overhead.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())

    for key in ("machine", "reps", "shim_ns_per_call", "workloads", "measurement_check", "rust", "target",
                "integrity_ok"):
        assert key in result, key
    assert result["mode"] == "quick" and result["reps"] >= 2
    assert result["machine"]["sglang"] and result["machine"]["cpus"]
    assert result["target"]["max_ratio"] == 1.10
    assert isinstance(result["target"]["ours_untagged_pass"], bool)
    assert result["integrity_ok"] is True

    rust = result["rust"]
    assert isinstance(rust["available"], bool)
    if not rust["available"]:
        assert rust["reason"]
    expected = ({"stock", "stock_again", "ours_untagged", "ours_hinted", "ours_hinted_full_walk"}
                | ({"rust"} if rust["available"] else set()))

    assert {wl["workload"] for wl in result["workloads"]} == {"branch_heavy", "short_tools"}
    for wl in result["workloads"]:
        variants = wl["variants"]
        assert set(variants) == expected
        roomy = wl["tree_work_roomy"]  # the README's "a pool neither cache evicts from"
        assert set(roomy) == {"stock", "ours_hinted"}
        assert all(w["evictions"] == 0 and w["pool_tokens"] > wl["pool_tokens"] for w in roomy.values())
        assert roomy["stock"]["insert_walk_steps"] > 0 and roomy["stock"]["mean_matched_path_nodes"] > 0
        assert wl["stream_ops"]["admit"] == wl["stream_ops"]["finish"] + wl["stream_ops"].get("abort", 0)
        stock = {kind: e["calls"] for kind, e in variants["stock"]["per_kind"].items()}
        assert stock["match"] == stock["lock"] == stock["unlock"] == wl["stream_ops"]["admit"]
        for name, entry in variants.items():
            assert entry["integrity_ok"], (wl["workload"], name, entry["integrity"])
            calls = {kind: e["calls"] for kind, e in entry["per_kind"].items()}
            # Stream-driven kinds are equal everywhere; a second stock cache, untagged ours and the Rust
            # core match stock in every kind (same traffic, same decisions); only the hinted cache adds
            # agent-only kinds and evicts at other moments.
            same = bench.STREAM_KINDS if name.startswith("ours_hinted") else bench.KINDS
            assert {k: calls.get(k) for k in same} == {k: stock.get(k) for k in same}, (wl["workload"], name)
            if name != "stock":
                assert entry["total_ratio"] > 0 and len(entry["ratio_samples"]) == result["reps"]
        assert variants["ours_hinted"]["per_kind"]["admit"]["calls"] == wl["stream_ops"]["admit"]
        # The locked-prefix skip changes no decision (same calls of every kind, same hits) and saves
        # exactly the walk steps it skips: untagged + skipped == stock, hinted + skipped == full walk.
        hinted, walked = variants["ours_hinted"], variants["ours_hinted_full_walk"]
        assert ({k: e["calls"] for k, e in hinted["per_kind"].items()}
                == {k: e["calls"] for k, e in walked["per_kind"].items()})
        assert hinted["cached_tokens"] == walked["cached_tokens"]
        work = wl["tree_work"]
        for skipping, walking in (("ours_untagged", "stock"), ("ours_hinted", "ours_hinted_full_walk")):
            assert work[skipping]["insert_skipped_nodes"] > work[skipping]["insert_walk_steps"] > 0
            assert (work[skipping]["insert_walk_steps"] + work[skipping]["insert_skipped_nodes"]
                    == work[walking]["insert_walk_steps"]), (wl["workload"], skipping)
            assert work[walking]["insert_skipped_nodes"] == 0
        assert "admit" not in variants["ours_untagged"]["per_kind"]
