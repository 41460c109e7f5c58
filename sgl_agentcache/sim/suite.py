"""The replay suite: every system on every workload, at equal device pool and equal host tier.

Workloads: the six generated classes (``trace/generators.py``, a seed each) and the committed real
traces (``bench/traces/``: the kv-cache-tester sessions together, the Mooncake conversation slice),
each seed of a real trace shifting its sessions against each other (``offset_sessions``).

Memory. The device pool is set per trace from its own working set, so a pressure point means the same
thing on every workload: ``pool = fraction x working_set`` with ``working_set = max concurrent
sessions x mean input tokens``, at least ``FLOOR x`` the longest call (every call must fit); when that
floor binds, every pressure point scales with it, so two pressure points always differ by their ratio.
The host tier is an axis, in multiples of the pool: every system of a cell gets exactly the same host
capacity, except the reference systems (stock SGLang, with and without session-radix), which have no
host tier at all and so appear at host 0 only -- stock without a host tier is the denominator of every
ratio, in every cell. All systems run at the main host levels (``hosts``); ours and the HiCache
baselines also run at the sweep levels (``sweep_hosts``, at ``sweep_pressure``).

Every system with a host tier runs on SGLang's own HiCache code driven offline (``server/scheduler/offline.py``):
``sglang-hicache`` is SGLang's HiCache itself (write-back), the write-back reference of every comparison;
ours (``agentcache``) is our lifecycle deciding what HiCache's host pool holds.

Statistics. Each figure is a mean over seeds with a 95% confidence interval (Student t over the
per-seed values); ours against each other system is the per-seed ratio of recomputed tokens, and a
verdict is "better" or "worse" only when its interval excludes 1 ("tie" otherwise). Every cell also
carries stock's hit rate with an infinite pool (for scale, not a bound) and the LP lower bound (``sim/bound.py``) on recompute for its
capacity: the smallest of its runs' bounds, so a bound for each of them; every run is checked to
recompute at least its own bound.

Ours also runs as ``agentcache-inferred``: the same cache given no client hint, the lifecycle inferred
from the calls as ``AGENTCACHE_INFER=chat`` does (``sim/inferred.py``), compared with ours given the
trace's explicit hints (``comparisons_inferred``: inferred / explicit, / stock, / SGLang's HiCache).

Everything a report quotes is computed here and written to ``results.json`` with the command, seeds,
profile and package versions. Jobs (a workload and a seed) run in worker processes.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.policies import POLICIES
from sgl_agentcache.sim.replay import ReplayResult, replay
from sgl_agentcache.trace.generators import WORKLOADS, generate
from sgl_agentcache.trace.stats import trace_stats

PRESSURES = {"tight": 0.3, "moderate": 0.6}
#: Every call must fit: the pool is at least this many times the longest call.
FLOOR = 1.3
#: Token ids the replay draws from: large, so two different blocks' tokens never start alike by chance
#: (the LP bound identifies tokens by their block chain). Offline, ids never reach a model.
REPLAY_VOCAB = 2**31 - 1
#: Real-trace workloads: name -> (sample, token scale, session offset spread in seconds).
REAL_WORKLOADS = {
    "real_cc_sessions": ("weka_mix", 64, 600.0),
    "real_mooncake_chat": ("mooncake_conversation", 64, 120.0),
}
OURS = "agentcache"
#: Ours with no client hints: the lifecycle inferred from the calls (AGENTCACHE_INFER=chat).
INFERRED = "agentcache-inferred"
#: SGLang's HiCache itself, driven offline through its code (server/scheduler/offline.py): the write-back reference.
SGLANG_HICACHE = "sglang-hicache"
DEFAULT_POLICIES = ("stock", SGLANG_HICACHE, "infercept", "continuum", "kvflow", "session-radix", OURS, INFERRED,
                    "clairvoyant")


@dataclass(frozen=True)
class SuiteConfig:
    workloads: tuple[str, ...] = tuple(WORKLOADS) + tuple(REAL_WORKLOADS)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    pressures: tuple[str, ...] = tuple(PRESSURES)
    hosts: tuple[float, ...] = (0.0, 1.0)  # host tier as a multiple of the pool: every policy (host 0 at
    # the sweep pressure only: every system without a host tier is the equal-memory comparison there)
    sweep_hosts: tuple[float, ...] = (0.25, 0.5, 4.0)  # ours and HiCache only, at sweep_pressure
    sweep_policies: tuple[str, ...] = (SGLANG_HICACHE, OURS)
    sweep_pressure: str = "tight"
    seeds: tuple[int, ...] = tuple(range(1, 11))
    real_seeds: tuple[int, ...] = tuple(range(1, 11))
    scale: float = 0.1
    profile: str = "seed"
    workers: int = 2


def pool_for(trace, pressure: str) -> int:
    stats = trace_stats(trace)
    working_set = stats["max_concurrent_sessions"] * stats["mean_input_tokens"]
    longest = max(r.input_tokens + max(r.output_tokens, 1) for r in trace.requests)
    fraction = PRESSURES[pressure]
    floor = FLOOR * longest * fraction / min(PRESSURES.values())
    return int(max(fraction * working_set, floor))


def workload_trace(workload: str, seed: int, scale: float):
    """The trace of ``workload`` for ``seed`` and its token scale (1 for generated traces)."""
    if workload in REAL_WORKLOADS:
        from sgl_agentcache.trace.samples import load_sample
        from sgl_agentcache.trace.transforms import offset_sessions

        sample, token_scale, spread = REAL_WORKLOADS[workload]
        return offset_sessions(load_sample(sample, token_scale=token_scale), seed, spread), token_scale
    return generate(workload, seed=seed, scale=scale), 1


def scaled_profile(profile: Profile, token_scale: int) -> Profile:
    """A profile under which one token of a ``token_scale``-scaled trace costs what ``token_scale``
    tokens of the original cost (bytes, prefill, decode), so times keep their meaning."""
    if token_scale == 1:
        return profile
    return replace(profile, name=f"{profile.name}/x{token_scale}", kv_bytes_per_token=profile.kv_bytes_per_token * token_scale,
                   prefill_tokens_per_s=profile.prefill_tokens_per_s / token_scale,
                   decode_s_per_token=profile.decode_s_per_token * token_scale,
                   token_scale=profile.token_scale * token_scale)


def infinite_cache(trace, profile: Profile) -> ReplayResult:
    """Stock with a pool that never evicts, on this trace (including the outputs each call leaves for
    the next). Not a bound: with room for everything no call ever queues, so calls that a tight pool
    holds back until a sibling has computed their shared prompt start at once and miss it (on
    ``stable_prompts`` write-back and ours under a tight pool recompute less). The bound is
    ``sim/bound.py``'s."""
    total = sum(r.input_tokens + max(r.output_tokens, 1) for r in trace.requests)
    return replay(trace, "stock", pool_tokens=total + 1024, host_tokens=0, profile=profile, vocab_size=REPLAY_VOCAB)


