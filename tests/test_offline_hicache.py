"""SGLang's own HiCache driven offline: its host pool, cache controller and ``direct`` io on CPU (the CPU
shims), attached by SGLang's registry as ``--enable-hierarchical-cache`` does, under stock SGLang's
``UnifiedRadixCache`` and under ours (the only host tier ours has); our lifecycle on it (closes,
purges and flushes delete on every tier, pause advice ranks HiCache's host eviction); and the
replayer running both (``sglang-hicache``, ``agentcache``, ours on it) at the same host bytes.

Nothing is mocked: the copies are real (tiny) tensor copies through SGLang's transfer code. Token ids
stay below 512.
"""

from __future__ import annotations

import random

import pytest

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.server.scheduler.cache import AgentRadixCache
from sgl_agentcache.server.scheduler.hicache_moves import host_evictable_tokens
from sgl_agentcache.server.scheduler.offline import OfflineDriver, OfflineHiCache, OfflineOutOfMemory, build_offline_cache
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.suite import pool_for
from sgl_agentcache.trace.generators import generate

POOL = 128
PROMPT = 50


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(PROMPT)] for _ in range(n)]


def _driver(kind: str, write_policy: str = "write_back", host_tokens: int = POOL) -> OfflineDriver:
    cache = build_offline_cache(pool_tokens=POOL, stock=kind == "stock",
                                hicache=OfflineHiCache(host_tokens, write_policy))
    return OfflineDriver(cache)


def _serve(driver: OfflineDriver, rid: str, prompt: list[int], budget: int = 4, session: str | None = None):
    """One call: prompt, 4 decoded tokens; with ``session``, hinted as that session's (branch ``main``)."""
    hint = lifecycle_envelope({"session": session}, message_id=rid) if session else None
    req = driver.admit(rid, prompt, kv_hints=hint, extra_key="t", budget=budget)
    driver.extend(req, [7] * 4, batched_decode=True)
    driver.finish(req)
    return req


def _host_free(driver: OfflineDriver) -> int:
    return driver.cache.cache_controller.mem_pool_host.available_size()


@pytest.mark.parametrize("kind", ["stock", "agentcache"])
def test_hicache_is_attached_with_exactly_the_host_budget(kind):
    driver = _driver(kind, host_tokens=96)
    cache = driver.cache
    assert isinstance(cache, AgentRadixCache) == (kind == "agentcache")
    assert driver.hicache and cache.cache_controller.mem_pool_host.size == 96 == _host_free(driver)
    if kind == "agentcache":  # HiCache's pool is the only host tier, and all of it is free
        assert cache.on_hicache and cache.host_tier_tokens == 96 and cache.host_room() == (96, 96)
        assert cache.hicache_stats()["attached"] and cache.hicache_stats()["host_pool_tokens"] == 96
    with pytest.raises(ValueError, match="multiple of page_size"):
        OfflineHiCache(0).server_fields(POOL, 1)
    with pytest.raises(ValueError, match="write policy"):
        OfflineHiCache(64, "write_sometimes").server_fields(POOL, 1)


@pytest.mark.parametrize("kind", ["stock", "agentcache"])
def test_a_prefix_written_back_to_host_loads_back_at_admission(kind):
    """Write-back: three 54-token sequences overflow the 128-slot pool, so the first goes to host on
    eviction; its next call loads it back through HiCache (``init_load_back``) and counts it cached."""
    driver = _driver(kind)
    a, b, c = _prompts(3)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        assert _serve(driver, rid, prompt).cached_tokens == 0
    assert _host_free(driver) < POOL  # the first one was written back when the third needed room
    again = _serve(driver, "a2", a + [9, 9, 9])
    assert again.host_hit_length == PROMPT and again.host_loaded_length == PROMPT
    assert again.cached_tokens == PROMPT and driver.hicache_loaded_tokens == PROMPT
    report = driver.check()
    assert report.ok, report.errors


@pytest.mark.parametrize("kind", ["stock", "agentcache"])
def test_a_request_refused_by_the_budget_loads_nothing_from_host(kind):
    """SGLang checks the prefill budget with the host hit counted as new tokens before it loads: a
    refused request moves nothing on either tier."""
    driver = _driver(kind)
    a, b, c = _prompts(3, seed=2)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        _serve(driver, rid, prompt)
    host_free, device_free = _host_free(driver), driver.free_tokens()
    with pytest.raises(OfflineOutOfMemory):
        driver.admit("a2", a + [9], extra_key="t", budget=POOL)
    assert (_host_free(driver), driver.free_tokens(), driver.hicache_loaded_tokens) == (host_free, device_free, 0)
    assert _serve(driver, "a3", a + [9]).host_loaded_length == PROMPT  # it fits with a small budget


