"""Real-server benchmark: one agent trace against stock SGLang, a host write-back baseline and ours, on CPU.

Contract. One seeded ``branch_heavy`` trace (a lead agent per session that forks short-lived workers,
short tools, pauses, closes and aborts) is replayed, in one run, against fresh real SGLang 0.5.23 CPU
servers on the same random-weight model (``bench`` shape: wide and deep enough that a recomputed
prefix shows in latency) with the same constrained KV pool and, for every backend that has one, the
same host tier:

- ``stock``: SGLang's default radix cache (no ``--radix-cache-backend``), no host tier;
- ``hicache-wb``, ``hicache-wt``: stock SGLang with its own HiCache (``--enable-hierarchical-cache``,
  ``--hicache-write-policy write_back`` / ``write_through``, ``--hicache-io-backend direct``, default
  ``page_first_direct`` layout), its host pool sized by ``--hicache-ratio`` to the same host tokens as
  ours; it serves on CPU through ``sgl-agentcache cpu-setup``'s HiCache shim. This is the real competitor;
- ``agentcache``: ours, lifecycle hints on every call, on SGLang's own HiCache (write-back, the same host
  tokens in its host pool): our lifecycle decides what HiCache's host pool holds (issue #36);
- ``agentcache-admit-lpm``: ``agentcache-lpm`` with program-aware admission
  (``AGENTCACHE_ADMISSION=agent``, issue #40): returning turns whose KV is resident before new sessions;
  ``agentcache-agent-lpm`` (run only when ``--backends`` names it): the same with ``agent-lpm``, longest
  device match first within each admission class; ``agentcache-hook-lpm`` (also run only when named):
  ``AGENTCACHE_ADMISSION=lpm``, the admission hook ordering by longest device match alone (no classes),
  the control that tells what the hook costs from what the classes do.

A ``-lpm`` suffix: the same under SGLang's ``--schedule-policy lpm`` (the others run ``fcfs``).

Per request it records the input tokens, ``meta_info.cached_tokens`` and so the prefill tokens actually
computed (``input - cached``), the time to first token (``/generate`` streamed), the HTTP latency and
the status; a request is a *resume* when its branch's previous call ended in a tool call. Per pass:
the trace's completion time (JCT: first call sent to last call answered), resume TTFT p50/p99.
Writes ``server_recompute.json`` and ``server_recompute.png``.

Passes. How the clients' calls interleave differs from pass to pass (thread scheduling, a loaded
machine), and with it what is resident when a call arrives. So each server plays the trace
``passes`` times, its cache emptied by SGLang's own ``/flush_cache`` before each later pass (session
ids carry a per-pass tag, since sessions an earlier pass closed stay closed). Ratios are taken pass
by pass (ours / theirs, same pass index) and reported as a mean with its 95% Student-t interval; a
claim of "better" or "worse" needs the interval to exclude 1. A flush empties the cache, not what
agentcache has learned: the tool classes' latency model carries over, as on a long-running server.

How the trace becomes traffic (as in ``sgl_agentcache/sim/replay.py``, but with real outputs):

- Prompts. A request whose blocks extend an earlier call ``P`` of its branch (or, for a fork's first
  call, the parent's latest call) is sent as ``P's prompt + P's actual output_ids + the trace's tokens
  after P's prompt and output``, so the prefix really matches what the server cached; other prompts
  are the trace's tokens. Trace tokens come from ``block_token_ids`` (always in ``[3, vocab)``);
  output ids are the server's own (``< vocab``) and go back verbatim, as a harness would send them.
- Order. A request is sent when (a) its trace arrival ``t * time_scale`` has passed, (b) the call it
  extends has returned, plus that call's tool duration and think time (times ``time_scale``), and (c)
  for a lead resuming after its ``subagents`` tool, every worker forked from that call has returned.
  At most ``clients`` requests are in flight (a thread pool); events run after their branch's calls.
- Sampling. Greedy, ``ignore_eos``, ``max_new_tokens = min(trace output, output_cap)`` (at least 1).
- Hints (``agentcache`` only; the others get the same bodies without ``kv_hints`` and none of our
  routes): session, branch, parent, ``stable_prefix_tokens``, ``fork_point_tokens`` and ``close``; a
  call that ends in a tool carries the tool class in its hint (``tool_class``: the branch pauses as the
  call finishes and the server decides keep/offload/discard). ``--pause-via route`` sends ``POST
  /agentcache/pause`` after the response instead. Trace ``close_branch`` and ``abort`` events become
  ``/agentcache/branch/close``, ``close_session`` events ``/agentcache/session/close``.

Counted: ``computed = input - cached`` over served requests; host-tier restores count as cached (their
KV is copied back, not prefilled). Cross-check: the server log's per-batch ``#new-token`` sum.
``ideal_computed`` is what a cache that never evicts (and shares even in-flight prefixes) would
compute for the same prompts: the compulsory tokens.

Why these parameters. ``time_scale`` is 0: the trace gives order and dependencies, and the load is a
burst of agent sessions on a server with 6 requests in flight, all alive at once, so their working set
is several times the 4096-token pool, which is the regime the claim is about; with the trace's own
clock the pressure would depend on how fast this shared 2-core machine happens to be. Tool pauses are
then the time a call waits for a free client, as on a saturated server. Latencies are real but on a
CPU: they rank the backends on this machine, they are not GPU figures.

Independent traces. Passes of one trace measure run-to-run noise, not how a result generalizes.
``--trace-seeds N`` plays N traces (the mode's generator seed and the N-1 after it) on the same servers,
``passes`` passes each, and adds ``seeds``: each pair's ratio per trace (the mean of its passes') and the
mean over traces with a 95% t interval over traces, the samples.

Run: ``SGLANG_USE_CPU_ENGINE=1 .venv/bin/python bench/server_recompute.py [--quick] [--out DIR]
[--backends a,b,...] [--passes P] [--trace-seeds N]`` (default ``bench/results``; about 40 minutes for
every backend, ``--quick`` about 5; a subset writes ``server_recompute-<a+b+...>.json`` beside the full
run's file, N traces ``server_recompute-seeds<N>...``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.cpu_server import CpuServer  # noqa: E402
from sgl_agentcache.gateway import ROUTING_HEADER, routing_key  # noqa: E402
from sgl_agentcache.hints import lifecycle_envelope  # noqa: E402
from sgl_agentcache.tiny_model import make_tiny_model  # noqa: E402
from sgl_agentcache.trace.generators import generate  # noqa: E402
from sgl_agentcache.trace.schema import Event, Request, Trace, block_token_ids  # noqa: E402

class Backend(NamedTuple):
    """How one compared system's server is started and driven."""

    radix_backend: str | None  # --radix-cache-backend (None: SGLang's default)
    hints: bool  # lifecycle hints on requests and our routes for events
    schedule_policy: str  # --schedule-policy
    hicache_write_policy: str | None = None  # SGLang's own HiCache with this --hicache-write-policy
    admission: str | None = None  # AGENTCACHE_ADMISSION: program-aware admission order (issue #40)