def ideal_hit_rate(trace, profile: Profile) -> float:
    """Hit rate of :func:`infinite_cache` (for scale: not a bound, see there)."""
    return infinite_cache(trace, profile).hit_rate


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == 0 else math.inf)


def result_row(result: ReplayResult, stock: ReplayResult, cell: dict) -> dict:
    d = result.to_dict()
    base = stock.to_dict()
    return cell | {
        "policy": result.policy, "label": result.label, "pool_tokens": result.pool_tokens,
        "host_tokens": result.host_tokens, "requests": result.requests, "refused": result.refused_requests,
        "hit_rate": d["hit_rate"], "host_hit_rate": result.restored_tokens / max(result.input_tokens, 1),
        "recomputed_tokens": result.recomputed_tokens,
        "recompute_vs_stock": _ratio(result.recomputed_tokens, stock.recomputed_tokens),
        "completion_vs_stock": _ratio(result.completion_s, stock.completion_s),
        "resume_p50_s": d["resume_s"]["p50"], "resume_p95_s": d["resume_s"]["p95"], "resume_p99_s": d["resume_s"]["p99"],
        "resume_p99_vs_stock": _ratio(d["resume_s"]["p99"], base["resume_s"]["p99"]),
        "resume_queue_p50_s": d["resume_queue_s"]["p50"], "idle_kv_token_s": result.idle_kv_token_s,
        "own_wait_p99_s": d["own_wait_s"]["p99"], "own_wait_total_s": d["own_wait_s"]["total"],
        "resume_own_wait_p99_s": d["resume_own_wait_s"]["p99"], "admission_refusals": result.admission_refusals,
        "session_jct_mean_s": d["session_jct_s"]["mean"], "session_jct_p50_s": d["session_jct_s"]["p50"],
        "reclaim_latency_p99_s": d["reclaim_latency_s"]["p99"], "reclaimed_tokens": result.reclaimed_tokens,
        "bytes_d2h": result.bytes_d2h, "bytes_h2d": result.bytes_h2d, "decisions": result.decisions,
        "prefetch": result.prefetch, "fairness_jain": d["fairness_jain"], "leaked_tokens": result.leaked_tokens,
        "integrity_ok": result.integrity_ok, "wall_s": result.wall_s,
    }


