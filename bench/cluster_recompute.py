"""Two-worker benchmark behind SGLang's router: ours with session affinity against stock routing, on CPU.

Contract. The real-server benchmark (``bench/server_recompute.py``: its trace, plan, prompts, hints,
passes and measures, reused as they are) played against **two** workers behind SGLang's own router
(``sglang-router`` 0.3.2, ``sgl_agentcache.router_process``), each worker with the same device pool
(2048 tokens: the single server's 4096 split in two) and, for every system that has one, the same host
tier (1x the pool per worker):

- ``stock-round-robin``: stock SGLang workers, the router's ``round_robin`` policy, no host tier;
- ``stock-cache-aware``: stock SGLang workers, the router's ``cache_aware`` policy (prefix affinity:
  what a stock deployment uses to keep agent prefixes together), no host tier;
- ``hicache-cache-aware``: stock SGLang workers with SGLang's own HiCache, write-back (``--hicache-ratio``:
  the same host tokens per worker as ours; see server_recompute.py) behind ``cache_aware``;
- ``stock-cache-aware-lpm``, ``hicache-cache-aware-lpm``: the same with SGLang's ``--schedule-policy lpm``
  on the workers;
- ``hicache-session``: the same HiCache workers, routed as ours is (the router's ``manual`` policy
  with the session's routing key, no hint): the control that separates our cache from our routing;
  ``hicache-session-lpm`` the same with SGLang's ``--schedule-policy lpm`` on its workers;
- ``agentcache-no-host``: ours, hints on every call, **no** host tier, the router's ``manual`` policy
  with our routing key (every call of a session on one worker);
- ``agentcache``: ours on SGLang's HiCache (write-back, the same host tokens), ``manual`` + routing key.

Every worker runs ``--schedule-policy fcfs`` unless its name ends in ``-lpm``. Equal memory per
comparison: ``agentcache`` is compared with the write-back systems (same pools and host bytes),
``agentcache-no-host`` with both stock systems (same pools, no host tier anywhere). Per worker the
results give its pool, its host bytes, the calls it prefilled (its share) and its peak token usage,
from its log. Systems run one after another (two workers and a router each: all at once would not
fit this machine), so pass pairs share less than the single server's interleaved passes do.
Hinted calls go through the router with ``gateway.gateway_headers`` (the routing key and the hint in
``tracestate``: the router drops ``kv_hints``); the trace's closes go to the workers through
``cluster.Cluster`` (the router does not proxy our routes). Same trace and clients as the single
server, on the tiny model (4 passes).

Counted as in server_recompute.py: prefill tokens computed (``input - cached``) per pass, the pass
ratios' mean with a 95% Student-t interval; "better"/"worse" only when the interval excludes 1.
Cross-check: the workers' logs' ``#new-token`` sums. Latency and JCT are real but on a shared 2-core
CPU machine where two workers and the router interleave: prefill tokens are the exact measure.

Run: ``SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/cluster_recompute.py [--quick] [--out DIR]``
(default ``bench/results``; writes ``cluster_recompute.json``; about 30 minutes, ``--quick`` about 5).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import server_recompute as single  # noqa: E402

from sgl_agentcache.cluster import Cluster  # noqa: E402
from sgl_agentcache.cpu_server import CpuServer, stream_generate  # noqa: E402
from sgl_agentcache.gateway import gateway_headers  # noqa: E402
from sgl_agentcache.hints import ACTION_TYPE  # noqa: E402
from sgl_agentcache.router_process import RouterProcess  # noqa: E402
from sgl_agentcache.tiny_model import make_tiny_model  # noqa: E402
from sgl_agentcache.trace.generators import generate  # noqa: E402

WORKERS = 2
#: name -> (radix-cache backend, hints and routes, host tier, router policy). The host tier: ``"hicache"``
#: SGLang's own HiCache (write-back; ours decides what it holds), None. ``manual`` routes by the
#: session's routing key (hinted systems send their hint with it, the others only the key).
SYSTEMS = {
    "stock-round-robin": (None, False, None, "round_robin"),
    "stock-cache-aware": (None, False, None, "cache_aware"),
    "stock-cache-aware-lpm": (None, False, None, "cache_aware"),
    "hicache-cache-aware": (None, False, "hicache", "cache_aware"),
    "hicache-cache-aware-lpm": (None, False, "hicache", "cache_aware"),
    "hicache-session": (None, False, "hicache", "manual"),
    "hicache-session-lpm": (None, False, "hicache", "manual"),
    "agentcache-no-host": ("agentcache", True, None, "manual"),
    "agentcache": ("agentcache", True, "hicache", "manual"),
}
#: (ours, theirs): the pairs with equal device pools and equal host bytes.
COMPARISONS = (("agentcache", "hicache-session"), ("agentcache", "hicache-session-lpm"),
               ("agentcache", "hicache-cache-aware"), ("agentcache", "hicache-cache-aware-lpm"),
               ("agentcache-no-host", "stock-round-robin"), ("agentcache-no-host", "stock-cache-aware"),
               ("agentcache-no-host", "stock-cache-aware-lpm"))


def schedule_policy(name: str) -> str:
    return "lpm" if name.endswith("-lpm") else "fcfs"


def _mode(name: str) -> dict:
    """server_recompute's mode, its memory split over the workers: the same trace and clients, each
    worker half the single server's device pool (so the pressure per token of work is the same), the
    host tier 1x each worker's pool. The tiny model: prefill tokens are the measure here, and a wider
    model's compute on two workers sharing two cores would only stretch the run."""
    cfg = dict(single.MODES[name])
    cfg["pool_tokens"] = cfg["pool_tokens"] // WORKERS
    cfg["model_shape"] = "tiny"
    cfg["passes"] = 4 if name == "full" else cfg["passes"]
    return cfg