#: ``lpm`` is SGLang's cache-aware order (longest prefix first, and in-batch prefix sharing: of waiting
#: requests that share a prefix, one computes it and the others wait for it), which gives the baselines
#: the shared-prefill saving our hints give ours under ``fcfs``.
BACKENDS = {"stock": Backend(None, False, "fcfs"), "stock-lpm": Backend(None, False, "lpm"),
            "hicache-wb": Backend(None, False, "fcfs", "write_back"),
            "hicache-wb-lpm": Backend(None, False, "lpm", "write_back"),
            "hicache-wt-lpm": Backend(None, False, "lpm", "write_through"),
            # Ours: our lifecycle on SGLang's own HiCache (issue #36): its host pool, same host tokens.
            "agentcache": Backend("agentcache", True, "fcfs", "write_back"),
            "agentcache-lpm": Backend("agentcache", True, "lpm", "write_back"),
            # Ours with program-aware admission (issue #40) over lpm's order.
            "agentcache-admit-lpm": Backend("agentcache", True, "lpm", "write_back", admission="agent"),
            # The same with ``agent-lpm`` (longest device match first within each admission class).
            "agentcache-agent-lpm": Backend("agentcache", True, "lpm", "write_back", admission="agent-lpm"),
            # The hook's own order, ``lpm``'s keys without classes: a control for ``agent-lpm``.
            "agentcache-hook-lpm": Backend("agentcache", True, "lpm", "write_back", admission="lpm")}
#: Backends run only when ``--backends`` names them (variants of a default one; the full run stays as long).
OPT_IN = ("agentcache-agent-lpm", "agentcache-hook-lpm")
#: (ours, theirs) pairs the results compare, pass by pass; the headline is ours against SGLang's HiCache
#: under lpm (the strongest baseline here).
COMPARISONS = (("agentcache", "hicache-wb-lpm"), ("agentcache", "hicache-wt-lpm"), ("agentcache-lpm", "hicache-wb-lpm"),
               ("agentcache", "hicache-wb"), ("agentcache", "stock"), ("agentcache", "stock-lpm"),
               ("agentcache-admit-lpm", "hicache-wb-lpm"), ("agentcache-admit-lpm", "agentcache-lpm"),
               ("agentcache-agent-lpm", "hicache-wb-lpm"), ("agentcache-agent-lpm", "agentcache-lpm"),
               ("agentcache-hook-lpm", "agentcache-lpm"), ("agentcache-agent-lpm", "agentcache-hook-lpm"))
#: One row per request in the JSON (``pause``: agentcache's decision after a call that ends in a tool,
#: when pauses go through the route).
ROW_COLUMNS = ("id", "resume", "input", "cached", "ideal_cached", "max_new", "status", "ttft_s", "latency_s",
               "sent_s", "pause", "error")
_TRACE = dict(session_rate=5.0, system_tokens=256, task_tokens=(50, 150), output_tokens=(4, 12),
              worker_task_tokens=(30, 100), result_tokens=(30, 120))
MODES = {
    # Six passes: write-back's prefill moved by more than a tenth between three-pass runs; six give
    # pass-by-pass intervals of a few percent.
    "full": dict(passes=6, seed=1, pool_tokens=4096, host_ratio=1.0, context_length=2048, clients=6, time_scale=0.0,
                 output_cap=16, deadline_s=1800, model_shape="bench",
                 trace=_TRACE | dict(sessions=14, lead_turns=(3, 6), workers=(2, 4), worker_turns=(1, 3))),
    "quick": dict(passes=2, seed=2, pool_tokens=4096, host_ratio=1.0, context_length=2048, clients=4, time_scale=0.0,
                  output_cap=16, deadline_s=600, model_shape="tiny",
                  trace=_TRACE | dict(sessions=3, lead_turns=(3, 3), workers=(2, 2), worker_turns=(1, 2), spawn_p=1.0)),
}


# ---- the plan: which call each request extends, what it waits for ----

