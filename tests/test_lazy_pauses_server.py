"""Lazy tool pauses (the default) on a real SGLang server (CPU): the decision is advice, nothing moves
at the pause, and the next turn finds the whole history with greedy output identical to a run that
never paused; a passed deadline releases the paused branch.

Runs on the shared server (conftest.py: product defaults, device-only -- no host tier, so no pause is
advised to offload -- decisions priced as the seed's 36 KiB/token deployment, ``ci_run`` a long-tailed
tool class). Offload advice on SGLang's HiCache, where a paused branch's host copies outlive newer
sessions' and come back, is tested in ``test_agentcache_on_hicache_server.py``.
"""

from __future__ import annotations

import time

import pytest

from sgl_agentcache.hints import lifecycle_envelope

pytestmark = pytest.mark.server


def _gen(server, ids, session, *, extra_key, max_new_tokens=6):
    body = {"input_ids": ids, "extra_key": extra_key,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope({"session": session}, message_id=f"m-{time.monotonic_ns()}")}
    out = server.generate(body)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def _stats(server):
    status, stats = server.request("GET", "/agentcache/stats")
    assert status == 200
    return stats


def test_a_pause_is_advice_that_moves_nothing_and_the_next_turn_hits_its_history(server, tokens):
    assert _stats(server)["pauses"]["settings"]["lazy"] is True  # the default
    prompt, tool_result = tokens.ids(300), tokens.ids(40)
    # The reference: the same two turns in another namespace, never paused.
    ref1, _ = _gen(server, prompt, "ref", extra_key="lazy-ref")
    ref2, _ = _gen(server, prompt + ref1 + tool_result, "ref", extra_key="lazy-ref")

    out1, _ = _gen(server, prompt, "agent", extra_key="lazy")
    assert out1 == ref1
    before = _stats(server)
    status, paused = server.request("POST", "/agentcache/pause", {"session": "agent", "extra_key": "lazy",
                                                                  "tool_class": "ci_run"})
    # Device-only: there is no host room, so the long-tailed tool is not advised to offload.
    assert status == 200 and paused["paused"] and paused["lazy"] is True, paused
    assert paused["action"] in ("keep", "discard"), paused
    assert paused["inputs"]["host_free_bytes"] == 0, paused
    after = _stats(server)
    assert after["resident_tokens"] == before["resident_tokens"]  # nothing moved, nothing freed
    assert after["pauses"]["paused_by_placement"]["device"] == before["pauses"]["paused_by_placement"]["device"] + 1
    assert after["pauses"]["kept_branches"] == 0  # advice pins nothing
    out2, cached = _gen(server, prompt + out1 + tool_result, "agent", extra_key="lazy")
    assert cached >= len(prompt) + len(out1) - 1  # the whole first turn, still on the device
    assert out2 == ref2
    assert _stats(server)["pauses"]["paused_branches"] == before["pauses"]["paused_branches"]  # resumed
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report


def test_a_passed_deadline_releases_the_paused_branch(server, tokens):
    prompt = tokens.ids(300)
    _gen(server, prompt, "late", extra_key="lazy-late")
    before = _stats(server)["pauses"]
    # A fast tool (it would resume before the deadline): advised to keep, left on the device.
    status, paused = server.request("POST", "/agentcache/pause", {"session": "late", "extra_key": "lazy-late",
                                                                  "tool_class": "grep", "deadline_ms": 4000})
    assert status == 200 and paused["action"] == "keep" and paused["lazy"] is True, paused
    deadline = time.monotonic() + 20
    while _stats(server)["pauses"]["deadline_releases"] == before["deadline_releases"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _stats(server)
    assert after["pauses"]["deadline_releases"] > before["deadline_releases"]
    # The release freed everything the branch owned, at once (no pool pressure was needed).
    assert after["pauses"]["released_tokens"] - before["released_tokens"] >= len(prompt)
    assert all(b["owned_tokens"] == 0 for b in after["branches"] if b["session"] == "late")
    _, cached = _gen(server, prompt + tokens.ids(10), "late2", extra_key="lazy-late")
    assert cached == 0  # released: nothing left to hit
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report


def _call(server, ids, extra_key, **hint):
    body = {"input_ids": ids, "extra_key": extra_key,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope(hint, message_id=f"m-{time.monotonic_ns()}")}
    return server.generate(body)


def test_a_lead_paused_while_a_subagent_runs_is_priced_as_a_join(server, tokens):
    """Fork/join end to end: subagents' lifetimes are learned from their first call to their close; a
    lead that pauses while one runs is decided on the join (the coordinator sends the lifetime model and
    the subagent's age, the scheduler builds the JoinWait), and the decision says so."""
    from sgl_agentcache.policy.join import MIN_LIFETIMES

    key, session = "join", f"lead-{time.monotonic_ns()}"
    lead = tokens.ids(200)
    out = _call(server, lead, key, session=session)["output_ids"]
    context = lead + out
    for i in range(MIN_LIFETIMES):  # subagents that ran and closed: their lifetimes are learned
        _call(server, context + tokens.ids(20), key, session=session, branch=f"w{i}", parent_branch="main")
        _call(server, context + tokens.ids(30), key, session=session, branch=f"w{i}", parent_branch="main",
              close=True)
    joins = _stats(server)["coordinator"]["join_pauses"]
    _call(server, context + tokens.ids(20), key, session=session, branch="running", parent_branch="main")
    status, paused = server.request("POST", "/agentcache/pause", {"session": session, "extra_key": key,
                                                                  "tool_class": "subagents"})
    assert status == 200 and paused["paused"], paused
    assert _stats(server)["coordinator"]["join_pauses"] == joins + 1
    status, _ = server.request("POST", "/agentcache/session/close", {"session": session, "extra_key": key})
    assert status == 200
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report