class ClusterTarget:
    """The single-server API the replayer uses (``request``, ``stream_generate``), mapped onto a
    router and its workers: generation through the router (a hint becomes gateway headers), our
    routes and ``/flush_cache`` to every worker, stats summed and checks combined."""

    def __init__(self, router: RouterProcess, workers: list[CpuServer]):
        self.router, self.workers = router, workers
        self.cluster = Cluster([w.url for w in workers], timeout=120)

    def stream_generate(self, body: dict, timeout: float = 300.0, headers: dict | None = None):
        headers = dict(headers or {})  # an unhinted call routed by session brings its routing key
        if "kv_hints" in body:
            payload = next(a["payload"] for a in body["kv_hints"]["actions"] if a["action_type"] == ACTION_TYPE)
            headers |= gateway_headers(payload)
            body = {k: v for k, v in body.items() if k != "kv_hints"}
        return stream_generate(self.router.url, body, timeout, headers)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 120.0):
        if path == "/agentcache/stats":
            return 200, self.cluster.stats()["total"]
        if path == "/agentcache/check":
            reports = [w.request("GET", path, timeout=timeout)[1] for w in self.workers]
            return 200, {"ok": all(r.get("ok") for r in reports), "workers": reports}
        if path.startswith("/agentcache/"):
            return self.cluster.call(path, body or {})
        replies = [w.request(method, path, body, timeout=timeout) for w in self.workers]  # /flush_cache
        bad = [r for r in replies if r[0] != 200]
        return (bad[0] if bad else replies[0])


def _start_all(workers: list[CpuServer]) -> None:
    errors = []

    def start(worker):
        try:
            worker.start()
        except Exception as exc:  # noqa: BLE001 - reported below, after every start ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for w in workers:
            w.stop()
        raise errors[0]


