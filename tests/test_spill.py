"""The node spill (HiCache write-back semantics on our host tier), on the real cache offline.

Stock eviction copies the evicted leaf to host; a later match of a request copies the chain that
continues its key back, with the KV bytes it had, and the request hits it. The host tier's capacity is
shared with paused branches' copies; host leaves go least recently used first; a closed branch's
entries, a purged tenant's and everything on a reset go; a failed copy falls back to eviction
(spill) or recompute (load-back); nothing leaks. Token ids stay below 512.
"""

from __future__ import annotations

import pytest
import torch

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, NodeClass, namespace_key
from sgl_agentcache.server.async_load import ASYNC_LOAD_ENV
from sgl_agentcache.server.offline import OfflineDriver, build_offline_cache
from sgl_agentcache.server.pauses import PauseAction
from sgl_agentcache.server.spill import FULL


def ids(start: int, n: int) -> list[int]:
    assert 0 <= start and start + n <= 512
    return list(range(start, start + n))


def spill_driver(pool: int, host: int, page_size: int = 1) -> OfflineDriver:
    cache = build_offline_cache(pool_tokens=pool, page_size=page_size, max_reqs=8)
    cache.set_host_spill(True)
    cache.pauses.host.capacity_tokens = host
    return OfflineDriver(cache)


def run(driver: OfflineDriver, rid: str, prompt: list[int], out=(1,), hint: dict | None = None):
    req = driver.admit(rid, prompt, kv_hints=lifecycle_envelope(hint, message_id=rid) if hint else None)
    cached = req.cached_tokens
    driver.extend(req, list(out))
    driver.finish(req)
    return cached


def assert_clean(driver: OfflineDriver) -> None:
    report = driver.check()
    assert report.ok, report.errors
    assert driver.idle_free_tokens() == driver.pool_tokens


