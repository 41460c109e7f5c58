"""The admission study: program-aware admission on the real sessions (issue #40 item 2).

The same sample, groups, pool and statistics as the real-session study (``sim/sessions.py``: 38 Claude
Code sessions replayed in groups of five sharing a tight device pool; intervals over sessions, paired,
with a group bootstrap), at one host size, with the admission order as a second axis beside the cache
policy. Every system (:data:`SYSTEMS`) is a cache policy of ``sim/policies.py`` and an admission
strategy of ``policy/admission_order.py``:

- ``stock``: SGLang's LRU, no host tier, FCFS;
- ``hicache-fcfs``, ``hicache-lpm``: LRU write-back, FCFS / longest-prefix-first (SGLang's two
  orders; ``hicache-lpm`` is the baseline the targets name);
- ``continuum``: Continuum's TTL pin over write-back with its program-level FCFS (both halves of the
  paper's mechanism);
- ``autellix-plas``, ``autellix-atlas``: Autellix's program-level least-attained-service orders over
  write-back (its scheduler; it has no cache policy of its own);
- ``agentcache-fcfs``, ``agentcache-lpm``: ours under SGLang's two orders (what our admission order
  adds is ``agentcache`` against them);
- ``agentcache-agent-lpm``: ours with our admission classes, ``lpm``'s order within each;
- ``agentcache``: ours, with our admission order (``agent``: program FCFS within each class).

Per session: recomputed tokens, resume TTFT p50/p99, own-wait total, JCT, and the first call's TTFT (a
new session's wait: the fairness cost of favouring returning turns).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import NamedTuple

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.sessions import DUPLICATES, METRICS, SESSION_FILES, analyse, group_trace, groups, session_rows
from sgl_agentcache.sim.suite import REPLAY_VOCAB, _environment, pool_for, scaled_profile


class System(NamedTuple):
    policy: str  # a cache policy of sim/policies.py
    admission: str  # a strategy of policy/admission_order.py


SYSTEMS = {"stock": System("stock", "fcfs"),
           "hicache-fcfs": System("hicache", "fcfs"),
           "hicache-lpm": System("hicache", "lpm"),
           "continuum": System("continuum", "program-fcfs"),
           "autellix-plas": System("hicache", "plas"),
           "autellix-atlas": System("hicache", "atlas"),
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
    rows: list[dict] = []
    if config.workers <= 1:  # in this process (a forked worker of a process running threads can hang)
        for i, files in enumerate(dealt):
            rows += run_group(config, profile, i, files)
            if progress is not None:
                progress(f"group {i}: {', '.join(files)}")
    else:
        with ProcessPoolExecutor(max_workers=config.workers) as pool:
            futures = [(i, pool.submit(run_group, config, profile, i, files)) for i, files in enumerate(dealt)]
            for i, future in futures:
                rows += future.result()
                if progress is not None:
                    progress(f"group {i}: {', '.join(dealt[i])}")
    return {"config": asdict(config), "systems": {n: SYSTEMS[n]._asdict() for n in config.systems},
            "profile": profile.to_dict(), "groups": [list(g) for g in dealt], "duplicates": DUPLICATES,
            "rows": rows, "comparisons": analyse(rows, OURS, METRICS_ADMISSION),
            "wall_s": time.perf_counter() - started, "environment": _environment()}


__all__ = ["METRICS_ADMISSION", "OURS", "REFERENCES", "SYSTEMS", "AdmissionStudyConfig", "System", "run_group",
           "run_study"]
