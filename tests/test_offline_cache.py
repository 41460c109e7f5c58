"""The real ``AgentRadixCache`` offline: SGLang's pools, allocator and request code paths, no model.

Every test builds a fresh cache (cheap once SGLang is imported) through
``sgl_agentcache.server.scheduler.offline``, which goes through SGLang's own ``create_tree_cache`` and the
registered ``agentcache`` factory. Token ids stay below 512. ``conftest.py`` sets
``SGLANG_USE_CPU_ENGINE=1`` before SGLang is imported.
"""

from __future__ import annotations

import pytest

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.server.scheduler.cache import AgentRadixCache
from sgl_agentcache.server.scheduler.offline import (
    OfflineDriver,
    OfflineOutOfMemory,
    OfflineRefused,
    build_offline_cache,
)
from sgl_agentcache.server.scheduler.tree_core import FULL, AgentTreeCore
from sgl_agentcache.server.scheduler.request_state import state_of


def ids(start: int, n: int) -> list[int]:
    """``n`` consecutive token ids from ``start`` (all < 512)."""
    assert 0 <= start and start + n <= 512
    return list(range(start, start + n))


def assert_idle_ok(driver: OfflineDriver) -> None:
    assert not driver.live
    report = driver.check()
    assert report.ok, report.errors
    assert driver.idle_free_tokens() == driver.pool_tokens
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.pool_tokens


def test_builds_agent_radix_cache_on_agent_tree_core():
    cache = build_offline_cache(pool_tokens=1024, page_size=1, max_reqs=8)
    assert isinstance(cache, AgentRadixCache)
    assert isinstance(cache.tree_core, AgentTreeCore)
    assert cache.token_to_kv_pool_allocator.size == 1024
    assert cache.req_to_token_pool.size == 8
    driver = OfflineDriver(cache)
    assert driver.pool_tokens == 1024
    assert_idle_ok(driver)


def test_second_request_reuses_shared_prefix():
    driver = OfflineDriver(pool_tokens=4096)
    shared = ids(10, 100)
    first = driver.admit("first", shared + ids(200, 40))
    assert first.cached_tokens == 0
    driver.extend(first, [300, 301, 302])
    driver.finish(first)
    assert_idle_ok(driver)

    second = driver.admit("second", shared + ids(400, 30))
    assert second.cached_tokens >= 100
    report = driver.check()  # not idle: the shared prefix is locked by `second`
    assert report.ok, report.errors
    assert report.protected_tokens >= 100
    driver.extend(second, [303, 304])
    driver.finish(second)
    assert_idle_ok(driver)


def test_filling_the_pool_evicts_and_conserves_slots():
    driver = OfflineDriver(build_offline_cache(pool_tokens=512))  # untagged traffic: stock LRU eviction
    prompts = [[(7 + 83 * i + j) % 512 for j in range(200)] for i in range(6)]
    inserted = 0
    for i, prompt in enumerate(prompts):
        req = driver.admit(f"r{i}", prompt)
        assert req.cached_tokens == 0
        driver.extend(req, [1, 2, 3])
        driver.finish(req)
        inserted += 200 + 2  # the last output token never has KV
        assert_idle_ok(driver)
    assert inserted > driver.pool_tokens  # so the tree must have evicted
    assert driver.cache.evictable_size() <= driver.pool_tokens

    # The oldest prompt was evicted (LRU); the newest is still there.
    again = driver.admit("again", prompts[-1])
    assert again.cached_tokens == 199
    driver.abort(again)
    oldest = driver.admit("oldest", prompts[0])
    assert oldest.cached_tokens < 199
    driver.finish(oldest)
    assert_idle_ok(driver)


def test_out_of_memory_is_reported_and_changes_nothing():
    driver = OfflineDriver(pool_tokens=512)
    hold = driver.admit("hold", ids(0, 300))
    free_before = driver.free_tokens()
    with pytest.raises(OfflineOutOfMemory) as info:
        driver.admit("too-big", ids(300, 212) + ids(0, 50)[::-1])
    assert info.value.needed == 262
    assert "too-big" not in driver.live
    assert driver.free_tokens() == free_before
    report = driver.check()
    assert report.ok, report.errors
    driver.abort(hold)
    assert_idle_ok(driver)


