"""The replayer's latencies against the real server's, call by call, on one trace (issue #39).

Contract. One seeded ``branch_heavy`` trace (server_recompute's generator and plan) is played on its
own clock (``time_scale`` 1: arrivals, tool durations and think times as the trace gives them) against
one real SGLang 0.5.23 CPU server with our backend (hints, on SGLang's HiCache write-back with a host
pool 1x the device pool, ``fcfs``), with enough clients that none waits at the client: every call is
queued by the server. The same trace then runs through the replayer (``sgl_agentcache.sim.replay``,
policy ``agentcache``: ours on SGLang's HiCache driven offline) with the same pool, host tier and
running-request limit, priced by a profile **measured on that server** first:

- prefill rate: the slope of time to first token over prompt length (fresh random prompts of 128 to
  1,536 tokens, one token out, the median of three each; the intercept is the fixed cost per call,
  which the replayer does not model, reported apart);
- decode: the time per output token of a 65-token generation past its first token;
- KV bytes per token from the model's shape; host<->device rates of a CPU memory copy.

The server's pause decisions use the same measured profile (``AGENTCACHE_PROFILE``), so both price
pauses alike. Compared per call (matched by call id): time to first token counted from when the server
received the call (server: from the client's send; replay: own wait plus restore and prefill), cached
tokens, and the trace's completion time. Reported: both sides' TTFT p50/p99 (all calls and resumed
calls), the median and quartiles of per-call replay/server TTFT ratios (also with the measured fixed
cost per call added to the replay's), their Spearman rank
correlation, and the cached-token totals. A check, not a claim: it says how far the replayer's
latencies can be read as the server's.

Second check (``hicache_offline``): the same trace on stock SGLang with its own HiCache (write-back,
the same pool and host tokens; ``server_recompute``'s ``hicache-wb``), against the replayer's
``sglang-hicache`` policy, which drives that same HiCache code offline: prefill tokens computed on both
sides and their ratio (the target: within 5%).

Run: ``SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/replay_vs_server.py [--quick] [--out DIR]``
(default ``bench/results``; writes ``replay_vs_server.json``; about 5 minutes, ``--quick`` about 2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import server_recompute as single  # noqa: E402

from sgl_agentcache.cpu_server import CpuServer  # noqa: E402
from sgl_agentcache.policy.profiles import Profile, profile_file  # noqa: E402
from sgl_agentcache.sim.replay import replay  # noqa: E402
from sgl_agentcache.tiny_model import SHAPES, make_tiny_model  # noqa: E402
from sgl_agentcache.trace.generators import generate  # noqa: E402

MAX_RUNNING = 8  # CpuServer's --max-running-requests: the replayer's max_live
MODES = {
    "full": dict(seed=3, pool_tokens=4096, host_ratio=1.0, context_length=2048, clients=64, time_scale=1.0,
                 output_cap=16, deadline_s=900, model_shape="bench", pause_via="hint",
                 prompt_lengths=(128, 256, 512, 1024, 1536),
                 trace=single._TRACE | dict(sessions=10, session_rate=1.0, lead_turns=(3, 5), workers=(2, 3),
                                            worker_turns=(1, 2))),
    "quick": dict(seed=2, pool_tokens=4096, host_ratio=1.0, context_length=2048, clients=64, time_scale=1.0,
                  output_cap=16, deadline_s=600, model_shape="tiny", pause_via="hint",
                  prompt_lengths=(128, 512, 1024),
                  trace=single._TRACE | dict(sessions=3, session_rate=2.0, lead_turns=(3, 3), workers=(2, 2),
                                             worker_turns=(1, 2), spawn_p=1.0)),
}


# ---- the profile, measured on the server ----

def _ttft(server: CpuServer, ids: list[int], max_new: int) -> tuple[float, float]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
    sent = time.monotonic()
    status, ttft, out = server.stream_generate(body, timeout=300)
    if status != 200 or ttft is None:
        raise RuntimeError(f"calibration call failed: {status} {str(out)[:200]}")
    return ttft, time.monotonic() - sent


def measure_profile(server: CpuServer, vocab: int, cfg: dict) -> tuple[Profile, dict]:
    """Prefill rate and per-call overhead (least squares of TTFT over prompt length), decode time per
    token, on ``server``, one call at a time with fresh prompts (nothing cached)."""
    rng = random.Random(cfg["seed"])
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    _ttft(server, fresh(64), 1)  # warm
    points = [(n, statistics.median(_ttft(server, fresh(n), 1)[0] for _ in range(3))) for n in cfg["prompt_lengths"]]
    slope, intercept, fit = fit_prefill(points)
    ttft, total = _ttft(server, fresh(64), 65)
    decode = (total - ttft) / 64
    shape = SHAPES[cfg["model_shape"]]
    kv_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 4  # float32 K and V
    copy_rate = _memcpy_bytes_per_s()
    profile = Profile(f"cpu-{cfg['model_shape']}-measured", kv_bytes, 1.0 / slope, decode, copy_rate, copy_rate)
    return profile, {"prefill_points_s": [[n, round(t, 4)] for n, t in points], "prefill_fit": fit,
                     "per_call_overhead_s": round(intercept, 4), "decode_s_per_token": round(decode, 5),
                     "memcpy_bytes_per_s": round(copy_rate)}


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, str]:
    """(seconds per prompt token > 0, per-call overhead in s, how it was fitted) from (prompt length,
    TTFT) points: the least-squares line. On a tiny model the prefill can hide in per-call noise and
    the line come out flat or falling; a profile needs a positive rate (the server refuses any other),
    so then the longest prompt's TTFT is charged to its tokens (overhead 0: a lower bound on the rate)."""
    xs, ys = [n for n, _ in points], [t for _, t in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope > 0:
        return slope, intercept, "least squares"
    longest = max(range(len(xs)), key=xs.__getitem__)
    return ys[longest] / xs[longest], 0.0, "longest prompt (least-squares slope not positive)"


def _memcpy_bytes_per_s() -> float:
    import torch

    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * src.numel() / (time.perf_counter() - start)


def write_profile(profile: Profile, measured: dict, path: Path) -> None:
    path.write_text(json.dumps(profile_file(profile, measured)))


# ---- the two runs ----

def run_server(model, trace, plan, cfg: dict, profile_path: Path, log_dir: Path) -> single.Replayer:
    """Ours on SGLang's HiCache (server_recompute's ``agentcache`` configuration), pricing pauses with
    the measured profile."""
    server = single.start_server("agentcache", model, cfg, log_dir)
    server.env = dict(server.env or {}) | {"AGENTCACHE_PROFILE": str(profile_path)}
    return _play(server, model, trace, plan, cfg, agent=True)


def run_hicache_server(model, trace, plan, cfg: dict, log_dir: Path) -> single.Replayer:
    """The same trace on stock SGLang with its own HiCache (write-back, the same host tokens; the
    server_recompute ``hicache-wb`` configuration), no hints."""
    return _play(single.start_server("hicache-wb", model, cfg, log_dir), model, trace, plan, cfg, agent=False)


def _play(server: CpuServer, model, trace, plan, cfg: dict, agent: bool) -> single.Replayer:
    """Start ``server``, play the trace against it, stop it; the replayer holds the rows."""
    with server.start():
        rep = single.Replayer(server, trace, plan, model.vocab_size, cfg, agent=agent)
        rep.run()
    return rep


def _served_rows(rep: single.Replayer) -> dict:
    """The server's rows of the calls it answered, by call id."""
    return {row["id"]: row for row in rep.rows.values() if row["status"] == 200}


def hicache_check(trace, rep: single.Replayer, sim) -> dict:
    """The replay's ``sglang-hicache`` policy (SGLang's HiCache code driven offline) against the real
    server running it on the same trace: prefill tokens computed over the calls both served, and their
    ratio."""
    rows = _served_rows(rep)
    both = [r for r in trace.requests if r.id in rows and r.id in sim.calls]
    server = sum(rows[r.id]["input"] - rows[r.id]["cached"] for r in both)
    replayed = sum(r.input_tokens - sim.calls[r.id].cached_tokens for r in both)
    ratio = replayed / max(server, 1)
    return {"calls_compared": len(both), "computed_tokens": {"server": server, "replay": replayed},
            "computed_ratio_replay_over_server": round(ratio, 4), "within_5_percent": abs(ratio - 1) <= 0.05}


def compare(trace, rep: single.Replayer, sim, overhead_s: float) -> dict:
    """Per call (matched by id): TTFT from receipt on both sides, cached tokens; and the summaries.
    ``overhead_s``: the measured fixed cost per call, added to the replay's TTFTs in a second ratio."""
    rows = _served_rows(rep)
    calls = []
    for r in trace.requests:
        s, call = rows.get(r.id), sim.calls.get(r.id)
        if s is None or call is None:
            continue
        received = call.start_s - call.own_wait_s
        calls.append({"id": r.id, "resume": call.resumed, "server_ttft_s": s["ttft_s"],
                      "replay_ttft_s": round(call.first_token_s - received, 4),
                      "server_cached": s["cached"], "replay_cached": call.cached_tokens})
    timed = [c for c in calls if c["server_ttft_s"] > 0]
    ratios = sorted(c["replay_ttft_s"] / c["server_ttft_s"] for c in timed)
    with_overhead = sorted((c["replay_ttft_s"] + overhead_s) / c["server_ttft_s"] for c in timed)

    def side(key: str, resumed: bool | None = None) -> dict:
        values = [c[key] for c in calls if resumed is None or c["resume"] == resumed]
        return single._quantiles(values)

    from scipy.stats import spearmanr

    rho = spearmanr([c["server_ttft_s"] for c in calls], [c["replay_ttft_s"] for c in calls])
    def q(values: list[float], p: float) -> float:
        return round(values[min(len(values) - 1, int(p * len(values)))], 3)

    return {
        "calls_compared": len(calls), "calls_in_trace": len(trace.requests),
        "ttft_s": {"server": side("server_ttft_s"), "replay": side("replay_ttft_s")},
        "resume_ttft_s": {"server": side("server_ttft_s", True), "replay": side("replay_ttft_s", True)},
        "ttft_ratio_replay_over_server": {"p25": q(ratios, 0.25), "p50": q(ratios, 0.5), "p75": q(ratios, 0.75)},
        "ttft_ratio_with_call_overhead": {"p25": q(with_overhead, 0.25), "p50": q(with_overhead, 0.5),
                                          "p75": q(with_overhead, 0.75)},
        "ttft_spearman": round(float(rho.statistic), 3),
        "cached_tokens": {"server": sum(c["server_cached"] for c in calls),
                          "replay": sum(c["replay_cached"] for c in calls)},
        "jct_s": {"server": round(max(row["done_s"] for row in rep.rows.values()), 3),
                  "replay": round(sim.completion_s, 3)},
        "calls": calls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny trace on the tiny model")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = MODES[mode]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="replay-vs-server-") as tmp:
        log_dir = Path(tmp)
        model = make_tiny_model(log_dir / "model", shape=cfg["model_shape"])
        trace, dropped = single.fit_context(generate("branch_heavy", seed=cfg["seed"], **cfg["trace"]),
                                            cfg["context_length"], cfg["output_cap"])
        assert all(r.output_tokens <= cfg["output_cap"] for r in trace.requests)  # both sides decode as many
        with CpuServer(str(model.path), backend=None, log_path=log_dir / "calibration.log",
                       max_total_tokens=cfg["pool_tokens"], context_length=cfg["context_length"]) as calibration:
            profile, measured = measure_profile(calibration, model.vocab_size, cfg)
        profile_path = log_dir / "profile.json"
        write_profile(profile, measured, profile_path)
        print(f"[replay_vs_server] measured: {profile}", flush=True)
        plan = single.build_plan(trace)
        rep = run_server(model, trace, plan, cfg, profile_path, log_dir)
        hicache_rep = run_hicache_server(model, trace, plan, cfg, log_dir)
    sims = {policy: replay(trace, policy, pool_tokens=cfg["pool_tokens"], host_tokens=single.host_tokens(cfg),
                           profile=profile, vocab_size=model.vocab_size, max_live=MAX_RUNNING, timeline=False)
            for policy in ("agentcache", "sglang-hicache")}
    result = {
        "benchmark": "replay_vs_server", "mode": mode,
        "command": "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/replay_vs_server.py" + " --quick" * args.quick,
        "config": {"workload": "branch_heavy", **{k: v for k, v in cfg.items() if k != "trace"},
                   "host_tokens": single.host_tokens(cfg), "trace_params": cfg["trace"],
                   "sessions_dropped_for_context": dropped, "max_running_requests": MAX_RUNNING},
        "profile": profile.to_dict(), "measured": measured,
        "server_failures": sum(row["status"] != 200 for row in rep.rows.values()),
        **compare(trace, rep, sims["agentcache"], max(measured["per_call_overhead_s"], 0.0)),
        "hicache_offline": hicache_check(trace, hicache_rep, sims["sglang-hicache"]),
    }
    (out / "replay_vs_server.json").write_text(single.dump_json(result))
    print_summary(result)
    return 0


def print_summary(result: dict) -> None:
    t, r = result["ttft_s"], result["resume_ttft_s"]
    print(f"[replay_vs_server] {result['calls_compared']} calls; TTFT p50 server {t['server']['p50']:.3f} s, "
          f"replay {t['replay']['p50']:.3f} s; p99 {t['server']['p99']:.3f} / {t['replay']['p99']:.3f} s; "
          f"resume p50 {r['server']['p50']:.3f} / {r['replay']['p50']:.3f} s; per-call ratio p50 "
          f"{result['ttft_ratio_replay_over_server']['p50']} (with the per-call overhead "
          f"{result['ttft_ratio_with_call_overhead']['p50']}); Spearman {result['ttft_spearman']}; cached "
          f"{result['cached_tokens']['server']:,} / {result['cached_tokens']['replay']:,}; JCT "
          f"{result['jct_s']['server']:.1f} / {result['jct_s']['replay']:.1f} s")
    h = result["hicache_offline"]
    print(f"[replay_vs_server] SGLang's HiCache offline / on the server (write-back): prefill computed "
          f"{h['computed_tokens']['replay']:,} / {h['computed_tokens']['server']:,} = "
          f"{h['computed_ratio_replay_over_server']:.3f}x over {h['calls_compared']} calls")


if __name__ == "__main__":
    sys.exit(main())
