"""Real-session benchmark: ours against write-back on 38 real Claude Code sessions, with 95% intervals
over sessions (the study is ``sgl_agentcache/sim/sessions.py``; its docstring says how and why).

Writes ``real_sessions.json``: the configuration, the groups, one row per (session, system, host size)
and the comparisons (ours / every other system -- SGLang's HiCache, KVFlow on it, ours on the host tier
being retired --, ours without client hints / SGLang's HiCache and / ours with them), each a mean of
per-session ratios with a t interval over sessions and a group-bootstrap interval.

    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py            # every session (~5 min)
    SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py --quick    # two groups, host 1x
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.policy.profiles import resolve_profile  # noqa: E402
from sgl_agentcache.sim.sessions import (OURS, SessionStudyConfig, analyse, bench_arguments, quick_sample,  # noqa: E402
                                         run_study)
from sgl_agentcache.sim.suite import SGLANG_HICACHE  # noqa: E402

INFERRED = "agentcache-inferred"


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments(__doc__, argv, "two groups of small sessions, host 1x only",
                           Path(__file__).parent / "results")
    config = SessionStudyConfig(workers=args.workers)
    if args.quick:
        config = replace(quick_sample(config), hosts=(1.0,))
    profile = resolve_profile(config.profile)
    report = run_study(config, profile, progress=lambda what: print(f"[real_sessions] {what}", flush=True))
    report["comparisons_inferred"] = [c for c in analyse(report["rows"], INFERRED)
                                      if c["other"] in (SGLANG_HICACHE, OURS)]
    report["command"] = "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/real_sessions.py" + " --quick" * args.quick
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("real_sessions_quick.json" if args.quick else "real_sessions.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    bad = [r for r in report["rows"] if not r["integrity_ok"] or r["leaked_tokens"]]
    for c in report["comparisons"]:
        if c["other"] == SGLANG_HICACHE:
            lo, hi = c["ci95"]
            print(f"[real_sessions] ours / sglang-hicache, host {c['host_ratio']:g}x, {c['metric']}: {c['ratio']:.3f} "
                  f"[{lo:.3f}, {hi:.3f}] {c['verdict']} ({c['sessions']} sessions)")
    print(f"[real_sessions] wrote {path} in {report['wall_s']:.0f} s; integrity {'ok' if not bad else bad[:3]}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
