"""The v1 lifecycle hint contract: payload validation, envelope lookup, header parsing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache.hints import (
    ACTION_TYPE,
    ACTION_VERSION,
    MAX_PAYLOAD_BYTES,
    MAX_TOKENS_FIELD,
    HintError,
    LifecycleHint,
    find_lifecycle_hint,
    lifecycle_envelope,
    parse_header,
    parse_payload,
)

FULL = {
    "session": "sess-1",
    "branch": "sub.2",
    "parent_branch": "main",
    "stable_prefix_tokens": 128,
    "fork_point_tokens": 300,
    "close": True,
    "tool_class": "web_search",
    "deadline_ms": 5000,
    "priority": -7,
    "prefetch": True,
}


# --- valid payloads ---------------------------------------------------------------------------


def test_minimal_payload_defaults():
    hint = parse_payload({"session": "s"})
    assert hint == LifecycleHint(session="s")
    assert hint.branch == "main"
    assert hint.parent_branch is None
    assert hint.stable_prefix_tokens == 0
    assert hint.fork_point_tokens is None
    assert hint.close is False
    assert (hint.tool_class, hint.deadline_ms, hint.priority, hint.prefetch) == (None, None, None, False)
    assert not hint.is_fork


def test_full_payload():
    hint = parse_payload(FULL)
    for key, value in FULL.items():
        assert getattr(hint, key) == value
    assert hint.is_fork


def test_boundary_values_accepted():
    hint = parse_payload(
        {
            "session": "a" * 128,
            "branch": "A-Z_a.z:0-9",
            "parent_branch": "p",
            "stable_prefix_tokens": MAX_TOKENS_FIELD,
            "fork_point_tokens": MAX_TOKENS_FIELD,
            "tool_class": "t" * 64,
            "deadline_ms": 86_400_000,
            "priority": 100,
        }
    )
    assert hint.stable_prefix_tokens == MAX_TOKENS_FIELD
    assert parse_payload({"session": "s", "priority": -100, "deadline_ms": 1}).priority == -100
    assert parse_payload({"session": "s", "parent_branch": "p", "fork_point_tokens": 0}).fork_point_tokens == 0


def test_hint_is_frozen():
    hint = parse_payload({"session": "s"})
    with pytest.raises(AttributeError):
        hint.session = "other"  # type: ignore[misc]


# --- invalid payloads: HintError naming the field ---------------------------------------------


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"stable_prefix_tokens": "5"}, "stable_prefix_tokens"),  # str for int
        ({"stable_prefix_tokens": True}, "stable_prefix_tokens"),  # bool for int
        ({"fork_point_tokens": False, "parent_branch": "p"}, "fork_point_tokens"),
        ({"priority": True}, "priority"),
        ({"deadline_ms": 1.5}, "deadline_ms"),  # float for int
        ({"branch": 7}, "branch"),  # int for str
        ({"session": 7}, "session"),
        ({"close": 1}, "close"),  # int for bool
        ({"prefetch": "yes"}, "prefetch"),
        ({"stable_prefix_tokens": -1}, "stable_prefix_tokens"),
        ({"stable_prefix_tokens": MAX_TOKENS_FIELD + 1}, "stable_prefix_tokens"),
        ({"stable_prefix_tokens": 2**70}, "stable_prefix_tokens"),
        ({"fork_point_tokens": -1, "parent_branch": "p"}, "fork_point_tokens"),
        ({"fork_point_tokens": MAX_TOKENS_FIELD + 1, "parent_branch": "p"}, "fork_point_tokens"),
        ({"deadline_ms": 0}, "deadline_ms"),
        ({"deadline_ms": 86_400_001}, "deadline_ms"),
        ({"priority": -101}, "priority"),
        ({"priority": 101}, "priority"),
        ({"session": "a b"}, "session"),  # bad id characters
        ({"session": "a/b"}, "session"),
        ({"branch": "x\n"}, "branch"),  # trailing newline must not slip past the anchor
        ({"branch": "é"}, "branch"),
        ({"session": ""}, "session"),  # empty id
        ({"parent_branch": ""}, "parent_branch"),
        ({"session": "a" * 129}, "session"),  # too long
        ({"tool_class": "t" * 65}, "tool_class"),
        ({"tool_class": ""}, "tool_class"),
        ({"tool_class": "a;b"}, "tool_class"),
        ({"sesion": "typo"}, "sesion"),  # unknown field
        ({"extra": {"a": [[[[[[[[[[{"b": [1]}]]]]]]]]]]}}, "extra"),  # deep nesting in an unknown field
    ],
)
def test_invalid_field(update, field):
    payload = {"session": "s", **update}
    with pytest.raises(HintError, match=f"`(\\$\\.)?{field}`"):
        parse_payload(payload)


def test_missing_session():
    with pytest.raises(HintError, match="session"):
        parse_payload({"branch": "b"})


def test_parent_equal_to_branch():
    with pytest.raises(HintError, match="parent_branch"):
        parse_payload({"session": "s", "branch": "b", "parent_branch": "b"})


def test_fork_point_requires_parent():
    with pytest.raises(HintError, match="fork_point_tokens"):
        parse_payload({"session": "s", "fork_point_tokens": 10})


def test_fork_point_below_stable_prefix():
    with pytest.raises(HintError, match="fork_point_tokens.*stable_prefix_tokens"):
        parse_payload({"session": "s", "parent_branch": "p", "stable_prefix_tokens": 10, "fork_point_tokens": 9})


@pytest.mark.parametrize("payload", [None, [], "session", 3, ("session", "s"), b"{}"])
def test_payload_not_a_dict(payload):
    with pytest.raises(HintError, match="JSON object"):
        parse_payload(payload)


def test_payload_over_size_limit():
    with pytest.raises(HintError, match=f"{MAX_PAYLOAD_BYTES}-byte limit"):
        parse_payload({"session": "s", "junk": "x" * (1 << 20)})
    # Even when the oversized part is a known field, the size check comes first.
    with pytest.raises(HintError, match="limit"):
        parse_payload({"session": "s" * 5000})


def test_payload_not_json_encodable():
    with pytest.raises(HintError, match="JSON-encodable"):
        parse_payload({"session": "s", "x": object()})
    with pytest.raises(HintError, match="JSON-encodable"):
        parse_payload({"session": "\ud800"})


def test_payload_too_deep_to_encode():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(HintError):
        parse_payload({"session": "s", "x": deep})


def test_non_string_key():
    with pytest.raises(HintError):
        parse_payload({"session": "s", 1: "x"})


# --- envelopes ----------------------------------------------------------------------------------


def _action(action_type=ACTION_TYPE, version=ACTION_VERSION, payload=None, action_id="a"):
    return {
        "action_id": action_id,
        "action_type": action_type,
        "action_version": version,
        "payload": {"session": "s"} if payload is None else payload,
    }


def _env(*actions):
    return {"protocol_version": "1", "message_id": "m", "actions": list(actions)}


def _ns(env: dict) -> SimpleNamespace:
    """The attribute-shaped (msgspec struct-like) form of a dict envelope."""
    return SimpleNamespace(**{**env, "actions": [SimpleNamespace(**a) for a in env["actions"]]})


SHAPES = [pytest.param(lambda e: e, id="dict"), pytest.param(_ns, id="attrs")]


def test_none_envelope():
    assert find_lifecycle_hint(None) is None


@pytest.mark.parametrize("shape", SHAPES)
def test_envelope_without_our_action(shape):
    assert find_lifecycle_hint(shape(_env())) is None
    assert find_lifecycle_hint(shape(_env(_action(action_type="other.consumer", version="9")))) is None


@pytest.mark.parametrize("shape", SHAPES)
def test_other_actions_ignored(shape):
    env = _env(
        _action(action_type="other.consumer", version="7", payload={"whatever": [1, 2]}),
        _action(payload=FULL),
        _action(action_type="another", payload={}),
    )
    assert find_lifecycle_hint(shape(env)) == parse_payload(FULL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("version", ["2", "0", 1, None])
def test_wrong_version(shape, version):
    with pytest.raises(HintError, match="unsupported action_version"):
        find_lifecycle_hint(shape(_env(_action(version=version))))


@pytest.mark.parametrize("shape", SHAPES)
def test_two_lifecycle_actions(shape):
    with pytest.raises(HintError, match="at most one"):
        find_lifecycle_hint(shape(_env(_action(action_id="a"), _action(action_id="b"))))


@pytest.mark.parametrize("shape", SHAPES)
def test_envelope_with_bad_payload(shape):
    with pytest.raises(HintError, match="stable_prefix_tokens"):
        find_lifecycle_hint(shape(_env(_action(payload={"session": "s", "stable_prefix_tokens": -3}))))


def test_envelope_payload_not_a_dict():
    with pytest.raises(HintError, match="JSON object"):
        find_lifecycle_hint(_env(_action(payload=["session"])))


def test_envelope_actions_not_a_list():
    assert find_lifecycle_hint({"protocol_version": "1", "message_id": "m"}) is None
    with pytest.raises(HintError, match="actions"):
        find_lifecycle_hint({"protocol_version": "1", "message_id": "m", "actions": "nope"})


# --- header -------------------------------------------------------------------------------------


def test_header_valid():
    assert parse_header(json.dumps(FULL)) == parse_payload(FULL)
    assert parse_header('  {"session": "s"}  ') == LifecycleHint(session="s")


@pytest.mark.parametrize("value", ["", "{", "{'session': 's'}", '{"session": "s"} trailing', "nan", "[1,"])
def test_header_malformed_json(value):
    with pytest.raises(HintError, match="not valid JSON"):
        parse_header(value)


def test_header_not_an_object_or_invalid():
    with pytest.raises(HintError, match="JSON object"):
        parse_header('["session"]')
    with pytest.raises(HintError, match="priority"):
        parse_header('{"session": "s", "priority": 1000}')


def test_header_size_limit():
    with pytest.raises(HintError, match="limit"):
        parse_header(json.dumps({"session": "s", "junk": "x" * (1 << 20)}))
    # Under the limit in characters, over it in UTF-8 bytes.
    value = '{"session": "s", "junk": "' + "é" * 2100 + '"}'
    assert len(value) <= MAX_PAYLOAD_BYTES < len(value.encode())
    with pytest.raises(HintError, match="bytes"):
        parse_header(value)


def test_header_deep_nesting():
    with pytest.raises(HintError):
        parse_header("[" * 2000 + "]" * 2000)


def test_header_not_a_string():
    with pytest.raises(HintError):
        parse_header(b'{"session": "s"}')  # type: ignore[arg-type]


# --- lifecycle_envelope -------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [{"session": "s"}, FULL])
def test_lifecycle_envelope_round_trip(fields):
    env = lifecycle_envelope(fields, message_id="msg-1")
    assert env["protocol_version"] == "1"
    assert env["message_id"] == "msg-1"
    (action,) = env["actions"]
    assert action == {
        "action_id": "lifecycle",
        "action_type": ACTION_TYPE,
        "action_version": ACTION_VERSION,
        "payload": fields,
    }
    assert find_lifecycle_hint(env) == parse_payload(fields)
    # JSON-ready: survives a JSON round trip, and the attribute-shaped form reads the same.
    assert find_lifecycle_hint(json.loads(json.dumps(env))) == parse_payload(fields)
    assert find_lifecycle_hint(_ns(env)) == parse_payload(fields)


def test_lifecycle_envelope_custom_action_id():
    env = lifecycle_envelope({"session": "s"}, message_id="m", action_id="x1")
    assert env["actions"][0]["action_id"] == "x1"


def test_lifecycle_envelope_rejects_bad_fields():
    with pytest.raises(HintError, match="parent_branch"):
        lifecycle_envelope({"session": "s", "parent_branch": "main"}, message_id="m")
    with pytest.raises(HintError, match="message_id"):
        lifecycle_envelope({"session": "s"}, message_id="")


# --- property: untrusted input never raises anything but HintError -----------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
_field_names = st.sampled_from(
    [
        "session",
        "branch",
        "parent_branch",
        "stable_prefix_tokens",
        "fork_point_tokens",
        "close",
        "tool_class",
        "deadline_ms",
        "priority",
        "prefetch",
    ]
)
_ids = st.from_regex(r"[A-Za-z0-9._:\-]{1,12}", fullmatch=True)
# Mostly well-formed hints, so that the accepting path is exercised as well as the rejecting one.
_hintish = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries({"session": _ids}),
    st.dictionaries(
        _field_names | st.text(max_size=10),
        _ids | st.booleans() | st.integers(-5, 500) | _json_values,
        max_size=4,
    ),
)


@settings(max_examples=300, deadline=None)
@given(_json_values | _hintish)
def test_parse_payload_total(value):
    try:
        hint = parse_payload(value)
    except HintError:
        return
    assert isinstance(hint, LifecycleHint)
    assert parse_payload(value) == hint


@settings(max_examples=300, deadline=None)
@given(_json_values | _hintish)
def test_parse_header_total(value):
    try:
        text = json.dumps(value)
    except (ValueError, TypeError):
        return
    try:
        hint = parse_header(text)
    except HintError:
        return
    assert isinstance(hint, LifecycleHint)


def test_largest_valid_payload_is_under_the_limit():
    """parse_payload converts before it measures: sound only because no valid hint can be oversized
    (every field is bounded, unknown fields are refused). Every field here takes its longest value."""
    payload = {"session": "s" * 128, "branch": "b" * 128, "parent_branch": "p" * 128,
               "stable_prefix_tokens": MAX_TOKENS_FIELD, "fork_point_tokens": MAX_TOKENS_FIELD,
               "close": False, "edit_from_tokens": MAX_TOKENS_FIELD, "tool_class": "t" * 64,
               "deadline_ms": 86_400_000, "priority": -100, "prefetch": False, "inferred": False}
    assert set(payload) == set(LifecycleHint.__struct_fields__), "a new hint field needs its longest value here"
    assert parse_payload(payload).session == "s" * 128
    assert len(json.dumps(payload, ensure_ascii=True)) < MAX_PAYLOAD_BYTES // 2