@pytest.mark.parametrize("kind", ["stock", "agentcache"])
def test_write_through_backs_up_at_insert_and_loads_back_after_eviction(kind):
    driver = _driver(kind, "write_through", host_tokens=2 * POOL)
    a, b, c = _prompts(3, seed=3)
    _serve(driver, "a", a)
    assert _host_free(driver) < 2 * POOL  # backed up on insert, no eviction needed
    _serve(driver, "b", b)
    _serve(driver, "c", c)
    again = _serve(driver, "a2", a + [9])
    assert again.host_loaded_length == PROMPT and again.cached_tokens == PROMPT


@pytest.fixture(scope="module")
def branch_heavy_runs():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    pool = pool_for(trace, "tight")
    names = ("stock", "sglang-hicache", "agentcache")
    return trace, pool, {name: replay(trace, name, pool_tokens=pool, host_tokens=pool, profile=PROFILES["seed"],
                                      vocab_size=2**31 - 1) for name in names}


def test_the_replay_runs_sglangs_hicache_and_ours_on_it_at_the_same_host_bytes(branch_heavy_runs):
    trace, pool, runs = branch_heavy_runs
    stock = runs["stock"]
    for name in ("sglang-hicache", "agentcache"):
        r = runs[name]
        assert r.requests == len(trace.requests) and r.integrity_ok, name
        assert (r.pool_tokens, r.host_tokens) == (pool, pool), name  # same device pool and host bytes
        assert r.restored_tokens > 0, name  # host hits loaded back through HiCache
        assert r.recomputed_tokens < stock.recomputed_tokens, name
    assert runs["agentcache"].leaked_tokens == 0  # closes delete on every tier
    assert runs["agentcache"].reclaimed_tokens > 0


def test_pauses_price_hicache_write_back_duplicates_as_host_room():
    """Under write-back a node loaded back keeps its host copy, which HiCache's host eviction releases
    first when it needs room, at no loss (the device holds it): pause decisions must count it as free
    room (they read a pool full of such copies as full, and turned offloads into keeps and discards:
    short_tools, host 1x, 1.09x of the recompute on our own host tier), and an offload into it as
    displacing nothing."""
    driver = _driver("agentcache")
    a, b, c = _prompts(3, seed=4)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        _serve(driver, rid, prompt)
    _serve(driver, "a2", a + [9])  # a is on the device again, and still on host
    cache = driver.cache
    core = cache.tree_core
    # On both tiers, unlocked, no copy in flight: what drive_host_eviction may release (its index of
    # duplicates can hold stale entries, which it skips).
    duplicates = sum(len(cd.host_value) for n in core.full_host_duplicates.values()
                     for cd in (n.component_data[0],)
                     if cd.value is not None and cd.host_value is not None and cd.host_lock_ref == 0
                     and n.write_through_pending_id is None and n.load_back_pending_id is None)
    assert duplicates >= PROMPT
    free, room = cache.host_room()
    assert free == _host_free(driver) + duplicates and room == free + host_evictable_tokens(cache)


def test_host_room_counts_host_only_chains_whole_as_hicache_evicts_them():
    """HiCache's host eviction takes a host leaf, then its parent once that is a leaf: a host-only chain
    (a conversation and its continuation, both pushed off the device) is room all the way up. Counting
    its last node only read a host full of closed branches' KV as nearly full and turned offloads into
    discards (branch_heavy with chat inference: 1.34x the recompute of explicit hints on one seed)."""
    driver = _driver("agentcache", host_tokens=POOL * 2)
    a, b, c, d = _prompts(4, seed=9)
    _serve(driver, "a", a)
    _serve(driver, "a2", a + [9] * 30)  # a child node under a's
    for rid, prompt in (("b", b), ("c", c), ("d", d)):  # push both off the device, onto the host
        _serve(driver, rid, prompt)
    cache = driver.cache
    core = cache.tree_core
    host_only = [n for n in core.all_nodes() if n is not core.root_node and n.evicted and n.backuped]
    chain = [n for n in host_only if n.children]
    assert chain, "a's node should be a host-only parent of a2's"
    leaves = sum(len(n.component_data[0].host_value) for n in core.evictable_host_leaves)
    whole = sum(len(n.component_data[0].host_value) for n in host_only)
    assert host_evictable_tokens(cache) == whole > leaves
    free, room = cache.host_room()
    assert room == free + whole
    # SGLang's own host eviction frees exactly that much, and nothing host-only is left.
    assert cache.evict_host(whole) == whole
    assert not [n for n in core.all_nodes() if n is not core.root_node and n.evicted and n.backuped]
    assert host_evictable_tokens(cache) == 0