def _plan(config: SuiteConfig, pressure: str) -> list[tuple[float, tuple[str, ...]]]:
    """(host level, policies) to run at ``pressure``; reference systems only at host 0, and host 0 only
    at the sweep pressure. A baseline on SGLang's HiCache runs only with a host pool (without one it is
    LRU or its rule over no host tier, not the system its paper describes); ours runs at host 0 too
    (the replay then attaches no HiCache: ours without a host tier)."""
    def runs_at(policy: str, host: float) -> bool:
        p = POLICIES[policy]
        return policy != "stock" and (host == 0 or not p.reference) and (host > 0 or p.hicache is None or p.hints)

    plan = [(h, tuple(p for p in config.policies if runs_at(p, h)))
            for h in config.hosts if h > 0 or pressure == config.sweep_pressure]
    if pressure == config.sweep_pressure:
        plan += [(h, tuple(p for p in config.sweep_policies if p in config.policies)) for h in config.sweep_hosts
                 if h not in config.hosts]
    return plan


def run_job(config: SuiteConfig, profile: Profile, workload: str, seed: int) -> dict:
    """Every run of one (workload, seed): rows, the cells' bounds, and raw data for the plots."""
    from sgl_agentcache.sim.bound import lower_bound

    trace, token_scale = workload_trace(workload, seed, config.scale)
    prof = scaled_profile(profile, token_scale)
    infinite = infinite_cache(trace, prof)
    ideal = infinite.hit_rate
    rows, runs = [], []
    for pressure in config.pressures:
        pool = pool_for(trace, pressure)
        plotted = seed == config_first_seed(config, workload)
        stock = replay(trace, "stock", pool_tokens=pool, host_tokens=0, profile=prof, vocab_size=REPLAY_VOCAB,
                       timeline=plotted)
        for host_ratio, policies in _plan(config, pressure):
            host = int(round(host_ratio * pool))
            cell = {"workload": workload, "pressure": pressure, "host_ratio": host_ratio, "seed": seed,
                    "ideal_hit_rate": ideal, "token_scale": token_scale, "trace_requests": len(trace.requests)}
            results = {"stock": stock} | {p: replay(trace, p, pool_tokens=pool, host_tokens=host, profile=prof,
                                                    vocab_size=REPLAY_VOCAB, timeline=plotted) for p in policies}
            bounds = {}
            for name, result in results.items():
                bound = lower_bound(trace, result.access_log, pool + host).recompute_tokens
                if result.recomputed_tokens < bound - 1e-6:
                    raise RuntimeError(f"{workload} seed {seed} {pressure} host {host_ratio}: {name} recomputed "
                                       f"{result.recomputed_tokens} < its lower bound {bound:.0f}: a bug")
                bounds[name] = bound
            cell["lower_bound_tokens"] = min(bounds.values())
            cell["lower_bound_vs_stock"] = _ratio(cell["lower_bound_tokens"], stock.recomputed_tokens)
            cell["infinite_vs_stock"] = _ratio(infinite.recomputed_tokens, stock.recomputed_tokens)
            for name, result in results.items():
                rows.append(result_row(result, stock, cell))
                if plotted:
                    runs.append({"workload": workload, "pressure": pressure, "host_ratio": host_ratio, "seed": seed,
                                 "policy": name, "resume_latencies_s": result.resume_latencies_s,
                                 "timeline": result.timeline})
    return {"rows": rows, "runs": runs}