def test_the_token_budget_counts_new_tokens_only_and_refuses_what_cannot_decode():
    """PrefillAdder's check: a prefix resident on the device costs nothing (it is locked, not
    allocated); the new tokens plus the budget (output, running decodes) must stay below free +
    evictable, else nothing is admitted."""
    driver = OfflineDriver(pool_tokens=512)
    first = driver.admit("first", ids(0, 300))
    driver.finish(first)  # 300 tokens now cached and evictable
    hold = driver.admit("hold", ids(0, 300) + ids(300, 100), budget=50)  # 100 new + 50 fit in 212 free
    assert hold.cached_tokens == 300
    free_before = driver.free_tokens()
    with pytest.raises(OfflineOutOfMemory):  # 100 new + 12 budget >= 112 free (nothing evictable)
        driver.admit("tight", ids(400, 100), budget=12)
    assert "tight" not in driver.live and driver.free_tokens() == free_before
    fits = driver.admit("fits", ids(400, 100), budget=11)
    for req in (hold, fits):
        driver.abort(req)
    assert_idle_ok(driver)


def test_abort_frees_the_requests_non_shared_kv():
    driver = OfflineDriver(pool_tokens=4096)
    shared = ids(10, 100)
    owner = driver.admit("owner", shared + ids(200, 20))
    driver.extend(owner, [300, 301])
    driver.finish(owner)
    free_before = driver.free_tokens()
    evictable_before = driver.cache.evictable_size()

    aborted = driver.admit("aborted", shared + ids(400, 60))
    assert aborted.cached_tokens == 100
    assert driver.free_tokens() == free_before - 60
    driver.abort(aborted)
    assert driver.free_tokens() == free_before
    assert driver.cache.evictable_size() == evictable_before
    assert_idle_ok(driver)

    # Nothing of the aborted request reached the tree: only the shared prefix matches.
    probe = driver.admit("probe", shared + ids(400, 60))
    assert probe.cached_tokens == 100
    driver.abort(probe)
    assert_idle_ok(driver)


def test_paged_pool_with_chunked_prefill():
    driver = OfflineDriver(pool_tokens=1024, page_size=4)
    prompt = ids(20, 130)
    req = driver.admit("chunked", prompt, max_prefill_tokens=50)
    assert req.extend_end == 48  # floored to whole pages
    driver.checkpoint(req)
    driver.prefill_next_chunk(req, 40)
    assert req.extend_end == 88
    driver.checkpoint(req)
    driver.prefill_next_chunk(req)
    assert req.prefill_done
    report = driver.check()
    assert report.ok, report.errors
    driver.extend(req, [1, 2, 3, 4, 5])
    driver.finish(req)
    assert_idle_ok(driver)

    again = driver.admit("again", prompt + ids(300, 10))
    assert again.cached_tokens == 128  # the whole prompt, page-aligned
    driver.finish(again)
    assert_idle_ok(driver)


def test_lifecycle_fork_is_charged_and_closed_exactly():
    driver = OfflineDriver(pool_tokens=4096)
    cache = driver.cache
    prompt = ids(100, 50)
    main_hint = lifecycle_envelope({"session": "s", "branch": "main", "stable_prefix_tokens": 10}, message_id="m")
    main = driver.admit("main", prompt, kv_hints=main_hint)
    driver.extend(main, [400, 401, 402])
    driver.finish(main)
    assert cache.tree_core.owned_tokens(BranchKey("|", "s", "main")) == 40 + 2
    assert cache.resident_tokens_by_class()["stable"] == 10
    assert_idle_ok(driver)

    fork_hint = lifecycle_envelope({"session": "s", "branch": "b1", "parent_branch": "main"}, message_id="m2")
    free_before = driver.free_tokens()
    evictable_before = cache.evictable_size()
    fork = driver.admit("fork", prompt + ids(300, 20), kv_hints=fork_hint)
    assert fork.cached_tokens == 50
    outputs = [410, 411, 412, 413]
    driver.extend(fork, outputs)
    driver.finish(fork)
    created = free_before - driver.free_tokens()
    assert cache.evictable_size() == evictable_before + created  # nothing was evicted

    b1 = BranchKey("|", "s", "b1")
    assert created == 20 + len(outputs) - 1
    assert cache.tree_core.owned_tokens(b1) == created
    assert cache.resident_tokens_by_class()["scratch"] == created
    assert cache.tree_core.owned_tokens(BranchKey("|", "s", "main")) == 42  # the parent is not charged
    assert_idle_ok(driver)

    with driver.activated():
        result = cache.close_branch(b1)
    assert result["closed"] and result["freed_tokens"] == created
    assert result["pending_tokens"] == 0
    assert cache.tree_core.owned_tokens(b1) == 0
    assert driver.free_tokens() == free_before
    assert cache.tree_core.owned_tokens(BranchKey("|", "s", "main")) == 42
    assert_idle_ok(driver)


