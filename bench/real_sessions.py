"""Real-session benchmark: ours against write-back on 38 real Claude Code sessions, with 95% intervals
over sessions (the study is ``sgl_agentcache/sim/sessions.py``; its docstring says how and why).

Writes ``real_sessions.json``: the configuration, the groups, one row per (session, system, host size)
and the comparisons (ours / every other system, and ours without client hints / write-back), each a
mean of per-session ratios with a t interval over sessions and a group-bootstrap interval.

    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py            # every session (~5 min)
    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py --quick    # two groups, host 1x
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
from sgl_agentcache.sim.sessions import OURS, SessionStudyConfig, analyse, run_study  # noqa: E402

INFERRED = "agentcache-inferred"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two groups of small sessions, host 1x only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    args = ap.parse_args(argv)
    config = SessionStudyConfig(workers=args.workers)
    if args.quick:
        small = ("trace_0019", "trace_0021", "trace_0074", "trace_0094", "trace_0209", "trace_0233")
        config = replace(config, files=small, group_size=3, hosts=(1.0,))
    profile = resolve_profile(config.profile)
    report = run_study(config, profile, progress=lambda what: print(f"[real_sessions] {what}", flush=True))
    report["comparisons_inferred"] = [c for c in analyse(report["rows"], INFERRED) if c["other"] in ("hicache", OURS)]
    report["command"] = "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py" + " --quick" * args.quick
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("real_sessions_quick.json" if args.quick else "real_sessions.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    bad = [r for r in report["rows"] if not r["integrity_ok"] or r["leaked_tokens"]]
    for c in report["comparisons"]:
        if c["other"] == "hicache":
            lo, hi = c["ci95"]
            print(f"[real_sessions] ours / hicache, host {c['host_ratio']:g}x, {c['metric']}: {c['ratio']:.3f} "
                  f"[{lo:.3f}, {hi:.3f}] {c['verdict']} ({c['sessions']} sessions)")
    print(f"[real_sessions] wrote {path} in {report['wall_s']:.0f} s; integrity {'ok' if not bad else bad[:3]}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
