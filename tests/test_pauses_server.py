"""Eager tool pauses on a real SGLang server (CPU) with SGLang's HiCache as the host tier: an offload
demotes the paused branch's KV into HiCache's host pool at the pause and its next turn loads it back
(real KV bytes: greedy output is identical to a run that never paused), short tools are kept, and
deadlines release every tier.

These run on the ``eager_server`` fixture (``AGENTCACHE_PAUSE_MODE=eager`` on HiCache, write-back, a
host pool of 4x the device pool); the default, lazy mode is tested in ``test_lazy_pauses_server.py``.
Decisions are priced as the seed's 36 KiB/token deployment, with operator priors for the ``grep``
(~20 ms) and ``ci_run`` (~1 min, long tail) tool classes (conftest.py).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from sgl_agentcache.hints import lifecycle_envelope
from server_checks import check_when_idle

pytestmark = pytest.mark.server


@pytest.fixture
def server(eager_server):
    """This module's tests run on the eager server (see the module docstring)."""
    return eager_server

STABLE = 32


def _meta(server, ids, session, *, extra_key, max_new_tokens=6):
    body = {"input_ids": ids, "extra_key": extra_key,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope({"session": session, "stable_prefix_tokens": STABLE},
                                           message_id=f"m-{time.monotonic_ns()}")}
    out = server.generate(body)
    return out["output_ids"], out["meta_info"]


def _gen(server, ids, session, *, extra_key, max_new_tokens=6):
    out, meta = _meta(server, ids, session, extra_key=extra_key, max_new_tokens=max_new_tokens)
    return out, meta["cached_tokens"]


def _post(server, path, body):
    return server.request("POST", path, body)


def _stats(server):
    status, stats = server.request("GET", "/agentcache/stats")
    assert status == 200
    return stats


def _host(stats) -> int:
    """Tokens in HiCache's host pool that the device does not hold (every lifecycle class)."""
    return sum(stats["hicache"]["host_tokens_by_class"].values())


def _settled(server, done, timeout: float = 30.0) -> dict:
    """Stats once ``done(stats)`` holds (HiCache acknowledges a copy a scheduler step or two later)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(server)
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _events(server, until, timeout: float = 10.0) -> list[dict]:
    """The event log's records once ``until(records)`` holds (a writer thread appends them, off the
    request path, so the last ones may land a moment after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [json.loads(line) for line in server.event_log.read_text().splitlines()]
        if until(events) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def _conversation(server, tokens, session, extra_key, pause_body=None, after_pause=None):
    """Turn 1, an optional pause (and hook), turn 2 whose prompt extends turn 1 with a tool result.
    Returns turn 1's and turn 2's outputs, turn 2's cached tokens by tier and the pause's reply."""
    prompt = tokens.ids(300)
    tool_result = tokens.ids(40)
    out1, _ = _gen(server, prompt, session, extra_key=extra_key)
    paused = None
    if pause_body is not None:
        status, paused = _post(server, "/agentcache/pause", {"session": session, "extra_key": extra_key,
                                                             **pause_body})
        assert status == 200, paused
        if after_pause is not None:
            after_pause(paused)
    out2, meta2 = _meta(server, prompt + out1 + tool_result, session, extra_key=extra_key)
    return out1, out2, meta2["cached_tokens_details"], paused


