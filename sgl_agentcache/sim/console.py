"""``sgl-agentcache replay``: one trace or the whole suite, with progress, a results table, JSON and plots."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def add_arguments(rp: argparse.ArgumentParser) -> None:
    rp.add_argument("--suite", action="store_true",
                    help="every system x workload (generated and real traces) at equal pool and host tier")
    rp.add_argument("--quick", action="store_true",
                    help="suite: a smoke run (generated workloads only, two seeds, small traces; `make demo`)")
    rp.add_argument("--seeds", default=None, help="suite: comma-separated seeds of generated traces (default 1-10)")
    rp.add_argument("--real-seeds", default=None, help="suite: comma-separated seeds of real traces (default 1-5)")
    rp.add_argument("--workloads", default=None, help="suite: comma-separated subset of the workloads")
    rp.add_argument("--workers", type=int, default=2, help="suite: worker processes (default 2)")
    rp.add_argument("--out", default="replay-report", help="suite: directory for results.json and the plots")
    rp.add_argument("--trace", help="a trace file; default: generate --workload")
    rp.add_argument("--workload", default="branch_heavy", help="generated workload of a single-trace replay")
    rp.add_argument("--seed", type=int, default=1, help="seed of the generated trace")
    rp.add_argument("--scale", type=float, default=0.1, help="size of generated traces (1.0: full size)")
    rp.add_argument("--pool-tokens", type=int, help="device KV pool; default: --pressure")
    rp.add_argument("--pressure", default="tight", choices=("tight", "moderate"),
                    help="device pool as a fraction of the trace's working set")
    rp.add_argument("--host", type=float, default=1.0,
                    help="single trace: host tier as a multiple of the device pool, the same for every system "
                         "with a host tier (default 1.0; stock SGLang has none)")
    rp.add_argument("--policies", help="comma-separated subset of the systems (default: all)")
    rp.add_argument("--profile", default="seed", help="a built-in profile name or a calibrated profile file")
    rp.add_argument("--json", help="single trace: also write the results as JSON here")


def _table(rows: list[dict], title: str):
    """One row per system, one column per workload: recompute vs stock (95% CI), hit rate."""
    from rich.table import Table

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    table = Table(title=title, caption="cell: recomputed prefill / stock's (± 95% CI half-width) | hit rate; "
                                       "lower recompute is better")
    table.add_column("system")
    for w in workloads:
        table.add_column(w, justify="right")
    cells = {(r["policy"], r["workload"]): r for r in rows}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        out = []
        for w in workloads:
            c = cells.get((policy, w))
            if c is None:
                out.append("-")
                continue
            lo, hi = c.get("recompute_ci95", (float("nan"),) * 2)
            ci = f"±{(hi - lo) / 2:.2f}" if hi == hi else ""
            out.append(f"{c['recompute_vs_stock']:.2f}{ci} {c['hit_rate']:.2f}")
        table.add_row(policy, *out)
    bound = {r["workload"]: r.get("lower_bound_vs_stock") for r in rows if r["policy"] == "stock"}
    if any(v is not None for v in bound.values()):
        table.add_row("(LP lower bound)", *[f"{bound[w]:.2f}" if bound.get(w) is not None else "-" for w in workloads])
    ideal = {r["workload"]: r.get("ideal_hit_rate") for r in rows if r.get("ideal_hit_rate") is not None}
    if ideal:
        table.add_row("(stock, infinite pool)", *[f"hit {ideal[w]:.2f}" if w in ideal else "-" for w in workloads])
    return table


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",")) if text else default


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from sgl_agentcache.policy.profiles import resolve_profile
    from sgl_agentcache.sim.policies import POLICIES
    from sgl_agentcache.sim.suite import DEFAULT_POLICIES, REAL_WORKLOADS, SuiteConfig, run_suite, write_report
    from sgl_agentcache.trace.generators import WORKLOADS

    console = Console()
    profile = resolve_profile(args.profile)
    policies = tuple(args.policies.split(",")) if args.policies else None
    unknown = [p for p in policies or () if p not in POLICIES]
    if unknown:
        console.print(f"[red]unknown policies {unknown}; known: {', '.join(POLICIES)}")
        return 2
    if args.suite:
        config = SuiteConfig()
        if args.quick:
            config = SuiteConfig(workloads=tuple(WORKLOADS), seeds=(1, 2), real_seeds=(), sweep_hosts=(), scale=0.05)
        config = SuiteConfig(**(config.__dict__ | {
            "policies": policies or DEFAULT_POLICIES, "seeds": _ints(args.seeds, config.seeds),
            "real_seeds": _ints(args.real_seeds, config.real_seeds), "profile": profile.name,
            "workers": args.workers, "scale": config.scale if args.quick else args.scale,
            "workloads": tuple(args.workloads.split(",")) if args.workloads else config.workloads}))
        total = sum(len(config.real_seeds if w in REAL_WORKLOADS else config.seeds) for w in config.workloads)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("replay suite", total=total)

            def progress(what: str) -> None:
                bar.update(task, advance=1, description=what)

            report = run_suite(config, profile, progress)
        summary = report["summary"]
        for pressure in config.pressures:
            for host in sorted({s["host_ratio"] for s in summary if s["pressure"] == pressure}):
                rows = [s for s in summary if s["pressure"] == pressure and s["host_ratio"] == host]
                rows += [s for s in summary if s["pressure"] == pressure and s["policy"] == "stock"
                         and s["host_ratio"] == 0.0 and host != 0.0]
                console.print(_table(rows, f"{pressure} pool, host tier {host:g}x pool: {len(config.seeds)} seeds "
                                           f"(real traces {len(config.real_seeds)}), profile {profile.name}; "
                                           "ratios to stock (no host tier) in the same run"))
        bad = [s for s in summary if not s["integrity_ok"] or s["leaked_tokens"] or s["refused"]]
        console.print(f"integrity: {'all runs ok, no leaked tokens, no refused calls' if not bad else bad}")
        files = write_report(report, Path(args.out), "sgl-agentcache " + shlex.join(sys.argv[1:]))
        console.print(f"wrote {', '.join(str(f) for f in files)} in {report['wall_s']:.0f} s")
        return 0 if not bad else 1

    from sgl_agentcache.sim.replay import replay
    from sgl_agentcache.sim.suite import REPLAY_VOCAB, result_row, pool_for
    from sgl_agentcache.trace.generators import generate
    from sgl_agentcache.trace.schema import load

    trace = load(args.trace) if args.trace else generate(args.workload, seed=args.seed, scale=args.scale)
    pool = args.pool_tokens or pool_for(trace, args.pressure)
    host = int(round(args.host * pool))
    names = ("stock",) + tuple(p for p in policies or POLICIES if p != "stock")
    results = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("replay", total=len(names))
        for name in names:
            bar.update(task, description=f"{trace.header.name}: {name}")
            results[name] = replay(trace, name, pool_tokens=pool, host_tokens=host, profile=profile,
                                   vocab_size=REPLAY_VOCAB)
            bar.update(task, advance=1)
    cell = {"workload": trace.header.name, "pressure": args.pressure, "host_ratio": args.host, "seed": args.seed}
    rows = [result_row(results[p], results["stock"], cell) for p in names]
    console.print(_table(rows, f"replay: {trace.header.name}, {pool}-token pool, host tier {host} tokens, "
                               f"profile {profile.name}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": trace.header.name, "pool_tokens": pool, "host_tokens": host,
                                               "profile": profile.to_dict(), "rows": rows}, indent=1) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if all(r["integrity_ok"] and not r["leaked_tokens"] for r in rows) else 1