def config_first_seed(config: SuiteConfig, workload: str) -> int:
    seeds = config.real_seeds if workload in REAL_WORKLOADS else config.seeds
    return seeds[0]


def run_suite(config: SuiteConfig, profile: Profile, progress: Callable[[str], None] | None = None) -> dict:
    """Run the suite; returns ``{"config", "rows", "summary", "comparisons", "runs", ...}``."""
    started = time.perf_counter()
    jobs = [(w, s) for w in config.workloads
            for s in (config.real_seeds if w in REAL_WORKLOADS else config.seeds)]
    jobs.sort(key=lambda job: job[0] not in REAL_WORKLOADS)  # the long real traces first: no lone tail job
    rows, runs = [], []
    if config.workers <= 1:
        for workload, seed in jobs:
            out = run_job(config, profile, workload, seed)
            rows += out["rows"]
            runs += out["runs"]
            if progress is not None:
                progress(f"{workload} seed {seed}")
    else:
        with ProcessPoolExecutor(max_workers=config.workers) as pool:
            futures = [(w, s, pool.submit(run_job, config, profile, w, s)) for w, s in jobs]
            for workload, seed, future in futures:
                out = future.result()
                rows += out["rows"]
                runs += out["runs"]
                if progress is not None:
                    progress(f"{workload} seed {seed}")
    return {"config": asdict(config), "profile": profile.to_dict(), "rows": rows, "runs": runs,
            "summary": summarize(rows), "comparisons": compare(rows, OURS),
            "comparisons_inferred": [c for c in compare(rows, INFERRED)
                                     if c["other"] in ("stock", SGLANG_HICACHE, OURS)],
            "latency_comparisons": [c for metric in LATENCY_METRICS for c in compare(rows, OURS, metric)
                                    if c["other"] in ("stock", SGLANG_HICACHE)],
            "jobs": len(jobs),
            "wall_s": time.perf_counter() - started, "environment": environment()}


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and the Student-t confidence interval of the mean at ``level`` (95% by default; a single
    value: no interval)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    from scipy.stats import t

    half = float(t.ppf(0.5 + level / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, pressure, host level, policy): means over seeds, with 95% intervals."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["pressure"], row["host_ratio"], row["policy"]), []).append(row)
    out = []
    for (workload, pressure, host_ratio, policy), group in groups.items():
        mean = lambda k: statistics.fmean(r[k] for r in group)  # noqa: E731
        ratio, lo, hi = mean_ci([r["recompute_vs_stock"] for r in group])
        decisions: dict[str, int] = {}
        for r in group:
            for k, v in (r["decisions"] or {}).items():
                decisions[k] = decisions.get(k, 0) + v
        out.append({"workload": workload, "pressure": pressure, "host_ratio": host_ratio, "policy": policy,
                    "label": group[0]["label"], "seeds": len(group),
                    "pool_tokens": mean("pool_tokens"), "host_tokens": mean("host_tokens"),
                    "recompute_vs_stock": ratio, "recompute_ci95": [lo, hi],
                    "hit_rate": mean("hit_rate"), "host_hit_rate": mean("host_hit_rate"),
                    "ideal_hit_rate": mean("ideal_hit_rate"), "lower_bound_vs_stock": mean("lower_bound_vs_stock"),
                    "infinite_vs_stock": mean("infinite_vs_stock"),
                    "completion_vs_stock": mean("completion_vs_stock"),
                    "resume_p50_s": mean("resume_p50_s"), "resume_p99_s": mean("resume_p99_s"),
                    "resume_p99_vs_stock": mean("resume_p99_vs_stock"), "idle_kv_token_s": mean("idle_kv_token_s"),
                    "own_wait_total_s": mean("own_wait_total_s"), "session_jct_mean_s": mean("session_jct_mean_s"),
                    "admission_refusals": sum(r["admission_refusals"] for r in group),
                    "bytes_moved": mean("bytes_d2h") + mean("bytes_h2d"), "decisions": decisions,
                    "refused": sum(r["refused"] for r in group),
                    "leaked_tokens": max((r["leaked_tokens"] or 0) for r in group),
                    "integrity_ok": all(r["integrity_ok"] for r in group)})
    return out


#: Latencies compared seed by seed like recompute (``latency_comparisons``): a resumed call's latency from
#: its trace arrival (p50, p99), its own wait from when the server received it (p99), every call's own
#: waits summed, and the mean session JCT.
LATENCY_METRICS = ("resume_p50_s", "resume_p99_s", "resume_own_wait_p99_s", "own_wait_total_s", "session_jct_mean_s")


def compare(rows: list[dict], ours: str, metric: str = "recomputed_tokens") -> list[dict]:
    """Ours against every other system of the same cell, seed by seed: the mean ratio of ``metric``
    (ours / theirs; recomputed tokens by default) with its 95% interval, and a verdict that claims a
    difference only when the interval excludes 1 (lower is better)."""
    by_cell: dict[tuple, dict[str, dict[int, dict]]] = {}
    for row in rows:
        cell = (row["workload"], row["pressure"], row["host_ratio"])
        by_cell.setdefault(cell, {}).setdefault(row["policy"], {})[row["seed"]] = row
    out = []
    for (workload, pressure, host_ratio), policies in by_cell.items():
        mine = policies.get(ours)
        if not mine:
            continue
        for other, theirs in policies.items():
            if other == ours:
                continue
            seeds = sorted(set(mine) & set(theirs))
            ratios = [_ratio(mine[s][metric], theirs[s][metric]) for s in seeds]
            if not ratios or any(math.isinf(r) for r in ratios):
                continue
            mean, lo, hi = mean_ci(ratios)
            verdict = "better" if hi < 1.0 else "worse" if lo > 1.0 else "tie"
            out.append({"workload": workload, "pressure": pressure, "host_ratio": host_ratio, "other": other,
                        "seeds": len(seeds), "ratio": mean, "ci95": [lo, hi], "verdict": verdict}
                       | ({"metric": metric} if metric != "recomputed_tokens" else {}))
    return out


def environment() -> dict:
    from importlib import metadata

    versions = {}
    for name in ("sglang", "torch", "sgl-agentcache", "msgspec", "scipy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "machine": platform.machine(), "versions": versions}


def write_report(report: dict, out_dir: Path, command: str) -> list[Path]:
    """``results.json`` plus the PNG plots; returns the files written."""
    from sgl_agentcache.sim.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    body = {k: v for k, v in report.items() if k not in ("runs", "rows")} | {"command": command}
    body["rows"] = [{k: v for k, v in row.items() if k not in ("label",)} for row in report["rows"]]
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    return [path, *plot_all(report, out_dir)]
