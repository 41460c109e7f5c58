"""The admission study: program-aware admission on the real sessions (issue #40 item 2).

The same sample, groups, pool and statistics as the real-session study (``sim/sessions.py``: 38 Claude
Code sessions replayed in groups of five sharing a tight device pool; intervals over sessions, paired,
with a group bootstrap), at one host size, with the admission order as a second axis beside the cache
policy. Every system (:data:`SYSTEMS`) is a cache policy of ``sim/policies.py`` and an admission
strategy of ``policy/admission_order.py``:

- ``stock``: SGLang's LRU, no host tier, FCFS;
- ``hicache-fcfs``, ``hicache-lpm``: SGLang's own HiCache write-back (``sglang-hicache``), FCFS /
  longest-prefix-first (SGLang's two orders; ``hicache-lpm`` is the baseline the targets name);
- ``continuum``: Continuum's TTL pin over HiCache write-back with its program-level FCFS (both halves of
  the paper's mechanism);
- ``autellix-plas``, ``autellix-atlas``: Autellix's program-level least-attained-service orders over
  HiCache write-back (its scheduler; it has no cache policy of its own);
- ``agentcache-fcfs``, ``agentcache-lpm``: ours under SGLang's two orders (what our admission order
  adds is ``agentcache`` against them);
- ``agentcache-agent-lpm``: ours with our admission classes, ``lpm``'s order within each;
- ``agentcache``: ours, with our admission order (``agent``: program FCFS within each class).

Per session: recomputed tokens, resume TTFT p50/p99, own-wait total, JCT, and the first call's TTFT (a
new session's wait: the fairness cost of favouring returning turns).

The JCT floor (:func:`jct_floor`): no system answers a session's last call before the call arrives, so
a session's JCT under any cache and order is at least its trace's own span (first arrival to last), and
its JCT ratio to a reference is at least ``span / reference JCT``. The floor's median bounds the median
ratio any system can reach from below (a target under it is out of reach on these sessions).

The flood (:func:`run_flood`): two tenants on one pool, generated (seeds are independent samples). A
``calm`` tenant runs agent sessions with subagents (``branch_heavy``); a ``flood`` tenant starts many
short tool sessions quickly (``short_tools`` at a high session rate). Per system and seed: each
tenant's mean session JCT, the calm tenant's slowdown against running alone on the same pool, and each
tenant's first-call TTFT p99 (new sessions' wait).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.sessions import (DUPLICATES, METRICS, SESSION_FILES, analyse, collect_rows, group_trace,
                                         groups, session_rows)
from sgl_agentcache.sim.suite import REPLAY_VOCAB, environment, mean_ci, pool_for, scaled_profile
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.transforms import merge_tenants


class System(NamedTuple):
    policy: str  # a cache policy of sim/policies.py
    admission: str  # a strategy of policy/admission_order.py


SYSTEMS = {"stock": System("stock", "fcfs"),
           "hicache-fcfs": System("sglang-hicache", "fcfs"),
           "hicache-lpm": System("sglang-hicache", "lpm"),
           "continuum": System("continuum", "program-fcfs"),
           "autellix-plas": System("sglang-hicache", "plas"),
           "autellix-atlas": System("sglang-hicache", "atlas"),
           "agentcache-fcfs": System("agentcache", "fcfs"),
           "agentcache-lpm": System("agentcache", "lpm"),
           "agentcache-agent-lpm": System("agentcache", "agent-lpm"),
           "agentcache": System("agentcache", "agent")}
OURS = "agentcache"
#: The systems every figure is reported against (the issue's two references).
REFERENCES = ("stock", "hicache-lpm")
METRICS_ADMISSION = METRICS + ("first_ttft_s",)


@dataclass(frozen=True)
class AdmissionStudyConfig:
    files: tuple[str, ...] = tuple(f for f in SESSION_FILES if f not in DUPLICATES)
    group_size: int = 5
    pressure: str = "tight"
    host_ratio: float = 0.5
    systems: tuple[str, ...] = tuple(SYSTEMS)
    token_scale: int = 64
    profile: str = "seed"
    workers: int = 2


def run_group(config: AdmissionStudyConfig, profile: Profile, index: int, files: tuple[str, ...]) -> list[dict]:
    """Every system on one group's trace (same pool; the same host bytes for all but stock)."""
    trace = group_trace(files, config.token_scale)
    prof = scaled_profile(profile, config.token_scale)
    pool = pool_for(trace, config.pressure)
    rows = []
    for name in config.systems:
        system = SYSTEMS[name]
        host_ratio = 0.0 if system.policy == "stock" else config.host_ratio
        result = replay(trace, system.policy, pool_tokens=pool, host_tokens=int(round(host_ratio * pool)), profile=prof,
                        vocab_size=REPLAY_VOCAB, admission=system.admission, timeline=False)
        for row in session_rows(result, trace, index, host_ratio):
            rows.append(row | {"policy": name, "cache_policy": system.policy, "admission": system.admission,
                               "admission_refusals": result.admission_refusals})
    return rows