def test_hicache_host_reuse_rate_is_learned_from_its_load_backs_and_host_evictions():
    """The pause policy prices host room with the share of host tokens used again. On HiCache that is
    counted on HiCache's own moves (every load-back, every host eviction of a live branch's node)."""
    from sgl_agentcache.policy.retention import HOST_REUSE_PRIOR, learned_rate

    driver = _driver("agentcache", host_tokens=64)
    cache, core = driver.cache, driver.cache.tree_core
    assert cache.host_reuse_rate() == pytest.approx(HOST_REUSE_PRIOR)
    prompts = _prompts(4, seed=9)
    for rid, prompt in zip("abc", prompts):
        _serve(driver, rid, prompt)
    _serve(driver, "a2", prompts[0] + [9])  # loaded back from host
    assert core.host_loaded_tokens == PROMPT
    _serve(driver, "d", prompts[3])
    _serve(driver, "b2", prompts[1] + [9])
    assert core.host_lost_tokens > 0  # a 64-slot host pool cannot keep every 50-token prompt
    assert cache.host_reuse_rate() == pytest.approx(learned_rate(core.host_loaded_tokens, core.host_lost_tokens))
    assert cache.host_reuse_rate() != pytest.approx(HOST_REUSE_PRIOR)
    report = driver.check()
    assert report.ok, report.errors


@pytest.mark.parametrize("kind", ["stock", "agentcache"])
def test_a_leaf_longer_than_the_host_pool_keeps_its_head_on_host(kind):
    """Write-back, a 32-slot host pool, 54-token leaves: SGLang drops an evicted leaf whole when the host
    cannot take all of it; ours splits it at the host room and backs the head up (its tail is dropped),
    so the next call on that prefix loads 32 tokens from host instead of recomputing all 50."""
    driver = _driver(kind, host_tokens=32)
    a, b, c = _prompts(3, seed=5)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        _serve(driver, rid, prompt)
    again = _serve(driver, "a2", a + [9])
    report = driver.check()
    assert report.ok, report.errors
    if kind == "stock":
        assert again.host_hit_length == 0 and again.cached_tokens == 0
        return
    assert again.host_loaded_length == 32 and again.cached_tokens == 32
    counts = driver.cache.partial_backups
    assert counts["leaves"] >= 1 and counts["kept_tokens"] == 32 * counts["leaves"]
    assert counts["dropped_tokens"] > 0
    assert driver.cache.hicache_stats()["partial_backups"] == counts


@pytest.mark.parametrize("kind", ["stock", "baseline-key", "agentcache"])
def test_host_eviction_takes_only_the_tail_its_need_requires(kind):
    """An 80-slot host pool holds a's 54 tokens; b's 54-token write-back needs 27 more slots. SGLang's
    host eviction frees a's leaf whole; ours takes its 27-token tail and keeps the head, so a's next
    call loads 27 tokens from host instead of recomputing everything. A replayed baseline's ranking
    (``set_eviction_key``) keeps SGLang's whole-leaf eviction."""
    driver = _driver("stock" if kind == "stock" else "agentcache", host_tokens=80)
    if kind == "baseline-key":
        driver.cache.set_eviction_key(lambda node, session_ref, base_priority: (base_priority,))
    a, b, c, d = _prompts(4, seed=5)
    for rid, prompt in (("a", a), ("b", b), ("c", c), ("d", d)):
        _serve(driver, rid, prompt)
    core = driver.cache.tree_core
    trims = getattr(core, "host_trims", {"leaves": 0, "kept_tokens": 0})
    again = _serve(driver, "a2", a + [9])
    report = driver.check()
    assert report.ok, report.errors
    if kind != "agentcache":
        assert trims == {"leaves": 0, "kept_tokens": 0} and again.cached_tokens == 0
        return
    assert trims == {"leaves": 1, "kept_tokens": 27}
    assert again.host_loaded_length == 27 and again.cached_tokens == 27
    assert driver.cache.hicache_stats()["host_trims"] == trims