def kv_of(cache, prompt: list[int]) -> torch.Tensor:
    """The K values the tree holds for ``prompt`` (the tiny pool: one layer, one head, one dim)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    with OfflineDriver(cache).activated():
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), None)))
        assert match.device_prefix_len == len(prompt)
        slots = cache.path_device_indices(match.last_device_node)[: len(prompt)]
    return cache.token_to_kv_pool_allocator.get_kvcache().k_buffer[0][slots].flatten().clone()


def test_evicted_prefix_comes_back_from_host_with_its_bytes():
    driver = spill_driver(pool=300, host=1000)
    cache = driver.cache
    prompt = ids(10, 200)
    assert run(driver, "a", prompt, out=(5, 6)) == 0
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    with driver.activated():  # stamp recognisable KV into a's slots
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), None)))
        slots = cache.path_device_indices(match.last_device_node)[:200]
        kv.k_buffer[0][slots] = torch.arange(200, dtype=kv.k_buffer[0].dtype).view(-1, 1, 1) + 0.5
    before = kv_of(cache, prompt)
    assert run(driver, "b", ids(300, 150)) == 0  # evicts a (LRU): spilled, not lost
    assert cache.spill.tokens == 201 and cache.spill.counters["spills"] >= 1
    assert_clean(driver)

    c = driver.admit("c", prompt + [5, 6, 9])
    assert c.cached_tokens == 201  # prompt + a's first output token, all loaded back
    assert cache.spill.counters["loaded_tokens"] == 201
    driver.extend(c, [1])
    driver.finish(c)
    assert torch.equal(kv_of(cache, prompt), before)
    assert_clean(driver)


def test_on_by_default_and_off_means_stock_eviction():
    assert build_offline_cache(pool_tokens=300).spill.enabled  # the server's default
    cache = build_offline_cache(pool_tokens=300, page_size=1, max_reqs=8, host_spill=False)
    assert not cache.spill.enabled and cache.tree_core.node_removed is None
    driver = OfflineDriver(cache)
    run(driver, "a", ids(10, 200))
    run(driver, "b", ids(300, 150))
    assert cache.spill.tokens == 0 and cache.pauses.host.used_tokens == 0
    assert run(driver, "c", ids(10, 200)) < 199
    assert_clean(driver)


def test_a_chain_evicted_leaf_first_loads_back_whole():
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    shared, tail_a, tail_b = ids(10, 100), ids(120, 60), ids(200, 60)
    run(driver, "a", shared + tail_a)
    run(driver, "b", shared + tail_b)  # the tree: shared -> (tail_a..., tail_b...)
    run(driver, "flood", ids(300, 210))  # evicts both tails, then the shared prefix: a host tree
    assert cache.spill.tokens >= 100 + 60
    assert_clean(driver)
    assert run(driver, "a2", shared + tail_a + [7]) == 160  # the prefix and tail_a, from two entries
    assert run(driver, "b2", shared + tail_b + [7]) == 160  # its tail hung from the loaded prefix
    assert_clean(driver)


def test_entry_hanging_from_an_ancestor_of_the_match_is_found():
    """Part of a spilled node's tokens re-created on the device by another request: the entry hangs
    from an ancestor of the node the match ends at, and still loads."""
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    root_part, spilled = ids(10, 50), ids(100, 100)
    run(driver, "a", root_part + spilled)
    run(driver, "flood", ids(300, 200))  # a's tail goes to host, hanging from root_part... or deeper
    assert cache.spill.tokens > 0
    run(driver, "partial", root_part + spilled[:30] + ids(400, 5))  # re-creates 30 of the spilled tokens
    again = driver.admit("again", root_part + spilled + [9])
    assert again.cached_tokens >= 150
    driver.finish(again)
    assert_clean(driver)


def test_host_leaves_go_least_recently_used_first_and_pause_copies_push_them_out():
    driver = spill_driver(pool=300, host=250)
    cache = driver.cache
    a, b, c = ids(0, 100), ids(100, 100), ids(200, 100)
    for rid, prompt in (("a", a), ("b", b), ("c", c), ("d", ids(300, 100)), ("e", ids(400, 100))):
        run(driver, rid, prompt)  # d evicts a, e evicts b: both on host (200 of 250)
    assert cache.spill.tokens == 200
    run(driver, "f", ids(0, 100)[::-1])  # evicts c: room for it is made by dropping a (the oldest)
    assert cache.spill.counters["dropped_tokens"]["room"] == 100
    assert run(driver, "b2", b + [7]) == 100  # b survived on host
    assert run(driver, "a2", a) == 0
    assert_clean(driver)
    # A paused branch's offload needs room: spilled nodes make way for it.
    branch = {"session": "s", "branch": "main"}
    run(driver, "lead", ids(20, 100), hint=branch)
    key = BranchKey(namespace_key(None, None), "s", "main")
    with driver.activated():
        result = cache.pauses.pause(key, force=PauseAction.OFFLOAD)
    assert result["action"] == "offload"
    assert cache.pauses.host.used_tokens <= cache.pauses.host.capacity_tokens
    assert_clean(driver)


def test_closing_a_branch_frees_its_spilled_nodes_and_terminated_nodes_never_spill():
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    hint = {"session": "s", "branch": "w1", "parent_branch": None}
    del hint["parent_branch"]
    run(driver, "w", ids(10, 150), hint=hint)
    run(driver, "flood", ids(200, 200))
    owner = BranchKey(namespace_key(None, None), "s", "w1")
    assert cache.spill.by_owner.get(owner)
    assert all(e.state.cls is NodeClass.SESSION for e in cache.spill.by_owner[owner])
    with driver.activated():
        closed = cache.close_branch(owner)
    assert closed["host_freed_tokens"] >= 150
    assert owner not in cache.spill.by_owner
    assert_clean(driver)
    # A closed branch's nodes are terminated: reclaimed, never copied to host.
    run(driver, "w2", ids(10, 150), hint=hint | {"close": True})
    spilled = cache.spill.counters["spilled_tokens"]
    run(driver, "flood2", ids(300, 200))
    assert cache.spill.counters["spilled_tokens"] - spilled <= 201  # only flood's own node
    assert_clean(driver)


def test_a_close_that_keeps_the_cache_untags_the_branch_on_every_tier_and_it_still_hits():
    """Chat inference's idle close is a guess (``keep_cached``): the branch ends (no owner, no charge,
    never a parent), but its device and host nodes stay as untagged cache, and a later prompt that
    continues the history hits them, on device and from host."""
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    owner = BranchKey(namespace_key(None, None), "s", "w1")
    run(driver, "w", ids(10, 100), hint={"session": "s", "branch": "w1"})
    run(driver, "w", ids(10, 150), hint={"session": "s", "branch": "w1"})  # two nodes: 100, then 50
    run(driver, "flood", ids(200, 170))  # the leaf of w1's history spills to host
    spilled = sum(len(e) for e in cache.spill.by_owner.get(owner, ()))
    on_device = cache.tree_core.owned_tokens(owner) - spilled
    assert spilled > 0 and on_device > 0
    freed_before = cache.freed_on_close_tokens
    with driver.activated():
        closed = cache.close_branch(owner, keep_cached=True)
    assert closed["closed"] and closed["freed_tokens"] == 0 and closed["host_freed_tokens"] == 0
    assert closed["kept_tokens"] == cache.kept_on_close_tokens >= 150
    assert cache.freed_on_close_tokens == freed_before and owner in cache.closed
    assert cache.tree_core.owned_tokens(owner) == 0 and owner not in cache.spill.by_owner
    assert all(e.state.owner is None for e in cache.spill.lru)
    assert cache.agent_stats()["resident_tokens"]["session"] == 0
    assert_clean(driver)
    assert run(driver, "back", ids(10, 150) + ids(400, 5)) >= 149  # device nodes and host entries, reused
    assert_clean(driver)


def test_purge_and_reset_drop_host_entries():
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    req = driver.admit("t", ids(10, 150), cache_salt="agentcache:acme:x")
    driver.extend(req, [1])
    driver.finish(req)
    run(driver, "flood", ids(200, 200))
    assert cache.spill.tokens > 0
    with driver.activated():
        cache.purge_salt("agentcache:acme:x")
    assert all(e.cache_salt != "agentcache:acme:x" for e in cache.spill.lru)
    run(driver, "again", ids(10, 150))
    run(driver, "flood2", ids(300, 190))
    assert cache.spill.tokens > 0
    driver.flush_cache()
    assert cache.spill.tokens == 0 and cache.pauses.host.used_tokens == 0
    assert_clean(driver)


def test_failed_copies_fall_back_to_eviction_and_recompute():
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    run(driver, "a", ids(10, 200))
    cache.pauses.host.fail_next("demote", 1)
    run(driver, "b", ids(300, 150))  # the spill fails: plain eviction
    assert cache.spill.counters["spill_failed"] > 0 and cache.spill.tokens == 0
    assert_clean(driver)
    run(driver, "c", ids(10, 200))
    run(driver, "d", ids(300, 150))  # c goes to host now
    assert cache.spill.tokens > 0
    cache.pauses.host.fail_next("promote", 1)
    assert run(driver, "e", ids(10, 200)) == 0  # the load fails: recompute
    assert cache.spill.counters["load_failed"] == 1
    assert_clean(driver)


def test_paged_pool_spills_and_loads_whole_pages():
    driver = spill_driver(pool=320, host=2000, page_size=4)
    cache = driver.cache
    run(driver, "a", ids(10, 200))
    run(driver, "b", ids(300, 160))
    assert cache.spill.tokens > 0 and all(len(e) % 4 == 0 for e in cache.spill.lru)
    assert run(driver, "c", ids(10, 200) + [3]) == 200
    assert_clean(driver)
    assert all(n.component_data[FULL].value is None or len(n.key) % 4 == 0 for n in cache.tree_core.all_nodes()[1:])


def _raise_once(target, name: str, *, after: bool = False) -> dict:
    """Make ``target.name`` raise on its next call (``after``: once the real call did its work)."""
    original = getattr(target, name)
    state = {"armed": True}

    def wrapper(*args, **kwargs):
        if not state["armed"]:
            return original(*args, **kwargs)
        state["armed"] = False
        if after:
            original(*args, **kwargs)
        raise RuntimeError(f"injected failure of {name}")

    setattr(target, name, wrapper)
    return state


@pytest.mark.parametrize("where", ["copy", "insert", "insert-after", "load_back"])
def test_any_failure_of_a_load_back_in_the_match_falls_back_to_recompute(where, monkeypatch):
    """Issue #22 item 10: a load-back runs inside the scheduler's match; a bare error from the copy, a
    failing re-insert or anything else reached the scheduler. The request recomputes now, the chain
    leaves the host tier, no slot leaks or is freed twice. The synchronous load-back (asynchronous
    loads off; tests/test_async_load.py covers their failures)."""
    monkeypatch.setenv(ASYNC_LOAD_ENV, "0")
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    run(driver, "a", ids(10, 200), out=(5, 6))
    run(driver, "b", ids(300, 150))  # a goes to host
    assert cache.spill.tokens > 0
    if where == "copy":
        cache.pauses.host.fail_next("promote", unexpected=True)
    elif where == "load_back":
        armed = _raise_once(cache.spill, "load_back")
    else:
        armed = _raise_once(cache, "insert", after=where == "insert-after")
    cached = run(driver, "c", ids(10, 200) + [5, 6, 9])
    assert cached == 0  # (an insert that did its work before raising leaves its node to the next match)
    if where != "copy":
        assert not armed["armed"]
    counters = cache.spill.counters
    assert (counters["load_failed"], counters["load_errors"]) == ((1, 0) if where == "copy" else (0, 1))
    assert_clean(driver)


def test_a_waiting_request_loads_back_when_admitted_not_when_ranked():
    """Issue #22 item 12 for the node spill: the scheduler's ranking matches (lpm) load nothing back."""
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    run(driver, "a", ids(10, 200), out=(5, 6))
    run(driver, "b", ids(300, 150))  # a goes to host
    spilled = cache.spill.tokens
    waiting = driver.queue("c", ids(10, 200) + [5, 6, 9])
    for _ in range(3):
        driver.rank([waiting], "lpm")
    assert cache.spill.tokens == spilled and cache.spill.counters["loads"] == 0
    admitted = driver.admit_queued(waiting)
    assert admitted.cached_tokens == 201 and cache.spill.counters["loads"] == 1
    driver.finish(admitted)
    assert_clean(driver)


