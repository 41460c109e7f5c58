"""Attribution benchmark: where zero-config chat inference recomputes more than explicit hints, on the
38 real Claude Code sessions (the study is ``sgl_agentcache/sim/attribution_study.py``; its docstring
says how).

Writes ``inference_attribution.json``: per step (one inference decision added at a time) the per-session
recompute / explicit hints with 95% intervals over sessions, the audit of the inference's readings
against the trace's labels, and the extra recompute per kind of reading.

    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/inference_attribution.py           # every session (~8 min)
    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/inference_attribution.py --quick   # two groups, host 1x
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.policy.profiles import resolve_profile  # noqa: E402
from sgl_agentcache.sim.attribution_study import FLAGS, AttributionConfig, run_study  # noqa: E402
from sgl_agentcache.sim.sessions import bench_arguments, quick_sample  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments(__doc__, argv, "two groups of small sessions, host 1x only",
                           Path(__file__).parent / "results")
    config = AttributionConfig()
    sessions = replace(config.sessions, workers=args.workers)
    if args.quick:
        sessions = replace(quick_sample(sessions), hosts=(1.0,))
    config = replace(config, sessions=sessions)
    profile = resolve_profile(sessions.profile)
    report = run_study(config, profile, progress=lambda what: print(f"[attribution] {what}", flush=True))
    report["command"] = ("SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/inference_attribution.py"
                         + " --quick" * args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("inference_attribution_quick.json" if args.quick else "inference_attribution.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    for c in report["comparisons"]:
        if c["metric"] == "recomputed_tokens":
            lo, hi = c["ci95"]
            print(f"[attribution] {c['host_ratio']:g}x host, {c['policy']} / explicit, recompute: "
                  f"{c['ratio']:.3f} [{lo:.3f}, {hi:.3f}] {c['verdict']}")
    for key, entry in report["summary"].items():
        shares = ", ".join(f"{f or 'agrees'} {entry['extra_share_by_flag'][f]:+.1%}" for f in FLAGS)
        print(f"[attribution] {key}: extra recompute {entry['extra_share']:+.1%} of explicit ({shares})")
    bad = [r for r in report["rows"] if not r["integrity_ok"] or r["leaked_tokens"]]
    print(f"[attribution] wrote {path} in {report['wall_s']:.0f} s; integrity {'ok' if not bad else bad[:3]}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