@dataclass
class Step:
    index: int
    record: Request | Event
    deps: list[tuple[int, float]] = field(default_factory=list)  # (step, trace seconds to wait after it)
    pred: int | None = None  # the call whose prompt + output this prompt extends
    resume: bool = False


def _extends(r: Request, p: Request) -> bool:
    return r.blocks[:len(p.blocks)] == p.blocks and r.input_tokens >= p.input_tokens + p.output_tokens


def build_plan(trace: Trace) -> list[Step]:
    """Dependencies of every record (see the module docstring, "Order"); pure."""
    steps, last, forks = [], {}, {}
    for i, rec in enumerate(trace.records):
        step = Step(i, rec)
        key = (rec.tenant, rec.session, rec.branch)
        if isinstance(rec, Event):
            mine = [k for k in last if k[:2] == key[:2]] if rec.kind == "close_session" else [key]
            step.deps = [(last[k], 0.0) for k in mine if k in last]
        else:
            prev = last.get(key)
            if prev is not None:
                p = trace.records[prev]
                wait_s = p.think_s + (p.tool.duration_s if p.tool and p.tool.tool_class != "subagents" else 0.0)
                step.deps.append((prev, wait_s))
                step.deps += [(last[k], 0.0) for k in forks.get(prev, ())]  # the lead waits for its workers
                step.resume = p.tool is not None
                step.pred = prev if _extends(rec, p) else None
            elif rec.parent_branch is not None:
                parent = last.get((rec.tenant, rec.session, rec.parent_branch))
                if parent is not None:
                    step.deps.append((parent, 0.0))
                    forks.setdefault(parent, []).append(key)
                    step.pred = parent if _extends(rec, trace.records[parent]) else None
            last[key] = i
        steps.append(step)
    return steps


def fit_context(trace: Trace, context_length: int, output_cap: int) -> tuple[Trace, int]:
    """Drop every session with a prompt + output over ``context_length``; returns the trace and how many."""
    too_long = {(r.tenant, r.session) for r in trace.requests
                if r.input_tokens + max(min(r.output_tokens, output_cap), 1) > context_length}
    records = [r for r in trace.records if (r.tenant, r.session) not in too_long]
    return Trace(header=trace.header, records=records), len(too_long)


# ---- one backend ----

