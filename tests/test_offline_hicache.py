"""SGLang's own HiCache driven offline: its host pool, cache controller and ``direct`` io on CPU (the CPU
shims), attached by SGLang's registry as ``--enable-hierarchical-cache`` does, under stock SGLang's
``UnifiedRadixCache`` and under ours; and the replayer running both (``sglang-hicache``,
``agentcache``, ours on it) beside our own host tier (``agentcache-own-tier``) at the same host bytes.

Nothing is mocked: the copies are real (tiny) tensor copies through SGLang's transfer code. Token ids
stay below 512.
"""

from __future__ import annotations

import random

import pytest

from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.server.cache import AgentRadixCache
from sgl_agentcache.server.offline import OfflineDriver, OfflineHiCache, OfflineOutOfMemory, build_offline_cache
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


def _serve(driver: OfflineDriver, rid: str, prompt: list[int], budget: int = 4):
    req = driver.admit(rid, prompt, extra_key="t", budget=budget)
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
    if kind == "agentcache":  # our own host tier is retired: HiCache's pool is the only one
        assert cache.on_hicache and not cache.spill.enabled and cache.pauses.host.capacity_tokens == 0
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
    names = ("stock", "hicache", "sglang-hicache", "agentcache-own-tier", "agentcache")
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
    # SGLang's own write-back and the emulation our tier runs agree closely on this trace.
    emulated, real = runs["hicache"].recomputed_tokens, runs["sglang-hicache"].recomputed_tokens
    assert abs(emulated - real) <= 0.1 * real


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
    host_only = sum(len(n.component_data[0].host_value) for n in core.evictable_host_leaves)
    assert free == _host_free(driver) + duplicates and room == free + host_only


def test_hicache_host_reuse_rate_is_learned_from_its_load_backs_and_host_evictions():
    """The pause policy prices host room with the share of host tokens used again. On HiCache that is
    counted on HiCache's own moves (every load-back, every host eviction of a live branch's node), not
    read from our retired tier's counters (which stay at the prior there)."""
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
    assert cache.host_reuse_rate() != pytest.approx(cache.spill.reuse_rate())
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


def test_head_len_keeps_whole_pages_of_the_room_only_when_the_leaf_does_not_fit():
    from sgl_agentcache.server.hicache_moves import head_len

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
    branches, 1.13x KVFlow's recompute)."""
    from sgl_agentcache.hints import lifecycle_envelope
    from sgl_agentcache.lifecycle import BranchKey, namespace_key
    from sgl_agentcache.policy.pause import PauseAction
    from sgl_agentcache.policy.retention import Band
    from sgl_agentcache.server.hicache_moves import demote_chain

    cache = build_offline_cache(pool_tokens=1024, hicache=OfflineHiCache(1024))
    driver = OfflineDriver(cache)
    rng = random.Random(11)
    bands = {}
    for name, advice in (("kept", PauseAction.KEEP), ("offloaded", PauseAction.OFFLOAD),
                         ("discarded", PauseAction.DISCARD), ("plain", None)):
        hint = {"session": name, "branch": "main"}
        req = driver.admit(name, [rng.randrange(3, 400) for _ in range(100)],
                           kv_hints=lifecycle_envelope(hint, message_id=name))
        driver.extend(req, [7])
        driver.finish(req)
        branch = BranchKey(namespace_key(None, None), name, "main")
        if advice is not None:
            cache.spill.advise(branch, advice)
        with driver.activated():
            assert demote_chain(cache, cache.copies.movable_suffix(branch)) > 0
        nodes = [n for n in cache.tree_core.owner_index[branch] if n.evicted]
        bands[name] = {cache._hicache_host_key(n, 0.0)[0] for n in nodes}
    assert bands == {"kept": {Band.PROTECTED}, "offloaded": {Band.PROTECTED}, "discarded": {Band.TRIM},
                     "plain": {Band.VALUED}}
    assert driver.check().ok