def test_a_fork_without_a_fork_point_charges_the_parents_history_it_recomputes_to_the_parent():
    """The hint names the parent but no fork point, and the parent's history was evicted before the
    fork ran: the fork recomputes it. The cache finds where the parent's last context ends in the
    fork's prompt, so those tokens are the parent's session history, not scratch that dies with the
    fork."""
    driver = OfflineDriver(pool_tokens=4096)
    cache = driver.cache
    main_key, b1 = BranchKey("|", "s", "main"), BranchKey("|", "s", "b1")
    prompt, output = ids(100, 50), [400, 401, 402]
    main = driver.admit("main", prompt, kv_hints=lifecycle_envelope(
        {"session": "s", "branch": "main", "stable_prefix_tokens": 10}, message_id="m"))
    driver.extend(main, output)
    driver.finish(main)
    driver.flush_cache()  # the parent's history is gone from the tree
    assert cache.tree_core.owned_tokens(main_key) == 0
    fork = driver.admit("fork", prompt + output + ids(300, 20), kv_hints=lifecycle_envelope(
        {"session": "s", "branch": "b1", "parent_branch": "main", "stable_prefix_tokens": 10}, message_id="m2"))
    assert state_of(fork).plan.fork_point == 53 and cache.inferred_fork_points == 1
    driver.extend(fork, [410, 411])
    driver.finish(fork)
    assert cache.tree_core.owned_tokens(main_key) == 53 - 10  # the parent's history, recomputed
    assert cache.tree_core.owned_tokens(b1) == 20 + 1  # its own tokens (the last output is not cached)
    with driver.activated():
        cache.close_branch(b1)
    assert cache.tree_core.owned_tokens(main_key) == 43  # the fork's close leaves the parent's history
    # A prompt that does not continue the parent's context gets no fork point (all its own, as before).
    other = driver.admit("other", ids(0, 60), kv_hints=lifecycle_envelope(
        {"session": "s", "branch": "b2", "parent_branch": "main", "stable_prefix_tokens": 10}, message_id="m3"))
    assert state_of(other).plan.fork_point == 10 and cache.inferred_fork_points == 1
    driver.abort(other)
    assert_idle_ok(driver)


def test_a_closed_parent_leaves_no_fork_point_and_its_refused_fork_changes_no_counter():
    """Found by the hint fuzzer: a closed branch's late call (its tokens born terminated) recorded a
    context, so a refused fork of it counted an inferred fork point."""
    from sgl_agentcache.server.scheduler.offline import OfflineRefused

    driver = OfflineDriver(pool_tokens=4096)
    cache = driver.cache
    hint = {"session": "s", "branch": "main", "stable_prefix_tokens": 10}
    prompt = ids(100, 50)
    first = driver.admit("main", prompt, kv_hints=lifecycle_envelope(hint, message_id="m"))
    driver.finish(first)
    with driver.activated():
        assert cache.close_branch(BranchKey("|", "s", "main"))["closed"]
    late = driver.admit("late", prompt + ids(200, 10), kv_hints=lifecycle_envelope(hint, message_id="m2"))
    driver.extend(late, [400])
    driver.finish(late)  # a call of the closed branch: served, born terminated, leaves no context
    assert len(cache.contexts) == 0
    with pytest.raises(OfflineRefused, match="is closed"):
        driver.admit("fork", prompt + ids(200, 10) + [400] + ids(300, 5), kv_hints=lifecycle_envelope(
            {"session": "s", "branch": "b1", "parent_branch": "main", "stable_prefix_tokens": 10}, message_id="m3"))
    assert cache.inferred_fork_points == 0
    assert_idle_ok(driver)


