"""A bounded soak against a real server: concurrent agents with forks, pauses, resumes, prefetches, closes,
aborted streams and duplicate closes, on SGLang's HiCache; then everything is closed and checked.

``make soak`` runs three phases, each on a fresh server (:func:`run_standalone`): the product's defaults
(lazy pauses); eager pauses (offloads demoted into HiCache's host pool, prefetches loaded back through
HiCache's load path while the scheduler idles); and two tenants, one of
which floods the server with pausing calls and refused over-long chats while the other's agents run
and its ``/agentcache/stats`` is timed (:func:`run_tenants`).

Each worker owns its sessions (no cross-worker races by construction), so every call has a known
expected outcome and any other outcome is an unexplained failure; the one deliberate race, a close of a
subagent branch while its request is in flight, has two allowed outcomes for the close (see
:meth:`Soak._close_racing_request`). At the end: every branch closed,
zero tokens owned by closed branches, nothing terminated left resident on either tier, the tree
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
    """``headers``: sent with every call (a tenant's key); ``admin_headers``: with the final checks
    (stats, check) when they need more than the tenant may read. ``flood_workers``: threads that send
    tiny hinted calls pausing on ``grep`` as fast as they are answered, and over-long chats the server
    refuses (a hostile tenant). ``stats_every_s``: time ``GET /agentcache/stats`` that often meanwhile."""

    def __init__(self, server, vocab: int, *, workers: int = 4, seconds: float = 60.0, seed: int = 0,
                 headers: dict | None = None, admin_headers: dict | None = None,
                 flood_workers: int = 0, stats_every_s: float = 0.0):
        self.server, self.vocab, self.workers, self.seconds = server, vocab, workers, seconds
        self.seed = seed
        self.headers = dict(headers or {})
        self.admin_headers = dict(admin_headers if admin_headers is not None else self.headers)
        self.flood_workers, self.stats_every_s = flood_workers, stats_every_s
        self.system = random.Random(seed).choices(range(3, vocab), k=64)
        self.counts: Counter = Counter()
        self.unexpected: list[str] = []
        self.stats_waits: list[float] = []
        self.lock = threading.Lock()

    def _request(self, method: str, path: str, body: dict | None = None, admin: bool = False):
        return self.server.request(method, path, body, headers=self.admin_headers if admin else self.headers)

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
        status, out = self._request("POST", "/generate", body)
        self._note("generate", status == 200, f"{status} {out}")
        return out.get("output_ids") if status == 200 else None

    def _post(self, kind: str, path: str, body: dict, expect: tuple[int, ...] = (200,)) -> dict:
        status, out = self._request("POST", path, body)
        self._note(kind, status in expect, f"{path} {body} -> {status} {out}")
        return out

    def _aborted_stream(self, rng, session: str, prompt: list[int]) -> None:
        """A client that disconnects mid-stream (the server aborts the request)."""
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": session, "branch": "streamer", "parent_branch": "main",
                                                "fork_point_tokens": len(prompt)}, message_id=f"m{rng.random()}")}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json", **self.headers})
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
        status, out = self._request("POST", "/agentcache/branch/close", body)
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
        # Two turns take the first session past the 200 tokens a pause needs (system 64 + 120 + 2 x 20).
        opening = ["turn", "turn", "pause", "prefetch", "fork", "close_fork"]
        while time.monotonic() < deadline:
            if s is None or len(s.history) > MAX_PROMPT:
                if s is not None:
                    self._post("session_close", "/agentcache/session/close", {"session": s.name})
                serial += 1
                s = _Session(f"soak{self.seed}-w{index}-s{serial}", [])
                prompt = self.system + ids(120)
                s.history = prompt + (self._gen(rng, s.name, "main", prompt) or [])
                continue
            if opening:  # every worker covers pause -> prefetch -> resume however slow the machine is
                op = opening.pop(0)
            else:
                op = rng.choices(["turn", "fork", "pause", "close_fork", "abort", "dup_close", "race", "abandon",
                                  "prefetch"], weights=[5, 2, 2, 1, 1, 1, 1, 1, 1])[0]
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
            elif op == "prefetch" and s.paused:
                # "The tool is nearly done", then its result: the copy back may still be in flight when
                # the resume (or the next turn) comes, and the scheduler may idle meanwhile.
                self._post("prefetch", "/agentcache/prefetch", {"session": s.name}, expect=(200, 404))
                self._post("resume", "/agentcache/resume", {"session": s.name})
                s.paused = False
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
        if s is not None:
            self._post("session_close", "/agentcache/session/close", {"session": s.name})
        time.sleep(1.5)  # the last abandoned pauses reach their deadline first
        for name in abandoned:
            self._post("session_close", "/agentcache/session/close", {"session": name})
        with self.lock:
            self.counts["abandoned_sessions"] += len(abandoned)

    def _flood(self, index: int, deadline: float) -> None:
        """A hostile tenant: tiny hinted calls that pause on ``grep`` when answered, as fast as they are
        answered, on 40 branches of one session; first and every 25th call a chat far over the context
        (refused). A count, not a coin: on a slow machine a worker makes few calls, and the refusal must
        still happen."""
        rng = random.Random(self.seed * 1000 + 500 + index)
        session = f"soak{self.seed}-flood{index}"
        huge = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": ""}] * 3000}
        sent = 0
        while time.monotonic() < deadline:
            sent += 1
            if sent % 25 == 1:
                status, out = self._request("POST", "/v1/chat/completions", huge)
                self._note("flood_refused_chat", status == 400, f"{status} {out}")
                continue
            prompt = self.system + [rng.randrange(3, self.vocab) for _ in range(8)]
            self._gen(rng, session, f"b{rng.randrange(40)}", prompt, tool_class="grep")
        self._post("session_close", "/agentcache/session/close", {"session": session}, expect=(200, 404))

    def _time_stats(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            started = time.monotonic()
            status, out = self._request("GET", "/agentcache/stats")
            self._note("stats", status == 200, f"{status} {out}")
            with self.lock:
                self.stats_waits.append(time.monotonic() - started)
            time.sleep(self.stats_every_s)

    def drive(self) -> None:
        """Run the agents (and the flood and the stats timer), until every worker has finished."""
        deadline = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)]
        threads += [threading.Thread(target=self._flood, args=(i, deadline), daemon=True)
                    for i in range(self.flood_workers)]
        if self.stats_every_s > 0:
            threads.append(threading.Thread(target=self._time_stats, args=(deadline,), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.seconds + 300)

    # ---- the run ----

    def run(self) -> dict:
        started = time.monotonic()
        before = self._request("GET", "/agentcache/stats", admin=True)[1]
        self.drive()
        time.sleep(1.0)  # aborted streams finish releasing
        return self.report(before, started)

    def report(self, before: dict, started: float) -> dict:
        """What the run left: every soak branch closed and owning nothing, nothing terminated pending,
        the tree check passing, the server healthy (read with the admin headers)."""
        _, stats = self._request("GET", "/agentcache/stats", admin=True)
        _, check = self._request("GET", "/agentcache/check", admin=True)
        health, _ = self._request("GET", "/health")
        mine = [b for b in stats["branches"] if b["session"].startswith(f"soak{self.seed}-")]
        waits = sorted(self.stats_waits)
        return {
            "workers": self.workers, "flood_workers": self.flood_workers,
            "seconds": round(time.monotonic() - started, 1), "calls": dict(self.counts),
            "stats_wait_s": {"n": len(waits), "p50": waits[len(waits) // 2], "max": waits[-1]} if waits else None,
            "unexpected_failures": self.unexpected, "health": health, "check_ok": check.get("ok"),
            "check_idle": check.get("idle"), "open_soak_branches": [b for b in mine if not b["closed"]],
            "leaked_tokens": sum(b["owned_tokens"] for b in mine),
            "terminated_pending_tokens": stats["terminated_pending_tokens"],
            # Ended branches' tokens in HiCache's host pool (a close deletes them there too); live
            # shared history and stable prefixes are cache, not a leak, and are left out.
            "host_tokens": {"before": _ended_host_tokens(before), "after": _ended_host_tokens(stats)},
            "resident_tokens": {"before": before["resident_tokens"], "after": stats["resident_tokens"]},
            "pause_decisions": stats["pauses"]["decisions"],
            "deadline_releases": stats["pauses"]["deadline_releases"] - before["pauses"]["deadline_releases"],
            "fallbacks": {"offload": stats["pauses"]["offload_fallbacks"]},
            "hicache_offloaded_tokens": stats["pauses"]["hicache_offloaded_tokens"],
        }


def _ended_host_tokens(stats: dict) -> int:
    return stats["hicache"].get("host_tokens_by_class", {}).get("terminated", 0)


def passed(report: dict) -> bool:
    """A phase passed: no unexplained failure, the server alive and its tree sound, nothing left."""
    return bool(not report["unexpected_failures"] and report["health"] == 200 and report["check_ok"]
                and not report["open_soak_branches"] and report["leaked_tokens"] == 0
                and report["terminated_pending_tokens"] == 0 and report["host_tokens"]["after"] == 0)


TOOL_PRIORS = {"grep": {"median_s": 0.02, "sigma": 0.5}, "ci_run": {"median_s": 60.0, "sigma": 1.5}}
#: The two tenants of the tenant phase (keys for this local test server only).
TENANT_KEYS = {"flooder": "ak-soak-flooder-0123456789", "victim": "ak-soak-victim-01234567890"}
ADMIN_KEY = "ak-soak-admin-0123456789abc"


def tenants_file(path) -> None:
    """The tenant phase's tenants: two tenants and an admin; sessions need no credential (any id,
    still bound to its tenant's namespace), so the soak's agents name their own."""
    from sgl_agentcache.tenancy import key_digest

    lines = ["require_signed_sessions = false", f'admin_keys = ["{key_digest(ADMIN_KEY)}"]']
    for name, key in TENANT_KEYS.items():
        lines += [f"[tenants.{name}]", f'keys = ["{key_digest(key)}"]']
    path.write_text("\n".join(lines) + "\n")


def run_tenants(server, vocab: int, *, seconds: float, workers: int, seed: int = 0) -> dict:
    """Two tenants on one server: ``flooder`` runs agents plus a flood (pausing calls, refused chats),
    ``victim`` runs agents and times its own stats meanwhile. Both are checked once both are done."""
    admin = {"x-agentcache-key": ADMIN_KEY}
    flooder = Soak(server, vocab, workers=max(workers // 3, 1), seconds=seconds, seed=seed * 10 + 1,
                   headers={"x-agentcache-key": TENANT_KEYS["flooder"]}, admin_headers=admin,
                   flood_workers=max(workers, 2))
    victim = Soak(server, vocab, workers=max(workers // 2, 1), seconds=seconds, seed=seed * 10 + 2,
                  headers={"x-agentcache-key": TENANT_KEYS["victim"]}, admin_headers=admin, stats_every_s=0.25)
    started = time.monotonic()
    before = server.request("GET", "/agentcache/stats", headers=admin)[1]
    runs = [threading.Thread(target=soak.drive, daemon=True) for soak in (flooder, victim)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(seconds + 600)
    time.sleep(1.0)
    return {"flooder": flooder.report(before, started), "victim": victim.report(before, started)}


def run_standalone(seconds: float, workers: int, out_path: str | None, seed: int = 0,
                   phases: tuple[str, ...] = ("lazy", "eager", "tenants")) -> dict:
    """Soak a fresh CPU server per phase (tiny model, on SGLang's HiCache; see the module docstring),
    ``seconds`` each; write the report. A phase passes with 0 server deaths and 0 leaked tokens."""
    import tempfile
    from pathlib import Path

    from sgl_agentcache.cpu_server import CpuServer
    from sgl_agentcache.tiny_model import make_tiny_model

    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        for phase in phases:
            env = {"AGENTCACHE_PROFILE": "seed", "AGENTCACHE_TOOL_PRIORS": json.dumps(TOOL_PRIORS)}
            if phase == "eager":
                env["AGENTCACHE_PAUSE_MODE"] = "eager"
            if phase == "tenants":
                tenants_file(Path(tmp) / "tenants.toml")
                env |= {"AGENTCACHE_TENANTS": str(Path(tmp) / "tenants.toml"), "AGENTCACHE_SECRET": "k" * 48,
                        "AGENTCACHE_INFER": "chat"}
            # A small HiCache host pool (a few branches' worth, 1/8 of the pool): offloads also meet a full one.
            server = CpuServer(str(model.path), log_path=Path(tmp) / f"sglang-{phase}.log", max_total_tokens=4096,
                               extra_args=("--enable-cache-report", "--enable-hierarchical-cache",
                                           "--hicache-io-backend", "direct", "--hicache-write-policy", "write_back",
                                           "--hicache-ratio", "0.125"), env=env)
            with server.start():
                if phase == "tenants":
                    runs = run_tenants(server, model.vocab_size, seconds=seconds, workers=workers, seed=seed)
                else:
                    runs = {phase: Soak(server, model.vocab_size, workers=workers, seconds=seconds, seed=seed).run()}
                alive = server.proc is not None and server.proc.poll() is None
            for name, run in runs.items():
                run["server_alive"] = alive
                run["passed"] = alive and passed(run)
                report[name] = run
    report["passed"] = all(run["passed"] for run in report.values())
    if out_path:
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")
    return report
