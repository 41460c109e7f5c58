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

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.policy.profiles import resolve_profile  # noqa: E402
from sgl_agentcache.sim.attribution_study import FLAGS, AttributionConfig, run_study  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two groups of small sessions, host 1x only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    args = ap.parse_args(argv)
    config = AttributionConfig()
    sessions = replace(config.sessions, workers=args.workers)
    if args.quick:
        small = ("trace_0019", "trace_0021", "trace_0074", "trace_0094", "trace_0209", "trace_0233")
        sessions = replace(sessions, files=small, group_size=3, hosts=(1.0,))
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