def test_branch_contexts_match_only_a_continued_context_and_stay_bounded():
    from sgl_agentcache.fork_points import BranchContexts

    contexts = BranchContexts(limit=2)
    contexts.record("a", list(range(100)), [7, 8])
    assert contexts.fork_point("a", list(range(100)) + [7, 8, 9]) == 102  # prompt and output
    assert contexts.fork_point("a", list(range(100)) + [5]) == 100  # the prompt only
    assert contexts.fork_point("a", [1] + list(range(1, 100))) == 100  # a window, not the whole prefix
    assert contexts.fork_point("a", list(range(99))) is None  # shorter than the context
    assert contexts.fork_point("unknown", list(range(100))) is None
    contexts.record("b", [1], [])
    contexts.record("c", [2], [])
    assert len(contexts) == 2 and contexts.fork_point("a", list(range(100))) is None  # "a" forgotten
    contexts.forget_where(lambda branch: branch == "b")
    assert len(contexts) == 1


def test_session_close_finds_every_branch_even_one_the_seen_set_forgot():
    """close_session looks branches up by session (never by scanning every branch ever seen); a branch
    the bounded seen set has forgotten but that owns nodes is found through the owner index. (The set
    never forgets a branch that owns tokens; these were forgotten while their requests ran, before
    their first insert.)"""
    driver = OfflineDriver(pool_tokens=4096)
    cache = driver.cache
    cache.seen.limit = 1  # remember only the latest branch
    reqs = []
    for i, (session, branch) in enumerate([("s", "main"), ("s", "w1"), ("other", "main")]):
        hint = {"session": session, "branch": branch}
        reqs.append(driver.admit(f"r{i}", ids(100 * i, 40), kv_hints=lifecycle_envelope(hint, message_id=f"m{i}")))
    for req in reqs:
        driver.extend(req, [450, 451])
        driver.finish(req)
    s_main, s_w1, other = BranchKey("|", "s", "main"), BranchKey("|", "s", "w1"), BranchKey("|", "other", "main")
    assert s_main not in cache.seen and s_w1 not in cache.seen and other in cache.seen
    assert all(cache.tree_core.owned_tokens(b) == 41 for b in (s_main, s_w1, other))
    free_before = driver.free_tokens()
    with driver.activated():
        result = cache.close_session(None, "s")
    assert result == {"branches": 2, "freed_tokens": 82}
    assert driver.free_tokens() == free_before + 82
    assert cache.tree_core.owned_tokens(s_main) == cache.tree_core.owned_tokens(s_w1) == 0
    assert cache.tree_core.owned_tokens(other) == 41 and other not in cache.closed
    assert_idle_ok(driver)


def test_fork_of_unknown_parent_is_refused_before_allocating():
    driver = OfflineDriver(pool_tokens=1024)
    hint = lifecycle_envelope({"session": "s", "branch": "b1", "parent_branch": "nobody"}, message_id="m")
    with pytest.raises(OfflineRefused):
        driver.admit("orphan", ids(10, 40), kv_hints=hint)
    assert not driver.live
    assert driver.free_tokens() == driver.pool_tokens
    assert_idle_ok(driver)


def _hint(session: str, branch: str = "main", parent: str | None = None) -> dict:
    payload = {"session": session, "branch": branch} | ({"parent_branch": parent} if parent else {})
    return lifecycle_envelope(payload, message_id=f"m-{session}-{branch}")


def _seen_without_tokens(driver, rid: str, session: str, branch: str, tenant: str) -> None:
    """Admit a request of the branch and abort it before its first insert: seen, owning nothing."""
    driver.abort(driver.admit(rid, ids(300, 8), kv_hints=_hint(session, branch), extra_key=tenant))


@pytest.mark.parametrize("lead_owns_tokens", [True, False])
def test_a_namespace_flooding_branch_names_never_makes_another_lose_its_lead(lead_owns_tokens):
    """Issue #22: one namespace (tenant) flooding the bounded seen set used to evict another's lead, whose
    next fork was then refused as a fork of an unknown parent. The bound is per namespace now, and a
    branch that owns tokens is never forgotten at all."""
    driver = OfflineDriver(pool_tokens=2048)
    cache = driver.cache
    cache.seen.limit = 8  # all namespaces together (the default holds 131,072 branches)
    prefix = ids(0, 40)
    if lead_owns_tokens:
        lead = driver.admit("lead", prefix, kv_hints=_hint("task"), extra_key="acme")
        driver.extend(lead, [450])
        driver.finish(lead)
    else:
        _seen_without_tokens(driver, "lead", "task", "main", "acme")
    for i in range(40):
        _seen_without_tokens(driver, f"flood{i}", f"f{i}", "main", "globex")
    assert len(cache.seen) <= 8
    fork = driver.admit("fork", prefix + ids(100, 10), kv_hints=_hint("task", "w", "main"), extra_key="acme")
    driver.finish(fork)
    with driver.activated():
        cache.close_session("acme|", "task")
    assert_idle_ok(driver)


