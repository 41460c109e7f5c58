"""The results blocks of README.md (a short summary) and bench/README.md (every table), generated from
the committed JSON under ``bench/results/``.

``python bench/readme_results.py`` prints both; ``--write`` replaces the block between the
``<!-- results:begin -->`` / ``<!-- results:end -->`` markers in each file; ``--check`` exits 1 when a
file's block differs from what the JSON says (``tests/test_readme_results.py`` runs it), so a quoted
figure can never drift from its committed measurement.

The prose is checked too: every ratio (``0.93x``) and interval (``[0.92, 0.94]``) written outside
the generated blocks must be a figure some generated block shows (:func:`stale_prose_figures`), unless
it stands in a ``<!-- history -->`` ... ``<!-- /history -->`` region: figures as an earlier release
measured them, or of an experiment not kept, which the text around them must say.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SHOWN = ("stock", "session-radix", "sglang-hicache", "infercept", "continuum", "kvflow", "agentcache",
         "agentcache-own-tier", "agentcache-inferred", "clairvoyant")
OURS = "agentcache"
INFERRED = "agentcache-inferred"  # ours too (no client hints): never anyone's "best other system"
OWN_TIER = "agentcache-own-tier"  # ours too (on our retiring host tier): never anyone's "best other system"
#: SGLang's own HiCache (write-back), the write-back reference of every comparison.
SGLANG_HICACHE = "sglang-hicache"


def _cell(s: dict | None) -> str:
    if s is None:
        return "-"
    lo, hi = s["recompute_ci95"]
    return f"{s['recompute_vs_stock']:.2f}" + (f" ±{(hi - lo) / 2:.2f}" if hi == hi else "")


def _verdict(c: dict | None) -> str:
    """A seed-by-seed comparison: mean ratio, 95% CI and verdict ("-" when there is none)."""
    return "-" if c is None else f"{c['ratio']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}] {c['verdict']}"


def _verdict_table(title: str, columns: list[str], workloads, cell) -> list[str]:
    """A table of seed-by-seed comparisons: a row per workload, ``cell(workload, column index)`` gives
    each comparison (None: "-")."""
    out = [f"{title} | " + " | ".join(columns), "---|" + "|".join("---:" for _ in columns)]
    out += [f"{w} | " + " | ".join(_verdict(cell(w, i)) for i in range(len(columns))) for w in workloads]
    return out + [""]


def _grid(body: dict, pressure: str, host: float) -> list[str]:
    cfg = body["config"]
    workloads = list(cfg["workloads"])
    rows = {(s["policy"], s["workload"]): s for s in body["summary"]
            if s["pressure"] == pressure and (s["host_ratio"] == host or s["policy"] == "stock")}
    out = [f"**{pressure} pool, host tier {host:g}x pool** | " + " | ".join(workloads),
           "---|" + "|".join("---:" for _ in workloads)]
    for policy in SHOWN:
        if not any((policy, w) in rows and (policy == "stock" or rows[(policy, w)]["host_ratio"] == host)
                   for w in workloads):
            continue
        out.append(f"{policy} | " + " | ".join(_cell(rows.get((policy, w))) for w in workloads))
    bounds = {s["workload"]: s for s in body["summary"]
              if s["pressure"] == pressure and s["host_ratio"] == host and s["policy"] == OURS}
    out.append("LP lower bound | " + " | ".join(f"{bounds[w]['lower_bound_vs_stock']:.2f}" if w in bounds else "-"
                                                for w in workloads))
    out.append("stock, infinite pool (hit rate; not a bound) | " + " | ".join(
        f"({rows[('stock', w)]['ideal_hit_rate']:.2f})" if ('stock', w) in rows else "-" for w in workloads))
    return out + [""]


def _verdicts(body: dict, pressure: str, host: float) -> list[str]:
    """Ours against the best other non-clairvoyant system of each workload, pass by pass."""
    cmp = [c for c in body["comparisons"] if c["pressure"] == pressure and c["host_ratio"] == host
           and c["other"] not in ("clairvoyant", INFERRED, OWN_TIER)]
    summary = {(s["workload"], s["policy"]): s["recompute_vs_stock"] for s in body["summary"]
               if s["pressure"] == pressure and s["host_ratio"] in (host, 0.0)}
    out = []
    for w in body["config"]["workloads"]:
        mine = [c for c in cmp if c["workload"] == w]
        if not mine:
            continue
        best = min(mine, key=lambda c: summary.get((w, c["other"]), 9.0))
        lo, hi = best["ci95"]
        relation = "tie with" if best["verdict"] == "tie" else f"{best['verdict']} than"
        out.append(f"`{w}` {relation} `{best['other']}` ({best['ratio']:.2f}x, 95% CI "
                   f"[{lo:.2f}, {hi:.2f}])")
    return out


def _sweep(body: dict) -> list[str]:
    cfg = body["config"]
    pressure = cfg["sweep_pressure"]
    hosts = sorted({c["host_ratio"] for c in body["comparisons"] if c["pressure"] == pressure and c["host_ratio"] > 0})
    cells = {(c["workload"], c["host_ratio"]): c for c in body["comparisons"]
             if c["pressure"] == pressure and c["other"] == SGLANG_HICACHE}
    return _verdict_table(f"**ours / {SGLANG_HICACHE}, {pressure} pool**", [f"host {h:g}x" for h in hosts],
                          cfg["workloads"], lambda w, i: cells.get((w, hosts[i])))


def _own_tier(body: dict) -> list[str]:
    """Ours on SGLang's HiCache against ours on the host tier the package carried before, seed by seed at
    every host level of the sweep pressure and at host 1x of the other pressures (issue #36 item 3: that
    tier goes once the HiCache path matches or beats it)."""
    cfg = body["config"]
    sweep = cfg["sweep_pressure"]
    mine = [c for c in body["comparisons"] if c["other"] == OWN_TIER]
    columns = sorted({(sweep, c["host_ratio"]) for c in mine if c["pressure"] == sweep and c["host_ratio"] > 0},
                     key=lambda col: col[1])
    columns += sorted({(c["pressure"], 1.0) for c in mine if c["pressure"] != sweep and c["host_ratio"] == 1.0})
    if not columns:
        return []
    cells = {(c["workload"], c["pressure"], c["host_ratio"]): c for c in mine}
    return (["Ours (on SGLang's HiCache) against ours on the host tier being retired (`agentcache-own-tier`: "
             "our own host store, exclusive, its own transfer threads), same device pool and host bytes; "
             "recomputed tokens, seed by seed:", ""]
            + _verdict_table("**ours / ours on our own host tier**", [f"{p} pool, host {h:g}x" for p, h in columns],
                             cfg["workloads"], lambda w, i: cells.get((w, *columns[i]))))


def _replay(body: dict) -> list[str]:
    cfg = body["config"]
    real = [w for w in cfg["workloads"] if w.startswith("real_")]
    out = [f"Replay suite (`make bench`; generated workloads {len(cfg['seeds'])} seeds each, real traces "
           f"({', '.join(real)}) {len(cfg['real_seeds'])} session-offset seeds each, profile `{cfg['profile']}`): "
           "recomputed prefill tokens as a ratio to stock SGLang *without* a host tier in the same run, mean "
           "± 95% CI half-width over seeds (lower is better). Every system in a table has the same device pool "
           "and the same host tier (stock and session-radix have none); the LP lower bound is a provable floor "
           "for that capacity (`sim/bound.py`).", ""]
    for pressure, host in ((cfg["sweep_pressure"], 1.0), (cfg["sweep_pressure"], 0.0)) + tuple(
            (p, 1.0) for p in cfg["pressures"] if p != cfg["sweep_pressure"]):
        if any(s["pressure"] == pressure and s["host_ratio"] == host for s in body["summary"]):
            out += _grid(body, pressure, host)
    verdicts = _verdicts(body, cfg["sweep_pressure"], 1.0)
    if verdicts:
        out += [f"Ours against the best other system (not clairvoyant) per workload, {cfg['sweep_pressure']} pool, "
                "host tier 1x, seed by seed: " + "; ".join(verdicts) + ".", ""]
    out += _sweep(body)
    out += _own_tier(body)
    out += _latency(body)
    out += _inferred(body)
    out += _decisions(body, cfg["sweep_pressure"], 1.0)
    return out


_LATENCY_COLUMNS = (("resume_p50_s", "resume p50"), ("resume_p99_s", "resume p99"),
                    ("resume_own_wait_p99_s", "resume own wait p99"), ("own_wait_total_s", "own waits, total"),
                    ("session_jct_mean_s", "session JCT, mean"))


def _latency(body: dict) -> list[str]:
    """Ours / HiCache write-back on latency, seed by seed, at the sweep pressure and host tier 1x: a
    resumed call's latency counts from its trace arrival (lag its branch's earlier calls left included);
    its own wait counts from when the server received it (what its own admission cost)."""
    cfg = body["config"]
    pressure = cfg["sweep_pressure"]
    cells = {(c["metric"], c["workload"]): c for c in body.get("latency_comparisons", ())
             if c["pressure"] == pressure and c["host_ratio"] == 1.0 and c["other"] == SGLANG_HICACHE}
    if not cells:
        return []
    refused = {(s["workload"], s["policy"]): s["admission_refusals"] for s in body["summary"]
               if s["pressure"] == pressure and s["host_ratio"] == 1.0 and s["policy"] in (OURS, SGLANG_HICACHE)}
    out = _verdict_table(f"**ours / {SGLANG_HICACHE}, latency, {pressure} pool, host 1x** (modelled times)",
                         [label for _, label in _LATENCY_COLUMNS], cfg["workloads"],
                         lambda w, i: cells.get((_LATENCY_COLUMNS[i][0], w)))
    counts = "; ".join(f"{w} {refused.get((w, OURS), 0)} / {refused.get((w, SGLANG_HICACHE), 0)}"
                       for w in cfg["workloads"])
    return out + [f"Admission attempts refused for room, all seeds (ours / {SGLANG_HICACHE}): {counts}.", ""]


def _inferred(body: dict) -> list[str]:
    """Ours with no client hints (the lifecycle inferred from the calls) against ours with the trace's
    explicit hints, stock and HiCache, seed by seed, at the sweep pressure and host tier 1x."""
    cfg = body["config"]
    pressure = cfg["sweep_pressure"]
    cells = {(c["other"], c["workload"]): c for c in body.get("comparisons_inferred", ())
             if c["pressure"] == pressure and c["host_ratio"] in (1.0, 0.0)
             and (c["host_ratio"] == 1.0 or c["other"] == "stock")}
    if not cells:
        return []
    others = (OURS, SGLANG_HICACHE, "stock")
    return _verdict_table(f"**ours, inferred (no client hints) / other, {pressure} pool, host 1x**",
                          [f"/ {o}" for o in others], cfg["workloads"], lambda w, i: cells.get((others[i], w)))


def _decisions(body: dict, pressure: str, host: float) -> list[str]:
    """Ours' pause decisions per kind (summed over seeds): the policy must show a mix."""
    kinds = ("keep", "offload", "discard", "release", "too_small")
    rows = [s for s in body["summary"] if s["policy"] == OURS and s["pressure"] == pressure and s["host_ratio"] == host]
    if not rows:
        return []
    out = [f"**ours' pause decisions, {pressure} pool, host {host:g}x** (all seeds) | " + " | ".join(kinds),
           "---|" + "|".join("---:" for _ in kinds)]
    out += [f"{s['workload']} | " + " | ".join(str(s["decisions"].get(k, 0)) for k in kinds) for s in rows]
    return out + [""]