class Replayer:
    """Sends the plan to one server; thread-safe by construction (a step reads only finished steps)."""

    def __init__(self, server: CpuServer, trace: Trace, plan: list[Step], vocab: int, cfg: dict, agent: bool,
                 tag: str = "", route_session: bool = False):
        self.server, self.trace, self.plan, self.vocab, self.cfg, self.agent = server, trace, plan, vocab, cfg, agent
        self.tag = tag  # appended to session ids: a later pass must not meet the sessions an earlier one closed
        # Unhinted calls carry their session's routing key (a router's manual policy; hinted calls have it
        # in their hint's gateway headers).
        self.route_session = route_session and not agent
        self.block = trace.header.block_tokens
        self.prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.fork_point: dict[tuple, int] = {}
        self.rows: dict[int, dict] = {}
        self.pauses: dict[str, int] = {}
        self.control_errors: list[str] = []

    def _trace_tokens(self, r: Request) -> list[int]:
        out = [t for b in r.blocks for t in block_token_ids(b, self.block, self.vocab)]
        return out[:r.input_tokens]

    def _prompt(self, step: Step) -> list[int]:
        r = step.record
        if step.pred is None:
            return self._trace_tokens(r)
        p = self.trace.records[step.pred]
        new = self._trace_tokens(r)[p.input_tokens + p.output_tokens:]
        return self.prompts[step.pred] + self.outputs[step.pred] + new

    def _hint(self, step: Step, ids: list[int]) -> dict:
        r = step.record
        hint = {"session": r.session + self.tag, "branch": r.branch,
                "stable_prefix_tokens": min(r.stable_prefix_tokens, len(ids)), "close": r.close}
        if r.parent_branch is not None:
            hint["parent_branch"] = r.parent_branch
            key = (r.tenant, r.session, r.branch)
            if key not in self.fork_point and step.pred is not None:  # the fork's first call
                self.fork_point[key] = len(self.prompts[step.pred]) + len(self.outputs[step.pred])
            if key in self.fork_point:
                hint["fork_point_tokens"] = max(min(self.fork_point[key], len(ids)), hint["stable_prefix_tokens"])
        return hint

    def _post(self, path: str, body: dict) -> dict:
        try:
            status, out = self.server.request("POST", path, body, timeout=120)
        except OSError as exc:
            status, out = -1, {"error": repr(exc)}
        if status != 200:
            self.control_errors.append(f"{path} {body.get('session')}/{body.get('branch', '*')}: {status} {out}")
        return out

    def run_step(self, i: int, t0: float) -> float:
        step = self.plan[i]
        r = step.record
        if isinstance(r, Event):
            if self.agent and r.kind == "close_session":
                self._post("/agentcache/session/close", {"session": r.session + self.tag})
            elif self.agent:  # close_branch, or an abort while the worker waits on its tool
                self._post("/agentcache/branch/close", {"session": r.session + self.tag, "branch": r.branch})
            return time.monotonic()
        ids = self._prompt(step)
        assert all(0 <= t < self.vocab for t in ids), f"{r.id}: token id out of range"  # one would kill SGLang
        self.prompts[i] = ids
        n = max(min(r.output_tokens, self.cfg["output_cap"]), 1)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
        if self.agent:
            hint = self._hint(step, ids)
            if r.tool is not None and self.cfg["pause_via"] == "hint":
                hint["tool_class"] = r.tool.tool_class  # pause as the call finishes, before the response
            body["kv_hints"] = lifecycle_envelope(hint, message_id=r.id)
        sent = time.monotonic()
        try:
            headers = {ROUTING_HEADER: routing_key(r.session + self.tag)} if self.route_session else None
            status, ttft, out = self.server.stream_generate(body, timeout=300, headers=headers)
        except OSError as exc:  # a timeout or a dead server: a failure, the run goes on
            status, ttft, out = -1, None, {"error": repr(exc)}
        latency = time.monotonic() - sent
        ok = status == 200 and len(out.get("output_ids", ())) == n
        # A failed call still needs a continuation for its branch: filler ids the server never produced.
        self.outputs[i] = out["output_ids"] if ok else block_token_ids(zlib.crc32(r.id.encode()), n, self.vocab)
        self.rows[i] = {"id": r.id, "resume": step.resume, "input": len(ids), "max_new": n, "status": status,
                        "cached": out["meta_info"]["cached_tokens"] if ok else 0,
                        "ttft_s": round(ttft, 4) if ttft is not None else None,
                        "latency_s": round(latency, 4), "sent_s": round(sent - t0, 3),
                        "done_s": round(time.monotonic() - t0, 3)}
        if not ok:
            self.rows[i]["error"] = str(out)[:300]
        if self.agent and r.tool is not None and self.cfg["pause_via"] == "route":  # the server decides
            paused = self._post("/agentcache/pause", {"session": r.session + self.tag, "branch": r.branch,
                                                      "tool_class": r.tool.tool_class})
            action = self.rows[i]["pause"] = paused.get("action", "error")
            self.pauses[action] = self.pauses.get(action, 0) + 1
        return time.monotonic()

    def run(self) -> float:
        """Play every step; returns the wall time. Raises if the run exceeds the configured deadline."""
        scale, plan = self.cfg["time_scale"], self.plan
        t0 = time.monotonic()
        done: dict[int, float] = {}
        pending, running = list(range(len(plan))), {}
        with ThreadPoolExecutor(self.cfg["clients"]) as calls, ThreadPoolExecutor(2) as control:
            while pending or running:
                now, wake, later = time.monotonic(), time.monotonic() + 0.5, []
                for i in pending:
                    step = plan[i]
                    if any(d not in done for d, _ in step.deps):
                        later.append(i)
                        continue
                    ready = max([t0 + step.record.t * scale] + [done[d] + w * scale for d, w in step.deps])
                    if ready > now:
                        wake = min(wake, ready)
                        later.append(i)
                        continue
                    pool = calls if isinstance(step.record, Request) else control
                    running[pool.submit(self.run_step, i, t0)] = i
                pending = later
                if now - t0 > self.cfg["deadline_s"]:
                    for f in running:
                        f.cancel()
                    raise TimeoutError(f"replay exceeded {self.cfg['deadline_s']} s with {len(pending)} steps left")
                finished, _ = wait(running, timeout=max(wake - time.monotonic(), 0.01), return_when=FIRST_COMPLETED)
                for f in finished:
                    done[running.pop(f)] = f.result()
        return time.monotonic() - t0


# ---- measures ----

def _quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else 0.0  # noqa: E731
    mean = round(statistics.fmean(v), 4) if v else 0.0
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "mean": mean}


def ideal_computed(rep: Replayer) -> int:
    """A lower bound on prefill for this traffic: a cache that never evicts and shares even in-flight
    prefixes. In sending order, each prompt hits the longest prefix of any earlier prompt or earlier
    prompt + output (less its last token, whose KV is never written); at least one token is computed.
    Also sets each served row's ``ideal_cached``."""
    mod, base = (1 << 61) - 1, 1_000_003
    seen, total = set(), 0
    for i, row in sorted(rep.rows.items(), key=lambda item: item[1]["sent_s"]):
        if row["status"] != 200:
            continue
        h, hit, prompt = 0, 0, rep.prompts[i]
        for k, t in enumerate(prompt + rep.outputs[i][:-1]):
            h = (h * base + t + 1) % mod
            if k < len(prompt) and h in seen and hit == k:
                hit = k + 1
            seen.add(h)
        row["ideal_cached"] = min(hit, len(prompt) - 1)
        total += len(prompt) - row["ideal_cached"]
    return total


def log_counts(path: Path, offset: int) -> dict:
    """What the server log says from ``offset`` on: prefill tokens per batch, retractions, errors."""
    text = path.read_bytes()[offset:].decode(errors="replace")
    batches = re.findall(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)", text)
    usage = [float(u) for u in re.findall(r"Prefill batch.*?token usage: ([\d.]+)", text)]
    return {"prefill_batches": len(batches), "prefill_new_tokens": sum(int(n) for n, _ in batches),
            "prefill_requests": sum(int(n) for n in re.findall(r"Prefill batch.*?#new-seq: (\d+)", text)),
            "peak_token_usage": max(usage, default=0.0),
            "prefill_cached_tokens": sum(int(c) for _, c in batches),
            "retractions": len(re.findall(r"Retract requests", text)),
            "tracebacks": text.count("Traceback"), "warnings": len(re.findall(r"\bWARNING\b", text)),
            "pause_log_lines": len(re.findall(r"agentcache pause", text)),
            "keep_clips": len(re.findall(r"keep of .* clipped", text))}


