"""Inserts that start at the request's locked node build exactly the tree SGLang's full walk builds.

``AgentTreeCore._skip_locked_prefix`` lets an insert start at the node its request holds locked
instead of re-walking (re-comparing, re-slicing) the request's prefix from the root. It must change
nothing but the time: these tests play one recorded agent stream (forks, closes, evictions; the
tree-overhead benchmark's recorder) into caches side by side, one driver op at a time, and after
every op compare the whole trees -- every node's tokens, KV slots, lock count, priority, hit count,
lifecycle state -- and the LRU order of all nodes (SGLang's access stamps are a process-wide counter,
so the order is compared, not the stamps):

- our hinted cache with the skip against the same cache with it off (page sizes 1 and 4);
- our cache on untagged traffic, with the skip, against stock SGLang's ``UnifiedRadixCache``.

Each test also checks that the skip really happened (most of the stock walk's steps were skipped),
so it cannot pass by never skipping.
"""

from __future__ import annotations

from collections import Counter

import pytest
from bench_module import load_bench
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

import sgl_agentcache.server.scheduler.offline as offline
from sgl_agentcache.lifecycle import UNTAGGED_STATE

FULL = ComponentType.FULL


@pytest.fixture(scope="module")
def bench():
    return load_bench("tree_overhead")


@pytest.fixture(scope="module")
def stream(bench):
    # A pool tight enough that allocation evicts (LRU order matters), recorded under the hinted cache.
    return bench.record("branch_heavy", 0.1, 5120)


def tree(core) -> tuple[dict, list]:
    """(path tokens -> node facts, paths in LRU order) for every node but the root."""
    facts, stamps = {}, []
    stack = [(child, ()) for child in core.root_node.children.values()]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.key.raw_token_ids()[: len(node.key)])
        data = node.component_data[FULL]
        state = getattr(node, "agent", UNTAGGED_STATE)  # stock nodes carry no state: untagged
        facts[path] = (None if data.value is None else data.value.tolist(), data.lock_ref, node.priority,
                       node.hit_count, (state.cls, state.owner, state.terminated))
        stamps.append((node.last_access_time, path))
        stack.extend((child, path) for child in node.children.values())
    return facts, [path for _, path in sorted(stamps)]


class Side:
    """One cache fed the stream through the offline driver (the benchmark's ``apply_op``)."""

    def __init__(self, bench, cache, hinted: bool):
        self.apply, self.cache, self.hinted = bench.apply_op, cache, hinted
        self.driver = offline.OfflineDriver(cache)
        self.live: dict = {}
        self.cached_tokens = 0

    def step(self, op: tuple) -> None:
        req = self.apply(self.driver, self.live, op, self.hinted)
        if req is not None:
            self.cached_tokens += req.cached_tokens


def play_side_by_side(bench, stream, a: Side, b: Side, skipping_core) -> Counter:
    """Play ``stream`` into both, comparing the trees after every op; return the walk/skip counts."""
    counts: Counter = Counter()
    for side in (a, b):  # count the evictions allocation triggers (LRU order decides what goes)
        evict = side.cache.evict_for_alloc

        def counted(*args, _evict=evict, _side=side, **kwargs):
            counts[(id(_side), "evict")] += 1
            return _evict(*args, **kwargs)

        side.cache.evict_for_alloc = counted
    with bench._counting_insert_steps(counts):
        for i, op in enumerate(stream.ops):
            a.step(op)
            b.step(op)
            facts_a, order_a = tree(a.cache.tree_core)
            facts_b, order_b = tree(b.cache.tree_core)
            assert facts_a == facts_b, f"trees differ after op {i} {op[:2]}"
            assert order_a == order_b, f"LRU order differs after op {i} {op[:2]}"
    assert counts[(id(a), "evict")] > 0 and counts[(id(b), "evict")] > 0, "the pool never filled"
    assert a.cached_tokens == b.cached_tokens > 0
    assert not a.live and not b.live
    for side in (a, b):
        report = side.driver.check() if hasattr(side.cache.tree_core, "owner_index") else None
        assert report is None or report.ok, report.errors[:5]
    skipped = counts[(id(skipping_core), "skipped")]
    walked = counts[id(skipping_core)]
    assert skipped > 2 * walked, f"the skip barely ran: {skipped} nodes skipped, {walked} walked"
    return counts


def _build(stream, page_size: int, stock: bool = False):
    # No host tier (no HiCache): the trees and LRU orders compared are the device's alone.
    return offline.build_offline_cache(pool_tokens=stream.pool_tokens, page_size=page_size,
                                       max_reqs=stream.max_reqs, context_len=stream.context_len, stock=stock)


@pytest.mark.parametrize("page_size", [1, 4])
def test_hinted_cache_skip_matches_full_walk(bench, stream, page_size):
    skipping, walking = _build(stream, page_size), _build(stream, page_size)
    walking.skip_locked_prefix = False
    counts = play_side_by_side(bench, stream, Side(bench, skipping, True), Side(bench, walking, True),
                               skipping.tree_core)
    # Every node the skip passed is one step the full walk took: nothing else about the walk changed.
    assert (counts[id(skipping.tree_core)] + counts[(id(skipping.tree_core), "skipped")]
            == counts[id(walking.tree_core)])
    assert counts[(id(walking.tree_core), "skipped")] == 0


def test_untagged_traffic_matches_stock_sglang(bench, stream):
    ours, stock = _build(stream, 1), _build(stream, 1, stock=True)
    counts = play_side_by_side(bench, stream, Side(bench, ours, False), Side(bench, stock, False),
                               ours.tree_core)
    assert counts[id(ours.tree_core)] + counts[(id(ours.tree_core), "skipped")] == counts[id(stock.tree_core)]


@pytest.mark.parametrize("locked", [True, False])
def test_a_start_node_off_the_key_leaves_the_walk_to_sglang(locked):
    """A start node whose path is not the key's prefix (a caller's mistake) must not graft the key
    under it: the spot check (start locked, as a request's is) or the lock test (start unlocked)
    sends the insert down SGLang's own walk, so the tree is the one a cache without it builds."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    trees = []
    for forge in (False, True):
        cache = offline.build_offline_cache(pool_tokens=256)
        driver = offline.OfflineDriver(cache)
        driver.finish(driver.admit("a", list(range(1, 41))))  # the tree holds [1..40] as one leaf
        core = cache.tree_core
        (leaf,) = core.root_node.children.values()
        with driver.activated():
            ids = list(range(101, 161))  # shares no token with [1..40]
            slots = cache.token_to_kv_pool_allocator.alloc(len(ids))
            lock = cache.lock(leaf.id) if locked else None
            core.insert_from = leaf if forge else None
            try:
                cache.insert(InsertParams(key=RadixKey(ids), value=slots.to(torch.int64), prev_prefix_len=40))
            finally:
                core.insert_from = None
                if lock is not None:
                    cache.unlock(lock)
        trees.append(tree(core))
        assert driver.check().ok
    assert trees[0] == trees[1]
    assert len(trees[0][0]) == 2  # two leaves under the root: nothing was grafted under [1..40]