_SESSION_COLUMNS = (("recomputed_tokens", "recomputed tokens"), ("resume_ttft_p50_s", "resume TTFT p50"),
                    ("resume_ttft_p99_s", "resume TTFT p99"), ("own_wait_total_s", "own waits"), ("jct_s", "JCT"))


def _session_cell(c: dict | None) -> str:
    if c is None:
        return "-"
    lo, hi = c["ci95"]
    return f"{c['ratio']:.2f} [{lo:.2f}, {hi:.2f}] {c['verdict']}"


def _sessions(body: dict) -> list[str]:
    """The real-session study: per-session paired ratios with intervals over sessions."""
    cfg = body["config"]
    n = len({r["session"] for r in body["rows"]})
    out = [f"Real sessions (`bench/real_sessions.py`; {n} Claude Code sessions of the kv-cache-tester corpus, "
           f"one of two identical files left out, in {len(body['groups'])} groups of up to {cfg['group_size']} "
           f"sharing a {cfg['pressure']} pool, tokens scaled 1/{cfg['token_scale']}, "
           f"profile `{body['profile']['name']}`; "
           "every system of a row has the same device pool and host bytes): the mean of per-session ratios "
           "with a 95% t interval over sessions; a verdict needs that interval and a bootstrap over whole "
           "groups to exclude 1. Resume TTFT counts from the call's trace arrival (modelled times).", ""]
    for title, comparisons, others in (("ours", body["comparisons"], (SGLANG_HICACHE, "kvflow", OWN_TIER, "stock")),
                                       ("ours, inferred (no client hints)", body.get("comparisons_inferred", ()),
                                        (SGLANG_HICACHE, OURS))):
        if not comparisons:
            continue
        cells = {(c["other"], c["host_ratio"], c["metric"]): c for c in comparisons}
        columns = [label for _, label in _SESSION_COLUMNS]
        out += [f"**{title} / other, per session** | " + " | ".join(columns),
                "---|" + "|".join("---:" for _ in columns)]
        for other in others:
            for host in sorted({c["host_ratio"] for c in comparisons}):
                if (other, host, "recomputed_tokens") not in cells:
                    continue
                where = (f"stock, no host tier (ours at host {host:g}x)" if other == "stock"
                         else f"{other}, host {host:g}x")
                out.append(f"/ {where} | " + " | ".join(_session_cell(cells.get((other, host, m)))
                                                         for m, _ in _SESSION_COLUMNS))
        out.append("")
    return out + _session_spread(body)


