"""The real-session study: ours against write-back on every committed Claude Code session, with 95%
intervals over sessions (issue #39 item 2).

The sample: the 39 kv-cache-tester traces in ``bench/traces/kv-cache-tester/`` (Apache-2.0; ten with
subagents). Two of them, ``trace_0397`` and ``trace_0410``, hold the same requests under another id: one
session, counted once (:data:`DUPLICATES`), so the study has 38 independent sessions. Start offsets of
the same sessions are not independent samples, so the unit here is the session.

Contention. A session alone in a pool that fits its longest call barely evicts; what a cache policy
decides matters when sessions share the pool. So the sessions are replayed in fixed groups of
:data:`GROUP_SIZE` (dealt round-robin in file order, a group's sessions started :data:`STAGGER_S`
apart), every system on the same group trace with the same device pool (``tight``: 0.3x of the group's
working set, at least 1.3x its longest call) and the same host bytes (0.25x, 0.5x and 1x of the pool;
stock SGLang has none). Each session's figures are read from its own calls in its group's run
(``ReplayResult.calls``, ``ReplayResult.sessions``): recomputed tokens, the TTFT of its resumed calls
(from their trace arrival: p50, p99), the total of its calls' own waits and its JCT.

Statistics: per session, the ratio ours / other; the mean ratio with a Student-t 95% interval over the
sessions (paired: both systems ran the same session in the same group). Sessions of one group share a
pool, so they are not fully independent of each other: :func:`analyse` also reports the interval of a
bootstrap that resamples whole groups, and a verdict claims "better" or "worse" only when both exclude 1.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.suite import REPLAY_VOCAB, environment, mean_ci, pool_for, scaled_profile

#: Every committed kv-cache-tester trace (``bench/traces/kv-cache-tester/``), in file order.
SESSION_FILES = (
    "trace_0003", "trace_0004", "trace_0010", "trace_0014", "trace_0017", "trace_0019", "trace_0020", "trace_0021",
    "trace_0023", "trace_0024", "trace_0046", "trace_0051", "trace_0062", "trace_0063", "trace_0070", "trace_0074",
    "trace_0090", "trace_0094", "trace_0097", "trace_0149", "trace_0209", "trace_0233", "trace_0256", "trace_0267",
    "trace_0279", "trace_0295", "trace_0311", "trace_0339", "trace_0363", "trace_0392", "trace_0397", "trace_0410",
    "trace_0477", "trace_0508", "trace_0520", "trace_0547", "trace_0588", "trace_0701", "trace_0706")
#: Files that repeat another's session (same requests, another id): left out of the sample.
DUPLICATES = {"trace_0410": "trace_0397"}
GROUP_SIZE = 5
STAGGER_S = 60.0
TOKEN_SCALE = 64
OURS = "agentcache"
#: Per-session figures compared (lower is better for each).
METRICS = ("recomputed_tokens", "resume_ttft_p50_s", "resume_ttft_p99_s", "own_wait_total_s", "jct_s")
BOOTSTRAP_DRAWS = 2000
#: Six small sessions, in groups of three: every session benchmark's ``--quick`` smoke sample.
QUICK_FILES = ("trace_0019", "trace_0021", "trace_0074", "trace_0094", "trace_0209", "trace_0233")


@dataclass(frozen=True)
class SessionStudyConfig:
    files: tuple[str, ...] = tuple(f for f in SESSION_FILES if f not in DUPLICATES)
    group_size: int = GROUP_SIZE
    pressure: str = "tight"
    hosts: tuple[float, ...] = (0.25, 0.5, 1.0)
    policies: tuple[str, ...] = ("sglang-hicache", "kvflow", OURS, "agentcache-inferred")
    token_scale: int = TOKEN_SCALE
    profile: str = "seed"
    workers: int = 2


def quick_sample(config):
    """``config`` (any study config with ``files`` and ``group_size``) on :data:`QUICK_FILES` only."""
    return replace(config, files=QUICK_FILES, group_size=3)


def bench_arguments(doc: str, argv: list[str] | None, quick_help: str, out: Path) -> argparse.Namespace:
    """The command line every session benchmark takes: ``--quick`` (``quick_help`` says what it
    runs), ``--out`` (default ``out``), ``--workers``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=str(out), help="directory for the JSON")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    return ap.parse_args(argv)


