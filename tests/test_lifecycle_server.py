"""Lifecycle classes, fork sharing, branch quotas and termination in a real SGLang server (CPU)."""

from __future__ import annotations

import contextlib
import http.client
import json
import time

import pytest
from server_checks import SWEEP_FIELDS, sweep_intervened, without_sweep

from sgl_agentcache.hints import lifecycle_envelope

pytestmark = pytest.mark.server

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _gen(server, ids, hint=None, *, max_new_tokens=4, rid=None):
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
    if hint is not None:
        body["kv_hints"] = lifecycle_envelope(hint, message_id=f"m-{time.monotonic_ns()}")
    if rid is not None:
        body["rid"] = rid
    return server.request("POST", "/generate", body)


@contextlib.contextmanager
def _streaming(server, ids, hint, *, rid):
    """A streamed /generate long enough to be aborted mid-decode; yields the response."""
    body = {"input_ids": ids, "stream": True, "rid": rid,
            "sampling_params": {**GREEDY, "max_new_tokens": 800},
            "kv_hints": lifecycle_envelope(hint, message_id="m-stream")}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        yield response
    finally:
        conn.close()


def _stats(server) -> dict:
    """``/agentcache/stats`` without the control channel's transport counters (every stats call is one
    more op sent to the schedulers: they move between any two snapshots)."""
    status, stats = server.request("GET", "/agentcache/stats")
    assert status == 200
    stats.pop("control_channel", None)
    return stats


#: What the idle sweep may move between two snapshots: its shared fields, and the paused tokens they
#: sum to (it pauses, and prices again, the module's earlier branches as their idle time grows).
SWEEP_STATS = SWEEP_FIELDS + ("paused_tokens_by_priority",)


def _compared_with(before: dict, server) -> tuple[dict, dict]:
    """(``/agentcache/stats`` now, ``before``) as a nothing-changed check compares them: whole, or
    without the idle sweep's fields when it fired between the two."""
    after = _stats(server)
    if sweep_intervened(before, after):
        return without_sweep(after, SWEEP_STATS), without_sweep(before, SWEEP_STATS)
    return after, before


def _owned(stats, session) -> dict[str, int]:
    return {b["branch"]: b["owned_tokens"] for b in stats["branches"] if b["session"] == session}


def _assert_integrity(server):
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report["errors"]


def test_forks_share_the_prefix_and_are_charged_only_their_own_tokens(server, tokens):
    prefix = tokens.ids(300)
    status, out = _gen(server, prefix, {"session": "fork", "stable_prefix_tokens": 100}, max_new_tokens=0)
    assert status == 200
    children = {f"b{i}": prefix + tokens.ids(50) for i in range(4)}
    outs = {}
    for name, ids in children.items():
        status, outs[name] = _gen(server, ids, {"session": "fork", "branch": name, "parent_branch": "main"})
        assert status == 200, outs[name]
        assert outs[name]["meta_info"]["cached_tokens"] >= len(prefix)  # prefilled once, shared by all
    owned = _owned(_stats(server), "fork")
    assert owned["main"] == 200  # [100, 300): the parent's session history; [0, 100) is stable, unowned
    for name, out in outs.items():
        # A child owns exactly the tokens it added: its 50 new prompt tokens and the generated tokens
        # that have KV (the last sampled token has none).
        assert owned[name] == 50 + out["meta_info"]["completion_tokens"] - 1
    before = _stats(server)

    freed = 0
    for name in ("b0", "b1", "b2"):
        status, body = server.request("POST", "/agentcache/branch/close", {"session": "fork", "branch": name})
        assert status == 200 and body["freed_tokens"] == owned[name] and body["pending_tokens"] == 0
        freed += body["freed_tokens"]
    after = _stats(server)
    assert set(_owned(after, "fork")) == {"main", "b3"}
    assert after["resident_tokens"]["scratch"] == before["resident_tokens"]["scratch"] - freed
    assert after["freed_on_close_tokens"] - before["freed_on_close_tokens"] == freed
    assert after["evictable_tokens"] == before["evictable_tokens"] - freed
    # The fourth branch still hits the shared prefix and its own scratch; the closed ones do not.
    status, out = _gen(server, children["b3"], {"session": "fork", "branch": "b3", "parent_branch": "main"})
    assert out["meta_info"]["cached_tokens"] >= len(children["b3"]) - 1
    status, out = _gen(server, children["b0"])
    assert len(prefix) <= out["meta_info"]["cached_tokens"] < len(children["b0"])
    _assert_integrity(server)