def _session_spread(body: dict, policy: str = OURS, other: str = SGLANG_HICACHE) -> list[str]:
    """Per session, ours / write-back recomputed tokens at each host size: the spread behind the mean
    (the six best and six worst sessions)."""
    rows = {(r["session"], r["policy"], r["host_ratio"]): r["recomputed_tokens"] for r in body["rows"]}
    out = []
    for host in sorted({h for _, p, h in rows if p == policy}):
        ratios = sorted((rows[(s, policy, host)] / max(rows[(s, other, host)], 1), s) for s, p, h in rows
                        if p == policy and h == host and (s, other, host) in rows)
        if not ratios:
            continue
        show = lambda part: ", ".join(f"{s} {r:.2f}x" for r, s in part)  # noqa: E731
        out.append(f"- ours / {other} per session at host {host:g}x: best {show(ratios[:6])}; worst "
                   f"{show(ratios[:-7:-1])}; {sum(r > 1.05 for r, _ in ratios)} of {len(ratios)} sessions "
                   "more than 5% worse, " + f"{sum(r < 0.95 for r, _ in ratios)} more than 5% better.")
    return out + [""]


#: The attribution study's steps, as the table names them.
_STEP_LABELS = {"agentcache-inferred-v1": "as first shipped (idle close frees, edit = fork)",
                "agentcache-inferred-no-edits": "+ idle close keeps the KV cached",
                "agentcache-inferred-fixed-bounds": "+ edits inferred",
                "agentcache-inferred": "+ learned bounds, subagent closes (shipped)",
                "agentcache-inferred+closes": "+ the trace's subagent closes (explicit only)"}
_FLAG_LABELS = {"return_after_close": "back after an idle close", "trace_edit": "edit (trace-labelled)",
                "edit_not_in_trace": "edit inferred, not in trace", "subagent_start": "subagent's first call",
                "branch_change": "continuation moved", "": "reading agrees with the trace"}


def _attribution(body: dict) -> list[str]:
    """Inference, one decision at a time, against explicit hints on the real sessions; and where the
    extra recompute lands."""
    n = len({r["session"] for r in body["rows"]})
    cells = {(c["policy"], c["host_ratio"], c["metric"]): c for c in body["comparisons"]}
    hosts = sorted({c["host_ratio"] for c in body["comparisons"]})
    out = [f"Zero-config inference against explicit hints (`bench/inference_attribution.py`; the same {n} sessions, "
           "groups, pools and host bytes as above): each row adds one inference decision to the row before; "
           "recomputed tokens and resume TTFT p99 as the mean of per-session ratios to ours with the trace's "
           "explicit hints, 95% t interval over sessions (verdict: it and a group bootstrap exclude 1).", "",
           "**inferred / explicit hints** | " + " | ".join(f"recompute, host {h:g}x | resume p99, host {h:g}x"
                                                           for h in hosts),
           "---|" + "|".join("---:|---:" for _ in hosts)]
    for step in body["steps"]:
        out.append(f"{_STEP_LABELS.get(step, step)} | " + " | ".join(
            f"{_session_cell(cells.get((step, h, 'recomputed_tokens')))} | "
            f"{_session_cell(cells.get((step, h, 'resume_ttft_p99_s')))}" for h in hosts))
    steps = {(c["policy"], c["host_ratio"]): c for c in body.get("step_comparisons", ())
             if c["metric"] == "recomputed_tokens"}
    for step in body["steps"][1:]:
        got = [f"host {h:g}x {_session_cell(steps.get((step, h)))}" for h in hosts if (step, h) in steps]
        if got:
            out.append(f"- {_STEP_LABELS.get(step, step)}, recompute / the row before: " + "; ".join(got) + ".")
    out += ["", "Where the extra recompute lands (calls summed over every session, as a share of explicit hints' "
            "total recompute; each call flagged by how the inference read it against the trace's labels):", "",
            "step, host | total | " + " | ".join(_FLAG_LABELS.values()),
            "---|---:|" + "|".join("---:" for _ in _FLAG_LABELS)]
    for key, entry in body["summary"].items():
        shares = entry["extra_share_by_flag"]
        out.append(f"{_STEP_LABELS.get(entry['policy'], entry['policy'])}, {entry['host_ratio']:g}x | "
                   f"{entry['extra_share']:+.1%} | " + " | ".join(f"{shares.get(f, 0.0):+.1%}" for f in _FLAG_LABELS))
    shipped = next((e for e in body["summary"].values()
                    if e["policy"] == "agentcache-inferred" and e["host_ratio"] == 0.5), None)
    if shipped is not None:
        a = shipped["audit"]
        out += ["", f"Readings at host 0.5x, shipped inference, all sessions: {a['calls']} calls; "
                f"{a['trace_edits']} edits in the trace: {a['trace_edits_inferred']} read as edits, "
                f"{a.get('trace_edits_continued', 0)} as the branch going on (the rewrite falls within the prompt's "
                f"last, partial block, which carries no fingerprint), {a['trace_edits_as_forks']} as forks, the "
                f"rest as a new conversation (the rewrite reaches the first user message, which names the "
                f"session); "
                f"{a['edits_not_in_trace']} edits inferred where the trace has none; {a['subagent_starts']} subagents, "
                f"{a['subagents_forked']} linked to their lead (the others open with a system prompt of their own); "
                f"{a['returns_after_close']} calls back on a branch inference had closed; "
                f"{a['branch_changes']} continuations moved to another branch"
                + (f"; {a['subagent_closes']} subagents closed as their lead resumed from its tool, "
                   f"{a['returns_after_subagent_close']} of them wrongly (they sent again); "
                   f"{a['tool_bound_closes']} branches closed past their learned tool bound"
                   if "subagent_closes" in a else "") + "."]
    return out + [""]


