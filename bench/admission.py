"""Admission benchmark: program-aware admission against SGLang's orders, Continuum and Autellix on the
38 real Claude Code sessions, with 95% intervals over sessions (the study is
``sgl_agentcache/sim/admission_study.py``; its docstring names the systems).

Writes ``admission.json``: the configuration, one row per (session, system) and the comparisons of ours
against every other system (mean of per-session ratios, t interval over sessions and group bootstrap);
and ``flood``: two generated tenants on one pool, one flooding it with new sessions, per system and
seed (five seeds: intervals over seeds).

    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/admission.py            # every session (~3 min)
    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/admission.py --quick    # two groups of small sessions
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.policy.profiles import resolve_profile  # noqa: E402
from sgl_agentcache.sim.sessions import bench_arguments, quick_sample  # noqa: E402
from sgl_agentcache.sim.admission_study import (  # noqa: E402
    REFERENCES, AdmissionStudyConfig, FloodConfig, run_flood, run_study)


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments(__doc__, argv, "two groups of small sessions", Path(__file__).parent / "results")
    config = AdmissionStudyConfig(workers=args.workers)
    flood = FloodConfig(workers=args.workers)
    if args.quick:
        config = quick_sample(config)
        flood = replace(flood, seeds=(0, 1), calm_sessions=2, flood_sessions=12)
    profile = resolve_profile(config.profile)
    progress = lambda what: print(f"[admission] {what}", flush=True)  # noqa: E731
    report = run_study(config, profile, progress=progress)
    report["flood"] = run_flood(flood, resolve_profile(flood.profile), progress=progress)
    report["command"] = "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/admission.py" + " --quick" * args.quick
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("admission_quick.json" if args.quick else "admission.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    bad = [r for r in report["rows"] if not r["integrity_ok"] or r["leaked_tokens"]]
    bad += [r for r in report["flood"]["rows"] if not r["integrity_ok"]]
    for c in report["comparisons"]:
        if c["other"] in REFERENCES:
            lo, hi = c["ci95"]
            print(f"[admission] ours / {c['other']}, {c['metric']}: {c['ratio']:.3f} [{lo:.3f}, {hi:.3f}] "
                  f"{c['verdict']} ({c['sessions']} sessions)")
    for other in REFERENCES:
        for m, c in report["flood"]["ours_vs"][other].items():
            lo, hi = c["ci95"]
            print(f"[admission] flood, ours / {other}, {m}: {c['ratio']:.3f} [{lo:.3f}, {hi:.3f}] {c['verdict']}")
    print(f"[admission] wrote {path} in {report['wall_s']:.0f} s; integrity {'ok' if not bad else bad[:3]}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
