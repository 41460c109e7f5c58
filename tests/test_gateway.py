"""Hints through SGLang's router: the tracestate carrier and the routing key (pure; no server)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache.gateway import (
    MAX_TRACESTATE_VALUE,
    ROUTING_HEADER,
    TRACESTATE_HEADER,
    TRACESTATE_KEY,
    gateway_headers,
    hint_from_tracestate,
    merge_tracestate,
    routing_key,
    tracestate_member,
)
from sgl_agentcache.hints import HintError, parse_payload

FORK = {"session": "0b6c1f52-4d1e-4b8e-9a39-3f2f1b7d9c10", "branch": "sub-3", "parent_branch": "main",
        "stable_prefix_tokens": 1024, "fork_point_tokens": 20480, "tool_class": "bash"}


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def test_a_hint_round_trips_through_tracestate_with_other_vendors_members():
    member = tracestate_member(FORK)
    assert member.startswith(f"{TRACESTATE_KEY}=") and len(member.split("=", 1)[1]) <= MAX_TRACESTATE_VALUE
    assert "," not in member and member.count("=") == 1  # W3C: no ',' or '=' inside a value
    header = merge_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7", member)
    assert header.split(",")[0] == member and "congo=t61rcWkgMzE" in header and "rojo=00f067aa0ba902b7" in header
    assert hint_from_tracestate([header]) == parse_payload(FORK)
    # Split over two header lines (W3C allows it), ours in the second.
    assert hint_from_tracestate(["congo=t61rcWkgMzE", header]) == parse_payload(FORK)


def test_no_member_of_ours_is_no_hint_whatever_else_is_there():
    assert hint_from_tracestate([]) is None
    assert hint_from_tracestate(["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"]) is None
    assert hint_from_tracestate(["garbage without equals, ,,=x"]) is None


def test_merging_replaces_our_older_member_and_keeps_the_list_bounded():
    old = tracestate_member({"session": "s", "branch": "old"})
    others = ",".join(f"v{i}=x" for i in range(40))
    merged = merge_tracestate(f"{others},{old}", tracestate_member({"session": "s", "branch": "new"}))
    members = merged.split(",")
    assert len(members) == 32 and sum(m.startswith(TRACESTATE_KEY + "=") for m in members) == 1
    assert hint_from_tracestate([merged]).branch == "new"
    assert merge_tracestate(None, old) == old


@pytest.mark.parametrize("value, says", [
    ("", "1-256 characters"),
    ("A" * (MAX_TRACESTATE_VALUE + 1), "1-256 characters"),
    ("not base64!", "not unpadded base64url"),
    (base64.urlsafe_b64encode(b"\xff\xfe").rstrip(b"=").decode(), "not UTF-8"),
    (_b64("{not json"), "not valid JSON"),
    (base64.urlsafe_b64encode(b'{"session":"ab"}').decode(), "not unpadded base64url"),  # `==` padding (#38 item 7)
    (_b64(json.dumps({"session": 5})), "session"),
    (_b64(json.dumps({"session": "s", "grant_memory": 1})), "grant_memory"),
])
def test_a_malformed_member_of_ours_is_refused_by_name(value, says):
    with pytest.raises(HintError, match="tracestate member `sgl-agentcache`") as info:
        hint_from_tracestate([f"rojo=1,{TRACESTATE_KEY}={value}"])
    assert says in str(info.value)


def test_our_member_past_w3cs_32_members_is_not_read():
    """Issue #38 item 7: a list has at most 32 members (W3C); ours was read at position 35 of 40."""
    member = tracestate_member({"session": "s"})
    others = [f"v{i}=x" for i in range(40)]
    assert hint_from_tracestate([",".join(others[:34] + [member] + others[34:])]) is None
    assert hint_from_tracestate([",".join(others[:31] + [member])]).session == "s"  # the 32nd is read
    assert hint_from_tracestate([",".join(others[:20]), ",".join(others[20:31]), member]).session == "s"


def test_our_member_sent_twice_is_refused():
    member = tracestate_member({"session": "s"})
    with pytest.raises(HintError, match="sent 2 times"):
        hint_from_tracestate([member, member])


def test_a_hint_too_long_for_tracestate_is_refused_when_built():
    long_ids = {"session": "s" * 128, "branch": "b" * 128, "parent_branch": "p" * 128}
    with pytest.raises(HintError, match="over W3C's 256"):
        tracestate_member(long_ids)
    with pytest.raises(HintError, match="parent_branch"):
        tracestate_member({"session": "s", "branch": "x", "parent_branch": "x"})


def test_routing_key_pins_a_session_not_a_branch_and_separates_namespaces():
    lead = gateway_headers({"session": "s1", "branch": "main"})
    fork = gateway_headers({"session": "s1", "branch": "sub", "parent_branch": "main"})
    assert lead[ROUTING_HEADER] == fork[ROUTING_HEADER] == routing_key("s1")
    assert routing_key("s1", "tenant-a") != routing_key("s1", "tenant-b") != routing_key("s1")
    assert len(lead[ROUTING_HEADER]) == 32 and "s1" not in lead[ROUTING_HEADER]
    merged = gateway_headers({"session": "s1"}, tracestate="rojo=1")[TRACESTATE_HEADER]
    assert merged.endswith(",rojo=1")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=5))
def test_any_tracestate_text_yields_a_hint_none_or_a_hint_error(lines):
    try:
        hint_from_tracestate(lines)
    except HintError:
        pass