def _server(body: dict) -> list[str]:
    cfg = body["config"]
    b = body["backends"]
    out = [f"Real CPU server (`bench/server_recompute.py`; `{cfg['model_shape']}` random-weight model, "
           f"`{cfg['workload']}` trace, {cfg['trace_stats']['requests']} requests, {cfg['pool_tokens']}-token "
           f"pool, host tier {cfg['host_tokens']} tokens for every backend that has one, {cfg['passes']} "
           "passes interleaved across servers running side by side (each round runs every backend once, "
           "the order rotated); the median pass shown):", "",
           "backend | schedule policy | host tokens | prefill tokens computed | failures | JCT (s) | "
           "resume TTFT p50 / p99 (s)",
           "---|---|---:|---:|---:|---:|---:"]
    for name, x in b.items():
        q = x["resume_ttft_s"]
        out.append(f"{name} | {x.get('schedule_policy', 'fcfs')} | {x['host_tokens']} | {x['computed_tokens']} | "
                   f"{x['failures']} | {x['jct_s']:.1f} | {q['p50']:.3f} / {q['p99']:.3f}")
    admit = b.get("agentcache-admit-lpm", {}).get("agentcache", {}).get("stats", {}).get("admission", {})
    if admit.get("passes"):
        out.append(f"(`agentcache-admit-lpm`: `AGENTCACHE_ADMISSION=agent` over `lpm`'s order; its last pass "
                   f"reordered {admit['reordered_passes']} of {admit['passes']} scheduler passes and moved "
                   f"{admit['moved_ahead']} requests ahead.)")
    out.append("")
    for pair, c in body["comparison"].items():
        parts = [f"{k.replace('_', ' ')} {_passwise(v)} {v['verdict']}" for k, v in c.items() if isinstance(v, dict)]
        out.append(f"- {_pair(pair)}, pass by pass (95% CI): " + "; ".join(parts) + ".")
    return out + [""]


#: The server benchmark over independent traces (``--trace-seeds``): intervals over traces. Each run
#: that exists is shown, in this order (the largest sample first).
SERVER_SEEDS = ("server_recompute-seeds10-hicache-wb-lpm+agentcache-lpm+agentcache-agent-lpm+agentcache-hook-lpm.json",
                "server_recompute-seeds5-hicache-wb-lpm+agentcache-lpm+agentcache-admit-lpm.json",
                "server_recompute-seeds5-hicache-wb-lpm+agentcache-lpm+agentcache-agent-lpm.json")
_SERVER_MEASURES = (("computed", "prefill computed"), ("jct", "JCT"), ("resume_ttft_p50", "resume TTFT p50"),
                    ("resume_ttft_p99", "resume TTFT p99"))


def _server_seeds(body: dict) -> list[str]:
    """Each pair's ratio over independent traces: mean, 95% t interval over traces, and each trace's."""
    seeds, cfg = body["seeds"], body["config"]
    calls = [s["requests"] for s in seeds["trace_stats"]]
    out = [f"Real CPU server over {len(seeds['seeds'])} independent traces (`bench/server_recompute.py "
           f"--trace-seeds {len(seeds['seeds'])}`; `{cfg['workload']}` generator seeds {seeds['seeds'][0]}-"
           f"{seeds['seeds'][-1]}, {min(calls)}-{max(calls)} calls each, the same servers, {cfg['pool_tokens']}-token "
           f"pool and {cfg['host_tokens']} host tokens as above, {cfg['passes']} interleaved passes per trace): "
           "per trace, the mean of its pass-by-pass ratios; the interval is over traces, the samples.", "",
           "pair | " + " | ".join(label for _, label in _SERVER_MEASURES),
           "---|" + "|".join("---" for _ in _SERVER_MEASURES)]
    for pair, c in seeds["comparison"].items():
        out.append(f"{pair} | " + " | ".join(
            f"{_passwise(c[m])} {c[m]['verdict']} (per trace {', '.join(f'{v:.2f}' for v in c[m]['per_trace'])})"
            for m, _ in _SERVER_MEASURES))
    return out + [""]


def _server_seeds_summary(body: dict) -> list[str]:
    seeds = body["seeds"]
    parts = [f"{pair}: " + "; ".join(f"{label} {_passwise(c[m])} ({c[m]['verdict']})"
                                     for m, label in _SERVER_MEASURES)
             for pair, c in seeds["comparison"].items()]
    return [f"Real CPU server over {len(seeds['seeds'])} independent traces (interval over traces, all under "
            "`lpm`): " + " | ".join(parts) + ".", ""]


_ADMISSION_COLUMNS = _SESSION_COLUMNS + (("first_ttft_s", "first-call TTFT"),)


def _admission(body: dict) -> list[str]:
    """The admission study: ours (our cache and admission order) against every other system."""
    cfg = body["config"]
    n = len({r["session"] for r in body["rows"]})
    systems = ", ".join(f"`{name}` ({s['policy']} + {s['admission']})" for name, s in body["systems"].items())
    cells = {(c["other"], c["metric"]): c for c in body["comparisons"]}
    columns = [label for _, label in _ADMISSION_COLUMNS]
    out = [f"Admission order on the real sessions (`bench/admission.py`; the same {n} sessions, groups and "
           f"{cfg['pressure']} pool as above, host {cfg['host_ratio']:g}x of the pool for every system but "
           f"stock; systems as cache policy + admission strategy: {systems}). Mean of per-session ratios, "
           "95% t interval over sessions, a verdict only where a group bootstrap agrees:", "",
           "**ours / other, per session** | " + " | ".join(columns), "---|" + "|".join("---:" for _ in columns)]
    for other in body["systems"]:
        if (other, "recomputed_tokens") in cells:
            out.append(f"/ {other} | " + " | ".join(_session_cell(cells.get((other, m)))
                                                     for m, _ in _ADMISSION_COLUMNS))
    return out + [""] + _jct_floor(body) + (_flood(body["flood"]) if "flood" in body else [])


def _jct_floor(body: dict) -> list[str]:
    """How low a JCT ratio any system could reach on these sessions (``sim/admission_study.jct_floor``)."""
    floors = body.get("jct_floor", {})
    if not floors:
        return []
    parts = [f"/ {ref}: median {f['median']:.3f}, mean {f['mean']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}], "
             f"lowest {f['lowest']:.3f}; {f['below_target']} of {f['sessions']} sessions under {f['target']:g}"
             for ref, f in floors.items()]
    return ["JCT floor: no system answers a session's last call before it arrives, so a session's JCT ratio "
            "to a reference is at least its trace's span over the reference's JCT, whatever the cache or "
            "the order. " + " | ".join(parts) + ".", ""]


_FLOOD_COLUMNS = (("calm_slowdown", "calm tenant's JCT / alone"), ("calm_jct_s", "calm JCT (s)"),
                  ("flood_jct_s", "flood JCT (s)"), ("calm_first_ttft_p99_s", "calm first-call TTFT p99 (s)"),
                  ("flood_first_ttft_p99_s", "flood first-call TTFT p99 (s)"))


