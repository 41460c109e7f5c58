"""The replay suite: every policy on every workload at two memory-pressure points, as ratios to stock.

Pressure is set per trace from its own working set, so "tight" means the same thing for every workload:
``pool = fraction x working_set`` (at least 1.3x the longest request, so every call fits), where
``working_set = max concurrent sessions x mean input tokens`` -- roughly what the live sessions would
hold if everything they used stayed resident.

Every figure a report quotes is computed here and written to ``results.json`` with the exact command,
seeds, profile and package versions, so a claim can be regenerated; ratios are against B0 (stock)
*in the same run, on the same trace*.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.policies import POLICIES
from sgl_agentcache.sim.replay import ReplayResult, replay
from sgl_agentcache.trace.generators import WORKLOADS, generate
from sgl_agentcache.trace.stats import trace_stats

PRESSURES = {"tight": 0.3, "moderate": 0.6}


@dataclass(frozen=True)
class SuiteConfig:
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    policies: tuple[str, ...] = tuple(POLICIES)
    pressures: tuple[str, ...] = tuple(PRESSURES)
    seeds: tuple[int, ...] = (1,)
    scale: float = 0.1
    profile: str = "seed"


def pool_for(trace, pressure: str) -> int:
    stats = trace_stats(trace)
    working_set = stats["max_concurrent_sessions"] * stats["mean_input_tokens"]
    longest = max(r.input_tokens + max(r.output_tokens, 1) for r in trace.requests)
    return int(max(PRESSURES[pressure] * working_set, 1.3 * longest))


def ideal_hit_rate(trace, profile: Profile) -> float:
    """Hit rate of an infinite cache on this trace: stock with a pool that never evicts (exact, including
    the outputs each call leaves for the next), the limit no policy can beat."""
    total = sum(r.input_tokens + max(r.output_tokens, 1) for r in trace.requests)
    return replay(trace, "stock", pool_tokens=total + 1024, profile=profile).hit_rate


def _row(result: ReplayResult, stock: ReplayResult, workload: str, pressure: str, seed: int,
         ideal: float | None = None) -> dict:
    d = result.to_dict()
    base = stock.to_dict()
    ratio = lambda a, b: a / b if b else (1.0 if a == 0 else float("inf"))  # noqa: E731
    return {
        "workload": workload, "pressure": pressure, "seed": seed, "policy": result.policy, "label": result.label,
        "pool_tokens": result.pool_tokens, "requests": result.requests, "refused": result.refused_requests,
        "hit_rate": d["hit_rate"], "host_hit_rate": result.restored_tokens / max(result.input_tokens, 1),
        "ideal_hit_rate": ideal,  # an infinite cache: the true limit of any policy on this trace
        "recomputed_tokens": result.recomputed_tokens,
        "recompute_vs_stock": ratio(result.recomputed_tokens, stock.recomputed_tokens),
        "resume_p50_s": d["resume_s"]["p50"], "resume_p95_s": d["resume_s"]["p95"], "resume_p99_s": d["resume_s"]["p99"],
        "resume_p99_vs_stock": ratio(d["resume_s"]["p99"], base["resume_s"]["p99"]),
        "resume_queue_p50_s": d["resume_queue_s"]["p50"], "idle_kv_token_s": result.idle_kv_token_s,
        "reclaim_latency_p99_s": d["reclaim_latency_s"]["p99"], "reclaimed_tokens": result.reclaimed_tokens,
        "bytes_d2h": result.bytes_d2h, "bytes_h2d": result.bytes_h2d, "decisions": result.decisions,
        "prefetch": result.prefetch, "fairness_jain": d["fairness_jain"], "leaked_tokens": result.leaked_tokens,
        "integrity_ok": result.integrity_ok, "wall_s": result.wall_s,
    }


def run_suite(config: SuiteConfig, profile: Profile, progress: Callable[[str], None] | None = None) -> dict:
    """Run the suite; returns ``{"config", "rows", "runs", ...}``. ``runs`` keeps the raw per-run data
    the plots need (resume latencies, memory timelines)."""
    started = time.perf_counter()
    rows, runs = [], []
    for workload in config.workloads:
        for seed in config.seeds:
            trace = generate(workload, seed=seed, scale=config.scale)
            ideal = ideal_hit_rate(trace, profile)
            for pressure in config.pressures:
                pool = pool_for(trace, pressure)
                results = {}
                for policy in ("stock",) + tuple(p for p in config.policies if p != "stock"):
                    if progress is not None:
                        progress(f"{workload} seed {seed} {pressure} ({pool} tokens): {policy}")
                    results[policy] = replay(trace, policy, pool_tokens=pool, profile=profile)
                for policy in config.policies:
                    rows.append(_row(results[policy], results["stock"], workload, pressure, seed, ideal))
                    r = results[policy]
                    runs.append({"workload": workload, "pressure": pressure, "seed": seed, "policy": policy,
                                 "resume_latencies_s": r.resume_latencies_s, "timeline": r.timeline})
    return {"config": config.__dict__, "profile": profile.to_dict(), "rows": rows, "runs": runs,
            "summary": summarize(rows), "wall_s": time.perf_counter() - started, "environment": _environment()}


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over seeds per (workload, pressure, policy)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["pressure"], row["policy"]), []).append(row)
    out = []
    for (workload, pressure, policy), group in groups.items():
        mean = lambda k: statistics.fmean(r[k] for r in group)  # noqa: E731
        out.append({"workload": workload, "pressure": pressure, "policy": policy, "label": group[0]["label"],
                    "seeds": len(group), "hit_rate": mean("hit_rate"), "ideal_hit_rate": mean("ideal_hit_rate"),
                    "recompute_vs_stock": mean("recompute_vs_stock"),
                    "resume_p50_s": mean("resume_p50_s"), "resume_p99_s": mean("resume_p99_s"),
                    "resume_p99_vs_stock": mean("resume_p99_vs_stock"), "idle_kv_token_s": mean("idle_kv_token_s"),
                    "bytes_moved": mean("bytes_d2h") + mean("bytes_h2d"), "refused": sum(r["refused"] for r in group),
                    "leaked_tokens": max((r["leaked_tokens"] or 0) for r in group),
                    "integrity_ok": all(r["integrity_ok"] for r in group)})
    return out


def _environment() -> dict:
    from importlib import metadata

    versions = {}
    for name in ("sglang", "torch", "sgl-agentcache", "msgspec"):
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
    body = {k: v for k, v in report.items() if k != "runs"} | {"command": command}
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    return [path, *plot_all(report, out_dir)]