def run_system(name: str, model, trace, plan, cfg: dict, log_dir: Path) -> tuple[dict, list]:
    """``cfg["passes"]`` passes on fresh workers behind a fresh router (as server_recompute.run_backend)."""
    backend, agent, host, policy = SYSTEMS[name]
    env, extra = {}, ["--schedule-policy", schedule_policy(name)]
    if host == "hicache":  # its host pool sized to the same host tokens (plus one padding page)
        extra += ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--hicache-io-backend",
                  "direct", "--hicache-ratio", f"{cfg['host_ratio']:g}"]
    workers = [CpuServer(str(model.path), backend=backend, log_path=log_dir / f"{name}-w{i}.log",
                         max_total_tokens=cfg["pool_tokens"], context_length=cfg["context_length"], env=env,
                         extra_args=tuple(extra))
               for i in range(WORKERS)]
    per_worker = [[] for _ in workers]
    router = RouterProcess([w.url for w in workers], policy=policy, log_path=log_dir / f"{name}-router.log")
    runs = []
    _start_all(workers)
    try:
        router.start()
        target = ClusterTarget(router, workers)
        stats = single._agentcache_stats(target) if backend else None
        for k in range(cfg["passes"]):
            if k:
                single._flush(target)
            offsets = [w.log_path.stat().st_size for w in workers]
            rep = single.Replayer(target, trace, plan, model.vocab_size, cfg, agent, tag=f".p{k}" if k else "",
                                  route_session=policy == "manual")
            wall = rep.run()
            logs = [single.log_counts(w.log_path, off) for w, off in zip(workers, offsets)]
            for mine, entry in zip(per_worker, logs):
                mine.append(entry)
            log = {key: sum(entry[key] for entry in logs) for key in logs[0] if key != "peak_token_usage"}
            before, stats = stats, single._agentcache_stats(target) if backend else None
            runs.append((single.summarise(rep, wall, log, stats, before), rep))
            print(f"[cluster_recompute] {name} pass {k + 1}/{cfg['passes']}: "
                  f"{runs[-1][0]['computed_tokens']:,} prefill tokens computed", flush=True)
    finally:
        router.stop()
        for w in workers:
            w.stop()
    order = sorted(range(len(runs)), key=lambda k: runs[k][0]["computed_tokens"])
    summary, rep = runs[order[(len(order) - 1) // 2]]
    summary["passes"] = [{f: s[f] for f in single.PASS_FIELDS if f in s} for s, _ in runs]
    summary |= {"pool_tokens_per_worker": cfg["pool_tokens"], "workers": WORKERS, "router_policy": policy,
                "schedule_policy": schedule_policy(name),
                "host_tokens_per_worker": single.host_tokens(cfg) if host else 0,
                "per_worker": [_worker_share(i, entries, per_worker, cfg, bool(host))
                               for i, entries in enumerate(per_worker)]}
    return summary, [[rep.rows[i].get(c) for c in single.ROW_COLUMNS] for i in sorted(rep.rows)]


def _worker_share(i: int, entries: list[dict], all_workers: list[list[dict]], cfg: dict, host: bool) -> dict:
    """Worker ``i`` over every pass: its memory, the share of calls it prefilled (from its log's
    ``#new-seq``), and its peak token usage in any pass."""
    calls = sum(e["prefill_requests"] for e in entries)
    everyone = sum(e["prefill_requests"] for w in all_workers for e in w)
    return {"worker": i, "pool_tokens": cfg["pool_tokens"], "host_tokens": single.host_tokens(cfg) if host else 0,
            "prefilled_calls": calls, "share_of_calls": round(calls / max(everyone, 1), 3),
            "peak_token_usage": max((e["peak_token_usage"] for e in entries), default=0.0)}


def compare(systems: dict) -> dict:
    """Each pair of COMPARISONS, pass by pass: mean ratio (ours / theirs) with its 95% interval."""
    return {f"{ours} / {theirs}": single.paired(systems[ours], systems[theirs]) for ours, theirs in COMPARISONS}


def print_table(result: dict) -> None:
    print("\nsystem                  prefill computed   hit rate   JCT s   failures   calls per worker")
    for name, s in result["systems"].items():
        shares = " / ".join(f"{w['share_of_calls']:.0%}" for w in s["per_worker"])
        print(f"{name:22s}  {s['computed_tokens']:>16,}   {s['hit_rate']:>8.3f}   {s['jct_s']:>5.1f}   "
              f"{s['failures']:>8}   {shares}")
    print("\nratio (95% CI over passes)                      computed                    JCT")
    for pair, c in result["comparison"].items():
        fmt = lambda m: f"{m['mean']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] {m['verdict']}"  # noqa: E731
        print(f"{pair:46s}  {fmt(c['computed']):28s}  {fmt(c['jct'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny trace")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON")
    ap.add_argument("--log-dir", help="keep the worker and router logs here (default: a temporary directory)")
    ap.add_argument("--passes", type=int, help="passes per system (default: the single-server benchmark's)")
    ap.add_argument("--systems", help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = _mode(mode) | {"pause_via": "hint"} | ({"passes": args.passes} if args.passes else {})
    names = args.systems.split(",") if args.systems else list(SYSTEMS)
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems: {', '.join(sorted(unknown))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cluster-recompute-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(Path(tmp) / "model", shape=cfg["model_shape"])
        trace, dropped = single.fit_context(generate("branch_heavy", seed=cfg["seed"], **cfg["trace"]),
                                            cfg["context_length"], cfg["output_cap"])
        plan = single.build_plan(trace)
        systems, rows = {}, {}
        for name in names:
            print(f"[cluster_recompute] {name}: {WORKERS} fresh workers + router, {len(trace.requests)} calls",
                  flush=True)
            systems[name], rows[name] = run_system(name, model, trace, plan, cfg, log_dir)
    result = {
        "benchmark": "cluster_recompute", "mode": mode,
        "command": "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/cluster_recompute.py" + " --quick" * args.quick
                   + (f" --passes {args.passes}" if args.passes else ""),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "sglang": single._version("sglang"), "sglang_router": single._version("sglang-router")},
        "config": {"workload": "branch_heavy", "workers": WORKERS, **{k: v for k, v in cfg.items() if k != "trace"},
                   "host_tokens_per_worker": single.host_tokens(cfg), "trace_params": cfg["trace"],
                   "sessions_dropped_for_context": dropped, "trace_stats": single.trace_stats(trace, plan),
                   "systems": {n: {"radix_cache_backend": b or "default", "hints": h, "host_tier": ht,
                                   "hicache_write_policy": "write_back" if ht == "hicache" else None,
                                   "router_policy": pol, "schedule_policy": schedule_policy(n)}
                               for n, (b, h, ht, pol) in SYSTEMS.items() if n in names}},
        "systems": systems,
        "comparison": compare(systems) if set(names) == set(SYSTEMS) else {},
        "requests": {"columns": list(single.ROW_COLUMNS), **rows},
    }
    (out / "cluster_recompute.json").write_text(single.dump_json(result))
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