def run_study(config: AdmissionStudyConfig, profile: Profile, progress=None) -> dict:
    """Every group (in worker processes); returns the configuration, the rows and the comparisons of
    ours against every other system."""
    started = time.perf_counter()
    dealt = groups(config.files, config.group_size)
    rows = collect_rows(run_group, [(config, profile, i, files) for i, files in enumerate(dealt)],
                        [f"group {i}: {', '.join(files)}" for i, files in enumerate(dealt)], config.workers, progress)
    return {"config": asdict(config), "systems": {n: SYSTEMS[n]._asdict() for n in config.systems},
            "profile": profile.to_dict(), "groups": [list(g) for g in dealt], "duplicates": DUPLICATES,
            "rows": rows, "comparisons": analyse(rows, OURS, METRICS_ADMISSION),
            "jct_floor": {ref: jct_floor(rows, ref) for ref in REFERENCES if ref in config.systems},
            "wall_s": time.perf_counter() - started, "environment": environment()}


def jct_floor(rows: list[dict], reference: str, target: float = 0.7) -> dict:
    """The lowest JCT ratio to ``reference`` any system could reach, session by session: ``span / JCT``
    of the reference's run (a session's JCT is at least its trace's span under any system). Returns the
    sessions counted, the floor's median, mean with its 95% t interval, lowest, and how many sessions
    have a floor under ``target``."""
    floors = sorted(r["span_s"] / r["jct_s"] for r in rows if r["policy"] == reference and r["jct_s"] > 0)
    if not floors:
        raise ValueError(f"no session of {reference!r} with a JCT in the rows")
    mean, lo, hi = mean_ci(floors)
    return {"sessions": len(floors), "median": statistics.median(floors), "mean": mean, "ci95": [lo, hi],
            "lowest": floors[0], "target": target, "below_target": sum(f < target for f in floors)}


@dataclass(frozen=True)
class FloodConfig:
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    calm_sessions: int = 6
    flood_sessions: int = 48
    flood_rate: float = 4.0  # flood sessions started per second
    pressure: str = "tight"
    host_ratio: float = 0.5
    systems: tuple[str, ...] = tuple(SYSTEMS)
    profile: str = "seed"
    workers: int = 2


def flood_traces(config: FloodConfig, seed: int):
    """(both tenants, the calm tenant alone) for one seed."""
    calm = generate("branch_heavy", seed=seed, sessions=config.calm_sessions)
    flood = generate("short_tools", seed=seed + 1000, sessions=config.flood_sessions, session_rate=config.flood_rate)
    return merge_tenants({"calm": calm, "flood": flood}), merge_tenants({"calm": calm})


