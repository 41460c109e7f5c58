"""Two agentcache workers on SGLang's HiCache sharing one L3 ``file`` store, behind SGLang's router
(issue #36 item 5), and the benchmark that measures it (``bench/l3_failover.py``).

Each worker runs our backend on HiCache (write-through, so a session's pages reach the store while it
runs) with the same ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``; the router runs ``--policy manual``
and pins each session's routing key to one worker. When a worker dies, the router re-pins its
sessions to the survivor: with the shared store their next call loads the history from L3 instead of
recomputing it (``tests/test_router_server.py`` shows the same move without L3: cold), while the
survivor's own sessions keep their device cache.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from bench_module import load_bench

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.router_process import RouterProcess, router_available

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PAGE = 16
HISTORY = 256  # tokens of each session's first prompt: 16 full pages
#: A request whose prefix SGLang finds in L3 waits for that prefetch to finish (SGLang's default,
#: best_effort, takes whatever has arrived when the request is scheduled: on a loaded CI machine that
#: can be nothing, and a test of L3 hits would see a miss).
WAIT_FOR_L3 = ("--hicache-storage-prefetch-policy", "wait_complete")


FAILOVER = load_bench("l3_failover")  # its helpers serve the test too


def _turn(router: RouterProcess, session: str, ids: list[int]) -> dict:
    return FAILOVER._turn(router, session, ids)[0]


_holder = FAILOVER._holder


def test_a_killed_workers_sessions_continue_from_the_shared_l3_store(tiny_model, tmp_path):
    if not router_available():
        pytest.fail("sglang_router is not importable: install the test extra (it pins sglang-router==0.3.2)")
    store = tmp_path / "l3"
    store.mkdir()
    workers = [CpuServer(str(tiny_model.path), log_path=tmp_path / f"worker{i}.log", max_total_tokens=2048,
                         env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)},
                         extra_args=("--enable-cache-report", "--enable-hierarchical-cache", "--hicache-io-backend",
                                     "direct", "--hicache-write-policy", "write_through", "--hicache-ratio", "2",
                                     "--hicache-storage-backend", "file", "--page-size", str(PAGE), *WAIT_FOR_L3))
               for i in range(2)]
    router = RouterProcess([w.url for w in workers], log_path=tmp_path / "router.log")
    rng = random.Random(7)
    try:
        for worker in workers:
            worker.start()
        router.start()
        prompts, placed = {}, {}
        while min(list(placed.values()).count(i) for i in (0, 1)) < 1:  # a session on each worker
            assert len(prompts) < 8, placed  # min_group gives a new key to the worker holding fewer
            session = f"s{len(prompts)}"
            prompts[session] = [rng.randrange(3, tiny_model.vocab_size) for _ in range(HISTORY)]
            out = _turn(router, session, prompts[session])
            prompts[session] += out["output_ids"] + [rng.randrange(3, tiny_model.vocab_size) for _ in range(20)]
            placed[session] = _holder(workers, session)
        # Write-through backs each history up and writes its pages to the store a few steps later.
        deadline = time.monotonic() + 30
        while len(list(store.glob("*.bin"))) < len(prompts) * (HISTORY // PAGE):
            assert time.monotonic() < deadline, "the histories never reached the shared store"
            time.sleep(0.2)
        workers[1].stop()  # dies with its sessions; the router re-pins them to worker 0
        for session, ids in prompts.items():
            details = _turn(router, session, ids)["meta_info"]["cached_tokens_details"]
            if placed[session] == 0:
                assert details["device"] >= HISTORY, details  # the survivor's own: still on its device
            else:
                # Moved: the history comes from the store, not recomputed (cold would be 0).
                assert details.get("storage", 0) >= HISTORY // PAGE * PAGE, details
        status, report = workers[0].request("GET", "/agentcache/check")
        assert status == 200 and report["ok"], report
    finally:
        router.stop()
        for worker in workers:
            worker.stop()


def test_the_failover_benchmark_measures_moved_sessions_against_cold(tmp_path):
    """``bench/l3_failover.py --quick``: with the shared store a moved session's first call after the
    move loads its history from L3 and computes only what is new; without one it computes everything;
    the survivor's own sessions compute the same in both runs."""
    if not router_available():
        pytest.fail("sglang_router is not importable: install the test extra (it pins sglang-router==0.3.2)")
    bench = FAILOVER
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "l3_failover_quick.json").read_text())
    cfg, rows = result["config"], result["rows"]
    moved = {c: [r for r in rows if r["condition"] == c and r["moved"]] for c in ("l3", "cold")}
    assert moved["l3"] and moved["cold"], result["placed"]  # min_group puts a session on each worker
    for r in moved["l3"]:
        assert r["first_call_storage_tokens"] >= cfg["history"] // bench.PAGE * bench.PAGE, r
        assert r["computed_tokens"] < r["input_tokens"] - cfg["history"] // 2, r
    assert all(r["computed_tokens"] == r["input_tokens"] for r in moved["cold"])  # cold: everything again
    stayed = {(r["condition"], r["session"]): r["computed_tokens"] for r in rows if not r["moved"]}
    both = {s for c, s in stayed if ("l3", s) in stayed and ("cold", s) in stayed}
    assert all(stayed[("l3", s)] == stayed[("cold", s)] for s in both)
    assert all(r["last_call_before_latency_s"] > 0 for r in rows)  # the control: each session before the move