@pytest.mark.parametrize("host", [True, False], ids=["hicache", "no-host"])
@pytest.mark.parametrize("kind", ["stock", "baseline-key", "untagged", "agentcache", "kept-on-close"])
def test_device_eviction_takes_only_the_tail_of_a_session_leaf_its_need_requires(kind, host):
    """The 128-slot pool holds sessions a's and b's 54 tokens; c's 54 need 34 more slots. SGLang evicts
    a's leaf whole (written back to host, or deleted without a host tier); ours takes only the tails c's
    allocations require and keeps a 22-token head of a's history on the device, so a's next call finds
    it there and loads only the rest from host (or recomputes only the rest). A replayed baseline's
    ranking (``set_eviction_key``) and untagged traffic keep SGLang's whole-leaf eviction; a history a
    guessed close kept as cache (chat inference's idle close, ``keep_cached``) is trimmed as a branch's
    is, and its user, back without hints, finds the head."""
    hicache = OfflineHiCache(POOL, "write_back") if host else None
    driver = OfflineDriver(build_offline_cache(pool_tokens=POOL, stock=kind == "stock", hicache=hicache))
    cache = driver.cache
    if kind == "baseline-key":
        cache.set_eviction_key(lambda node, session_ref, base_priority: (base_priority,))
    a, b, c = _prompts(3, seed=5)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        if kind == "kept-on-close" and rid == "c":  # a's conversation is guessed over: kept as cache
            (owner,) = [o for o in cache.tree_core.owner_index if o.session == "a"]
            with driver.activated():
                # its prompt and 3 of its 4 decoded tokens (the last one has no KV yet)
                assert cache.close_branch(owner, keep_cached=True)["kept_tokens"] == PROMPT + 3
            assert all(n.agent.kept and n.agent.owner is None for n in cache.tree_core.all_nodes()[1:]
                       if list(n.key.token_ids[:1]) == a[:1])
        _serve(driver, rid, prompt, session=None if kind == "untagged" else rid)
    trims = getattr(cache.tree_core, "device_trims", {"leaves": 0, "kept_tokens": 0})
    again = _serve(driver, "a2", a + [9], session=None if kind in ("untagged", "kept-on-close") else "a")
    report = driver.check()
    assert report.ok, report.errors
    on_device = again.cached_tokens - again.host_loaded_length
    if kind not in ("agentcache", "kept-on-close"):
        assert trims == {"leaves": 0, "kept_tokens": 0} and on_device == 0
        assert again.cached_tokens == (PROMPT if host else 0)
        return
    assert trims["leaves"] >= 1 and on_device == 22
    assert again.cached_tokens == (PROMPT if host else 22)
    assert cache.agent_stats()["device_trims"] == cache.tree_core.device_trims


