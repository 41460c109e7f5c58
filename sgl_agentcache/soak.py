"""A bounded soak against a real server: concurrent agents with forks, pauses, resumes, closes, aborted
streams, duplicate closes and injected transfer faults; then everything is closed and checked.

Each worker owns its sessions (no cross-worker races by construction), so every call has a known
expected outcome and any other outcome is an unexplained failure; the one deliberate race, a close of a
subagent branch while its request is in flight, has two allowed outcomes for the close (see
:meth:`Soak._close_racing_request`). At the end: every branch closed,
zero tokens owned by closed branches, nothing terminated left resident, the host tier empty, the tree
check passes with the scheduler idle, and the server is healthy. Loopback only; bounded in time and
in prompt length (under the server's context length); token ids always in ``[3, vocab)``.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from sgl_agentcache.hints import lifecycle_envelope

MAX_PROMPT = 700  # the test server's context is 1024 tokens; a session restarts past this
NEW_TOKENS = 6


@dataclass
class _Session:
    name: str
    history: list[int]
    forks: list[str] = field(default_factory=list)
    paused: bool = False


class Soak:
    def __init__(self, server, vocab: int, *, workers: int = 4, seconds: float = 60.0, seed: int = 0,
                 faults: bool = True):
        self.server, self.vocab, self.workers, self.seconds, self.faults = server, vocab, workers, seconds, faults
        self.seed = seed
        self.system = random.Random(seed).choices(range(3, vocab), k=64)
        self.counts: Counter = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()

    # ---- calls ----

    def _note(self, kind: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.counts[kind] += 1
            if not ok:
                self.unexpected.append(f"{kind}: {detail}"[:300])

    def _gen(self, rng, session: str, branch: str, prompt: list[int], **hint) -> list[int] | None:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                         "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": session, "branch": branch, "stable_prefix_tokens": 64,
                                                **hint}, message_id=f"m{rng.random()}")}
        status, out = self.server.request("POST", "/generate", body)
        self._note("generate", status == 200, f"{status} {out}")
        return out.get("output_ids") if status == 200 else None

    def _post(self, kind: str, path: str, body: dict, expect: tuple[int, ...] = (200,)) -> dict:
        status, out = self.server.request("POST", path, body)
        self._note(kind, status in expect, f"{path} {body} -> {status} {out}")
        return out

    def _aborted_stream(self, rng, session: str, prompt: list[int]) -> None:
        """A client that disconnects mid-stream (the server aborts the request)."""
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": session, "branch": "streamer", "parent_branch": "main",
                                                "fork_point_tokens": len(prompt)}, message_id=f"m{rng.random()}")}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            ok = response.status == 200 and bool(response.fp.readline())
            self._note("aborted_stream", ok, f"status {response.status}")
        finally:
            conn.close()

    def _close_racing_request(self, rng, session: str, branch: str, prompt: list[int]) -> None:
        """A subagent's request in flight while its branch is closed: the request still succeeds (its
        tokens are born or become terminated and are freed when it releases); the close answers 200, or
        404 when it overtakes the request before the server has seen the branch, in which case the
        harness closes it again once the request has returned."""
        worker = threading.Thread(target=self._gen, args=(rng, session, branch, prompt),
                                  kwargs={"parent_branch": "main", "fork_point_tokens": len(prompt) - 40})
        worker.start()
        time.sleep(rng.uniform(0.0, 0.05))
        body = {"session": session, "branch": branch}
        status, out = self.server.request("POST", "/agentcache/branch/close", body)
        self._note("race_close", status in (200, 404), f"{status} {out}")
        worker.join(120)
        if status == 404:
            with self.lock:
                self.counts["race_close_overtook"] += 1
            self._post("branch_close", "/agentcache/branch/close", body)

    # ---- one agent ----

    def _worker(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        ids = lambda n: [rng.randrange(3, self.vocab) for _ in range(n)]  # noqa: E731
        deadline = time.monotonic() + self.seconds
        serial = 0
        s: _Session | None = None
        abandoned: list[str] = []
        while time.monotonic() < deadline:
            if s is None or len(s.history) > MAX_PROMPT:
                if s is not None:
                    self._post("session_close", "/agentcache/session/close", {"session": s.name})
                serial += 1
                s = _Session(f"soak{self.seed}-w{index}-s{serial}", [])
                prompt = self.system + ids(120)
                s.history = prompt + (self._gen(rng, s.name, "main", prompt) or [])
                continue
            op = rng.choices(["turn", "fork", "pause", "close_fork", "abort", "dup_close", "race", "abandon", "fault"],
                             weights=[5, 2, 2, 1, 1, 1, 1, 1, 1 if self.faults else 0])[0]
            if op == "turn":
                prompt = s.history + ids(rng.randrange(20, 80))
                out = self._gen(rng, s.name, "main", prompt)
                s.history = prompt + (out or [])
                s.paused = False
            elif op == "fork":
                name = f"f{len(s.forks)}"
                prompt = s.history + ids(40)
                out = self._gen(rng, s.name, name, prompt, parent_branch="main", fork_point_tokens=len(s.history))
                if out is not None:
                    s.forks.append(name)
                    self._gen(rng, s.name, name, prompt + out + ids(20), close=rng.random() < 0.5)
            elif op == "pause" and len(s.history) > 200:
                self._post("pause", "/agentcache/pause", {"session": s.name, "tool_class": rng.choice(["grep", "ci_run"]),
                                                          "deadline_ms": rng.randrange(1000, 5000)})
                s.paused = True
            elif op == "pause":
                self._post("resume", "/agentcache/resume", {"session": s.name})
            elif op == "close_fork" and s.forks:
                self._post("branch_close", "/agentcache/branch/close", {"session": s.name, "branch": s.forks.pop()})
            elif op == "abort" and len(s.history) + 200 < 1000:
                self._aborted_stream(rng, s.name, s.history + ids(10))
            elif op == "dup_close" and s.forks:
                branch = s.forks.pop()
                for _ in range(2):  # the second close is idempotent
                    self._post("branch_close", "/agentcache/branch/close", {"session": s.name, "branch": branch})
            elif op == "abandon" and len(s.history) > 200:
                # A tool that never returns: pause with a short deadline and never come back. The
                # deadline releases the branch on every tier; the session is closed at the very end.
                self._post("pause", "/agentcache/pause", {"session": s.name, "tool_class": "ci_run",
                                                          "deadline_ms": 1000})
                abandoned.append(s.name)
                s = None
            elif op == "race":
                self._close_racing_request(rng, s.name, f"r{serial}-{rng.randrange(10**6)}", s.history + ids(40))
            elif op == "fault":
                self._post("fault", "/agentcache/fault", {"kind": rng.choice(["demote", "promote"]), "count": 1})
        if s is not None:
            self._post("session_close", "/agentcache/session/close", {"session": s.name})
        time.sleep(1.5)  # the last abandoned pauses reach their deadline first
        for name in abandoned:
            self._post("session_close", "/agentcache/session/close", {"session": name})
        with self.lock:
            self.counts["abandoned_sessions"] += len(abandoned)

    # ---- the run ----

    def run(self) -> dict:
        started = time.monotonic()
        before = self.server.request("GET", "/agentcache/stats")[1]
        threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.seconds + 300)
        time.sleep(1.0)  # aborted streams finish releasing
        _, stats = self.server.request("GET", "/agentcache/stats")
        _, check = self.server.request("GET", "/agentcache/check")
        health, _ = self.server.request("GET", "/health")
        mine = [b for b in stats["branches"] if b["session"].startswith(f"soak{self.seed}-")]
        return {
            "workers": self.workers, "seconds": round(time.monotonic() - started, 1), "calls": dict(self.counts),
            "unexpected_failures": self.unexpected, "health": health, "check_ok": check.get("ok"),
            "check_idle": check.get("idle"), "open_soak_branches": [b for b in mine if not b["closed"]],
            "leaked_tokens": sum(b["owned_tokens"] + b.get("spilled_tokens", 0) for b in mine),
            "terminated_pending_tokens": stats["terminated_pending_tokens"],
            # Paused branches' host copies; the node spill's entries (evicted shared nodes, kept for
            # reuse) are not a leak and are left out.
            "host_tokens": {"before": _pause_host_tokens(before), "after": _pause_host_tokens(stats)},
            "resident_tokens": {"before": before["resident_tokens"], "after": stats["resident_tokens"]},
            "pause_decisions": stats["pauses"]["decisions"],
            "deadline_releases": stats["pauses"]["deadline_releases"] - before["pauses"]["deadline_releases"],
            # Copies of the node spill (lazy pauses move KV there, not at the pause) that failed, this run.
            "spill_failures": {k: stats["spill"][k] - before["spill"][k] for k in ("spill_failed", "load_failed")},
            "fallbacks": {"offload": stats["pauses"]["offload_fallbacks"],
                          "restore": stats["pauses"]["restore_failures"]},
        }


def _pause_host_tokens(stats: dict) -> int:
    return stats["pauses"]["host"]["used_tokens"] - stats["spill"]["tokens"]


def run_standalone(seconds: float, workers: int, out_path: str | None, seed: int = 0) -> dict:
    """Start a CPU server with the tiny model (fault injection on), soak it, write the report."""
    import tempfile
    from pathlib import Path

    from sgl_agentcache.cpu_server import CpuServer
    from sgl_agentcache.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        server = CpuServer(str(model.path), log_path=Path(tmp) / "sglang.log", max_total_tokens=4096,
                           extra_args=("--enable-cache-report",),
                           env={"AGENTCACHE_FAULT_INJECTION": "1", "AGENTCACHE_PROFILE": "seed",
                                # A small host tier (a few branches' worth): offloads also meet a full one.
                                "AGENTCACHE_HOST_TOKENS": "640",
                                "AGENTCACHE_TOOL_PRIORS": json.dumps({"grep": {"median_s": 0.02, "sigma": 0.5},
                                                                          "ci_run": {"median_s": 60.0, "sigma": 1.5}})})
        with server.start():
            report = Soak(server, model.vocab_size, workers=workers, seconds=seconds, seed=seed).run()
    report["passed"] = (not report["unexpected_failures"] and report["health"] == 200 and report["check_ok"]
                        and not report["open_soak_branches"] and report["leaked_tokens"] == 0
                        and report["terminated_pending_tokens"] == 0 and report["host_tokens"]["after"] == 0)
    if out_path:
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")
    return report