def _tenant_figures(result, trace, tenant: str) -> dict:
    jcts = [jct for (t, _), (jct, _) in result.sessions.items() if t == tenant]
    first: dict[str, float] = {}
    for request in trace.requests:
        if request.tenant == tenant and request.session not in first and request.id in result.calls:
            first[request.session] = result.calls[request.id].ttft_s
    ttfts = sorted(first.values())
    return {"jct_mean_s": sum(jcts) / max(len(jcts), 1),
            "first_ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else 0.0}


def run_flood_seed(config: FloodConfig, profile: Profile, seed: int) -> list[dict]:
    both, alone = flood_traces(config, seed)
    pool = pool_for(both, config.pressure)
    rows = []
    for name in config.systems:
        system = SYSTEMS[name]
        host = 0 if system.policy == "stock" else int(round(config.host_ratio * pool))
        kw = dict(pool_tokens=pool, host_tokens=host, profile=profile, vocab_size=REPLAY_VOCAB,
                  admission=system.admission, timeline=False)
        shared, solo = replay(both, system.policy, **kw), replay(alone, system.policy, **kw)
        calm, flood = _tenant_figures(shared, both, "calm"), _tenant_figures(shared, both, "flood")
        calm_alone = _tenant_figures(solo, alone, "calm")
        rows.append({"seed": seed, "system": name, "pool_tokens": pool, "host_tokens": host,
                     "calm_jct_s": calm["jct_mean_s"], "calm_alone_jct_s": calm_alone["jct_mean_s"],
                     "calm_slowdown": calm["jct_mean_s"] / max(calm_alone["jct_mean_s"], 1e-9),
                     "flood_jct_s": flood["jct_mean_s"], "calm_first_ttft_p99_s": calm["first_ttft_p99_s"],
                     "flood_first_ttft_p99_s": flood["first_ttft_p99_s"],
                     "integrity_ok": shared.integrity_ok and solo.integrity_ok})
    return rows


FLOOD_METRICS = ("calm_slowdown", "calm_jct_s", "flood_jct_s", "calm_first_ttft_p99_s", "flood_first_ttft_p99_s")


def analyse_flood(rows: list[dict], ours: str = OURS) -> dict:
    """Per system, each metric's mean with a t interval over seeds; and ours / every other system,
    seed by seed, with its interval (a verdict only where it excludes 1)."""
    by = {(r["system"], r["seed"]): r for r in rows}
    systems, seeds = sorted({r["system"] for r in rows}), sorted({r["seed"] for r in rows})
    levels = {name: {m: list(mean_ci([by[(name, s)][m] for s in seeds])) for m in FLOOD_METRICS} for name in systems}
    ratios = {}
    for other in systems:
        if other == ours:
            continue
        ratios[other] = {}
        for m in FLOOD_METRICS:
            values = [by[(ours, s)][m] / by[(other, s)][m] for s in seeds if by[(other, s)][m] > 0]
            if not values:
                continue
            mean, lo, hi = mean_ci(values)
            verdict = "better" if hi < 1.0 else "worse" if lo > 1.0 else "tie"
            ratios[other][m] = {"ratio": mean, "ci95": [lo, hi], "verdict": verdict, "seeds": len(values)}
    return {"levels": levels, "ours_vs": ratios}


def run_flood(config: FloodConfig, profile: Profile, progress=None) -> dict:
    rows = collect_rows(run_flood_seed, [(config, profile, seed) for seed in config.seeds],
                        [f"flood seed {seed}" for seed in config.seeds], config.workers, progress)
    return {"config": asdict(config), "rows": rows, **analyse_flood(rows)}


__all__ = ["FLOOD_METRICS", "METRICS_ADMISSION", "OURS", "REFERENCES", "SYSTEMS", "AdmissionStudyConfig", "FloodConfig",
           "System", "analyse_flood", "flood_traces", "jct_floor", "run_flood", "run_flood_seed", "run_group",
           "run_study"]