def test_a_requested_eviction_takes_that_many_tokens_off_the_tail_of_a_session_leaf():
    """``evict(n)`` (SGLang's own calls, e.g. a retract) frees n tokens, not whole leaves: here a
    session's 3-token decode leaf goes whole, then 2 tokens off the tail of the prompt's node it
    exposed; the 48-token head stays on the device and the session's next call finds it. A need of the
    whole leaf or more, or none, splits nothing."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_agentcache.server.scheduler.leaf_tails import device_tail

    driver = OfflineDriver(build_offline_cache(pool_tokens=POOL))
    cache, core = driver.cache, driver.cache.tree_core
    prompts = dict(zip("ab", _prompts(2, seed=7)))
    for session, prompt in prompts.items():
        _serve(driver, session, prompt, session=session)
    before = set(core.evictable_device_leaves)
    free = cache.token_to_kv_pool_allocator.available_size()
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 5
    assert cache.token_to_kv_pool_allocator.available_size() == free + 5
    assert core.device_trims == {"leaves": 1, "kept_tokens": PROMPT - 2}
    (head,) = set(core.evictable_device_leaves) - before  # what is left of the prompt's node
    assert len(head.key) == PROMPT - 2
    session = head.agent.owner.session
    assert list(head.key.token_ids) == prompts[session][:PROMPT - 2]
    for need in (PROMPT - 2, PROMPT + 3, 0):  # a need of the whole leaf or more, or none
        assert device_tail(core, head, need) is head and len(head.key) == PROMPT - 2
    core.trim_device_tails = False
    assert device_tail(core, head, 3) is head and len(head.key) == PROMPT - 2
    core.trim_device_tails = True
    assert core.device_trims["leaves"] == 1
    assert _serve(driver, "again", prompts[session] + [9], session=session).cached_tokens == PROMPT - 2
    report = driver.check()
    assert report.ok, report.errors


def test_one_token_needs_split_off_at_least_the_floor_so_decode_does_not_split_every_step():
    """Under pressure SGLang asks eviction for exactly the shortfall (``evict_to_free_tokens``): one
    token per decoding request per step. Each split takes at least ``tail_floor`` of the pool (here 16
    of 1,024), so 64 one-token decode allocations cost 4 splits (and the decoded tokens' own 4-token
    leaf), not 64, and the history keeps its head on the device. A requested eviction above the floor
    takes just what it asked."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_agentcache.server.scheduler.leaf_tails import TAIL_FLOOR_SHARE, tail_floor

    pool = 1024
    floor = tail_floor(pool, 1)
    assert floor == int(pool * TAIL_FLOOR_SHARE) == 16 and tail_floor(10, 1) == 1 and tail_floor(4096, 16) == 64
    driver = OfflineDriver(build_offline_cache(pool_tokens=pool))
    cache, core = driver.cache, driver.cache.tree_core
    allocator = cache.token_to_kv_pool_allocator
    assert core.device_tail_floor == floor
    rng = random.Random(3)
    history = [rng.randrange(1, 500) for _ in range(400)]
    _serve(driver, "a", history, session="a")
    with driver.activated():
        held = [allocator.alloc(allocator.available_size())]  # another request's KV fills the pool
        for _ in range(64):  # it decodes: one slot per step, each short by one
            allocator.evict_to_free_tokens(cache, 1)
            held.append(allocator.alloc(1))
            assert held[-1] is not None
        assert core.device_trims["leaves"] == 4
        assert cache.evict(EvictParams(num_tokens=floor + 5)).num_tokens_evicted == floor + 5
        assert core.device_trims["leaves"] == 5
        for slots in held:
            allocator.free(slots)
    again = _serve(driver, "a2", history + [9], session="a")
    assert again.cached_tokens == 400 - 4 * floor - (floor + 5)
    report = driver.check()
    assert report.ok, report.errors


def test_host_tail_splits_whole_pages_and_keeps_the_heads_recency():
    """``host_tail`` on a host-only leaf: a need of the whole leaf or more takes it whole; a smaller one
    splits off a tail of that length, and the head keeps the leaf's LRU stamp, so it ranks as the leaf
    did."""
    from sgl_agentcache.server.scheduler.hicache_moves import host_tail

    driver = _driver("agentcache", host_tokens=POOL * 2)
    a, b, c = _prompts(3, seed=9)
    for rid, prompt in (("a", a), ("b", b), ("c", c)):  # a is pushed onto the host
        _serve(driver, rid, prompt)
    core = driver.cache.tree_core
    while max(len(n.key) for n in core.evictable_host_leaves) < 40:  # decode's short leaves go first
        driver.cache.evict_host(min(len(n.key) for n in core.evictable_host_leaves))
    leaf = max(core.evictable_host_leaves, key=lambda n: len(n.key))
    length, stamp, parent = len(leaf.key), leaf.last_access_time, leaf.parent
    assert host_tail(core, leaf, 0) is leaf and host_tail(core, leaf, length) is leaf
    assert host_tail(core, leaf, length + 5) is leaf
    assert len(leaf.key) == length and leaf.parent is parent
    tail = host_tail(core, leaf, 20)
    assert tail is leaf and len(tail.key) == 20 and len(tail.component_data[0].host_value) == 20
    head = tail.parent
    assert head is not parent and head.parent is parent and len(head.key) == length - 20
    assert head.last_access_time == stamp and head.evicted and head.backuped
    assert core.host_trims == {"leaves": 1, "kept_tokens": length - 20}
    assert driver.cache.evict_host(20) == 20 and core.host_trims["leaves"] == 1  # the tail goes first...
    assert head in core.evictable_host_leaves  # ...and leaves the head a host leaf
    report = driver.check()
    assert report.ok, report.errors