def test_long_tailed_tool_is_offloaded_into_hicache_and_loaded_back_exactly(server, tokens):
    seen = {}
    before = _stats(server)
    assert before["hicache"]["attached"] and before["hicache"]["write_policy"] == "write_back"

    def after_pause(paused):
        moved = paused.get("moved_tokens", 0)
        stats = _settled(server, lambda s: _host(s) >= _host(before) + moved)
        seen["host"] = _host(stats)
        seen["resident"] = stats["resident_tokens"]
        seen["pauses"] = stats["pauses"]

    reference = _conversation(server, tokens.__class__(tokens.vocab_size, seed=7), "ref", "ref-ns")
    before = _stats(server)
    out1, out2, cached2, paused = _conversation(
        server, tokens.__class__(tokens.vocab_size, seed=7), "tool", "tool-ns",
        pause_body={"tool_class": "ci_run"}, after_pause=after_pause)
    assert paused["action"] == "offload" and paused["lazy"] is False, paused
    retained = paused["tokens"]
    assert retained >= 300 - STABLE
    assert paused["moved_tokens"] == retained  # all of it found host room
    assert "offload" in paused["costs"] and paused["inputs"]["latency_p50_s"] > 10
    assert paused["inputs"]["host_free_bytes"] > 0  # HiCache's host pool is the host tier
    # In HiCache's host pool, and off the device: the session class lost exactly the retained tokens.
    assert seen["host"] == _host(before) + retained
    assert seen["resident"]["session"] <= before["resident_tokens"]["session"] + STABLE
    # Recorded as OFFLOAD advice on the device placement (HiCache holds the copy, we hold the advice).
    assert seen["pauses"]["paused_by_placement"]["device"] == before["pauses"]["paused_by_placement"]["device"] + 1
    assert seen["pauses"]["hicache_offloaded_tokens"] - before["pauses"]["hicache_offloaded_tokens"] == retained
    # Turn 2 hit the whole retained prefix: the stable prefix on the device, the rest loaded from host.
    assert cached2 == {"device": STABLE, "host": retained}, cached2
    assert (out1, out2) == reference[:2]  # greedy output identical to the run that never paused
    after = _stats(server)
    assert after["pauses"]["paused_branches"] == before["pauses"]["paused_branches"]  # resumed
    check_when_idle(server)
    events = _events(server, lambda ev: any(e["state"] == "restoring" and e["session"] == "tool" for e in ev))
    assert any(e["state"] == "tool_wait" and e["session"] == "tool" and e["action"] == "offload" for e in events)
    assert any(e["state"] == "restoring" and e["session"] == "tool" for e in events)


def test_short_tool_is_kept(server, tokens):
    def after_pause(paused):
        assert _stats(server)["pauses"]["kept_branches"] >= 1

    before = _stats(server)["pauses"]
    _, _, cached2, paused = _conversation(server, tokens, "fast", "fast-ns", pause_body={"tool_class": "grep"},
                                          after_pause=after_pause)
    assert paused["action"] == "keep" and "moved_tokens" not in paused, paused
    assert cached2["device"] >= 300 and cached2["host"] == 0, cached2  # pinned on the device
    after = _stats(server)["pauses"]
    assert after["kept_branches"] == before["kept_branches"]  # the next turn unpinned it
    assert after["hicache_offloaded_tokens"] == before["hicache_offloaded_tokens"]
    check_when_idle(server)


def test_passed_deadline_releases_every_tier(server, tokens):
    prompt = tokens.ids(300)
    _gen(server, prompt, "dl", extra_key="dl-ns")
    before = _stats(server)
    status, paused = _post(server, "/agentcache/pause", {"session": "dl", "extra_key": "dl-ns",
                                                         "tool_class": "ci_run", "deadline_ms": 4000})
    # A ci_run returns within 4 s with p ~ 0.04: worth a host copy, not device memory.
    assert status == 200 and paused["action"] == "offload" and paused["deadline_s"] == 4.0, paused
    assert paused["moved_tokens"] == paused["tokens"] > 0, paused
    during = _settled(server, lambda s: _host(s) >= _host(before) + paused["tokens"])
    assert _host(during) >= _host(before) + paused["tokens"]
    time.sleep(5.5)
    stats = _settled(server, lambda s: s["pauses"]["deadline_releases"] > before["pauses"]["deadline_releases"])
    assert stats["pauses"]["deadline_releases"] >= before["pauses"]["deadline_releases"] + 1
    assert stats["coordinator"]["deadline_expiries"] >= 1
    # Released on every tier: its host copy left HiCache's pool too.
    assert _host(stats) == _host(during) - paused["tokens"]
    assert stats["hicache"]["deleted"]["host_tokens"] - during["hicache"]["deleted"]["host_tokens"] >= paused["tokens"]
    mine = [b for b in stats["branches"] if b["session"] == "dl"]
    assert all(b["owned_tokens"] == 0 for b in mine)
    _, cached = _gen(server, prompt, "dl", extra_key="dl-ns")
    assert cached == STABLE  # recomputed after the release
    check_when_idle(server)