def test_a_namespace_flooding_closes_never_revives_another_namespaces_closed_branch():
    """A closed branch forgotten by the closed set would be revived by a late request of it: its tokens
    would be cached as live history instead of born terminated and freed."""
    driver = OfflineDriver(pool_tokens=2048)
    cache = driver.cache
    cache.closed.limit = cache.seen.limit = 8
    _seen_without_tokens(driver, "old", "task", "old", "acme")
    closed = BranchKey("acme|", "task", "old")
    with driver.activated():
        assert cache.close_branch(closed)["closed"]
    for i in range(40):
        _seen_without_tokens(driver, f"flood{i}", f"f{i}", "main", "globex")
        with driver.activated():
            cache.close_branch(BranchKey("globex|", f"f{i}", "main"))
    assert closed in cache.closed and len(cache.closed) <= 8
    late = driver.admit("late", ids(0, 40), kv_hints=_hint("task", "old"), extra_key="acme")
    assert state_of(late).plan.own.terminated
    driver.finish(late)
    assert cache.tree_core.owned_tokens(closed) == 0
    assert_idle_ok(driver)


def _tree_snapshot(cache) -> dict:
    """Every node with what eviction reads from it: key length, LRU stamp, device slots, parent."""
    core = cache.tree_core
    return {n.id: (len(n.key) if n.key is not None else 0, n.last_access_time,
                   None if n.parent is None else n.parent.id,
                   _slots(n.component_data[FULL].value))
            for n in core.all_nodes()}


def _slots(value) -> list | None:
    return None if value is None else [int(v) for v in value]


def test_quotas_bound_fairness_not_a_branchs_context():
    """A fork may hold more than its quota while memory is free (nothing is clipped); under pressure
    its nodes go first -- before another branch's scratch within quota and before untagged KV (no host
    tier here; on HiCache an over-quota branch's host copies rank first too, test_offline_hicache)."""
    from sgl_agentcache.hints import lifecycle_envelope

    driver = OfflineDriver(pool_tokens=1024)
    cache = driver.cache
    assert cache.branch_quota_tokens == 256 and cache.host_room() == (0, 0)

    def run(rid, prompt, hint=None):
        req = driver.admit(rid, prompt, kv_hints=lifecycle_envelope(hint, message_id=rid) if hint else None)
        cached = req.cached_tokens
        driver.extend(req, [1])
        driver.finish(req)
        return cached

    run("lead", ids(0, 40), {"session": "s"})
    fork = {"session": "s", "branch": "big", "parent_branch": "main", "fork_point_tokens": 40}
    history = ids(0, 40)
    for k in range(3):  # 3 x 120 tokens of the fork's own scratch: 360 > its 256-token quota
        history = history + ids(100 + 120 * k, 120)
        run(f"big{k}", history, fork)
    big = BranchKey(namespace_key(None, None), "s", "big")
    owned = cache.tree_core.owned_tokens(big)
    assert owned >= 360 and cache.over_quota(big)  # free memory: all kept
    small = {"session": "s", "branch": "small", "parent_branch": "main", "fork_point_tokens": 40}
    run("small", ids(0, 40) + ids(480, 30), small)
    run("flood", ids(0, 512)[::-1] + ids(0, 100), None)  # untagged, needs most of the pool
    assert cache.quota_trimmed_tokens > 0  # the over-quota fork's nodes went first
    assert cache.tree_core.owned_tokens(big) < owned
    assert cache.tree_core.owned_tokens(BranchKey(big.namespace, "s", "small")) >= 30  # within quota: kept
    assert run("small-again", ids(0, 40) + ids(480, 30) + [7], small) >= 70  # its scratch survived
    assert_idle_ok(driver)


