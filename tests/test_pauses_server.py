"""Eager tool pauses on a real SGLang server (CPU): offload and restore move real KV bytes, greedy
output is identical to a run that never paused, short tools are kept, deadlines release every tier,
and injected transfer faults fall back to recompute without leaking anything.

These run on the ``eager_server`` fixture (``AGENTCACHE_PAUSE_MODE=eager``, node spill off: the host
tier holds exactly the paused copies); the default, lazy mode is tested in
``test_lazy_pauses_server.py``. Decisions are priced as the seed's 36 KiB/token deployment, with
operator priors for the ``grep`` (~20 ms) and ``ci_run`` (~1 min, long tail) tool classes (conftest.py).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from sgl_agentcache.hints import lifecycle_envelope

pytestmark = pytest.mark.server


@pytest.fixture
def server(eager_server):
    """This module's tests run on the eager server (see the module docstring)."""
    return eager_server

STABLE = 32


def _gen(server, ids, session, *, extra_key, max_new_tokens=6):
    body = {"input_ids": ids, "extra_key": extra_key,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope({"session": session, "stable_prefix_tokens": STABLE},
                                           message_id=f"m-{time.monotonic_ns()}")}
    out = server.generate(body)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def _post(server, path, body):
    return server.request("POST", path, body)


def _stats(server):
    status, stats = server.request("GET", "/agentcache/stats")
    assert status == 200
    return stats