def groups(files: tuple[str, ...], size: int) -> list[tuple[str, ...]]:
    """The files dealt round-robin into ``ceil(len / size)`` groups (deterministic)."""
    n = max(math.ceil(len(files) / size), 1)
    return [tuple(files[i::n]) for i in range(n)]


def group_trace(files: tuple[str, ...], token_scale: int, root: str | Path | None = None):
    """One group's sessions as one trace, started :data:`STAGGER_S` apart, tokens scaled."""
    from sgl_agentcache.trace.importers import import_weka
    from sgl_agentcache.trace.samples import default_root
    from sgl_agentcache.trace.transforms import scale_tokens

    base = Path(root or default_root()) / "kv-cache-tester"
    trace = import_weka([base / f"{name}.json.gz" for name in files], stagger_s=STAGGER_S,
                        name="+".join(files))
    return scale_tokens(trace, token_scale)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def session_rows(result, trace, group: int, host_ratio: float) -> list[dict]:
    """Each session's figures in one run (``result`` of ``trace``)."""
    by_session: dict[str, list] = {}
    for request in trace.requests:
        record = result.calls.get(request.id)
        if record is not None:
            by_session.setdefault(request.session, []).append((request, record))
    rows = []
    for (tenant, session), (jct, span) in sorted(result.sessions.items()):
        calls = by_session.get(session, [])
        resumed = [record.ttft_s for _, record in calls if record.resumed]
        rows.append({"session": session, "group": group, "policy": result.policy, "host_ratio": host_ratio,
                     "pool_tokens": result.pool_tokens, "host_tokens": result.host_tokens, "calls": len(calls),
                     "input_tokens": sum(r.input_tokens for r, _ in calls),
                     "recomputed_tokens": sum(r.input_tokens - rec.cached_tokens for r, rec in calls),
                     "resume_ttft_p50_s": _quantile(resumed, 0.5), "resume_ttft_p99_s": _quantile(resumed, 0.99),
                     "own_wait_total_s": sum(rec.own_wait_s for _, rec in calls), "jct_s": jct, "span_s": span,
                     # The session's first call, as a new session's: what admission that favours
                     # returning turns may cost it.
                     "first_ttft_s": calls[0][1].ttft_s if calls else 0.0,
                     "integrity_ok": result.integrity_ok, "leaked_tokens": result.leaked_tokens})
    return rows


def group_results(config: SessionStudyConfig, profile: Profile, files: tuple[str, ...], *, with_stock: bool = True):
    """One group's replays, host size by host size: yields ``(trace, host_ratio, {policy: result})``,
    first stock alone without a host tier (``with_stock``), then every policy of ``config`` at each
    host size (same pool, same host bytes for all of them)."""
    trace = group_trace(files, config.token_scale)
    prof = scaled_profile(profile, config.token_scale)
    pool = pool_for(trace, config.pressure)

    def run(policy: str, host: int):
        return replay(trace, policy, pool_tokens=pool, host_tokens=host, profile=prof, vocab_size=REPLAY_VOCAB)

    if with_stock:
        yield trace, 0.0, {"stock": run("stock", 0)}
    for host_ratio in config.hosts:
        host = int(round(host_ratio * pool))
        yield trace, host_ratio, {policy: run(policy, host) for policy in config.policies}


def run_group(config: SessionStudyConfig, profile: Profile, index: int, files: tuple[str, ...]) -> list[dict]:
    """Every system on one group: stock without a host tier, the others at each host size."""
    rows = []
    for trace, host_ratio, results in group_results(config, profile, files):
        for result in results.values():
            rows += session_rows(result, trace, index, host_ratio)
    return rows