def test_closing_is_idempotent_and_unknown_branches_are_404(server, tokens):
    ids = tokens.ids(40)
    assert _gen(server, ids, {"session": "idem", "branch": "main"})[0] == 200
    first = server.request("POST", "/agentcache/branch/close", {"session": "idem", "branch": "main"})
    second = server.request("POST", "/agentcache/branch/close", {"session": "idem", "branch": "main"})
    assert first[0] == second[0] == 200
    assert second[1]["already_closed"] and second[1]["freed_tokens"] == 0
    before = _stats(server)
    status, body = server.request("POST", "/agentcache/branch/close", {"session": "idem", "branch": "never"})
    assert status == 404 and "unknown branch" in body["error"]
    after, before = _compared_with(before, server)
    assert after == before


def test_close_hint_and_abort_terminate_the_branch(server, tokens):
    prefix = tokens.ids(64)
    assert _gen(server, prefix, {"session": "term"}, max_new_tokens=0)[0] == 200
    # close=True on the branch's last request: its scratch is reclaimed when the request releases.
    status, _ = _gen(server, prefix + tokens.ids(30),
                     {"session": "term", "branch": "done", "parent_branch": "main", "close": True})
    assert status == 200
    assert "done" not in _owned(_stats(server), "term")
    # Abort mid-decode: the branch is closed and everything it owned is freed once released.
    hint = {"session": "term", "branch": "aborted", "parent_branch": "main"}
    with _streaming(server, prefix + tokens.ids(30), hint, rid="agentcache-abort-me") as stream:
        stream.readline()  # the request is decoding now
        assert server.request("POST", "/abort_request", {"rid": "agentcache-abort-me"})[0] == 200
        stream.read()
    stats = _stats(server)
    assert "aborted" not in _owned(stats, "term") and _owned(stats, "term")["main"] == 64
    _assert_integrity(server)


def test_namespaces_that_once_joined_alike_stay_apart(server, tokens):
    """Tenancy off: ``extra_key="a|", cache_salt="b"`` and ``extra_key="a", cache_salt="|b"`` are two
    namespaces, so closing one's branch leaves the other's open (a fork of it is still admitted)."""
    prefix = tokens.ids(40)
    first, second = {"extra_key": "ns-a|", "cache_salt": "b"}, {"extra_key": "ns-a", "cache_salt": "|b"}
    for ns in (first, second):
        body = {"input_ids": prefix, "sampling_params": GREEDY, **ns,
                "kv_hints": lifecycle_envelope({"session": "joined"}, message_id=f"m-{time.monotonic_ns()}")}
        assert server.request("POST", "/generate", body)[0] == 200
    status, closed = server.request("POST", "/agentcache/branch/close",
                                    {"session": "joined", "branch": "main", **first})
    assert status == 200 and not closed["already_closed"], closed
    fork = {"input_ids": prefix + tokens.ids(10), "sampling_params": GREEDY, **second,
            "kv_hints": lifecycle_envelope({"session": "joined", "branch": "w", "parent_branch": "main"},
                                           message_id=f"m-{time.monotonic_ns()}")}
    status, reply = server.request("POST", "/generate", fork)
    assert status == 200, reply
    status, closed = server.request("POST", "/agentcache/session/close", {"session": "joined", **second})
    assert status == 200 and closed["branches"] == 2, closed
    _assert_integrity(server)


