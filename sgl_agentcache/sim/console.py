"""``sgl-agentcache replay``: one trace or the whole suite, with progress bars, a results table, JSON and plots."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def add_arguments(rp: argparse.ArgumentParser) -> None:
    rp.add_argument("--suite", action="store_true", help="every policy x workload at two pressure points")
    rp.add_argument("--quick", action="store_true", help="suite: smaller traces (what `make demo` runs)")
    rp.add_argument("--seeds", default="1", help="suite: comma-separated trace seeds")
    rp.add_argument("--out", default="replay-report", help="suite: directory for results.json and the plots")
    rp.add_argument("--trace", help="a trace file; default: generate --workload")
    rp.add_argument("--workload", default="branch_heavy")
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--scale", type=float, default=0.1)
    rp.add_argument("--pool-tokens", type=int, help="device KV pool; default: --pressure")
    rp.add_argument("--pressure", default="tight", choices=("tight", "moderate"))
    rp.add_argument("--policies", help="comma-separated subset of the policies (default: all)")
    rp.add_argument("--profile", default="seed", help="a built-in profile name or a calibrated profile file")
    rp.add_argument("--json", help="single trace: also write the results as JSON here")


def _table(rows: list[dict], title: str):
    """One row per policy, one column per workload: recompute vs stock, hit rate and resume p99 vs stock."""
    from rich.table import Table

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    table = Table(title=title, caption="cell: recomputed prefill vs stock | hit rate | resume p99 vs stock "
                                       "(lower, higher, lower is better)")
    table.add_column("policy")
    for w in workloads:
        table.add_column(w, justify="right")
    cells = {(r["policy"], r["workload"]): r for r in rows}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        table.add_row(policy, *[f"{c['recompute_vs_stock']:.2f}x {c['hit_rate']:.2f} {c['resume_p99_vs_stock']:.2f}x"
                                if (c := cells.get((policy, w))) else "-" for w in workloads])
    ideal = {r["workload"]: r.get("ideal_hit_rate") for r in rows if r.get("ideal_hit_rate") is not None}
    if ideal:
        table.add_row("(infinite cache)", *[f"hit {ideal[w]:.2f}" if w in ideal else "-" for w in workloads])
    return table


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from sgl_agentcache.policy.profiles import resolve_profile
    from sgl_agentcache.sim.policies import POLICIES
    from sgl_agentcache.sim.suite import SuiteConfig, pool_for, run_suite, write_report

    console = Console()
    profile = resolve_profile(args.profile)
    policies = tuple(args.policies.split(",")) if args.policies else tuple(POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        console.print(f"[red]unknown policies {unknown}; known: {', '.join(POLICIES)}")
        return 2
    if args.suite:
        config = SuiteConfig(policies=policies, seeds=tuple(int(s) for s in args.seeds.split(",")),
                             scale=0.05 if args.quick else args.scale, profile=profile.name)
        total = len(config.workloads) * len(config.seeds) * len(config.pressures) * len(set(policies) | {"stock"})
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("replay suite", total=total)

            def progress(what: str) -> None:
                bar.update(task, advance=1, description=what)

            report = run_suite(config, profile, progress)
        summary = report["summary"]
        for pressure in config.pressures:
            console.print(_table([s for s in summary if s["pressure"] == pressure],
                                 f"{pressure} pool: {len(config.seeds)} seed(s), profile {profile.name}; "
                                 "ratios vs stock in the same run"))
        bad = [s for s in summary if not s["integrity_ok"] or s["leaked_tokens"] or s["refused"]]
        console.print(f"integrity: {'all runs ok, no leaked tokens, no refused calls' if not bad else bad}")
        files = write_report(report, Path(args.out), "sgl-agentcache " + shlex.join(sys.argv[1:]))
        console.print(f"wrote {', '.join(str(f) for f in files)} in {report['wall_s']:.0f} s")
        ok = all(s["integrity_ok"] and not s["leaked_tokens"] for s in summary)
        return 0 if ok else 1

    from sgl_agentcache.sim.replay import replay
    from sgl_agentcache.sim.suite import _row
    from sgl_agentcache.trace.generators import generate
    from sgl_agentcache.trace.schema import load

    trace = load(args.trace) if args.trace else generate(args.workload, seed=args.seed, scale=args.scale)
    pool = args.pool_tokens or pool_for(trace, args.pressure)
    results = {name: replay(trace, name, pool_tokens=pool, profile=profile)
               for name in ("stock",) + tuple(p for p in policies if p != "stock")}
    rows = [_row(results[p], results["stock"], trace.header.name, f"{pool} tok", args.seed) for p in policies]
    for row in rows:
        row["refused"] = row["refused"]
    console.print(_table(rows, f"replay: {trace.header.name}, {pool}-token pool, profile {profile.name}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": trace.header.name, "pool_tokens": pool,
                                               "profile": profile.to_dict(), "rows": rows}, indent=1) + "\n")
    return 0 if all(r["integrity_ok"] and not r["leaked_tokens"] for r in rows) else 1
