"""Where zero-config inference loses to explicit hints, on the real Claude Code sessions (issue #37
item 1).

Same sample, groups, pool and host sizes as the real-session study (:mod:`sgl_agentcache.sim.sessions`).
Each group runs ours with the trace's explicit hints and five inferred variants, one decision at a time
(:data:`STEPS`, each adds one thing to the one before):

1. ``agentcache-inferred-v1`` -- inference as it first shipped: an idle close frees the branch, an
   edited prompt is a fork of the old branch, a fixed 300 s idle time;
2. ``agentcache-inferred-no-edits`` -- an idle close keeps the KV as untagged cache;
3. ``agentcache-inferred-fixed-bounds`` -- and a divergence from an idle branch is its edit (the old
   suffix freed);
4. ``agentcache-inferred`` -- and the idle and tool-wait bounds learned per namespace from the gaps
   seen (:mod:`sgl_agentcache.policy.gap_bounds`), and a lead resuming from its tool closing its
   finished forks (subagent completion);
5. ``agentcache-inferred+closes`` -- and the trace's own closes of subagents (what an explicit hint
   says; not something inference has), to size what subagent closes could still win.

Every variant's per-session recompute is compared with explicit hints (mean of per-session ratios, t
interval over sessions and group bootstrap, as in the session study). The call-level view: each inferred
call carries a flag where its reading departs from the trace's labels (``ReplayResult.inference_flags``:
a return to a branch the idle sweep closed, an edit the trace marks, an edit it does not, a subagent's
first call, a continuation moved to another branch); the extra recompute of each call over the same call
with explicit hints is summed per flag. Calls of one group share a pool, so a call's extra recompute may
be caused by another call's decision (an edit read as a fork holds memory that evicts a neighbour): the
flags attribute where the cost lands, the steps what causes it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.sessions import (DUPLICATES, SessionStudyConfig, analyse, collect_rows, group_results, groups,
                                         session_rows)
from sgl_agentcache.sim.suite import environment

EXPLICIT = "agentcache"
STEPS = ("agentcache-inferred-v1", "agentcache-inferred-no-edits", "agentcache-inferred-fixed-bounds",
         "agentcache-inferred", "agentcache-inferred+closes")
#: Call flags, in report order ("" = the reading agrees with the trace's labels).
FLAGS = ("return_after_close", "trace_edit", "edit_not_in_trace", "subagent_start", "branch_change", "")


@dataclass(frozen=True)
class AttributionConfig:
    sessions: SessionStudyConfig = replace(SessionStudyConfig(), policies=(EXPLICIT, *STEPS))


def run_group(config: AttributionConfig, profile: Profile, index: int, files: tuple[str, ...]) -> list[dict]:
    """Explicit hints and every step on one group, at each host size: session rows, plus one ``audit``
    row and one ``causes`` row per (step, host)."""
    rows = []
    for trace, host_ratio, results in group_results(config.sessions, profile, files, with_stock=False):
        for result in results.values():
            rows += [r | {"kind": "session"} for r in session_rows(result, trace, index, host_ratio)]
        explicit = results[EXPLICIT].calls
        for policy in STEPS:
            result = results[policy]
            extra, calls = Counter(), Counter()
            for request in trace.requests:
                flag = result.inference_flags.get(request.id, "")
                mine, theirs = result.calls.get(request.id), explicit.get(request.id)
                if mine is None or theirs is None:
                    continue
                extra[flag] += theirs.cached_tokens - mine.cached_tokens  # recompute over explicit
                calls[flag] += 1
            rows.append({"kind": "audit", "group": index, "policy": policy, "host_ratio": host_ratio,
                         **result.inference["audit"], "idle_closes": result.inference["idle_closes"],
                         "tool_bound_closes": result.inference["tool_bound_closes"],
                         "subagent_closes": result.inference["subagent_closes"],
                         "kept_on_close_tokens": result.inference["kept_on_close_tokens"]})
            rows.append({"kind": "causes", "group": index, "policy": policy, "host_ratio": host_ratio,
                         "explicit_recomputed": sum(r.input_tokens - explicit[r.id].cached_tokens
                                                    for r in trace.requests if r.id in explicit),
                         "extra_by_flag": dict(extra), "calls_by_flag": dict(calls)})
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per step and host: the audit counts and the extra recompute per flag, summed over groups (the
    extra also as a share of explicit hints' total recompute)."""
    out: dict = {}
    for row in rows:
        key = f"{row['policy']}@{row['host_ratio']:g}"
        entry = out.setdefault(key, {"policy": row["policy"], "host_ratio": row["host_ratio"], "audit": Counter(),
                                     "extra_by_flag": Counter(), "calls_by_flag": Counter(), "explicit_recomputed": 0})
        if row["kind"] == "audit":
            entry["audit"].update({k: v for k, v in row.items() if k not in ("kind", "group", "policy", "host_ratio")})
        elif row["kind"] == "causes":
            entry["extra_by_flag"].update(row["extra_by_flag"])
            entry["calls_by_flag"].update(row["calls_by_flag"])
            entry["explicit_recomputed"] += row["explicit_recomputed"]
    for entry in out.values():
        total = max(entry["explicit_recomputed"], 1)
        entry["extra_share_by_flag"] = {f: entry["extra_by_flag"].get(f, 0) / total for f in FLAGS}
        entry["extra_share"] = sum(entry["extra_by_flag"].values()) / total
        for name in ("audit", "extra_by_flag", "calls_by_flag"):
            entry[name] = dict(entry[name])
    return out


def run_study(config: AttributionConfig, profile: Profile, progress=None) -> dict:
    started = time.perf_counter()
    study = config.sessions
    dealt = groups(study.files, study.group_size)
    rows = collect_rows(run_group, [(config, profile, i, files) for i, files in enumerate(dealt)],
                        [f"group {i}: {', '.join(files)}" for i, files in enumerate(dealt)], study.workers, progress)
    sessions = [r for r in rows if r["kind"] == "session"]
    comparisons = [{"policy": step} | c for step in STEPS for c in analyse(sessions, step) if c["other"] == EXPLICIT]
    # Each step against the one before: what that one decision changed, session by session.
    step_comparisons = [{"policy": step} | c for before, step in zip(STEPS, STEPS[1:])
                        for c in analyse(sessions, step) if c["other"] == before]
    return {"config": asdict(config), "profile": profile.to_dict(), "groups": [list(g) for g in dealt],
            "duplicates": DUPLICATES, "steps": list(STEPS), "rows": sessions, "comparisons": comparisons,
            "step_comparisons": step_comparisons,
            "summary": summarise([r for r in rows if r["kind"] != "session"]),
            "wall_s": time.perf_counter() - started, "environment": environment()}


__all__ = ["EXPLICIT", "FLAGS", "STEPS", "AttributionConfig", "run_group", "run_study", "summarise"]