def _flood(flood: dict) -> list[str]:
    """Two tenants, one flooding: each system's levels, and ours / each other system, over seeds."""
    cfg = flood["config"]
    out = [f"Two-tenant flood (replay, generated: a `calm` tenant's {cfg['calm_sessions']} `branch_heavy` sessions "
           f"and a `flood` tenant's {cfg['flood_sessions']} `short_tools` sessions started at {cfg['flood_rate']:g} "
           f"per second, on one {cfg['pressure']} pool, host {cfg['host_ratio']:g}x; {len(cfg['seeds'])} seeds, "
           "mean with a 95% t interval over seeds; the calm tenant's slowdown is against running alone on "
           "the same pool):", "",
           "system | " + " | ".join(label for _, label in _FLOOD_COLUMNS),
           "---|" + "|".join("---:" for _ in _FLOOD_COLUMNS)]
    fmt = lambda v: f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"  # noqa: E731
    for name, levels in flood["levels"].items():
        out.append(f"{name} | " + " | ".join(fmt(levels[m]) for m, _ in _FLOOD_COLUMNS))
    out += ["", "**ours / other, seed by seed** | " + " | ".join(label for _, label in _FLOOD_COLUMNS),
            "---|" + "|".join("---:" for _ in _FLOOD_COLUMNS)]
    for other, c in flood["ours_vs"].items():
        out.append(f"/ {other} | " + " | ".join(_session_cell(c[m]) for m, _ in _FLOOD_COLUMNS))
    return out + [""]


def _admission_summary(body: dict) -> list[str]:
    cells = {(c["other"], c["metric"]): c for c in body["comparisons"]}
    parts = []
    for other in ("hicache-lpm", "agentcache-fcfs", "stock"):
        got = [f"{label} {_session_cell(cells.get((other, m)))}" for m, label in _ADMISSION_COLUMNS
               if m in ("recomputed_tokens", "resume_ttft_p50_s", "resume_ttft_p99_s", "jct_s", "first_ttft_s")]
        parts.append(f"/ {other}: " + "; ".join(got))
    n = len({r["session"] for r in body["rows"]})
    floor = body.get("jct_floor", {}).get("hicache-lpm")
    bound = ("" if floor is None else f" The lowest JCT ratio to hicache-lpm any system could reach (span / its JCT, "
             f"per session): median {floor['median']:.3f}, lowest {floor['lowest']:.3f}.")
    return [f"Program-aware admission, replay of the same {n} sessions (host {body['config']['host_ratio']:g}x), "
            "ours (our cache + our admission order): " + " | ".join(parts) + "." + bound, ""]


def _cluster(body: dict) -> list[str]:
    cfg, systems = body["config"], body["systems"]
    out = [f"Two workers behind SGLang's router (`bench/cluster_recompute.py`; the real-server `{cfg['workload']}` "
           f"trace, {cfg['trace_stats']['requests']} calls, `{cfg['model_shape']}` model, {cfg['pool_tokens']}-token "
           f"device pool per worker, host tier {cfg['host_tokens_per_worker']} tokens per worker where a system has "
           f"one, {cfg['passes']} passes, systems run one after another; hints travel in `tracestate`, closes "
           "through the fan-out; the median pass shown, calls per worker and peak usage over all passes):", "",
           "system | router | schedule | host tokens per worker | prefill computed | hit rate | JCT (s) | "
           "calls per worker | peak token usage per worker",
           "---|---|---|---:|---:|---:|---:|---|---"]
    for name, x in systems.items():
        workers = x.get("per_worker") or []
        calls = " / ".join(f"{w['share_of_calls']:.0%}" for w in workers) or "-"
        usage = " / ".join(f"{w['peak_token_usage']:.2f}" for w in workers) or "-"
        out.append(f"{name} | {x['router_policy']} | {x.get('schedule_policy', 'fcfs')} | "
                   f"{x['host_tokens_per_worker']} | {x['computed_tokens']} | {x['hit_rate']:.2f} | {x['jct_s']:.1f} | "
                   f"{calls} | {usage}")
    out.append("")
    for pair, c in body["comparison"].items():
        computed, jct = c["computed"], c["jct"]
        out.append(f"- {pair}, pass by pass (95% CI): prefill computed {_passwise(computed)} {computed['verdict']}; "
                   f"JCT {_passwise(jct)} {jct['verdict']}.")
    return out + [""]


def _replay_vs_server(body: dict) -> list[str]:
    t, r, m = body["ttft_s"], body["resume_ttft_s"], body["measured"]
    ratio, with_overhead = body["ttft_ratio_replay_over_server"], body["ttft_ratio_with_call_overhead"]
    return [f"Replay against the real server (`bench/replay_vs_server.py`; one `{body['config']['workload']}` "
            f"trace on its own clock, {body['calls_compared']} calls, `{body['config']['model_shape']}` model, "
            f"the replayer priced by a profile measured on the server: {body['profile']['prefill_tokens_per_s']:,.0f} "
            f"prefill tokens/s, {m['decode_s_per_token'] * 1000:.1f} ms per output token, "
            f"{m['per_call_overhead_s'] * 1000:.0f} ms fixed per call, which the replayer does not model):", "",
            "TTFT from receipt (s) | server | replay",
            "---|---:|---:",
            f"all calls p50 / p99 | {t['server']['p50']:.3f} / {t['server']['p99']:.3f} | "
            f"{t['replay']['p50']:.3f} / {t['replay']['p99']:.3f}",
            f"resumed calls p50 / p99 | {r['server']['p50']:.3f} / {r['server']['p99']:.3f} | "
            f"{r['replay']['p50']:.3f} / {r['replay']['p99']:.3f}",
            f"cached tokens | {body['cached_tokens']['server']} | {body['cached_tokens']['replay']}",
            f"trace completion (s) | {body['jct_s']['server']:.1f} | {body['jct_s']['replay']:.1f}", "",
            f"Per call, replay / server TTFT: median {ratio['p50']:.2f}x (quartiles {ratio['p25']:.2f}x, "
            f"{ratio['p75']:.2f}x); with the fixed per-call cost added to the replay's, {with_overhead['p50']:.2f}x "
            f"({with_overhead['p25']:.2f}x, {with_overhead['p75']:.2f}x); Spearman rank correlation "
            f"{body['ttft_spearman']:.2f}.", ""] + _hicache_emulation(body)