def test_session_close_terminates_every_branch(server, tokens):
    prefix = tokens.ids(80)
    _gen(server, prefix, {"session": "whole"}, max_new_tokens=0)
    for name in ("x", "y"):
        _gen(server, prefix + tokens.ids(20), {"session": "whole", "branch": name, "parent_branch": "main"})
    status, body = server.request("POST", "/agentcache/session/close", {"session": "whole"})
    assert status == 200 and body["branches"] == 3 and body["freed_tokens"] > 0
    assert _owned(_stats(server), "whole") == {}
    _assert_integrity(server)


def test_runaway_branch_is_trimmed_first_and_nobody_else_pays(server, tokens):
    """Quotas bound fairness, not a branch's context: a branch may go past its quota while memory is
    free (nothing it sent is clipped), and under pressure it is the first to lose tokens; the
    bystander's prefix survives a flood."""
    quota = _stats(server)["branch_quota_tokens"]
    assert quota == 512  # set for the test server in conftest
    bystander = tokens.ids(200)
    _gen(server, bystander, {"session": "bystander"}, max_new_tokens=0)
    history = tokens.ids(50)
    _gen(server, history, {"session": "runaway"}, max_new_tokens=0)
    trimmed_before = _stats(server)["quota_trimmed_tokens"]
    branch = {"session": "runaway", "branch": "loop", "parent_branch": "main"}
    for _ in range(4):  # each turn adds 200 tokens of branch-local history: 800 > quota
        history = history + tokens.ids(200)
        assert _gen(server, history, branch, max_new_tokens=1)[0] == 200
    assert _owned(_stats(server), "runaway").get("loop", 0) > quota  # free memory: kept past the quota
    for _ in range(5):  # untagged floods that need most of the 4096-token pool
        assert _gen(server, tokens.ids(900), None, max_new_tokens=1)[0] == 200
    stats = _stats(server)
    # It went first: eviction trimmed its tokens over the quota (the shared server has no host tier).
    assert stats["quota_trimmed_tokens"] > trimmed_before
    assert _owned(stats, "runaway").get("loop", 0) < 800
    # Nobody else paid for it: the bystander's prefix is still resident.
    assert _gen(server, bystander)[1]["meta_info"]["cached_tokens"] >= len(bystander) - 1
    _assert_integrity(server)


BAD_HINTS = [
    ({"session": "bad", "branch": 5}, "branch"),
    ({"session": "bad", "stable_prefix_tokens": -1}, "stable_prefix_tokens"),
    ({"session": "bad", "stable_prefix_tokens": 10_000}, "past the end"),
    ({"session": "bad", "stable_prefix_tokens": True}, "stable_prefix_tokens"),
    ({"session": "bad/../x"}, "session"),
    ({"session": "bad", "unknown_field": 1}, "unknown_field"),
    ({"session": "bad", "branch": "b", "parent_branch": "b"}, "parent_branch"),
    ({"session": "bad", "deadline_ms": 10 ** 30}, "deadline_ms"),
    ({"session": "bad", "pad": "x" * 1_000_000}, "limit"),
    ({"session": "bad", "branch": "orphan", "parent_branch": "no-such-parent"}, "unknown parent branch"),
]