def _ratio(a: float, b: float) -> float | None:
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def _bootstrap(ratios_by_group: dict[int, list[float]], draws: int, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean ratio, resampling whole groups (with replacement)."""
    rng = random.Random(seed)
    keys = sorted(ratios_by_group)
    means = []
    for _ in range(draws):
        picked = [x for _ in keys for x in ratios_by_group[rng.choice(keys)]]
        means.append(statistics.fmean(picked))
    means.sort()
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def analyse(rows: list[dict], ours: str = OURS, metrics: tuple[str, ...] = METRICS) -> list[dict]:
    """Ours against every other system (stock: without a host tier) per host size and metric: the mean
    of the per-session ratios with its t interval over sessions and its group-bootstrap interval, and
    the ratio of the totals over the same sessions."""
    index = {(r["policy"], r["host_ratio"], r["session"]): r for r in rows}
    out = []
    hosts = sorted({r["host_ratio"] for r in rows if r["host_ratio"] > 0})
    sessions = sorted({r["session"] for r in rows})
    for host in hosts:
        for other in sorted({r["policy"] for r in rows} - {ours}):
            other_host = 0.0 if other == "stock" else host
            for metric in metrics:
                pairs = []  # (group, mine, theirs) per session both ran
                for session in sessions:
                    mine, theirs = index.get((ours, host, session)), index.get((other, other_host, session))
                    if mine is not None and theirs is not None:
                        pairs.append((mine["group"], mine[metric], theirs[metric]))
                ratios = [(g, _ratio(a, b)) for g, a, b in pairs]
                ratios = [(g, r) for g, r in ratios if r is not None]
                if len(ratios) < 2:
                    continue
                mean, lo, hi = mean_ci([r for _, r in ratios])
                by_group: dict[int, list[float]] = {}
                for group, r in ratios:
                    by_group.setdefault(group, []).append(r)
                blo, bhi = _bootstrap(by_group, BOOTSTRAP_DRAWS)
                verdict = "better" if max(hi, bhi) < 1.0 else "worse" if min(lo, blo) > 1.0 else "tie"
                out.append({"host_ratio": host, "other": other, "metric": metric, "sessions": len(ratios),
                            "ratio": mean, "ci95": [lo, hi], "ci95_group_bootstrap": [blo, bhi], "verdict": verdict,
                            "total_ratio": _ratio(sum(a for _, a, _ in pairs), sum(b for _, _, b in pairs))})
    return out


def collect_rows(fn, jobs: list[tuple], labels: list[str], workers: int, progress=None) -> list[dict]:
    """``fn(*job)``'s rows for every job, concatenated in job order: in this process with
    ``workers <= 1`` (a forked worker of a process running threads can hang), else in that many worker
    processes. ``progress(label)`` after each job's rows are in."""
    rows: list[dict] = []
    if workers <= 1:
        for job, label in zip(jobs, labels):
            rows += fn(*job)
            if progress is not None:
                progress(label)
        return rows
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        for future, label in zip(futures, labels):
            rows += future.result()
            if progress is not None:
                progress(label)
    return rows


def run_study(config: SessionStudyConfig, profile: Profile, progress=None) -> dict:
    """Run every group (in worker processes); returns ``{"config", "rows", "comparisons", ...}``."""
    import time

    started = time.perf_counter()
    dealt = groups(config.files, config.group_size)
    rows = collect_rows(run_group, [(config, profile, i, files) for i, files in enumerate(dealt)],
                        [f"group {i}: {', '.join(files)}" for i, files in enumerate(dealt)], config.workers, progress)
    return {"config": asdict(config), "profile": profile.to_dict(), "groups": [list(g) for g in dealt],
            "duplicates": DUPLICATES, "rows": rows, "comparisons": analyse(rows),
            "wall_s": time.perf_counter() - started, "environment": environment()}


__all__ = ["DUPLICATES", "GROUP_SIZE", "METRICS", "QUICK_FILES", "SESSION_FILES", "SessionStudyConfig", "analyse",
           "bench_arguments", "collect_rows", "group_results", "group_trace", "groups", "quick_sample", "run_group",
           "run_study", "session_rows"]