def test_head_len_keeps_whole_pages_of_the_room_only_when_the_leaf_does_not_fit():
    from sgl_agentcache.server.scheduler.hicache_moves import head_len

    assert head_len(54, 64, 1) == 0  # fits whole: SGLang's own path
    assert head_len(54, 32, 1) == 32
    assert head_len(54, 35, 16) == 32  # whole pages only
    assert head_len(54, 15, 16) == 0  # not one page: nothing to keep


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_an_applied_offload_demotes_the_branch_into_hicache_and_its_next_call_loads_it_back(write_policy):
    """A forced (baseline) or eager offload on HiCache: the paused branch's own suffix is backed up and
    demoted into HiCache's host pool at once (its device slots freed), the stable prefix stays; the
    branch's next call loads it back through HiCache, byte for byte."""
    import torch

    from sgl_agentcache.hints import lifecycle_envelope
    from sgl_agentcache.lifecycle import BranchKey, namespace_key
    from sgl_agentcache.policy.pause import PauseAction

    cache = build_offline_cache(pool_tokens=1024, hicache=OfflineHiCache(1024, write_policy))
    driver = OfflineDriver(cache)
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    rng = random.Random(6)
    prompt = [rng.randrange(3, 400) for _ in range(300)]

    def call(rid, tokens):
        hint = {"session": "s", "branch": "main", "stable_prefix_tokens": 32}
        return driver.admit(rid, tokens, kv_hints=lifecycle_envelope(hint, message_id=rid))

    first = call("r1", prompt)
    idx = driver.req_to_token_pool.req_to_token[first.kv.req_pool_idx, :300]
    for buf in kv.k_buffer + kv.v_buffer:
        buf[idx] = (torch.arange(300, dtype=buf.dtype) + 1000.0).view(-1, 1, 1)
    driver.extend(first, [7, 8, 9])
    driver.finish(first)
    free_before = driver.free_tokens()
    branch = BranchKey(namespace_key(None, None), "s", "main")
    with driver.activated():
        result = cache.pauses.pause(branch, force=PauseAction.OFFLOAD)
    moved = 300 + 2 - 32  # the prompt and the outputs with KV, past the shared stable prefix
    assert result["action"] == "offload" and result["moved_tokens"] == moved == result["tokens"]
    assert driver.free_tokens() == free_before + moved
    assert cache.pauses.records[branch].advice is PauseAction.OFFLOAD  # its host copies rank protected
    assert cache.pauses.counters["hicache_offloaded_tokens"] == moved
    assert driver.check().ok

    second = call("r2", prompt + [7, 8, 9] + [11, 12])
    assert second.host_loaded_length == moved and second.cached_tokens == 302
    idx = driver.req_to_token_pool.req_to_token[second.kv.req_pool_idx, :300]
    for buf in kv.k_buffer + kv.v_buffer:
        assert torch.equal(buf[idx].flatten(), torch.arange(300, dtype=buf.dtype) + 1000.0)
    driver.extend(second, [5])
    driver.finish(second)
    report = driver.check()
    assert report.ok, report.errors