def _hicache_emulation(body: dict) -> list[str]:
    h = body.get("hicache_offline")
    if h:
        verdict = "within" if h["within_5_percent"] else "outside"
        return [f"The replay's `sglang-hicache` policy (SGLang's HiCache code driven offline, the write-back "
                f"reference of every replay table) on the same trace as stock SGLang with its own HiCache on the "
                f"server (write-back, same pool and host tokens): prefill computed "
                f"{h['computed_tokens']['replay']:,} (replay) / {h['computed_tokens']['server']:,} (server) = "
                f"{h['computed_ratio_replay_over_server']:.3f}x over {h['calls_compared']} calls, {verdict} the "
                "5% target.", ""]
    h = body.get("hicache_emulation")  # results written before the emulation was removed
    if not h:
        return []
    verdict = "within" if h["within_5_percent"] else "outside"
    return [f"The replay's `hicache` policy (the write-back emulation every replay table compares against) "
            f"on the same trace as stock SGLang with its own HiCache (write-back, same pool and host tokens): "
            f"prefill computed {h['computed_tokens']['replay']:,} (replay) / {h['computed_tokens']['server']:,} "
            f"(server) = {h['computed_ratio_replay_over_server']:.3f}x over {h['calls_compared']} calls, "
            f"{verdict} the 5% target.", ""]


def _l3_failover(body: dict) -> list[str]:
    """A worker stopped mid-session: its sessions on the survivor, from the shared L3 store or cold."""
    cfg, cmp = body["config"], body["comparisons"]
    out = [f"**A worker dies** (`bench/l3_failover.py`; two workers running ours on SGLang's HiCache, write-through, "
           f"pool {cfg['pool_tokens']} tokens and host {cfg['host_ratio']}x per worker, behind SGLang's router; "
           f"{cfg['sessions']} sessions of a {cfg['history']}-token history, worker 1 stopped after "
           f"{cfg['turns_before']} turns, {cfg['turns_after']} turns after; `{cfg['model_shape']}` model, CPU): "
           "per session after the move, `l3` (both workers share one `file` store) against `cold` (no store): "
           "means over sessions with 97.5% t intervals, and l3 / cold as the ratio of the means with the "
           "conservative 95% interval the two give. One run per condition: the intervals are over sessions "
           "within a run, not over runs, and the prefill counts are deterministic (no spread at all). The "
           "survivor's pool holds every session, so its own sessions are the control.", "",
           "sessions (l3 / cold runs) | prefill computed after the move: l3, cold, l3 / cold | "
           "first call's latency (s): l3, cold, l3 / cold | control, the last call before the move (s): l3, "
           "cold, l3 / cold",
           "---|---|---|---"]

    def side(c: dict, fmt: str) -> str:
        return f"{c['mean']:{fmt}} [{c['ci'][0]:{fmt}}, {c['ci'][1]:{fmt}}]"

    for group in ("moved", "stayed"):
        a, b = cmp.get(f"{group}:computed_tokens"), cmp.get(f"{group}:first_call_latency_s")
        if a is None or b is None:
            continue
        control = cmp.get(f"{group}:last_call_before_latency_s")  # absent from runs before it was recorded
        cells = [f"{side(c['l3'], fmt)}, {side(c['cold'], fmt)}, {c['ratio']:.2f}x "
                 f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}] {c['verdict']}" if c is not None else "-"
                 for c, fmt in ((a, ".0f"), (b, ".3f"), (control, ".3f"))]
        out.append(f"{group} ({a['l3']['sessions']} / {a['cold']['sessions']}) | " + " | ".join(cells))
    storage = [r["first_call_storage_tokens"] for r in body["rows"] if r["moved"] and r["condition"] == "l3"]
    if storage:
        out += ["", f"Each moved session's first call after the move, `l3`: {min(storage)}-{max(storage)} tokens "
                "from the store (`cached_tokens_details.storage`); `cold`: none from anywhere."]
    return out + [""]


def _passwise(v: dict) -> str:
    """A pass-by-pass ratio of server_recompute.json or cluster_recompute.json: ``0.91x [0.88, 0.94]``."""
    return f"{v['mean']:.2f}x [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]"


def _pair(key: str) -> str:
    """A comparison key of server_recompute.json: ``"ours / theirs"`` (older files: ``"theirs"``)."""
    return key if " / " in key else f"agentcache / {key}"


def _overhead(body: dict) -> list[str]:
    target = body["target"]
    names = [w["workload"] for w in body["workloads"]]
    rust = body["rust"]
    rust_cell = ", ".join(f"{x:.2f}x" for x in rust["total_ratio_vs_stock"]) if rust.get("available") \
        else f"unavailable ({rust.get('reason')})"

    def steps(w: dict) -> int:  # the nodes the insert visits, walked or skipped (= stock's walk)
        return w["insert_walk_steps"] + w.get("insert_skipped_nodes", 0)

    def work(wl: dict, key: str, which: str = "tree_work") -> str:
        w = wl[which]
        if key == "insert_walk_steps":
            return f"{steps(w['ours_hinted']) / max(steps(w['stock']), 1):.2f}x"
        return f"{w['ours_hinted'][key] / max(w['stock'][key], 1):.2f}x"

    def ratios(key: str) -> str:
        return ", ".join(f"{x:.2f}x" for x in target[key])

    skipped = ", ".join(
        f"{w['tree_work']['ours_untagged']['insert_skipped_nodes'] / max(steps(w['tree_work']['stock']), 1):.0%}"
        for w in body["workloads"])
    kept = ", ".join(work(w, "mean_nodes_at_admit") for w in body["workloads"])
    walked = ", ".join(work(w, "insert_walk_steps") for w in body["workloads"])
    roomy = ", ".join(work(w, "insert_walk_steps", "tree_work_roomy") for w in body["workloads"])
    return [
        f"Tree overhead (`bench/tree_overhead.py`; cache time for the same recorded operation stream, ours / "
        f"stock Python tree core, on {', '.join(names)}): untagged traffic {ratios('ours_untagged_ratios')}, "
        f"with lifecycle hints {ratios('ours_hinted_ratios')} (target {target['max_ratio']:.2f}x). Our inserts "
        f"start at the node the request holds locked, where stock's re-walk the request's prefix from the "
        f"root ({skipped} of the nodes stock's insert walks on untagged traffic are skipped; same tree, same "
        f"decisions). With stock's full walk the hinted cache reads {ratios('ours_hinted_full_walk_ratios')}: "
        f"our lifecycle bookkeeping alone, on a tree holding {kept} stock's nodes when a request arrives, "
        f"whose insert paths are {walked} as many nodes as stock's (in a pool neither cache evicts from, "
        f"{roomy}). SGLang's Rust tree core, for reference: {rust_cell}.",
        "",
    ]


