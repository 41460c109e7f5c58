"""Pure lifecycle rules: insert plans, bounded branch sets (no SGLang). The eviction rank over these
states is the retention policy's (tests/test_retention.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_agentcache.hints import LifecycleHint, insert_plan
from sgl_agentcache.lifecycle import (
    UNTAGGED_PLAN,
    UNTAGGED_STATE,
    BranchKey,
    NodeClass,
    NodeState,
    RecentBranches,
    namespace_key,
    namespace_salt,
    split_namespace,
)

B = BranchKey("|", "s", "b")


def test_plan_for_root_branch():
    plan = insert_plan(LifecycleHint(session="s", stable_prefix_tokens=100), "ns", closed=set())
    assert plan.boundaries == (100,)
    assert plan.state_at(99).cls is NodeClass.STABLE and plan.state_at(99).owner is None
    assert plan.state_at(100) == NodeState(NodeClass.SESSION, BranchKey("ns", "s", "main"))


def test_plan_for_fork_charges_only_past_the_fork_point():
    hint = LifecycleHint(session="s", branch="b1", parent_branch="main", stable_prefix_tokens=10,
                         fork_point_tokens=40)
    plan = insert_plan(hint, "ns", closed=set())
    assert plan.boundaries == (10, 40)
    assert plan.state_at(5).cls is NodeClass.STABLE
    assert plan.state_at(10) == NodeState(NodeClass.SESSION, BranchKey("ns", "s", "main"))
    assert plan.state_at(40) == NodeState(NodeClass.SCRATCH, BranchKey("ns", "s", "b1"))


def test_plan_of_closed_branch_is_born_terminated():
    closed = {BranchKey("ns", "s", "b1")}
    plan = insert_plan(LifecycleHint(session="s", branch="b1", parent_branch="main"), "ns", closed)
    assert plan.own.terminated and not plan.parent.terminated


def test_no_hint_is_untagged():
    assert insert_plan(None, "ns", set()) is UNTAGGED_PLAN
    assert UNTAGGED_PLAN.boundaries == () and UNTAGGED_PLAN.state_at(0) == UNTAGGED_STATE


def test_recent_branches_is_bounded_and_ordered():
    recent = RecentBranches(limit=3)
    keys = [BranchKey("|", "s", f"b{i}") for i in range(5)]
    for key in keys:
        recent.add(key)
    recent.add(keys[2])  # refresh: b2 becomes newest
    assert len(recent) == 3 and keys[0] not in recent and keys[1] not in recent
    assert list(recent) == [keys[3], keys[4], keys[2]]


def test_recent_branches_session_index_follows_the_set():
    """A session close looks its branches up by session; the index must forget what the set forgets
    (bound, discard) and track re-adds, across namespaces."""
    recent = RecentBranches(limit=3, by_session=True)
    a, b, c = BranchKey("t1|", "s", "main"), BranchKey("t2|", "s", "w0"), BranchKey("t1|", "other", "main")
    for key in (a, b, c):
        recent.add(key)
    assert set(recent.of_session("s")) == {a, b} and recent.of_session("other") == [c]
    version = recent.version
    recent.discard(b)
    recent.discard(b)  # absent: nothing else changes
    assert recent.of_session("s") == [a] and recent.version > version
    recent.add(a)  # refresh, not a second index entry
    for i in range(3):  # push everything else out through the bound
        recent.add(BranchKey("t1|", "new", f"b{i}"))
    assert recent.of_session("s") == [] and recent.of_session("other") == []
    assert len(recent.of_session("new")) == 3 and len(recent) == 3
    with pytest.raises(TypeError):
        RecentBranches().of_session("s")


def test_namespace_keys_of_different_parts_never_collide():
    """Tenancy off, a client picks both parts: ``("a|", "b")`` and ``("a", "|b")`` are two namespaces."""
    assert namespace_key("a|", "b") != namespace_key("a", "|b")
    assert namespace_key("a\\", "|b") != namespace_key("a", "\\|b")
    assert namespace_key(None, None) == namespace_key("", "") == "|"  # SGLang reads "" as unset too
    assert namespace_key("t1", None) == "t1|" and namespace_key(None, "agentcache:acme:b") == "|agentcache:acme:b"
    for bad in ("", "a", "a|b|c", "a\\x|b", "a|b\\"):
        with pytest.raises(ValueError):
            split_namespace(bad)
        assert namespace_salt(bad) is None
    assert namespace_salt(namespace_key("x|", "agentcache:acme:b")) == "agentcache:acme:b"


PART = st.none() | st.text(alphabet=st.sampled_from("ab|\\:"), max_size=6)


@given(PART, PART, PART, PART)
def test_namespace_key_is_injective_and_split_inverts_it(e1, s1, e2, s2):
    key = namespace_key(e1, s1)
    assert split_namespace(key) == (e1 or None, s1 or None)
    if (e1 or None, s1 or None) != (e2 or None, s2 or None):
        assert key != namespace_key(e2, s2)


def test_a_namespace_flood_forgets_only_its_own_branches():
    """Tenants share the bounded sets: one flooding branch names must not push another's out."""
    recent = RecentBranches(limit=8, namespace_limit=6)
    victim = BranchKey("|agentcache:acme:b", "s", "main")
    recent.add(victim)
    flood = [BranchKey("|agentcache:globex:b", "s", f"b{i}") for i in range(50)]
    for key in flood:
        recent.add(key)
    assert victim in recent  # over the total, the largest namespace (the flooder's) gave way
    assert [k for k in recent if k.namespace == flood[0].namespace] == flood[-6:]  # its own bound, newest kept
    for i in range(7):  # a second tenant grows past its fair share of the total: it gives way, not the victim
        recent.add(BranchKey("t3|", "s", f"x{i}"))
    assert victim in recent and len(recent) <= 8


def test_a_branch_that_holds_tokens_is_never_forgotten():
    holding = {BranchKey("|", "s", "lead")}
    recent = RecentBranches(limit=4, by_session=True, retained=holding.__contains__)
    lead = BranchKey("|", "s", "lead")
    recent.add(lead)
    for i in range(20):
        recent.add(BranchKey("|", "s", f"w{i}"))
    assert lead in recent and len(recent) == 4 and lead in recent.of_session("s")
    holding.clear()  # its tokens are gone: now it may be forgotten like any other
    for i in range(4):
        recent.add(BranchKey("|", "s", f"v{i}"))
    assert lead not in recent and lead not in recent.of_session("s")