LEAD = {"session": "s", "branch": "main"}


def _fork(name: str, fork_point: int) -> dict:
    return {"session": "s", "branch": name, "parent_branch": "main", "fork_point_tokens": fork_point}


def test_tokens_forks_share_past_their_fork_point_become_the_leads_history():
    """What the harness appended to the lead's context before forking (past the fork point, in every
    fork's prompt and in the lead's next one) is created by whichever fork runs first; the next fork
    that reuses it hands it to the lead, so it survives the forks' closes and the lead's next turn hits."""
    driver = spill_driver(pool=400, host=0)
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    run(driver, "w1", lead_ctx + shared + ids(200, 20), hint=_fork("w1", 100))
    lead = BranchKey(namespace_key(None, None), "s", "main")
    w1 = lead._replace(branch="w1")
    owned_before = cache.tree_core.owned_tokens(lead)
    run(driver, "w2", lead_ctx + shared + ids(250, 20), hint=_fork("w2", 100))
    assert cache.adopted_tokens == 16 and cache.tree_core.owned_tokens(lead) == owned_before + 16
    with driver.activated():
        cache.close_branch(w1)
        cache.close_branch(w1._replace(branch="w2"))
    assert cache.tree_core.owned_tokens(w1) == 0
    assert run(driver, "lead1", lead_ctx + shared + ids(300, 20), hint=LEAD) == 116
    assert_clean(driver)