def test_pause_routes_reject_bad_input_and_change_nothing(server, tokens):
    before = _stats(server)["pauses"]
    for body in ({"session": "never-seen"}, ):
        status, out = _post(server, "/agentcache/pause", body)
        assert status == 404 and "unknown branch" in out["error"]
    for path, body in (("/agentcache/pause", {"session": "x", "deadline_ms": -5}),
                       ("/agentcache/pause", {"session": "x", "tool_class": "a b"}),
                       ("/agentcache/pause", {"session": "x", "retained_tokens": 10**9}),
                       ("/agentcache/pause", {"session": "x", "priority": 10**6}),
                       ("/agentcache/prefetch", {"session": "x", "expected_remaining_ms": "soon"}),
                       ("/agentcache/resume", {"branch": "no-session"})):
        status, out = _post(server, path, body)
        assert status == 400, (path, body, out)
    status, out = _post(server, "/agentcache/prefetch", {"session": "never-seen"})
    assert status == 404
    status, out = _post(server, "/agentcache/resume", {"session": "never-seen"})
    assert status == 200 and out["resumed"] is False
    after = _stats(server)["pauses"]
    for key in ("paused_branches", "decisions", "kept_branches", "hicache_offloaded_tokens", "prefetch"):
        assert after[key] == before[key], key


def _metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text format)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total, found = total + float(value), True
    assert found, f"no sample of {name} with {labels}"
    return total


def test_prometheus_metrics(server, tokens):
    _, _, cached2, _ = _conversation(server, tokens, "metrics", "metrics-ns", pause_body={"tool_class": "ci_run"})
    assert cached2["host"] > 0  # the offloaded history came back from HiCache's host pool
    time.sleep(1.2)  # the scheduler publishes at most once a second, on its next step
    _gen(server, tokens.ids(40), "metrics-tick", extra_key="metrics-ns")
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert _metric(text, "sglang:agentcache_pause_decisions_total", action="offload") >= 1
    assert _metric(text, "sglang:agentcache_bytes_moved_total", direction="host_to_device") > 0
    assert "device_to_host" not in text  # HiCache's write-backs are its own: only load-backs are counted
    assert _metric(text, "sglang:agentcache_resident_tokens", cls="stable", tier="device") > 0
    assert _metric(text, "sglang:agentcache_resident_tokens", cls="session", tier="host") >= 0  # HiCache's pool
    assert 0.0 <= _metric(text, "sglang:agentcache_eviction_pressure") <= 1.0
    assert _metric(text, "sglang:agentcache_pause_events_total", event="pauses") >= 1
    assert _metric(text, "sglang:agentcache_waiting_requests", priority_class="default") >= 0
    assert _metric(text, "sglang:agentcache_paused_tokens", priority_class="normal", placement="device") >= 0


def test_pause_as_a_hint_action(server, tokens):
    """``tool_class`` in the lifecycle hint: the branch pauses when the call finishes, before the
    response comes back (the same decision as the route), and the next call resumes it."""
    prompt = tokens.ids(300)
    before = _stats(server)["pauses"]
    body = {"input_ids": prompt, "extra_key": "hint-ns",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope({"session": "hinted", "stable_prefix_tokens": STABLE,
                                            "tool_class": "ci_run"}, message_id="m-hint")}
    out = server.generate(body)
    stats = _stats(server)
    assert stats["pauses"]["decisions"]["offload"] == before["decisions"]["offload"] + 1
    assert stats["pauses"]["hicache_offloaded_tokens"] > before["hicache_offloaded_tokens"]
    assert stats["pauses"]["recent_decisions"][-1]["branch"]["session"] == "hinted"
    assert stats["coordinator"]["active_pauses"] >= 1
    _, meta = _meta(server, prompt + out["output_ids"] + tokens.ids(20), "hinted", extra_key="hint-ns")
    assert meta["cached_tokens"] >= 300 and meta["cached_tokens_details"]["host"] > 0  # loaded back from host
    check_when_idle(server)


def test_event_log_follows_a_trajectory_to_its_end(server, tokens):
    """tool_wait -> restoring -> completed for a branch closed by the agent (route or ``close`` hint)."""
    prompt = tokens.ids(300)
    _gen(server, prompt, "traj", extra_key="traj-ns")
    assert _post(server, "/agentcache/pause", {"session": "traj", "extra_key": "traj-ns", "tool_class": "ci_run"})[0] == 200
    _gen(server, prompt + tokens.ids(20), "traj", extra_key="traj-ns")
    assert _post(server, "/agentcache/session/close", {"session": "traj", "extra_key": "traj-ns"})[0] == 200
    body = {"input_ids": tokens.ids(60), "extra_key": "traj-ns", "sampling_params": {"max_new_tokens": 2},
            "kv_hints": lifecycle_envelope({"session": "traj2", "close": True}, message_id="m-close")}
    server.generate(body)
    events = _events(server, lambda ev: any(e["state"] == "completed" and e["session"] == "traj2" for e in ev))
    states = [e["state"] for e in events if e["session"] == "traj"]
    assert states[0] == "tool_wait" and "restoring" in states and states[-1] == "completed", states
    assert any(e["state"] == "completed" and e["session"] == "traj2" and e["reason"] == "hint" for e in events)