def _hint_pause_decisions(stats: dict, before: dict | None) -> dict[str, int]:
    """The server's own count of pause decisions (``none``: too small to track) since ``before``."""
    def counts(s: dict | None) -> dict[str, int]:
        pauses = (s or {}).get("stats", {}).get("pauses", {})
        return {**pauses.get("decisions", {}), "none": pauses.get("too_small", 0)}

    now, then = counts(stats), counts(before)
    return {k: v - then.get(k, 0) for k, v in sorted(now.items()) if v - then.get(k, 0)}


def summarise(rep: Replayer, wall_s: float, log: dict, stats: dict | None, stats_before: dict | None = None) -> dict:
    rows = list(rep.rows.values())
    served = [r for r in rows if r["status"] == 200]
    resumes = [r["latency_s"] for r in served if r["resume"]]
    resume_ttft = [r["ttft_s"] for r in served if r["resume"] and r["ttft_s"] is not None]
    out = {"requests": len(rows), "served": len(served), "failures": len(rows) - len(served),
           "input_tokens": sum(r["input"] for r in served), "cached_tokens": sum(r["cached"] for r in served),
           "computed_tokens": sum(r["input"] - r["cached"] for r in served),
           "ideal_computed_tokens": ideal_computed(rep),
           "resume_requests": len(resumes),
           "resume_computed_tokens": sum(r["input"] - r["cached"] for r in served if r["resume"]),
           "resume_latency_s": _quantiles(resumes), "latency_s": _quantiles([r["latency_s"] for r in served]),
           "resume_ttft_s": _quantiles(resume_ttft),
           "ttft_s": _quantiles([r["ttft_s"] for r in served if r["ttft_s"] is not None]),
           "jct_s": round(max((r["done_s"] for r in rows), default=0.0), 3),
           "wall_s": round(wall_s, 1), "pause_decisions": dict(sorted(rep.pauses.items())), "extra_pause_decisions": 0,
           "control_errors": len(rep.control_errors), "control_error_samples": rep.control_errors[:5],
           "server_log": log, "resume_latencies_s": sorted(resumes)}
    out["hit_rate"] = round(out["cached_tokens"] / max(out["input_tokens"], 1), 4)
    if stats is not None:
        out["agentcache"] = stats  # cumulative over the server's passes so far
        if not rep.pauses:  # hint pauses: the server decided them; count this pass's
            out["pause_decisions"] = _hint_pause_decisions(stats, stats_before)
            # Decisions no call's tool made: the idle sweep's (a branch idle past its namespace's usual
            # gap, and again each time its idle time doubles, on the server's clock) and a paused lead's
            # re-pricing when a subagent starts.
            coordinator = lambda s: (s or {}).get("stats", {}).get("coordinator", {})  # noqa: E731
            out["extra_pause_decisions"] = sum(coordinator(stats).get(k, 0) - coordinator(stats_before).get(k, 0)
                                               for k in ("idle_pauses", "idle_repriced", "join_repriced"))
    return out


def _agentcache_stats(server: CpuServer) -> dict:
    """The server's own account: pauses, restores, quota clips, frees on close; and the integrity check."""
    _, stats = server.request("GET", "/agentcache/stats")
    _, check = server.request("GET", "/agentcache/check")
    picked = {k: v for k, v in stats.items() if k != "branches"}  # one entry per branch: too long to keep
    if isinstance(picked.get("pauses"), dict):
        picked["pauses"] = {k: v for k, v in picked["pauses"].items() if k != "recent_decisions"}
    picked["branches_seen"] = len(stats.get("branches", ()))
    return {"stats": picked, "check_ok": check.get("ok"), "check": check if not check.get("ok") else None}


def _flush(server: CpuServer) -> None:
    """SGLang's ``/flush_cache`` between passes (refused while a request is still in flight: retry)."""
    for _ in range(50):
        status, out = server.request("POST", "/flush_cache")
        if status == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"/flush_cache kept failing: {status} {out}")


#: Per-pass figures kept for every pass (the median pass keeps its full summary and rows).
PASS_FIELDS = ("computed_tokens", "cached_tokens", "failures", "resume_computed_tokens", "resume_latency_s",
               "resume_ttft_s", "jct_s", "wall_s", "pause_decisions", "extra_pause_decisions", "pass_order")


def host_tokens(cfg: dict) -> int:
    return int(round(cfg["host_ratio"] * cfg["pool_tokens"]))


def start_server(name: str, model, cfg: dict, log_dir: Path) -> CpuServer:
    """A fresh server for backend ``name`` (not started): equal pool for all, equal host bytes for all
    that have a host tier."""
    b = BACKENDS[name]
    env = {"AGENTCACHE_EVENT_LOG": str(log_dir / f"{name}-events.jsonl")} if b.radix_backend else {}
    if b.admission:
        env |= {"AGENTCACHE_ADMISSION": b.admission}
    extra = ["--schedule-policy", b.schedule_policy]
    gpu = cfg.get("gpu", False)
    if b.hicache_write_policy:
        # HiCache sizes its host pool as a multiple of the device pool (plus one padding page): the
        # same host tokens as ours. On CPU the ``direct`` io backend (the CPU shim's); on a GPU SGLang's
        # kernel io backend with its ``page_first`` layout, the production setting.
        io = ("--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first") if gpu else \
            ("--hicache-io-backend", "direct")
        extra += ["--enable-hierarchical-cache", "--hicache-write-policy", b.hicache_write_policy, *io,
                  "--hicache-ratio", f"{cfg['host_ratio']:g}"]
    return CpuServer(str(model.path), backend=b.radix_backend, log_path=log_dir / f"{name}.log",
                     max_total_tokens=cfg["pool_tokens"], context_length=cfg["context_length"], env=env,
                     extra_args=tuple(extra), gpu=gpu)


