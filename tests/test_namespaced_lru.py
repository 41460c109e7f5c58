"""The per-namespace bounded LRU behind the branch sets and the latency book (pure)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache.namespaced_lru import SCAN, NamespacedLRU


def test_each_namespace_is_bounded_by_itself_and_the_largest_yields_to_the_total():
    lru = NamespacedLRU(limit=6, namespace_limit=4)
    for i in range(10):
        lru.put(("a", i), i)
    assert [k for k in lru] == [("a", 6), ("a", 7), ("a", 8), ("a", 9)] and lru.forgotten == 6
    lru.put(("b", 0), 0)
    lru.put(("b", 1), 1)
    lru.put(("c", 0), 0)  # 7 > 6: "a" is the largest, its oldest goes
    assert ("a", 6) not in lru and len(lru) == 6 and lru.namespace_size("a") == 3
    lru.touch(("a", 7))
    lru.put(("d", 0), 0)
    assert ("a", 8) not in lru and ("a", 7) in lru  # touched: no longer the oldest
    assert lru.get(("b", 1)) == 1 and lru.pop(("b", 1)) == 1 and ("b", 1) not in lru
    assert sorted(k for k, _ in lru.pop_namespace("a")) == [("a", 7), ("a", 9)] and lru.namespace_size("a") == 0
    assert None not in lru and 5 not in lru  # not keys at all: simply absent


def test_retained_entries_are_passed_over_and_may_hold_the_map_over_its_bound():
    keep = {("a", i) for i in range(SCAN + 10)}
    lru = NamespacedLRU(limit=SCAN + 10, retained=keep.__contains__)
    for key in sorted(keep):
        lru.put(key, None)
    lru.put(("a", "new"), None)  # every other entry is retained: the map stays over by one
    assert len(lru) == SCAN + 11 and all(k in lru for k in keep)
    keep.clear()
    lru.put(("a", "newer"), None)
    assert len(lru) == SCAN + 10 and ("a", "newer") in lru and ("a", "new") in lru


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 12), st.booleans()), max_size=200),
       st.integers(1, 10), st.integers(1, 6))
def test_bounds_and_fairness_hold_for_any_sequence(ops, limit, namespace_limit):
    """Sizes stay within both bounds, the key just put is always present, and what the bounds evict is
    exactly what the map no longer holds."""
    lru: NamespacedLRU = NamespacedLRU(limit, namespace_limit)
    shadow: dict = {}
    for ns, i, remove in ops:
        key = (ns, i)
        if remove:
            assert lru.pop(key, "x") == shadow.pop(key, "x")
            continue
        sizes = {n: lru.namespace_size(n) for n in "abcd"}
        evicted = lru.put(key, i)
        shadow[key] = i
        for old, _ in evicted:
            del shadow[old]
            if old[0] != ns:  # taken for the total: from a namespace at least as large as the one that grew
                assert sizes[old[0]] >= lru.namespace_size(ns)
        assert key in lru and len(lru) == len(shadow) <= limit
        assert all(lru.namespace_size(n) <= min(namespace_limit, limit) for n in "abcd")
    assert sorted(lru) == sorted(shadow)