def test_flush_cache_drops_paused_branches_and_hicaches_host_copies(server, tokens):
    """SGLang's own ``/flush_cache`` empties the tree and HiCache's host pool; the pause records and
    pins hung from the tree go too."""
    prompt = tokens.ids(300)
    _gen(server, prompt, "flushed", extra_key="flush-ns")
    status, paused = _post(server, "/agentcache/pause", {"session": "flushed", "extra_key": "flush-ns",
                                                         "tool_class": "ci_run"})
    assert status == 200 and paused["action"] == "offload" and paused["moved_tokens"] > 0, paused
    held = _settled(server, lambda s: _host(s) >= paused["moved_tokens"])
    assert _host(held) >= paused["moved_tokens"] and held["pauses"]["paused_branches"] >= 1
    status, _ = server.request("POST", "/flush_cache")
    assert status == 200
    stats = _stats(server)
    pauses, hicache = stats["pauses"], stats["hicache"]
    assert pauses["paused_branches"] == 0 and pauses["kept_branches"] == 0
    assert _host(stats) == 0 and hicache["host_available_tokens"] == hicache["host_pool_tokens"], hicache
    check_when_idle(server)
    _, meta = _meta(server, prompt, "flushed", extra_key="flush-ns")  # serves normally, from nothing
    assert meta["cached_tokens"] == 0
    check_when_idle(server)


def _alive_after_idle_polls(server, seconds: float = 1.5) -> None:
    """The scheduler idles (SGLang checks its pool for leaks at every idle poll) and the server lives."""
    time.sleep(seconds)
    assert server.proc.poll() is None, server.log_tail()
    assert server.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("route", ["resume", "prefetch", "fork"])
def test_an_offloaded_branch_brought_back_while_the_scheduler_idles_leaks_nothing(server, tokens, route):
    """Issue #38 item 1, on HiCache: an offloaded branch brought back while nothing runs (the resume
    route, a prefetch through HiCache's load path, a fork of it) leaves SGLang's idle check (free +
    evictable + protected == pool) balanced, and the next turn still hits the whole history."""
    session, ns = f"idle-{route}", f"idle-{route}-ns"
    assert server.request("POST", "/flush_cache")[0] == 200  # device room for the prefetch (it never evicts)
    prompt = tokens.ids(200)
    out1, _ = _gen(server, prompt, session, extra_key=ns)
    status, paused = _post(server, "/agentcache/pause", {"session": session, "extra_key": ns, "tool_class": "ci_run"})
    assert status == 200 and paused["action"] == "offload" and paused["moved_tokens"] == paused["tokens"], paused
    if route == "fork":
        body = {"input_ids": prompt + out1 + tokens.ids(20), "extra_key": ns,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": session, "branch": "sub", "parent_branch": "main",
                                                "stable_prefix_tokens": STABLE}, message_id=f"m-{route}")}
        meta = server.generate(body)["meta_info"]
        assert meta["cached_tokens"] >= len(prompt) and meta["cached_tokens_details"]["host"] > 0, meta
    elif route == "prefetch":
        status, out = _post(server, "/agentcache/prefetch", {"session": session, "extra_key": ns})
        assert status == 200 and out["prefetched"] and out["restored_tokens"] == paused["moved_tokens"], out
    else:
        status, out = _post(server, "/agentcache/resume", {"session": session, "extra_key": ns})
        assert status == 200 and out["resumed"] and "restored_tokens" not in out, out
    _alive_after_idle_polls(server)
    check_when_idle(server)
    _, meta = _meta(server, prompt + out1 + tokens.ids(20), session, extra_key=ns)
    assert meta["cached_tokens"] >= len(prompt), meta
    if route == "prefetch":  # already back on the device
        assert meta["cached_tokens_details"]["host"] == 0, meta
    _alive_after_idle_polls(server)
    check_when_idle(server)