def test_a_kept_branch_forced_to_host_ranks_with_the_offloaded_ones_in_hicaches_host_eviction():
    """HiCache's host eviction ranks host-only nodes by their branch's pause advice: DISCARD first, then
    branches without advice, then OFFLOAD -- and KEEP beside OFFLOAD: the policy judged a kept branch
    worth device memory, so when pressure still pushes it to host it must not go before a branch judged
    worth only host memory (it did: short_tools seed 2, a kept 2,600-token lead lost on host to offloaded
    branches, 1.13x KVFlow's recompute). A branch over its quota ranks first whatever its advice, and
    an ended branch's nodes before everything."""
    from sgl_agentcache.hints import lifecycle_envelope
    from sgl_agentcache.lifecycle import BranchKey, namespace_key
    from sgl_agentcache.policy.pause import PauseAction
    from sgl_agentcache.policy.retention import Band
    from sgl_agentcache.server.scheduler.branch_walks import movable_suffix
    from sgl_agentcache.server.scheduler.hicache_moves import demote_chain

    cache = build_offline_cache(pool_tokens=1024, hicache=OfflineHiCache(1024))
    driver = OfflineDriver(cache)
    rng = random.Random(11)
    bands = {}
    cases = (("kept", PauseAction.KEEP), ("offloaded", PauseAction.OFFLOAD), ("discarded", PauseAction.DISCARD),
             ("plain", None), ("over_quota", PauseAction.OFFLOAD))
    for name, advice in cases:
        hint = {"session": name, "branch": "main"}
        req = driver.admit(name, [rng.randrange(3, 400) for _ in range(100)],
                           kv_hints=lifecycle_envelope(hint, message_id=name))
        driver.extend(req, [7])
        driver.finish(req)
        branch = BranchKey(namespace_key(None, None), name, "main")
        if advice is not None:
            cache.pauses.advice[branch] = advice  # what a lazy pause leaves (PauseBook._advise)
        if name == "over_quota":
            cache.quotas.put(branch, 16)
        with driver.activated():
            assert demote_chain(cache, movable_suffix(cache.tree_core, branch)) == 100
        nodes = [n for n in cache.tree_core.owner_index[branch] if n.evicted]
        bands[name] = {cache.hicache_host_key(n, 0.0)[0] for n in nodes}
    assert bands == {"kept": {Band.PROTECTED}, "offloaded": {Band.PROTECTED}, "discarded": {Band.TRIM},
                     "plain": {Band.VALUED}, "over_quota": {Band.TRIM}}
    driver.step()
    assert driver.check().ok
    ended = BranchKey(namespace_key(None, None), "plain", "main")
    node = next(n for n in cache.tree_core.owner_index[ended] if n.evicted)
    cache.tree_core.set_state(node, node.agent.ended())  # a closed branch's node not yet deleted
    assert cache.hicache_host_key(node, 0.0)[0] is Band.ENDED


# ---- our lifecycle on HiCache's host pool: closes, purges, flushes ----


def _hinted(driver: OfflineDriver, rid: str, prompt: list[int], hint: dict | None = None, out=(1,),
            cache_salt: str | None = None) -> int:
    """One call (hinted when ``hint``): returns the tokens it found cached (device or loaded from host)."""
    from sgl_agentcache.hints import lifecycle_envelope

    req = driver.admit(rid, prompt, kv_hints=lifecycle_envelope(hint, message_id=rid) if hint else None,
                       cache_salt=cache_salt)
    cached = req.cached_tokens
    driver.extend(req, list(out))
    driver.finish(req)
    return cached


def _host_tokens_of(cache, owner) -> int:
    return sum(len(n.component_data[0].host_value) for n in cache.tree_core.host_holders() if n.agent.owner == owner)


def _clean(driver: OfflineDriver) -> None:
    report = driver.check()
    assert report.ok, report.errors
    assert driver.idle_free_tokens() == driver.pool_tokens