def has_host_tier(name: str) -> bool:
    b = BACKENDS[name]
    return b.hicache_write_policy is not None


def run_pass(name: str, server: CpuServer, k: int, trace: Trace, plan: list[Step], cfg: dict, vocab: int,
             stats: dict | None) -> tuple[dict, "Replayer", dict | None]:
    """Pass ``k`` of the trace on ``name``'s server (flushed first unless it is the first pass; session
    ids tagged per pass). Returns the pass's summary, its replayer and the server's stats after it."""
    backend, agent = BACKENDS[name].radix_backend, BACKENDS[name].hints
    if k:
        _flush(server)
    offset = server.log_path.stat().st_size  # start-up's warm-up prefills (and earlier passes) are not counted
    rep = Replayer(server, trace, plan, vocab, cfg, agent, tag=f".p{k}" if k else "")
    wall = rep.run()
    after = _agentcache_stats(server) if backend else None
    summary = summarise(rep, wall, log_counts(server.log_path, offset), after, stats)
    print(f"[server_recompute] {name} pass {k + 1}: "
          f"{summary['computed_tokens']:,} prefill tokens computed, JCT {summary['jct_s']:.1f} s", flush=True)
    return summary, rep, after


def run_interleaved(names: list[str], model, workloads: list[tuple[Trace, list[Step]]], cfg: dict,
                    log_dir: Path) -> list[tuple[dict, dict]]:
    """Every backend's server up at once (idle ones sleep on their sockets), and the passes interleaved:
    pass ``k`` runs each backend in turn, the order rotated by one each pass, so that the ``k``-th
    passes of two backends ran minutes apart under the same machine conditions and pair by index.
    ``workloads`` (trace, plan) run one after another on the same servers, ``cfg["passes"]`` passes
    each (pass numbers, and so session tags, run on across workloads). Returns, per workload and
    backend, the median pass's summary (by prefill tokens computed; ``passes`` lists every pass of
    that workload) and that pass's request rows."""
    runs: list[dict[str, list]] = [{n: [] for n in names} for _ in workloads]
    stats: dict[str, dict | None] = {}
    with ExitStack() as stack:
        servers = {}
        for name in names:
            print(f"[server_recompute] starting {name}'s server", flush=True)
            servers[name] = stack.enter_context(start_server(name, model, cfg, log_dir).start())
            stats[name] = _agentcache_stats(servers[name]) if BACKENDS[name].radix_backend else None
        for w, (trace, plan) in enumerate(workloads):
            for j in range(cfg["passes"]):
                k = w * cfg["passes"] + j
                for name in names[k % len(names):] + names[:k % len(names)]:
                    summary, rep, stats[name] = run_pass(name, servers[name], k, trace, plan, cfg, model.vocab_size,
                                                         stats[name])
                    summary["pass_order"] = (names.index(name) - k) % len(names)
                    runs[w][name].append((summary, rep))
    out = []
    for per_workload in runs:
        summaries, rows = {}, {}
        for name in names:
            summaries[name], rows[name] = _median_pass(name, per_workload[name], cfg)
        out.append((summaries, rows))
    return out