def _events(server, until, timeout: float = 10.0) -> list[dict]:
    """The event log's records once ``until(records)`` holds (a writer thread appends them, off the
    request path, so the last ones may land a moment after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [json.loads(line) for line in server.event_log.read_text().splitlines()]
        if until(events) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def _check(server):
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report


def _conversation(server, tokens, session, extra_key, pause_body=None, after_pause=None):
    """Turn 1, an optional pause (and hook), turn 2 whose prompt extends turn 1 with a tool result."""
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
    out2, cached2 = _gen(server, prompt + out1 + tool_result, session, extra_key=extra_key)
    return out1, out2, cached2, paused


def test_long_tailed_tool_is_offloaded_and_restored_exactly(server, tokens):
    seen = {}

    def after_pause(paused):
        stats = _stats(server)
        seen["host"] = stats["pauses"]["host"]["used_tokens"]
        seen["resident"] = stats["resident_tokens"]

    reference = _conversation(server, tokens.__class__(tokens.vocab_size, seed=7), "ref", "ref-ns")
    before = _stats(server)
    out1, out2, cached2, paused = _conversation(
        server, tokens.__class__(tokens.vocab_size, seed=7), "tool", "tool-ns",
        pause_body={"tool_class": "ci_run"}, after_pause=after_pause)
    assert paused["action"] == "offload", paused
    retained = paused["tokens"]
    assert retained >= 300 - STABLE
    assert seen["host"] == before["pauses"]["host"]["used_tokens"] + retained  # on host...
    assert "offload" in paused["costs"] and paused["inputs"]["latency_p50_s"] > 10
    # ...and off the device: the session class lost exactly the retained tokens while paused.
    assert seen["resident"]["session"] <= before["resident_tokens"]["session"] + STABLE
    assert cached2 == STABLE + retained  # turn 2 hit the whole retained prefix, restored from host
    assert (out1, out2) == reference[:2]  # greedy output identical to the run that never paused
    after = _stats(server)
    assert after["pauses"]["restores"] >= 1 and after["pauses"]["host"]["used_tokens"] == 0
    _check(server)
    events = _events(server, lambda ev: any(e["state"] == "restoring" and e["session"] == "tool" for e in ev))
    assert any(e["state"] == "tool_wait" and e["session"] == "tool" and e["action"] == "offload" for e in events)
    assert any(e["state"] == "restoring" and e["session"] == "tool" for e in events)


def test_short_tool_is_kept(server, tokens):
    def after_pause(paused):
        assert _stats(server)["pauses"]["kept_branches"] >= 1

    _, _, cached2, paused = _conversation(server, tokens, "fast", "fast-ns", pause_body={"tool_class": "grep"},
                                          after_pause=after_pause)
    assert paused["action"] == "keep", paused
    assert cached2 >= 300
    _check(server)


def test_passed_deadline_releases_every_tier(server, tokens):
    prompt = tokens.ids(300)
    _gen(server, prompt, "dl", extra_key="dl-ns")
    status, paused = _post(server, "/agentcache/pause", {"session": "dl", "extra_key": "dl-ns",
                                                         "tool_class": "ci_run", "deadline_ms": 4000})
    # A ci_run returns within 4 s with p ~ 0.04: worth a host copy, not device memory.
    assert status == 200 and paused["action"] == "offload" and paused["deadline_s"] == 4.0
    host_during = _stats(server)["pauses"]["host"]["used_tokens"]
    assert host_during >= paused["tokens"]
    time.sleep(5.5)
    stats = _stats(server)
    assert stats["pauses"]["host"]["used_tokens"] == host_during - paused["tokens"]
    assert stats["pauses"]["deadline_releases"] >= 1 and stats["coordinator"]["deadline_expiries"] >= 1
    mine = [b for b in stats["branches"] if b["session"] == "dl"]
    assert all(b["owned_tokens"] == 0 for b in mine)
    _, cached = _gen(server, prompt, "dl", extra_key="dl-ns")
    assert cached == STABLE  # recomputed after the release
    _check(server)


@pytest.mark.parametrize("kind, unexpected", [("demote", False), ("promote", False), ("promote", True)])
def test_failed_transfer_falls_back_to_recompute(server, tokens, kind, unexpected):
    """A failed copy falls back to recompute. ``unexpected``: the restore (inside the scheduler's match)
    raises a bare ValueError instead of a transfer error, which used to kill the scheduler (issue #22
    item 10); the request recomputes and the server lives on."""
    status, armed = _post(server, "/agentcache/fault", {"kind": kind, "count": 1, "unexpected": unexpected})
    assert status == 200, armed
    before = _stats(server)["pauses"]
    session = f"fault-{kind}-{unexpected}"
    _, _, cached2, paused = _conversation(server, tokens, session, f"{session}-ns", pause_body={"tool_class": "ci_run"})
    after = _stats(server)["pauses"]
    assert cached2 == STABLE
    if kind == "demote":
        # A worker's copy fails after the pause answered (AGENTCACHE_ASYNC_OFFLOAD, on by default on CPU):
        # the branch is discarded when it lands, at the scheduler's next step or idle poll.
        assert paused["action"] == ("offload" if after["offload_copies"]["async"] else "discard")
        assert after["offload_fallbacks"]["transfer_failed"] == before["offload_fallbacks"]["transfer_failed"] + 1
    else:
        assert after["restore_failures"]["transfer_failed"] == before["restore_failures"]["transfer_failed"] + 1
    assert after["host"]["used_tokens"] == before["host"]["used_tokens"]
    _check(server)
    _gen(server, tokens.ids(50), f"{session}-after", extra_key=f"{session}-ns")  # the scheduler still serves


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
    for key in ("paused_branches", "decisions", "host", "kept_branches"):
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
    _conversation(server, tokens, "metrics", "metrics-ns", pause_body={"tool_class": "ci_run"})
    time.sleep(1.2)  # the scheduler publishes at most once a second, on its next step
    _gen(server, tokens.ids(40), "metrics-tick", extra_key="metrics-ns")
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert _metric(text, "sglang:agentcache_pause_decisions_total", action="offload") >= 1
    assert _metric(text, "sglang:agentcache_bytes_moved_total", direction="device_to_host") > 0
    assert _metric(text, "sglang:agentcache_bytes_moved_total", direction="host_to_device") > 0
    assert _metric(text, "sglang:agentcache_resident_tokens", cls="stable", tier="device") > 0
    assert 0.0 <= _metric(text, "sglang:agentcache_eviction_pressure") <= 1.0
    assert _metric(text, "sglang:agentcache_pause_events_total", event="pauses") >= 1
    assert _metric(text, "sglang:agentcache_waiting_requests", priority_class="default") >= 0
    assert _metric(text, "sglang:agentcache_paused_tokens", priority_class="normal", placement="host") >= 0


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
    assert stats["pauses"]["recent_decisions"][-1]["branch"]["session"] == "hinted"
    assert stats["coordinator"]["active_pauses"] >= 1
    _, cached = _gen(server, prompt + out["output_ids"] + tokens.ids(20), "hinted", extra_key="hint-ns")
    assert cached >= 300  # restored from host on the next call
    _check(server)


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


def test_flush_cache_drops_paused_branches_host_copies(server, tokens):
    """SGLang's own ``/flush_cache`` empties the tree; the host copies and pins hung from it go too."""
    prompt = tokens.ids(300)
    _gen(server, prompt, "flushed", extra_key="flush-ns")
    status, paused = _post(server, "/agentcache/pause", {"session": "flushed", "extra_key": "flush-ns",
                                                         "tool_class": "ci_run"})
    assert status == 200 and paused["action"] == "offload", paused
    assert _stats(server)["pauses"]["host"]["used_tokens"] >= paused["tokens"] > 0
    status, _ = server.request("POST", "/flush_cache")
    assert status == 200
    pauses = _stats(server)["pauses"]
    assert pauses["host"]["used_tokens"] == 0 and pauses["paused_branches"] == 0 and pauses["kept_branches"] == 0
    _check(server)
    _, cached = _gen(server, prompt, "flushed", extra_key="flush-ns")  # serves normally, from nothing
    assert cached == 0
    _check(server)


def _alive_after_idle_polls(server, seconds: float = 1.5) -> None:
    """The scheduler idles (SGLang checks its pool for leaks at every idle poll) and the server lives."""
    time.sleep(seconds)
    assert server.proc.poll() is None, server.log_tail()
    assert server.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("route", ["resume", "prefetch", "fork"])
def test_a_restore_in_flight_while_the_scheduler_idles_is_not_a_leak(server, tokens, route):
    """Issue #38 item 1: an offloaded branch's copy back issued while nothing runs (the resume route,
    a prefetch, a fork of it) holds slots a worker fills, outside the tree until it lands. SGLang's
    idle check (free + evictable + protected == pool) read them as a leak and stopped the server; they
    count as protected now. The next turn still hits the whole restored prefix."""
    session, ns = f"idle-{route}", f"idle-{route}-ns"
    prompt = tokens.ids(200)
    out1, _ = _gen(server, prompt, session, extra_key=ns)
    status, paused = _post(server, "/agentcache/pause", {"session": session, "extra_key": ns, "tool_class": "ci_run"})
    assert status == 200 and paused["action"] == "offload", paused
    if route == "fork":
        body = {"input_ids": prompt + out1 + tokens.ids(20), "extra_key": ns,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": session, "branch": "sub", "parent_branch": "main",
                                                "stable_prefix_tokens": STABLE}, message_id=f"m-{route}")}
        assert server.generate(body)["meta_info"]["cached_tokens"] >= len(prompt)
    else:
        status, out = _post(server, f"/agentcache/{route}", {"session": session, "extra_key": ns})
        assert status == 200 and out["restored_tokens"] == paused["tokens"], out
    _alive_after_idle_polls(server)
    _check(server)
    _, cached = _gen(server, prompt + out1 + tokens.ids(20), session, extra_key=ns)
    assert cached >= len(prompt)
    _alive_after_idle_polls(server)
    _check(server)