_SOAK_PHASES = {"lazy": "lazy pauses (the defaults)",
                "eager": "eager pauses (offloads demoted into HiCache's host pool, prefetches)",
                "flooder": "two tenants, the one flooding (pausing calls as fast as answered, refused over-long chats)",
                "victim": "two tenants, the other one"}


def _soak_run(body: dict) -> str:
    calls = {k: v for k, v in body["calls"].items() if k not in ("race_close_overtook", "abandoned_sessions")}
    host = body["host_tokens"]
    waits = body.get("stats_wait_s")
    timed = (f"; its `GET /agentcache/stats` meanwhile: p50 {waits['p50']:.3f} s, max {waits['max']:.3f} s "
             f"({waits['n']} calls)") if waits else ""
    flooding = body.get("flood_workers")
    flood = f", {calls.get('flood_refused_chat', 0)} refused over-long chats" if flooding else ""
    who = f"{body['workers']} agents" + (f" and {flooding} flooding threads" if flooding else "")
    checked = "passed" if body["check_ok"] else "FAILED"
    return (f"{who} "
            f"for {body['seconds']:.0f} s: {sum(calls.values())} calls ({calls.get('generate', 0)} generations, "
            f"{calls.get('session_close', 0)} sessions, {calls.get('pause', 0)} pauses, {calls.get('prefetch', 0)} "
            f"prefetches{flood}); {calls.get('aborted_stream', 0)} client disconnects mid-stream, "
            f"{calls.get('race_close', 0)} closes racing an in-flight request, "
            f"{body['calls'].get('abandoned_sessions', 0)} tools that never return ({body.get('deadline_releases', 0)} "
            f"deadline releases); {body.get('hicache_offloaded_tokens', 0)} tokens offloaded into HiCache's host "
            f"pool, {body['fallbacks']['offload']['host_full']} offloads to a full host pool{timed}. Unexplained "
            f"failures {len(body['unexpected_failures'])}, leaked tokens "
            f"{body['leaked_tokens']}, terminated tokens left {body['terminated_pending_tokens']} on the device and "
            f"{host['before']} -> {host['after']} in the host pool, integrity check {checked}, "
            f"server {'alive and healthy' if body['health'] == 200 and body.get('server_alive', True) else 'DOWN'}: "
            f"{'pass' if body['passed'] else 'FAIL'}.")


def _soak(body: dict) -> list[str]:
    phases = [(name, run) for name, run in body.items() if isinstance(run, dict)]
    lines = ["Soak (`make soak`: three phases, each on a fresh CPU server on SGLang's HiCache, a host pool 1/8 of "
             "the device pool; a phase passes with no server death, no unexplained failure and no leaked token):",
             ""]
    lines += [f"- {_SOAK_PHASES.get(name, name)}: {_soak_run(run)}" for name, run in phases]
    return lines + ["", f"Soak overall: {'pass' if body['passed'] else 'FAIL'}.", ""]


def _summary(body: dict) -> list[str]:
    """One row per workload at the sweep pressure, host tier 1x: HiCache-style write-back, the best
    other non-clairvoyant system, ours, ours against that best system seed by seed, ours without a
    host tier against stock, the LP floor (a bound) and stock with an infinite pool (not a bound: with
    room for everything no call queues, and a call a tight pool holds back until a sibling computed
    their shared prompt starts at once and misses it)."""
    cfg = body["config"]
    pressure = cfg["sweep_pressure"]
    cells = {(s["policy"], s["workload"], s["host_ratio"]): s for s in body["summary"] if s["pressure"] == pressure}
    cmps = {(c["other"], c["workload"], c["host_ratio"]): c for c in body["comparisons"] if c["pressure"] == pressure}
    others = [p for p in SHOWN if p not in ("stock", OURS, INFERRED, OWN_TIER, "clairvoyant")]
    out = [f"Recomputed prefill tokens as a ratio to stock SGLang (no host tier) in the same run, lower is better: "
           f"{pressure} device pool, a host tier of 1x the pool for every system that has one, mean ± 95% CI "
           f"half-width over {len(cfg['seeds'])} seeds ({len(cfg['real_seeds'])} for the real traces). "
           "\"vs best\": ours / the best other system on that workload (not the clairvoyant one), seed by seed, "
           "with its 95% CI; \"better\"/\"worse\" only where it excludes 1. \"ours, no client hints\": ours with "
           "the lifecycle inferred from the calls (chat inference, on by default), same pool and host tier. "
           "\"stock, infinite pool\": stock with a pool that never evicts; not a bound: "
           "with room for everything no call queues, so calls a tight pool holds back until a sibling has "
           "computed their shared prompt start at once and miss it (on `stable_prompts` write-back and ours "
           "go under it).", "",
           f"workload | {SGLANG_HICACHE} | best other | ours | ours vs best | ours, no host tier (vs stock) | "
           "ours, no client hints | LP floor | stock, infinite pool",
           "---|---:|---|---:|---|---|---:|---:|---:"]

    for w in cfg["workloads"]:
        ours = cells.get((OURS, w, 1.0))
        if ours is None:
            continue
        rivals = [(cells[(p, w, h)]["recompute_vs_stock"], p, h) for p in others for h in (1.0, 0.0)
                  if (p, w, h) in cells and (h == 1.0 or p == "session-radix")]
        best = min(rivals) if rivals else None
        out.append(" | ".join([
            w, _cell(cells.get((SGLANG_HICACHE, w, 1.0))),
            "-" if best is None else f"{best[1]} {_cell(cells[(best[1], w, best[2])])}", _cell(ours),
            "-" if best is None else _verdict(cmps.get((best[1], w, 1.0))),
            _verdict(cmps.get(("stock", w, 0.0))), _cell(cells.get((INFERRED, w, 1.0))),
            f"{ours['lower_bound_vs_stock']:.2f}",
            "-" if ours.get("infinite_vs_stock") is None else f"{ours['infinite_vs_stock']:.2f}"]))
    return out + [""]