@pytest.mark.parametrize("pp_size, needle", [(2, "pipeline parallelism"), (1, None)])
def test_unsupported_deployments_are_refused_by_the_backend_factory_too(pp_size, needle):
    """Pipeline stages the transfer agreement does not cover (issue #22 item 11) are refused at
    start-up (server/topology.py) and, for a scheduler built any other way, by the backend factory
    before anything is built. HiCache is not refused any more (issue #36: the lifecycle runs on it)."""
    from types import SimpleNamespace

    from sgl_agentcache.server.scheduler.cache import agentcache_factory
    from sgl_agentcache.server.topology import UnsupportedTopology, refusal

    reason = refusal("agentcache", 1, 1, 1, False, pp_size=pp_size)
    assert reason is None if needle is None else needle in reason
    assert refusal(None, 1, 1, 1, False, pp_size=pp_size) is None  # not ours
    if needle is not None:
        ctx = SimpleNamespace(disable_radix_cache=False, enable_hierarchical_cache=False,
                              params=SimpleNamespace(pp_size=pp_size))
        with pytest.raises(UnsupportedTopology, match=needle.replace("-", r"\-")):
            agentcache_factory(ctx)


# ---- siblings' shared tokens become the lead's history (adoption) ----


def _run(driver: OfflineDriver, rid: str, prompt: list[int], out=(1,), hint: dict | None = None) -> int:
    """One call (hinted when ``hint``); returns the tokens it found cached."""
    req = driver.admit(rid, prompt, kv_hints=lifecycle_envelope(hint, message_id=rid) if hint else None)
    cached = req.cached_tokens
    driver.extend(req, list(out))
    driver.finish(req)
    return cached


LEAD = {"session": "s", "branch": "main"}


def _fork(name: str, fork_point: int) -> dict:
    return {"session": "s", "branch": name, "parent_branch": "main", "fork_point_tokens": fork_point}


def test_tokens_forks_share_past_their_fork_point_become_the_leads_history():
    """What the harness appended to the lead's context before forking (past the fork point, in every
    fork's prompt and in the lead's next one) is created by whichever fork runs first; the next fork
    that reuses it hands it to the lead, so it survives the forks' closes and the lead's next turn hits."""
    driver = OfflineDriver(build_offline_cache(pool_tokens=400, max_reqs=8))
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    _run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    _run(driver, "w1", lead_ctx + shared + ids(200, 20), hint=_fork("w1", 100))
    lead = BranchKey(namespace_key(None, None), "s", "main")
    w1 = lead._replace(branch="w1")
    owned_before = cache.tree_core.owned_tokens(lead)
    _run(driver, "w2", lead_ctx + shared + ids(250, 20), hint=_fork("w2", 100))
    assert cache.adopted_tokens == 16 and cache.tree_core.owned_tokens(lead) == owned_before + 16
    with driver.activated():
        cache.close_branch(w1)
        cache.close_branch(w1._replace(branch="w2"))
    assert cache.tree_core.owned_tokens(w1) == 0
    assert _run(driver, "lead1", lead_ctx + shared + ids(300, 20), hint=LEAD) == 116
    assert_idle_ok(driver)


def test_forks_prefilled_together_hand_what_they_share_to_the_lead_at_their_insert():
    """Siblings forked at once are admitted before any of them is inserted (one prefill batch): none
    matches another's tokens, so the shared tokens are created by the first insert and only *matched*
    by the second; that insert hands them to the lead, and the lead's next turn hits them after both
    forks closed."""
    driver = OfflineDriver(build_offline_cache(pool_tokens=400, max_reqs=8))
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    _run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
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
    assert _run(driver, "lead1", lead_ctx + shared + ids(300, 20), hint=LEAD) == 116
    assert_idle_ok(driver)


def test_adoption_takes_only_other_branches_scratch_of_the_same_session():
    driver = OfflineDriver(build_offline_cache(pool_tokens=400, max_reqs=8))
    cache = driver.cache
    lead_ctx, shared = ids(10, 100), ids(120, 16)
    _run(driver, "lead0", lead_ctx, out=(), hint=LEAD)
    _run(driver, "w1", lead_ctx + shared + ids(200, 20), hint=_fork("w1", 100))
    _run(driver, "w1b", lead_ctx + shared + ids(200, 30), hint=_fork("w1", 100))  # its own scratch: kept
    other = {"session": "t", "branch": "main"}
    _run(driver, "other", lead_ctx + shared + ids(260, 20), hint=other)  # another session: not its history
    _run(driver, "plain", lead_ctx + shared + ids(290, 20))  # untagged traffic adopts nothing
    assert cache.adopted_tokens == 0
    assert_idle_ok(driver)
