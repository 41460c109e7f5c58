"""The replayer's cache takes the same decisions as the real server (issue #5 acceptance).

One small agent script -- five sessions sharing a system prompt, tool pauses of a fast and a
long-tailed class, a forked subagent that closes, a session close -- runs against a real SGLang CPU
server with a constrained KV pool, one request at a time. The same script, with the server's actual
output tokens, then drives the offline cache the replayer uses (same pool size, quotas and pause
settings as the server reports). Both must agree on every decision: cached tokens per request, the
pause decisions and the tokens they concern, the exact sequence of node deletions (evictions and
reclaims) and the final resident tokens per class. Neither has a host tier (no HiCache), so no pause
is an offload and what eviction takes is gone.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.distributions import LogNormal
from sgl_agentcache.policy.latency import LatencyBook, LatencyModel

from conftest import TOOL_PRIORS  # tests/ is on sys.path (pytest prepend import mode)

pytestmark = pytest.mark.server

POOL = 1536
STABLE = 64
NEW_TOKENS = 4


def _script(vocab: int) -> list[tuple]:
    """('gen', session, branch, parent, prompt_parts, close) and ('pause', session, branch, tool_class) and
    ('close_session', session) steps. prompt_parts: 'prev' (the branch's, or its parent's, last prompt
    + outputs) and token lists."""
    rng = random.Random(11)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = ids(STABLE)
    steps = []
    for s in range(8):  # about 2,700 tokens through a 1,536-token pool: evictions
        session = f"m{s}"
        steps.append(("gen", session, "main", None, [system, ids(230)], False))
        steps.append(("pause", session, "main", "ci_run" if s % 2 else "grep"))
        steps.append(("gen", session, "main", None, ["prev", ids(40)], False))
        if s == 1:  # a subagent forked from the lead, which finishes and closes
            steps.append(("gen", session, "w1", "main", ["prev", ids(60)], False))
            steps.append(("gen", session, "w1", None, ["prev", ids(20)], True))
        if s == 2:
            steps.append(("close_session", "m0"))
    return steps


def _hint(session, branch, parent, close, fork_point):
    hint = {"session": session, "branch": branch, "stable_prefix_tokens": STABLE, "close": close}
    if parent is not None:
        hint |= {"parent_branch": parent, "fork_point_tokens": fork_point}
    return hint


def _run_server(server, steps):
    history, record = {}, []
    for step in steps:
        if step[0] == "gen":
            _, session, branch, parent, parts, close = step
            base = history.get((session, parent or branch), [])
            prompt = [t for part in parts for t in (base if part == "prev" else part)]
            hint = _hint(session, branch, parent, close, len(base))
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                             "ignore_eos": True},
                    "kv_hints": lifecycle_envelope(hint, message_id=f"m-{time.monotonic_ns()}")}
            out = server.generate(body)
            history[(session, branch)] = prompt + out["output_ids"]
            record.append(("gen", prompt, out["output_ids"], hint, out["meta_info"]["cached_tokens"]))
        elif step[0] == "pause":
            _, session, branch, tool = step
            status, result = server.request("POST", "/agentcache/pause", {"session": session, "branch": branch,
                                                                         "tool_class": tool})
            assert status == 200, result
            record.append(("pause", session, branch, tool, result["action"], result["tokens"]))
        else:
            status, result = server.request("POST", "/agentcache/session/close", {"session": step[1]})
            assert status == 200, result
            record.append(("close_session", step[1]))
    return record


def _run_offline(record, stats, monkeypatch):
    from sgl_agentcache.server.scheduler.offline import OfflineDriver, build_offline_cache

    monkeypatch.setenv("AGENTCACHE_RECORD_EVICTIONS", "1")
    cache = build_offline_cache(pool_tokens=stats["pool_tokens"], page_size=stats["page_size"], max_reqs=8,
                                context_len=1024)
    cache.branch_quota_tokens, cache.session_quota_tokens = stats["branch_quota_tokens"], stats["session_quota_tokens"]
    for name, value in stats["pauses"]["settings"].items():
        setattr(cache.pauses.settings, name, value)
    driver = OfflineDriver(cache)
    book = LatencyBook(priors={k: LogNormal(**v) for k, v in TOOL_PRIORS.items()})
    ns = namespace_key(None, None)
    seen = []
    for i, entry in enumerate(record):
        if entry[0] == "gen":
            _, prompt, outputs, hint, _ = entry
            req = driver.admit(f"r{i}", prompt, kv_hints=lifecycle_envelope(hint, message_id=f"m{i}"))
            driver.extend(req, outputs)
            driver.finish(req)
            seen.append(("gen", req.cached_tokens))
        elif entry[0] == "pause":
            _, session, branch, tool, _, _ = entry
            # Exactly what the server's pause coordinator sends: the class's model, through msgpack.
            snapshot = msgspec.msgpack.decode(msgspec.msgpack.encode(book.peek(ns, tool).snapshot()),
                                              type=type(book.peek(ns, tool).snapshot()))
            with driver.activated():
                result = cache.pauses.pause(BranchKey(ns, session, branch), LatencyModel.from_snapshot(snapshot),
                                            tool_class=tool, deadline_s=600.0, priority=0, resume_probability=1.0)
            seen.append(("pause", result["action"], result["tokens"]))
        else:
            with driver.activated():
                cache.close_session(ns, entry[1])
            seen.append(("close_session",))
    return cache, driver, seen


def test_replayer_cache_takes_the_servers_decisions(tiny_model, tmp_path, monkeypatch):
    server = CpuServer(str(tiny_model.path), log_path=tmp_path / "sglang.log", max_total_tokens=POOL,
                       extra_args=("--enable-cache-report", "--skip-server-warmup"),
                       env={"AGENTCACHE_RECORD_EVICTIONS": "1", "AGENTCACHE_PROFILE": "seed",
                            "AGENTCACHE_TOOL_PRIORS": msgspec.json.encode(TOOL_PRIORS).decode()})
    with server.start():
        # SGLang's start-up probe leaves a few untagged tokens the offline cache never sees; under
        # this script's pressure eviction would reach them, so the script starts on an empty tree.
        assert server.request("POST", "/flush_cache")[0] == 200
        status, before = server.request("GET", "/agentcache/deletions")
        assert status == 200
        # SGLang's own health probes leave a few untagged tokens before the script starts.
        _, stats_before = server.request("GET", "/agentcache/stats")
        record = _run_server(server, _script(tiny_model.vocab_size))
        _, deletions = server.request("GET", "/agentcache/deletions")
        _, stats = server.request("GET", "/agentcache/stats")
    server_deletions = deletions["deletions"][len(before["deletions"]):]

    cache, driver, seen = _run_offline(record, stats, monkeypatch)
    server_seen = [("gen", e[4]) if e[0] == "gen" else ("pause", e[4], e[5]) if e[0] == "pause" else ("close_session",)
                   for e in record]
    assert seen == server_seen
    decisions = {e[1] for e in seen if e[0] == "pause"}
    assert {"keep", "discard"} <= decisions, decisions  # both decisions were exercised
    assert "offload" not in decisions  # no host tier: an offload has nowhere to go
    offline_deletions = [list(d) for d in cache.tree_core.deletions]
    assert len(server_deletions) > 10  # the pool was under pressure: evictions and reclaims
    assert offline_deletions == server_deletions
    with driver.activated():
        offline = cache.agent_stats()
    resident = dict(stats["resident_tokens"])
    resident["untagged"] -= stats_before["resident_tokens"]["untagged"]
    assert offline["resident_tokens"] == resident
    assert offline["evictable_tokens"] == stats["evictable_tokens"] - stats_before["resident_tokens"]["untagged"]
    assert driver.check().ok