def _sessions_summary(body: dict) -> list[str]:
    """One line per host size: ours / write-back on real sessions, per-session paired."""
    n = len({r["session"] for r in body["rows"]})
    cells = {(c["host_ratio"], c["metric"]): c for c in body["comparisons"] if c["other"] == SGLANG_HICACHE}
    parts = []
    for host in sorted({h for h, _ in cells}):
        got = [f"{label} {_session_cell(cells.get((host, m)))}" for m, label in _SESSION_COLUMNS
               if m in ("recomputed_tokens", "resume_ttft_p50_s", "resume_ttft_p99_s", "jct_s")]
        parts.append(f"host {host:g}x: " + "; ".join(got))
    out = [f"Real Claude Code sessions ({n} independent sessions, per-session paired, 95% CI over sessions), "
           f"ours / SGLang's HiCache write-back (`{SGLANG_HICACHE}`, same pool and host bytes): "
           + " | ".join(parts) + ".", ""]
    inferred = {(c["other"], c["host_ratio"], c["metric"]): c for c in body.get("comparisons_inferred", ())}
    parts = []
    for host in sorted({h for _, h, _ in inferred}):
        got = [f"/ {label} {_session_cell(inferred.get((other, host, 'recomputed_tokens')))}, resume p99 "
               f"{_session_cell(inferred.get((other, host, 'resume_ttft_p99_s')))}"
               for other, label in ((SGLANG_HICACHE, "SGLang's HiCache"), (OURS, "explicit hints"))]
        parts.append(f"host {host:g}x: " + "; ".join(got))
    if parts:
        out += ["Zero-config (chat inference, on by default; no client hints) on the same sessions, recomputed tokens: "
                + " | ".join(parts) + ".", ""]
    own = {(c["host_ratio"], c["metric"]): c for c in body["comparisons"] if c["other"] == OWN_TIER}
    parts = [f"host {host:g}x: recompute {_session_cell(own.get((host, 'recomputed_tokens')))}, resume p99 "
             f"{_session_cell(own.get((host, 'resume_ttft_p99_s')))}" for host in sorted({h for h, _ in own})]
    if parts:
        out += ["Ours / ours on the host tier being retired (`agentcache-own-tier`) on the same sessions: "
                + " | ".join(parts) + ".", ""]
    return out


def _server_summary(body: dict) -> list[str]:
    cfg = body["config"]
    parts = []
    for pair, c in body["comparison"].items():
        computed, jct = c["computed"], c["jct"]
        parts.append(f"{_pair(pair)}: prefill computed {_passwise(computed)} ({computed['verdict']}), "
                     f"JCT {_passwise(jct)} ({jct['verdict']})")
    return [f"Real CPU server (`{cfg['workload']}` trace, {cfg['pool_tokens']}-token pool, host tier "
            f"{cfg['host_tokens']} tokens for every backend that has one, {cfg['passes']} interleaved passes; "
            "`-lpm`: SGLang's `--schedule-policy lpm`, else `fcfs`; " + _where_ours_ran(cfg) + "): "
            + "; ".join(parts) + ".", ""]


def _where_ours_ran(cfg: dict) -> str:
    """Which host tier the server's ``agentcache`` ran on in this results file (the own tier before it was
    removed, SGLang's HiCache since)."""
    ours = cfg.get("backends", {}).get("agentcache", {})
    if ours.get("hicache_write_policy"):
        return "ours (`agentcache*`) on SGLang's HiCache write-back"
    return ("on the server `agentcache` and `agentcache-lpm` ran our own host tier (since removed), "
            "`agentcache-hicache-lpm` on SGLang's HiCache")


def _render(sections: tuple, tail: tuple = ()) -> str:
    """The block from each (results file, renderer) whose file exists, then ``tail``."""
    lines = [BEGIN, ""]
    for name, make in sections:
        path = RESULTS / name
        if path.exists():
            lines += make(json.loads(path.read_text()))
    return "\n".join(lines + list(tail) + [END])


def render_summary() -> str:
    """The README's block: the headline table and the server's ratios."""
    return _render((("replay/results.json", _summary), ("real_sessions.json", _sessions_summary),
                    ("admission.json", _admission_summary), ("server_recompute.json", _server_summary))
                   + tuple((name, _server_seeds_summary) for name in SERVER_SEEDS),
                   ("Every table, the host-tier sweep, the server's latencies, the tree's overhead, the soak, "
                    "and where ours loses: [`bench/README.md`](bench/README.md).", ""))


def render() -> str:
    """bench/README.md's block: every table."""
    return _render((("replay/results.json", _replay), ("real_sessions.json", _sessions),
                    ("inference_attribution.json", _attribution), ("admission.json", _admission),
                    ("server_recompute.json", _server))
                   + tuple((name, _server_seeds) for name in SERVER_SEEDS)
                   + (("cluster_recompute.json", _cluster), ("l3_failover.json", _l3_failover),
                      ("replay_vs_server.json", _replay_vs_server), ("tree_overhead.json", _overhead),
                      ("soak.json", _soak)))


def _block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN): text.index(END) + len(END)]


TARGETS = {ROOT / "README.md": render_summary, ROOT / "bench" / "README.md": render}
HISTORY = re.compile(r"<!-- history -->.*?<!-- /history -->", re.S)
#: A two-number interval (``[0.92, 0.94]``, ``[-0.04, 2.64]``).
INTERVAL = re.compile(r"\[-?\d+\.\d+, -?\d+\.\d+\]")
#: A ratio written as a figure (``0.93x``) or an interval.
FIGURE = re.compile(r"(?<![\w.])-?\d+\.\d+x|" + INTERVAL.pattern)
NUMBER = re.compile(r"-?\d+\.\d+")


def stale_prose_figures(text: str, generated: str) -> list[str]:
    """The figures of ``text``'s prose (outside its generated block and its history regions) that no
    generated block shows: an interval must appear as written in ``generated`` (the blocks' text), a
    ratio's number among its numbers outside intervals. Returns them with their line numbers (pure)."""
    intervals = set(INTERVAL.findall(generated))
    shown = set(NUMBER.findall(INTERVAL.sub(" ", generated)))  # a ratio, not an interval's bound
    block = _block(text) or ""
    prose = text.replace(block, "\n" * block.count("\n")) if block else text
    prose = HISTORY.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    stale = []
    for lineno, line in enumerate(prose.splitlines(), 1):
        for figure in FIGURE.findall(line):
            known = figure in intervals if figure.startswith("[") else figure[:-1] in shown
            if not known:
                stale.append(f"line {lineno}: {figure}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the results block of README.md and bench/README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if either file's block differs from the JSON")
    args = parser.parse_args(argv)
    stale, blocks = [], {path: make() for path, make in TARGETS.items()}
    generated = "\n".join(blocks.values())
    status = 0
    for path, block in blocks.items():
        if not (args.write or args.check):
            print(f"{path.relative_to(ROOT)}:\n{block}\n")
            continue
        text = path.read_text()
        old = _block(text)
        if old is None:
            raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
        if args.write:
            path.write_text(text.replace(old, block))
        elif old != block:
            stale.append(str(path.relative_to(ROOT)))
        figures = stale_prose_figures(path.read_text(), generated)
        if figures:
            status = 1
            print(f"{path.relative_to(ROOT)}: prose figures no results block shows (update them from the "
                  "results, or mark them <!-- history -->): " + "; ".join(figures), file=sys.stderr)
    if stale:
        print(f"{', '.join(stale)}: the results block differs from bench/results (run: python "
              "bench/readme_results.py --write)", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