def _median_pass(name: str, runs: list, cfg: dict) -> tuple[dict, list]:
    backend = BACKENDS[name].radix_backend
    order = sorted(range(len(runs)), key=lambda k: runs[k][0]["computed_tokens"])
    median = order[(len(order) - 1) // 2]  # the lower median: a pass that ran, never an average
    summary, rep = runs[median]
    summary["pass_index"] = median
    summary["passes"] = [{f: s[f] for f in PASS_FIELDS} | ({"check_ok": s["agentcache"]["check_ok"]} if backend else {})
                         for s, _ in runs]
    summary["host_tokens"] = host_tokens(cfg) if has_host_tier(name) else 0
    summary["pool_tokens"] = cfg["pool_tokens"]
    summary["schedule_policy"] = BACKENDS[name].schedule_policy
    return summary, [[rep.rows[i].get(c) for c in ROW_COLUMNS] for i in sorted(rep.rows)]


# ---- report ----

COLOURS = {"stock": "#999999", "stock-lpm": "#666666", "hicache-wb": "#e08a2c", "hicache-wb-lpm": "#b05f10",
           "hicache-wt-lpm": "#8a4a0c", "agentcache": "#2b7bba",
           "agentcache-lpm": "#164f80", "agentcache-admit-lpm": "#8a3ffc",
           "agentcache-agent-lpm": "#d12771", "agentcache-hook-lpm": "#7a8b99"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    b = result["backends"]
    names = list(b)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 5.2))
    computed = [statistics.fmean(p["computed_tokens"] for p in b[n]["passes"]) for n in names]
    left.bar(names, computed, color=[COLOURS[n] for n in names])
    left.axhline(b[names[0]]["ideal_computed_tokens"], color="green", ls=":", lw=1, label="never-evicting cache")
    for x, c in enumerate(computed):
        left.text(x, c, f"{c:,.0f}", ha="center", va="bottom", fontsize=9)
    left.set_ylabel("prefill tokens computed (mean of passes)")
    left.set_xlabel("backend")
    left.set_title("Prefill computed")
    for axis in (left, middle):
        axis.tick_params(axis="x", labelrotation=35, labelsize=8)
    left.legend(fontsize=8)
    jct = [statistics.fmean(p["jct_s"] for p in b[n]["passes"]) for n in names]
    middle.bar(names, jct, color=[COLOURS[n] for n in names])
    for x, c in enumerate(jct):
        middle.text(x, c, f"{c:.1f} s", ha="center", va="bottom", fontsize=9)
    middle.set_ylabel("trace completion time, s (mean of passes)")
    middle.set_xlabel("backend")
    middle.set_title("Job completion time")
    for n in names:
        lat = sorted(r[ROW_COLUMNS.index("ttft_s")] for r in result["requests"][n]
                     if r[ROW_COLUMNS.index("resume")] and r[ROW_COLUMNS.index("ttft_s")] is not None)
        if lat:
            right.step(lat, [(k + 1) / len(lat) for k in range(len(lat))], where="post", color=COLOURS[n],
                       label=f"{n} (n={len(lat)})")
    right.set_xscale("log")
    right.set_xlabel("resume time to first token, s (call after a tool; median pass)")
    right.set_ylabel("fraction of resumes")
    right.set_title("Resume TTFT CDF")
    right.legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"Real SGLang CPU server ({c['model_shape']} model), {c['workload']} seed {c['seed']}, "
                 f"{c['trace_stats']['requests']} calls, {c['pool_tokens']}-token KV pool, host tier "
                 f"{c['host_tokens']} tokens (all but stock), {c['passes']} passes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Real-server benchmark (one trace, fresh servers; figures of the median pass)")
    for col in ("backend", "host", "served", "failures", "computed", "ideal", "JCT s", "resume TTFT p50 s",
                "resume TTFT p99 s"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for name, b in result["backends"].items():
        q = b["resume_ttft_s"]
        table.add_row(name, f"{b['host_tokens']:,}", f"{b['served']}/{b['requests']}", str(b["failures"]),
                      f"{b['computed_tokens']:,}", f"{b['ideal_computed_tokens']:,}", f"{b['jct_s']:.1f}",
                      f"{q['p50']:.3f}", f"{q['p99']:.3f}")
    console = Console(width=max(Console().width, 140))  # the table must not be cut in logs
    console.print(table)
    for pair, cmp in result["comparison"].items():
        console.print(f"{pair}, pass by pass (mean, 95% CI): "
                      + "; ".join(f"{k} {v['mean']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] {v['verdict']}"
                                  for k, v in cmp.items() if isinstance(v, dict)))


def trace_stats(trace: Trace, plan: list[Step]) -> dict:
    reqs = trace.requests
    return {"requests": len(reqs), "events": len(trace.records) - len(reqs),
            "sessions": len({(r.tenant, r.session) for r in reqs}),
            "fork_branches": len({(r.session, r.branch) for r in reqs if r.parent_branch}),
            "tool_calls": sum(r.tool is not None for r in reqs), "resumes": sum(s.resume for s in plan),
            "extends_previous_call": sum(s.pred is not None for s in plan),
            "input_tokens": sum(r.input_tokens for r in reqs), "max_prompt_tokens": max(r.input_tokens for r in reqs)}


def dump_json(result: dict) -> str:
    """Indented JSON with one compact line per list of numbers or per request row (small, diffable)."""
    text = json.dumps(result, indent=1)
    # json's indent puts every list element on its own line; fold the innermost lists back onto one.
    text = re.sub(r"\[\n\s*([^\[\]{}]*?)\n\s*\]", lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    json.loads(text)  # still the same document
    return text + "\n"


def _mean_ci(values: list[float]) -> dict:
    """Mean, 95% Student-t interval and verdict (against 1) of per-pass ratios."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": round(mean, 4), "ci95": [math.nan, math.nan], "verdict": "tie", "passes": values}
    from scipy.stats import t

    half = float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    lo, hi = mean - half, mean + half
    verdict = "better" if hi < 1.0 else "worse" if lo > 1.0 else "tie"
    return {"mean": round(mean, 4), "ci95": [round(lo, 4), round(hi, 4)], "verdict": verdict,
            "passes": [round(v, 4) for v in values]}


#: What each comparison measures per pass: lower is better for all of them.
MEASURES = {"computed": lambda p: p["computed_tokens"], "jct": lambda p: p["jct_s"],
            "resume_ttft_p50": lambda p: p["resume_ttft_s"]["p50"], "resume_ttft_p99": lambda p: p["resume_ttft_s"]["p99"]}


def over_seeds(seeds: list[int], per_seed: list[dict], stats: list[dict]) -> dict:
    """Independent traces: each pair's per-trace ratio (the mean of that trace's pass-by-pass ratios)
    and, per measure, the mean over traces with its 95% t interval (traces are the samples, not passes)."""
    compared = [compare(backends) for backends in per_seed]
    pairs = compared[0].keys()
    return {"seeds": seeds, "trace_stats": stats,
            "per_seed": [{pair: {m: c[pair][m]["mean"] for m in MEASURES} for pair in pairs} for c in compared],
            "comparison": {pair: {m: _over_traces([c[pair][m]["mean"] for c in compared]) for m in MEASURES}
                           for pair in pairs}}


def _over_traces(values: list[float]) -> dict:
    ci = _mean_ci(values)
    ci["per_trace"] = ci.pop("passes")
    return ci


def compare(backends: dict) -> dict:
    """Each pair of :data:`COMPARISONS` (key ``"ours / theirs"``), pass by pass (same pass index: both
    saw the same trace from a flushed cache, in the same round of interleaved passes): the mean ratio
    of each measure with its 95% interval, "better"/"worse" only when the interval excludes 1. Plus
    extra failures over all passes (must be 0). Pairs with a backend that did not run are left out."""
    return {f"{a} / {b}": paired(backends[a], backends[b]) for a, b in COMPARISONS if a in backends and b in backends}


def paired(ours: dict, theirs: dict) -> dict:
    """Ours / theirs, pass by pass: each measure's mean ratio with its 95% interval and verdict, and
    the extra failures over all passes."""
    pairs = list(zip(ours["passes"], theirs["passes"]))
    out = {k: _mean_ci([f(a) / max(f(b), 1e-9) for a, b in pairs]) for k, f in MEASURES.items()}
    out["extra_failures"] = sum(p["failures"] for p in ours["passes"]) - sum(p["failures"] for p in theirs["passes"])
    return out


def _gpu_name() -> str | None:
    """The CUDA device's name (the servers run on it), for the results."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny trace (for the test)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON and PNG")
    ap.add_argument("--log-dir", help="keep the server logs here (default: a temporary directory)")
    ap.add_argument("--passes", type=int, help="passes of the trace per server (default: full 6, quick 2)")
    ap.add_argument("--pause-via", choices=("hint", "route"), default="hint",
                    help="how a call that ends in a tool pauses its branch (see the module docstring)")
    ap.add_argument("--backends", help="comma-separated subset of the backends (default: all but OPT_IN); the "
                                       "results then go to server_recompute-<subset>.json, the full run's file stays")
    ap.add_argument("--gpu", action="store_true",
                    help="serve on a CUDA GPU (SGLang 0.5.23 with its CUDA stack installed; bench/gpu/README.md): "
                         "GPU flags, HiCache's kernel io backend and page_first layout; results under a -gpu stem")
    ap.add_argument("--trace-seeds", type=int, default=1,
                    help="independent traces (generator seeds from the mode's): with more than one, ratios are "
                         "reported per trace and with an interval over traces (server_recompute-seeds<N>...json)")
    args = ap.parse_args(argv)
    if args.backends is None:
        names = [n for n in BACKENDS if n not in OPT_IN]
    else:
        names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown or not names:
        ap.error(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)}")
    stem = "server_recompute" if args.backends is None else "server_recompute-" + "+".join(names)
    if args.trace_seeds > 1:
        stem = stem.replace("server_recompute", f"server_recompute-seeds{args.trace_seeds}", 1)
    mode = "quick" if args.quick else "full"
    cfg = MODES[mode] | {"pause_via": args.pause_via} | ({"passes": args.passes} if args.passes is not None else {})
    if args.gpu:
        stem += "-gpu"
        cfg["gpu"] = True
    if cfg["passes"] < 1 or args.trace_seeds < 1:
        ap.error("--passes and --trace-seeds must be at least 1")
    seeds = [cfg["seed"] + i for i in range(args.trace_seeds)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="server-recompute-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(Path(tmp) / "model", shape=cfg["model_shape"])
        traces = [fit_context(generate("branch_heavy", seed=seed, **cfg["trace"]), cfg["context_length"],
                              cfg["output_cap"]) for seed in seeds]
        plans = [build_plan(trace) for trace, _ in traces]
        workloads = [(trace, plan) for (trace, _), plan in zip(traces, plans)]
        runs = run_interleaved(names, model, workloads, cfg, log_dir)
        if args.log_dir:
            print(f"[server_recompute] server logs in {log_dir}")
    (trace, dropped), plan, (backends, rows) = traces[0], plans[0], runs[0]
    result = {
        "benchmark": "server_recompute", "mode": mode,
        "command": ("python" if args.gpu else "SGLANG_USE_CPU_ENGINE=1 .venv/bin/python") + " bench/server_recompute.py"
                   + " --quick" * args.quick
                   + " --pause-via route" * (args.pause_via == "route")
                   + (f" --passes {args.passes}" if args.passes is not None else "")
                   + (f" --backends {','.join(names)}" if args.backends is not None else "")
                   + (f" --trace-seeds {args.trace_seeds}" if args.trace_seeds > 1 else "") + " --gpu" * args.gpu,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "gpu": _gpu_name() if args.gpu else None,
                    "sglang": _version("sglang"), "torch": _version("torch")},
        "config": {"workload": "branch_heavy", **{k: v for k, v in cfg.items() if k != "trace"},
                   "host_tokens": host_tokens(cfg), "trace_params": cfg["trace"], "vocab_size": model.vocab_size,
                   "sessions_dropped_for_context": dropped, "trace_stats": trace_stats(trace, plan),
                   "backends": {n: {"radix_cache_backend": b.radix_backend or "default", "hints": b.hints,
                                    "schedule_policy": b.schedule_policy,
                                    "hicache_write_policy": b.hicache_write_policy}
                                for n, b in BACKENDS.items() if n in names}},
        "backends": backends,
        "comparison": compare(backends),
        "requests": {"columns": list(ROW_COLUMNS), **rows},
    }
    if len(seeds) > 1:  # the first trace's figures above; every trace's, and intervals over traces, here
        stats = [trace_stats(t, p) for (t, _), p in zip(traces, plans)]
        result["seeds"] = over_seeds(seeds, [b for b, _ in runs], stats)
    (out / f"{stem}.json").write_text(dump_json(result))
    plot(result, out / f"{stem}.png")
    print_table(result)
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
