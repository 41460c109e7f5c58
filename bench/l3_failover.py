"""A worker dies: its sessions continue on the other worker from the shared L3 store, or cold (issue #36 item 5).

Contract. Two workers run our backend on SGLang's HiCache (write-through, ``--page-size 16``), behind
SGLang's own router (``--policy manual``: every call of a session goes to the worker its routing key is
pinned to). ``SESSIONS`` agent sessions each send a ``HISTORY``-token first prompt and then turns that
append the last answer and ``TURN_TOKENS`` new tokens (random ids below the tiny model's vocabulary,
one seed for all conditions). After ``TURNS_BEFORE`` turns, once every history's pages are in the store,
worker 1 is stopped; the router re-pins its sessions to worker 0, and every session plays
``TURNS_AFTER`` more turns. Conditions, same prompts, same pools and host bytes:

- ``l3``: both workers share one ``file`` storage backend (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``);
- ``cold``: no storage backend: a moved session's history exists nowhere the survivor can read.

Measured per session after the move: prefill tokens computed (``input - cached``) over its calls, the
first call's latency (4 output tokens, wall clock, CPU) and where its cached tokens came from
(``cached_tokens_details``: device / host / storage); as a control, the latency of each session's last
call before the move (both workers serving: what the condition costs without a failover). Per condition,
the moved sessions' mean with a 97.5% Student-t interval over sessions, and ``l3`` / ``cold`` as the
ratio of the means with the conservative 95% interval the two give (:func:`summarize`); the router picks
each session's worker (ties at random), so the moved groups differ between runs and are compared as
samples. One run per condition: the intervals are over sessions within a run, not over runs (run-to-run
machine noise is not in them). The survivor's own sessions are the control: its pool holds every
session, so the move evicts none of them. Sessions are independent samples (their prompts share
nothing).

Run: ``SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/l3_failover.py [--quick] [--out DIR]`` (writes
``l3_failover.json``; a few minutes, ``--quick`` about two).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.cpu_server import CpuServer  # noqa: E402
from sgl_agentcache.gateway import gateway_headers  # noqa: E402
from sgl_agentcache.router_process import RouterProcess, router_available  # noqa: E402
from sgl_agentcache.sim.suite import mean_ci  # noqa: E402
from sgl_agentcache.tiny_model import make_tiny_model  # noqa: E402

PAGE = 16
CONDITIONS = ("l3", "cold")
#: Each worker's pool holds every session (16 x ~1,000 tokens): the survivor evicts nothing for the moved
#: sessions, so what the move costs is the failover alone, and the survivor's own sessions are a clean control.
FULL = dict(sessions=16, history=768, turn_tokens=48, turns_before=2, turns_after=2, pool_tokens=20480,
            host_ratio=2, model_shape="bench", seed=11)
QUICK = dict(FULL, sessions=4, history=256, turns_after=1, pool_tokens=2048, model_shape="tiny")
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _workers(model, cfg: dict, condition: str, store: Path, log_dir: Path) -> list[CpuServer]:
    storage = ("--hicache-storage-backend", "file") if condition == "l3" else ()
    return [CpuServer(str(model.path), log_path=log_dir / f"{condition}-worker{i}.log",
                      max_total_tokens=cfg["pool_tokens"],
                      env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)},
                      extra_args=("--enable-cache-report", "--enable-hierarchical-cache", "--hicache-io-backend",
                                  "direct", "--hicache-write-policy", "write_through", "--hicache-ratio",
                                  str(cfg["host_ratio"]), "--page-size", str(PAGE), *storage))
            for i in range(2)]


def _turn(router: RouterProcess, session: str, ids: list[int]) -> tuple[dict, float]:
    started = time.perf_counter()
    status, out = router.request("POST", "/generate", {"input_ids": ids, "sampling_params": GREEDY},
                                 headers=gateway_headers({"session": session}))
    if status != 200:
        raise RuntimeError(f"{session}: HTTP {status}: {out}")
    return out, time.perf_counter() - started


def _holder(workers: list[CpuServer], session: str) -> int:
    for i, worker in enumerate(workers):
        status, stats = worker.request("GET", "/agentcache/stats")
        if status == 200 and any(b["session"] == session for b in stats["branches"]):
            return i
    raise RuntimeError(f"no worker holds {session}")


def run_condition(model, cfg: dict, condition: str, log_dir: Path) -> dict:
    """One condition: sessions on two workers, worker 1 stopped, every session continued. Returns per
    session its worker before the move, its calls before it (latency) and its calls after it."""
    rng = random.Random(cfg["seed"])
    vocab = model.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    store = log_dir / f"{condition}-store"
    store.mkdir(parents=True, exist_ok=True)
    workers = _workers(model, cfg, condition, store, log_dir)
    router = RouterProcess([w.url for w in workers], log_path=log_dir / f"{condition}-router.log")
    sessions = {f"s{i}": fresh(cfg["history"]) for i in range(cfg["sessions"])}
    placed, before, after = {}, {s: [] for s in sessions}, {s: [] for s in sessions}
    try:
        for worker in workers:
            worker.start()
        router.start()
        sent = {}
        for _ in range(cfg["turns_before"]):
            for session, ids in sessions.items():
                out, latency = _turn(router, session, ids)
                before[session].append({"input_tokens": len(ids), "latency_s": latency})
                sent[session] = len(ids)
                ids += out["output_ids"] + fresh(cfg["turn_tokens"])
        placed = {session: _holder(workers, session) for session in sessions}
        if condition == "l3":  # write-through backs each prompt up; its full pages reach the store steps later
            pages = sum(n // PAGE for n in sent.values())
            deadline = time.monotonic() + 120
            while len(list(store.glob("*.bin"))) < pages:
                if time.monotonic() > deadline:
                    raise RuntimeError("the histories never reached the shared store")
                time.sleep(0.2)
        workers[1].stop()  # it dies with its sessions; the router re-pins them to worker 0
        router.wait_healthy(1)  # the first call after the move measures the load, not failure detection
        for _ in range(cfg["turns_after"]):
            for session, ids in sessions.items():
                out, latency = _turn(router, session, ids)
                meta = out["meta_info"]
                after[session].append({"input_tokens": len(ids), "cached_tokens": meta["cached_tokens"],
                                       "details": meta.get("cached_tokens_details") or {}, "latency_s": latency})
                ids += out["output_ids"] + fresh(cfg["turn_tokens"])
        status, report = workers[0].request("GET", "/agentcache/check")
        if status != 200 or not report.get("ok"):
            raise RuntimeError(f"the survivor's integrity check failed: {report}")
    finally:
        router.stop()
        for worker in workers:
            worker.stop()
    return {"placed": placed, "before": before, "after": after}


def _interval(values: list[float], level: float) -> dict:
    """Mean and Student-t interval at ``level`` (a single value: no interval)."""
    mean, lo, hi = mean_ci(values, level)
    return {"sessions": len(values), "mean": mean, "ci": [lo, hi], "level": level}


def summarize(runs: dict) -> dict:
    """Per session after the move: computed tokens, first-call latency and cache sources. Per condition
    and group (moved, stayed), the mean over its sessions with a 97.5% t interval; and l3 / cold as the
    ratio of the means, with the interval the two give (l3's low end over cold's high end, and the
    reverse): both hold at once with probability at least 95% (Bonferroni), so it is a conservative 95%
    interval. Which sessions a worker gets is the router's choice (``min_group`` breaks ties at random),
    so the groups are compared as samples, not session by session. Each condition is one run: the
    intervals are over sessions within it, not over runs."""
    rows = []
    for condition, run in runs.items():
        for session, calls in run["after"].items():
            rows.append({"condition": condition, "session": session, "moved": run["placed"][session] == 1,
                         "computed_tokens": sum(c["input_tokens"] - c["cached_tokens"] for c in calls),
                         "input_tokens": sum(c["input_tokens"] for c in calls),
                         "first_call_latency_s": calls[0]["latency_s"],
                         # The control: the same session's last call before the move, when both workers
                         # served (a difference here is the condition's, not the failover's).
                         "last_call_before_latency_s": run["before"][session][-1]["latency_s"],
                         "first_call_storage_tokens": calls[0]["details"].get("storage", 0),
                         "first_call_device_tokens": calls[0]["details"].get("device", 0)})
    comparisons = {}
    for group, moved in (("moved", True), ("stayed", False)):
        for metric in ("computed_tokens", "first_call_latency_s", "last_call_before_latency_s"):
            side = {c: [r[metric] for r in rows if r["condition"] == c and r["moved"] == moved] for c in CONDITIONS}
            if min(len(v) for v in side.values()) < 2:
                continue
            l3, cold = _interval(side["l3"], 0.975), _interval(side["cold"], 0.975)
            lo = l3["ci"][0] / cold["ci"][1] if cold["ci"][1] > 0 else float("nan")
            hi = l3["ci"][1] / cold["ci"][0] if cold["ci"][0] > 0 else float("inf")
            verdict = "better" if hi < 1.0 else "worse" if lo > 1.0 else "tie"
            comparisons[f"{group}:{metric}"] = {"l3": l3, "cold": cold, "ratio": l3["mean"] / cold["mean"],
                                                "ci95": [lo, hi], "verdict": verdict}
    return {"rows": rows, "comparisons": comparisons}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 small sessions on the tiny model (a smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    args = parser.parse_args(argv)
    if not router_available():
        print("[l3_failover] sglang_router is not importable: install the test extra", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="l3-failover-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(Path(tmp) / "model", shape=cfg["model_shape"])
        runs = {}
        for condition in CONDITIONS:
            runs[condition] = run_condition(model, cfg, condition, log_dir)
            print(f"[l3_failover] {condition} done", flush=True)
    result = {"config": cfg, "conditions": list(CONDITIONS), "placed": runs["l3"]["placed"], **summarize(runs),
              "runs": runs, "wall_s": time.perf_counter() - started,
              "command": "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/l3_failover.py" + " --quick" * args.quick}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("l3_failover_quick.json" if args.quick else "l3_failover.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    for name, c in result["comparisons"].items():
        print(f"[l3_failover] l3 / cold, {name}: {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] "
              f"{c['verdict']} ({c['l3']['sessions']} / {c['cold']['sessions']} sessions)")
    print(f"[l3_failover] wrote {path} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