def test_closing_a_branch_deletes_its_host_copies_and_a_closed_branch_is_never_backed_up():
    """A close deletes the branch's nodes on both tiers (HiCache's host pool gets its slots back, the
    prompt sent again finds nothing); a branch closed by its own last call is deleted at once, never
    backed up to host."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_agentcache.lifecycle import BranchKey, namespace_key

    driver = OfflineDriver(build_offline_cache(pool_tokens=300, max_reqs=8, hicache=OfflineHiCache(2000)))
    cache = driver.cache
    cache.tree_core.trim_device_tails = False  # the flood pushes w1's whole leaf to host (leaf_tails)
    owner = BranchKey(namespace_key(None, None), "s", "w1")
    hint = {"session": "s", "branch": "w1"}
    prompt = list(range(10, 160))
    _hinted(driver, "w", prompt, hint)
    _hinted(driver, "flood", list(range(200, 400)))  # w1's node goes to host (write-back)
    on_host = _host_tokens_of(cache, owner)
    assert on_host >= 150 and cache.tree_core.resident_owned_tokens(owner) == 0
    host_free = _host_free(driver)
    with driver.activated():
        closed = cache.close_branch(owner)
    assert closed["closed"] and closed["host_freed_tokens"] == on_host
    assert _host_free(driver) == host_free + on_host and cache.hicache_deletes["host_tokens"] == on_host
    assert cache.tree_core.owned_tokens(owner) == 0 and owner not in cache.tree_core.owner_index
    _clean(driver)
    assert _hinted(driver, "again", prompt + [400]) == 0  # nothing left on either tier
    # A branch whose last call closes it: its nodes are deleted at once, on the device, and never
    # backed up (no host slot is spent on KV nobody reads again).
    closing = {"session": "t", "branch": "main", "close": True}
    freed = cache.freed_on_close_tokens
    _hinted(driver, "t", list(range(5, 155)), closing)
    assert cache.freed_on_close_tokens - freed == 150
    assert not any(n.agent.terminated for n in cache.tree_core.all_nodes()[1:])
    with driver.activated():
        assert cache.host_tokens_continuing(RadixKey(array("q", range(5, 155)))) == 0
    _clean(driver)


def test_a_close_that_keeps_the_cache_untags_the_branch_on_every_tier_and_it_still_hits():
    """Chat inference's idle close is a guess (``keep_cached``): the branch ends (no owner, no charge,
    never a parent), but its device and host nodes stay as untagged cache, and a later prompt that
    continues the history hits them, on device and loaded back from host."""
    from sgl_agentcache.lifecycle import BranchKey, namespace_key

    driver = OfflineDriver(build_offline_cache(pool_tokens=300, max_reqs=8, hicache=OfflineHiCache(2000)))
    cache = driver.cache
    cache.tree_core.trim_device_tails = False  # the flood pushes w1's whole leaf to host (leaf_tails)
    owner = BranchKey(namespace_key(None, None), "s", "w1")
    hint = {"session": "s", "branch": "w1"}
    _hinted(driver, "w0", list(range(10, 110)), hint)
    _hinted(driver, "w1", list(range(10, 160)), hint)  # two nodes: 100, then 50
    _hinted(driver, "flood", list(range(200, 370)))  # the leaf of w1's history goes to host
    on_host = _host_tokens_of(cache, owner)
    on_device = cache.tree_core.resident_owned_tokens(owner)
    assert on_host > 0 and on_device > 0
    freed_before, host_free = cache.freed_on_close_tokens, _host_free(driver)
    with driver.activated():
        closed = cache.close_branch(owner, keep_cached=True)
    assert closed["closed"] and closed["freed_tokens"] == 0 and closed["host_freed_tokens"] == 0
    assert closed["kept_tokens"] == cache.kept_on_close_tokens == on_host + on_device >= 150
    assert cache.freed_on_close_tokens == freed_before and owner in cache.closed and _host_free(driver) == host_free
    assert cache.tree_core.owned_tokens(owner) == 0 and owner not in cache.tree_core.owner_index
    assert all(n.agent.owner is None for n in cache.tree_core.host_holders())
    assert cache.agent_stats()["resident_tokens"]["session"] == 0
    assert cache.hicache_stats()["host_tokens_by_class"]["untagged"] >= on_host
    _clean(driver)
    assert _hinted(driver, "back", list(range(10, 160)) + list(range(400, 405))) >= 149  # device + host, reused
    _clean(driver)


def test_a_purge_and_a_flush_delete_host_copies():
    """A tenant purge deletes the salt's nodes from HiCache's host pool too (not the others'); a flush
    (``/flush_cache``) empties both tiers."""
    driver = OfflineDriver(build_offline_cache(pool_tokens=300, max_reqs=8, hicache=OfflineHiCache(2000)))
    cache = driver.cache
    salt = "agentcache:acme:x"
    _hinted(driver, "t", list(range(10, 160)), cache_salt=salt)
    _hinted(driver, "u", list(range(100, 250)))  # another tenant's (unsalted) prompt
    _hinted(driver, "flood", list(range(300, 500)))  # both go to host
    salted = [n for n in cache.tree_core.host_holders() if n.key.cache_salt == salt]
    held = sum(len(n.component_data[0].host_value) for n in salted)
    others = _host_free(driver)
    assert held >= 150
    with driver.activated():
        purged = cache.purge_salt(salt)
    assert purged["host_freed_tokens"] == held and _host_free(driver) == others + held
    assert not any(n.key.cache_salt == salt for n in cache.tree_core.host_holders())
    assert cache.tree_core.host_holders()  # the other tenant's copy stays
    assert _hinted(driver, "u2", list(range(100, 250)) + [7]) == 150  # and still loads back
    _clean(driver)
    driver.flush_cache()
    assert not cache.tree_core.host_holders() and _host_free(driver) == 2000
    assert driver.free_tokens() == driver.pool_tokens
    _clean(driver)