@pytest.mark.parametrize("payload,needle", BAD_HINTS, ids=[n for _, n in BAD_HINTS])
def test_malformed_hints_are_rejected_and_change_nothing(server, tokens, payload, needle):
    ids = tokens.ids(60)
    before = _stats(server)
    envelope = {"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "a", "action_type": "sgl_agentcache.lifecycle", "action_version": "1", "payload": payload}]}
    status, body = server.request("POST", "/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                                       "kv_hints": envelope})
    assert 400 <= status < 500, body
    assert needle in str(body)
    after = _stats(server)
    assert after == before


@pytest.mark.parametrize("body", [
    {"session": "x", "branch": "../etc"}, {"branch": "main"}, {"session": 1}, {"session": "x", "evil": True},
    {"session": "x", "extra_key": "k" * 10_000},
], ids=["bad-id", "missing-session", "wrong-type", "unknown-field", "oversized"])
def test_malformed_close_requests_are_400(server, body):
    before = _stats(server)
    status, reply = server.request("POST", "/agentcache/branch/close", body)
    assert status == 400 and "error" in reply
    after, before = _compared_with(before, server)
    assert after == before


def test_openai_routes_take_the_hint_header(server):
    headers = {"x-sgl-agentcache-hint": '{"session": "openai", "branch": "main"}'}
    request = {"model": "default", "prompt": "agent: plan the next tool call", "max_tokens": 2}
    status, _ = server.request("POST", "/v1/completions", request, headers=headers)
    assert status == 200
    assert _owned(_stats(server), "openai").get("main", 0) > 0
    chat = {"model": "default", "messages": [{"role": "user", "content": "run the tests"}], "max_tokens": 2}
    assert server.request("POST", "/v1/chat/completions", chat, headers=headers)[0] == 200
    before = _stats(server)
    status, body = server.request("POST", "/v1/completions", request,
                                  headers={"x-sgl-agentcache-hint": '{"session": 5}'})
    assert status == 400 and "session" in str(body)
    after, before = _compared_with(before, server)
    assert after == before


def test_a_hint_in_tracestate_is_taken_on_every_generation_route(server, tokens):
    """What SGLang's router forwards (gateway.py): the hint as a tracestate member, with other vendors'
    members around it; a kv_hints envelope or our header wins over it; a malformed one is a 400."""
    from sgl_agentcache.gateway import gateway_headers

    def headers(hint):
        return {"tracestate": gateway_headers(hint, tracestate="rojo=00f067aa0ba902b7")["tracestate"]}

    status, _ = server.request("POST", "/generate", {"input_ids": tokens.ids(40),
                               "sampling_params": {"max_new_tokens": 0}}, headers=headers({"session": "ts-gen"}))
    assert status == 200 and _owned(_stats(server), "ts-gen") == {"main": 40}
    chat = {"model": "default", "messages": [{"role": "user", "content": "run the tests"}], "max_tokens": 2}
    assert server.request("POST", "/v1/chat/completions", chat, headers=headers({"session": "ts-chat"}))[0] == 200
    assert _owned(_stats(server), "ts-chat").get("main", 0) > 0
    both = headers({"session": "ts-loser"}) | {"x-sgl-agentcache-hint": '{"session": "ts-winner"}'}
    assert server.request("POST", "/v1/chat/completions", chat, headers=both)[0] == 200
    owned = _stats(server)
    assert _owned(owned, "ts-winner") and not _owned(owned, "ts-loser")
    before = _stats(server)
    for route, body in (("/generate", {"input_ids": tokens.ids(8), "sampling_params": {"max_new_tokens": 1}}),
                        ("/v1/chat/completions", chat)):
        status, reply = server.request("POST", route, body, headers={"tracestate": "sgl-agentcache=not*b64"})
        assert status == 400 and "tracestate" in str(reply), (route, reply)
    assert _stats(server) == before
    _assert_integrity(server)


def test_context_edit_reclaims_the_old_suffix_and_keeps_reuse_exact(server, tokens):
    history = tokens.ids(400)
    assert _gen(server, history, {"session": "edit"}, max_new_tokens=0)[0] == 200
    before = _stats(server)
    assert _owned(before, "edit")["main"] == 400
    # The agent summarised everything after token 120: the new prompt shares only [0, 120).
    edited = history[:120] + tokens.ids(100)
    status, out = _gen(server, edited, {"session": "edit", "edit_from_tokens": 120}, max_new_tokens=0)
    assert status == 200 and out["meta_info"]["cached_tokens"] >= 120  # exact reuse of the shared part
    after = _stats(server)
    assert after["context_edit_freed_tokens"] - before["context_edit_freed_tokens"] == 280
    assert _owned(after, "edit")["main"] == 220  # [0, 120) kept + the 100 new tokens
    # The old suffix is really gone: re-sending the old history hits only the shared 120 tokens.
    assert _gen(server, history)[1]["meta_info"]["cached_tokens"] <= 121
    _assert_integrity(server)
