"""Learned wait bounds of chat inference (pure): what the gaps teach, and how inference closes a
branch abandoned on its tool or idle past its namespace's usual gaps. Replay and server wiring:
tests/test_replay_inferred.py and tests/test_chat_infer_server.py."""

from __future__ import annotations

import pytest

from sgl_agentcache.chat_infer import ChatInference, ChatTurn
from sgl_agentcache.settings import Settings
from sgl_agentcache.policy.gap_bounds import FLOOR_S, MARGIN, MIN_GAPS, WINDOW, GapBounds

NS = "ns"
SYSTEM = {"role": "system", "content": "you are a coding agent"}


def test_nothing_is_learned_before_min_gaps_then_margin_times_the_tail_with_a_floor():
    bounds = GapBounds()
    for i in range(MIN_GAPS - 1):
        bounds.observe(NS, "tool", 5.0)
    assert bounds.bound(NS, "tool") is None and bounds.seen(NS, "tool") == MIN_GAPS - 1
    bounds.observe(NS, "tool", 5.0)
    assert bounds.bound(NS, "tool") == MARGIN * 5.0
    assert bounds.bound(NS, "idle") is None  # kinds are learned apart
    for _ in range(MIN_GAPS):
        bounds.observe(NS, "idle", 0.01)  # instant returns: the floor holds
    assert bounds.bound(NS, "idle") == FLOOR_S
    assert bounds.bound("other", "tool") is None  # namespaces never share


def test_the_window_forgets_old_gaps_and_bad_kinds_are_refused():
    bounds = GapBounds()
    for _ in range(WINDOW):
        bounds.observe(NS, "tool", 100.0)
    assert bounds.bound(NS, "tool") == MARGIN * 100.0
    for _ in range(WINDOW):
        bounds.observe(NS, "tool", 3.0)
    assert bounds.bound(NS, "tool") == MARGIN * 3.0 and bounds.seen(NS, "tool") == WINDOW
    with pytest.raises(ValueError, match="unknown gap kind"):
        bounds.observe(NS, "sleep", 1.0)
    bounds.forget_namespace(NS)
    assert bounds.bound(NS, "tool") is None


def test_the_number_of_gaps_to_learn_from_is_the_operators_and_checked(monkeypatch):
    bounds = GapBounds(min_gaps=2)
    bounds.observe(NS, "tool", 1.0)
    assert bounds.bound(NS, "tool") is None
    bounds.observe(NS, "tool", 1.0)
    assert bounds.bound(NS, "tool") == max(FLOOR_S, MARGIN * 1.0)
    with pytest.raises(ValueError, match="min_gaps"):
        GapBounds(min_gaps=0)
    LEARN_AFTER_ENV = "AGENTCACHE_INFER_LEARN_AFTER"
    learn_after_gaps = lambda: Settings.from_env().infer_learn_after  # noqa: E731
    assert learn_after_gaps() == MIN_GAPS
    monkeypatch.setenv(LEARN_AFTER_ENV, "0")
    assert learn_after_gaps() == 0 and ChatInference(learn_after=0).learned is None
    for bad in ("-1", "lots", str(WINDOW + 1)):
        monkeypatch.setenv(LEARN_AFTER_ENV, bad)
        with pytest.raises(ValueError, match=LEARN_AFTER_ENV):
            learn_after_gaps()


def test_bounded_in_namespaces():
    bounds = GapBounds(limit=4)  # namespaces, each with a window per kind: 8 windows at most
    for i in range(10):
        bounds.observe(f"ns{i}", "tool", 1.0)
    assert sum(bounds.seen(f"ns{i}", "tool") for i in range(10)) == 8
    assert bounds.seen("ns9", "tool") == 1  # the newest is kept


def _tool_loop(inf: ChatInference, steps: int, gap: float, now: float = 0.0, opening: str = "task"):
    """One conversation calling a tool ``steps`` times, each result back ``gap`` s after the call;
    returns (the branch, the time its last call was answered) -- left waiting on its last tool."""
    messages = [SYSTEM, {"role": "user", "content": opening}]
    branch = None
    for i in range(steps):
        got, assignment = inf.assign(NS, ChatTurn.from_messages(messages), now)
        inf.commit(assignment)
        assert branch is None or got.branch == branch.branch
        branch = got
        now += 0.5
        inf.done(NS, got.session, got.branch, now, called_tool=True)
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"}]
        now += gap
    return branch, now - gap


def test_a_branch_abandoned_on_its_tool_closes_at_the_learned_bound_even_while_paused():
    inf = ChatInference(idle_s=300)
    lead, answered = _tool_loop(inf, MIN_GAPS + 1, gap=1.0)  # MIN_GAPS tool results came back after 1 s
    assert inf.bound(NS, True) == max(FLOOR_S, MARGIN * 1.0)
    paused = [(NS, lead.session, lead.branch)]  # the server holds its pause open
    assert inf.idle(answered + 1.0, busy=paused) == []
    closed = inf.idle(answered + inf.bound(NS, True), busy=paused)
    assert [c[:3] for c in closed] == paused and closed[0].reason == "tool_bound"
    assert inf.counters["tool_bound_closes"] == 1 and inf.counters["idle_closes"] == 0


def test_before_a_bound_is_learned_or_with_learning_off_the_fixed_rule_holds():
    for inf, steps in ((ChatInference(idle_s=300), 3), (ChatInference(idle_s=300, learn_after=0), MIN_GAPS + 1)):
        lead, answered = _tool_loop(inf, steps, gap=1.0)
        assert inf.bound(NS, True) is None and inf.bound(NS, False) == 300
        paused = [(NS, lead.session, lead.branch)]
        assert inf.idle(answered + 299, busy=paused) == [] and inf.idle(answered + 1000, busy=paused) == []
        assert [c[:3] for c in inf.idle(answered + 1000)] == paused  # the pause ended: then idle


def test_the_idle_bound_is_learned_from_user_gaps_and_never_exceeds_idle_s():
    inf = ChatInference(idle_s=300)
    messages, now = [SYSTEM, {"role": "user", "content": "q0"}], 0.0
    for i in range(MIN_GAPS + 1):
        got, assignment = inf.assign(NS, ChatTurn.from_messages(messages), now)
        inf.commit(assignment)
        inf.done(NS, got.session, got.branch, now + 1)
        messages = messages + [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i + 1}"}]
        now += 1 + 4.0  # the user answers after 4 s
    assert inf.bound(NS, False) == MARGIN * 4.0 and inf.bound(NS, True) is None
    answered = now - 4.0
    assert inf.idle(answered + MARGIN * 4.0 - 0.1) == []
    closed = inf.idle(answered + MARGIN * 4.0)
    assert [c.reason for c in closed] == ["idle"]
    slow = ChatInference(idle_s=5)
    slow.learned.observe(NS, "idle", 0)  # unused: the idle bound is capped by idle_s
    for _ in range(MIN_GAPS):
        slow.learned.observe(NS, "idle", 100.0)
    assert slow.bound(NS, False) == 5


def test_a_refused_request_teaches_nothing():
    inf = ChatInference(idle_s=300)
    lead, answered = _tool_loop(inf, 2, gap=1.0)
    seen = inf.learned.seen(NS, "tool")
    messages = [SYSTEM, {"role": "user", "content": "task"}]
    for i in range(2):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"}]
    got, assignment = inf.assign(NS, ChatTurn.from_messages(messages), answered + 1)
    assert got.branch == lead.branch and assignment.gap == ("tool", 1.0)
    inf.rollback(assignment, answered + 1)
    assert inf.learned.seen(NS, "tool") == seen