def test_forks_prefilled_together_hand_what_they_share_to_the_lead_at_their_insert():
    """Siblings forked at once are admitted before any of them is inserted (one prefill batch): none
    matches another's tokens, so the shared tokens are created by the first insert and only *matched*
    by the second; that insert hands them to the lead, and the lead's next turn hits them after both
    forks closed."""
    driver = spill_driver(pool=400, host=0)
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    lead = BranchKey(namespace_key(None, None), "s", "main")
    owned_before = cache.tree_core.owned_tokens(lead)
    forks = [driver.admit(name, lead_ctx + shared + ids(start, 20),
                          kv_hints=lifecycle_envelope(_fork(name, 100), message_id=name))
             for name, start in (("w1", 200), ("w2", 250))]
    assert [req.cached_tokens for req in forks] == [100, 100]  # neither saw the other's tokens
    for req in forks:
        driver.extend(req, [1])
        driver.finish(req)
    assert cache.adopted_tokens == 16 and cache.tree_core.owned_tokens(lead) == owned_before + 16
    with driver.activated():
        for name in ("w1", "w2"):
            cache.close_branch(lead._replace(branch=name))
    assert cache.tree_core.owned_tokens(lead._replace(branch="w1")) == 0
    assert run(driver, "lead1", lead_ctx + shared + ids(300, 20), hint=LEAD) == 116
    assert_clean(driver)


def test_adoption_takes_only_other_branches_scratch_of_the_same_session():
    driver = spill_driver(pool=400, host=0)
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    run(driver, "w1", lead_ctx + shared + ids(200, 20), hint=_fork("w1", 100))
    run(driver, "w1b", lead_ctx + shared + ids(200, 30), hint=_fork("w1", 100))  # its own scratch: kept
    other = {"session": "t", "branch": "main"}
    run(driver, "other", lead_ctx + shared + ids(260, 20), hint=other)  # another session: not its history
    run(driver, "plain", lead_ctx + shared + ids(290, 20))  # untagged traffic adopts nothing
    assert cache.adopted_tokens == 0
    assert_clean(driver)


def test_an_ended_forks_node_that_live_spilled_nodes_continue_is_kept_and_spilled_with_them():
    """The lead's quota is too small to take the shared tokens (they stay the fork's); the lead's next
    turn continues them, is spilled, and the fork closes: its node is what the lead's host entries hang
    from, so it is not reclaimed at the close, and eviction spills it as the lead's. Everything loads
    back."""
    driver = spill_driver(pool=300, host=2000)
    cache = driver.cache
    cache.session_quota_tokens = 50  # the lead is over quota from its first call: nothing adopted
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    run(driver, "w1", lead_ctx + shared + ids(200, 20), hint=_fork("w1", 100))
    lead1 = lead_ctx + shared + ids(300, 40)
    run(driver, "lead1", lead1, out=(), hint=LEAD)
    assert cache.adopted_tokens == 0
    w1 = BranchKey(namespace_key(None, None), "s", "w1")
    run(driver, "flood", ids(400, 100))  # evicts w1's own tail and the lead's newest node to host
    with driver.activated():
        cache.close_branch(w1)
    run(driver, "flood2", ids(0, 10) + ids(360, 30) + ids(500, 12), hint=None)
    kept = [n for n in cache.spill.by_anchor if n.agent.terminated]
    assert kept and all(n.agent.owner == w1 for n in kept)  # ended, kept: the lead's entries hang from it
    # A context edit in another session frees its own stale tokens, never this node.
    run(driver, "t0", ids(440, 8), out=(), hint={"session": "t"})
    run(driver, "t1", ids(440, 4) + ids(490, 2), out=(), hint={"session": "t", "edit_from_tokens": 4})
    assert cache.context_edit_freed_tokens == 4
    assert all(n in cache.spill.by_anchor for n in kept)
    assert cache.spill.counters["dropped_tokens"]["orphaned"] == 0
    run(driver, "flood3", ids(200, 150))  # the ended fork's node goes too: spilled, not dropped
    assert cache.spill.counters["dropped_tokens"]["orphaned"] == 0
    assert all(e.state.owner != w1 for e in cache.spill.lru)  # kept as the lead's, not the fork's
    assert run(driver, "lead2", lead1 + [7], hint=LEAD) == len(lead1)
    assert_clean(driver)


def _flood(driver, rid: str) -> None:
    """A request sharing nothing with the others that needs most of the pool: it evicts the rest."""
    run(driver, rid, list(range(450, 512)) * 6)


@pytest.mark.parametrize("respill", [False, True], ids=["on-device", "spilled-again"])
def test_a_recomputed_prefix_does_not_cut_off_the_history_spilled_below_it(monkeypatch, respill):
    """A system prompt spilled with the sessions' histories below it is recomputed by another request
    while the old copy waits on host (here: the copy was held by a load for a request that then left,
    as in the replay of ``stable_prompts``). A session that comes back must still find its history:
    through the old copy while the prompt is on the device (a bridge), and, once the prompt is evicted
    again, through one copy of it (the old entry serves as the node's copy: no twin that a match could
    follow instead)."""
    monkeypatch.setenv(ASYNC_LOAD_ENV, "0")
    driver = spill_driver(pool=400, host=4000)
    cache, spill = driver.cache, driver.cache.spill
    system, a, b, c = ids(10, 100), ids(120, 100), ids(230, 100), ids(340, 100)
    run(driver, "a", system + a)
    run(driver, "b", system + b)  # the tree splits the system prompt into a node of its own
    _flood(driver, "f1")  # a's and b's histories, then the prompt, go to host: the prompt's entry holds both
    [prompt_entry] = [e for e in spill.by_anchor[cache.tree_core.root_node] if list(e.tokens) == system]
    assert len(prompt_entry.children) == 2
    spill.loading.add(prompt_entry)  # another request's load holds it: c does not find it...
    assert run(driver, "c", system + c) == 0  # ...and recomputes the prompt on the device
    spill.loading.discard(prompt_entry)  # that request left: the old copy waits on host
    if respill:
        assert run(driver, "d", system + ids(440, 60)) == 100  # the prompt is a node of its own again
        _flood(driver, "f2")  # c's and d's histories, then the prompt node: its old entry is its copy
        assert spill.counters["spill_twins"] == 1
        starts = [e for e in spill.by_anchor.get(cache.tree_core.root_node, ()) if list(e.tokens[:100]) == system]
        assert starts == [prompt_entry] and len(prompt_entry.children) == 4  # a, b, c, d: one chain each
        assert run(driver, "c2", system + c + [1] + ids(0, 5)) >= 200
    assert run(driver, "a2", system + a + [1] + ids(0, 5)) >= 200  # a's history came back
    assert run(driver, "b2", system + b + [1] + ids(0, 5)) >= 200
    assert_clean(driver)
