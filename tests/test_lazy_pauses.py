"""Lazy tool pauses (the default): a decision is advice to eviction and to HiCache's host eviction;
nothing moves at the pause.

On the real cache offline (SGLang's CPU pools, SGLang's own HiCache attached: ``OfflineHiCache``):
KEEP leaves the branch as it is (no pin); what eviction pushes of a paused branch into HiCache's
host pool ranks there by the advice -- OFFLOAD (and KEEP) protected, DISCARD first to be dropped
(``AgentRadixCache.hicache_host_key``); the branch's next request loads back what HiCache holds,
byte for byte; a prefetch does it earlier into free memory; a deadline releases every tier; the
decision prices the host entries an offload would displace; nothing leaks. Without HiCache there
is no host tier: advice is all a lazy pause leaves. Token ids stay below 512.
"""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from kv_stamps import path_kv, stamp_prompt_kv

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.distributions import LogNormal, PointMass
from sgl_agentcache.policy.pause import PauseAction
from sgl_agentcache.policy.retention import Band
from sgl_agentcache.server.scheduler.offline import OfflineDriver, OfflineHiCache, build_offline_cache

NS = namespace_key(None, None)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Lazy:
    """``host``: HiCache's host pool in tokens (None: no host tier). ``device_tails=False``: our device
    eviction frees whole leaves, as SGLang's does, so a branch pushed off the device reaches the host
    whole (tests of host-side ranking whose arithmetic needs that; ``leaf_tails``)."""

    def __init__(self, pool: int = 1024, host: int | None = 4096, device_tails: bool = True):
        self.cache = build_offline_cache(pool_tokens=pool,
                                         hicache=OfflineHiCache(host) if host is not None else None)
        self.cache.tree_core.trim_device_tails = device_tails
        assert self.cache.pauses.settings.lazy  # the default
        # Decisions priced as the seed profile's deployment (36 KiB per token), not the 8-byte test pool.
        self.cache.pauses.settings.bytes_per_token = 36 * 1024
        self.driver = OfflineDriver(self.cache)
        self.n = 0

    def turn(self, prompt, session=None, branch="main", out=(7,), stamp=None, extra=None):
        """One call; returns the tokens it found cached (on the device or loaded back from host)."""
        self.n += 1
        fields = {"session": session, "branch": branch} | (extra or {})
        hint = None if session is None else lifecycle_envelope(fields, message_id=f"m{self.n}")
        req = self.driver.admit(f"r{self.n}", prompt, kv_hints=hint)
        cached = req.cached_tokens
        if stamp is not None:
            stamp_prompt_kv(self.driver, req, prompt, stamp)
        self.driver.extend(req, list(out))
        self.driver.finish(req)
        return cached

    def kv_of_path(self, prompt):
        return path_kv(self.driver, prompt)[1]

    def pause(self, session, latency, branch="main", **kw):
        with self.driver.activated():
            return self.cache.pauses.pause(BranchKey(NS, session, branch), latency, **kw)

    def resident(self, session, branch="main"):
        return self.cache.tree_core.resident_owned_tokens(BranchKey(NS, session, branch))

    def on_host(self, session, branch="main"):
        """Tokens the branch holds in HiCache's host pool."""
        key = BranchKey(NS, session, branch)
        return sum(len(n.component_data[0].host_value) for n in self.cache.tree_core.host_holders()
                   if n.agent.owner == key)

    def host_only_bands(self, session, branch="main") -> set:
        """HiCache's host-eviction band of each of the branch's host-only nodes."""
        key = BranchKey(NS, session, branch)
        return {self.cache.hicache_host_key(n, 0.0)[0] for n in self.cache.tree_core.owner_index.get(key, ())
                if n.evicted}

    def assert_clean(self):
        report = self.driver.check()
        assert report.ok, report.errors
        assert self.driver.idle_free_tokens() == self.driver.pool_tokens
        pauses = self.cache.pauses
        assert not pauses.kept and set(pauses.advice) <= set(pauses.records)  # lazy: nothing pinned


LONG = LogNormal(median_s=60.0, sigma=1.5)  # a long-tailed tool: worth keeping on host, not on the device
SHORT = PointMass(0.01)


@pytest.mark.parametrize("host", [None, 4096], ids=["no-host", "hicache"])
def test_a_lazy_pause_decides_but_moves_and_pins_nothing(host):
    h = Lazy(host=host)
    prompt = ids(1, 300)
    h.turn(prompt, "a")
    before, free = h.resident("a"), h.driver.free_tokens()
    result = h.pause("a", LONG, tool_class="ci_run")
    assert result["lazy"] is True and result["paused"]
    # A long-tailed tool: host memory where there is some, else nothing worth the device.
    assert result["action"] == ("offload" if host else "discard"), result
    assert h.resident("a") == before and h.driver.free_tokens() == free and not h.cache.pauses.kept
    assert h.cache.pauses.advice == {BranchKey(NS, "a", "main"): PauseAction(result["action"])}
    assert h.cache.pauses.counters["decisions"][result["action"]] == 1
    if host:
        assert h.on_host("a") == 0 and h.cache.pauses.counters["hicache_offloaded_tokens"] == 0
    assert h.turn(prompt + [7], "a") == 300 and not h.cache.pauses.records  # all still there; resumed
    h.assert_clean()


def test_offload_advice_protects_the_branch_on_host_and_the_resume_loads_it_back_exactly():
    h = Lazy(pool=1024, host=900)
    prompt = ids(2, 400)
    h.turn(prompt, "agent", stamp=0.25)
    before = h.kv_of_path(prompt)
    assert h.pause("agent", LONG, tool_class="ci_run")["action"] == "offload"
    for k in range(4):  # other agents' one-shot sessions: fill the device, push to host, churn the host pool
        h.turn(ids(100 + k, 500), f"other{k}")
    core = h.cache.tree_core
    assert h.resident("agent") == 0 and h.on_host("agent") == 400  # evicted to host, and kept there
    assert h.host_only_bands("agent") == {Band.PROTECTED}
    assert core.host_lost_tokens > 0  # others' host copies went first
    assert sum(h.on_host(f"other{k}") for k in range(4)) < 4 * 500
    cached = h.turn(prompt + ids(3, 20), "agent")  # the tool returned
    assert cached >= 400
    assert all(torch.equal(a, b) for a, b in zip(h.kv_of_path(prompt), before))
    agent = BranchKey(NS, "agent", "main")
    assert agent not in h.cache.pauses.records and not h.cache.pauses.advice
    h.assert_clean()


def test_an_idle_pauses_advice_never_lifts_its_host_copies_over_others():
    """A branch waiting on its user is priced on ``@idle`` by the idle sweep: a guess about a human, so
    even OFFLOAD advice leaves its host copies ranked by recency with the rest (on the real sessions,
    hours-idle sessions advised OFFLOAD pushed out a conversation idle for 40 s); a tool pause's
    OFFLOAD advice still protects."""
    from sgl_agentcache.policy.idle import IDLE_CLASS

    h = Lazy(pool=1024, host=900, device_tails=False)
    h.turn(ids(2, 400), "idle")
    h.turn(ids(3, 400), "tool")
    assert h.pause("idle", LONG, tool_class=IDLE_CLASS, elapsed_s=3000.0)["action"] == "offload"
    assert h.pause("tool", LONG, tool_class="ci_run")["action"] == "offload"
    h.turn(ids(100, 500), "other0")  # both pushed to host (the host holds both)
    h.turn(ids(101, 500), "other1")
    assert h.on_host("idle") == 400 and h.on_host("tool") == 400
    assert h.host_only_bands("idle") == {Band.VALUED} and h.host_only_bands("tool") == {Band.PROTECTED}
    h.assert_clean()


def test_discard_advice_goes_first_from_hicaches_host_pool():
    """``early`` (500 tokens, ordinary) goes to host first, then ``gone`` (300 tokens, advised DISCARD):
    when the host pool needs room, gone's copy is dropped, although early's is older."""
    h = Lazy(pool=1024, host=1000, device_tails=False)
    h.turn(ids(3, 500), "early")
    h.turn(ids(4, 300), "gone")
    settings = h.cache.pauses.settings
    rate, settings.prefill_tokens_per_s = settings.prefill_tokens_per_s, 1e12  # recompute is free: DISCARD
    result = h.pause("gone", LONG, tool_class="ci_run", resume_probability=0.05)
    assert result["action"] == "discard", result
    settings.prefill_tokens_per_s = rate
    h.turn(ids(200, 500), "other0")  # early goes to host
    h.turn(ids(201, 500), "other1")  # then gone: 800 of the 1000 host slots
    assert h.on_host("early") == 500 and h.on_host("gone") == 300
    assert h.host_only_bands("gone") == {Band.TRIM} and h.host_only_bands("early") == {Band.VALUED}
    h.turn(ids(202, 500), "other2")  # other0 needs host room: gone's copy is dropped, early's stays
    assert h.on_host("early") == 500 and h.on_host("gone") == 0
    assert h.cache.tree_core.host_lost_tokens == 300
    assert h.turn(ids(3, 500) + [7], "early") == 500  # early's copy loads back whole
    h.assert_clean()


def test_a_deadline_releases_every_tier_and_a_prefetch_loads_back_into_free_memory():
    h = Lazy(pool=1024, host=4096)
    late, soon = ids(5, 300), ids(6, 300)
    h.turn(late, "late")
    h.turn(soon, "soon")
    h.pause("late", LONG, tool_class="ci_run")
    h.pause("soon", LONG, tool_class="ci_run")
    for k in range(2):
        h.turn(ids(300 + k, 500), f"other{k}")  # both branches go to host
    pauses = h.cache.pauses
    late_key, soon_key = BranchKey(NS, "late", "main"), BranchKey(NS, "soon", "main")
    held = h.on_host("late")
    assert held > 0 and h.on_host("soon") > 0
    deleted = h.cache.hicache_deletes["host_tokens"]
    with h.driver.activated():
        expired = pauses.expire(late_key)
    assert expired["expired"] and h.on_host("late") == 0 and late_key not in pauses.records
    assert h.cache.hicache_deletes["host_tokens"] - deleted == held
    assert h.cache.tree_core.owned_tokens(late_key) == h.resident("late")  # nothing of it left on host
    h.driver.step()
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=1024))  # room: a prefetch only uses free memory
        pauses.settings.prefetch_budget_tokens = 1024  # the default (an eighth of the pool) is too small here
        got = pauses.prefetch_branch(soon_key)
    h.driver.idle_poll()  # the scheduler acknowledges the load at its next loop iteration
    assert got["prefetched"] is True and got["restored_tokens"] == 300, got
    assert h.resident("soon") == 300
    assert h.turn(soon + ids(7, 10), "soon") >= 300
    assert pauses.prefetch["used"] == 1
    h.assert_clean()


def test_a_prefetch_that_would_save_nothing_is_refused_and_counted_as_such():
    """Where re-prefilling is cheaper than reloading, a prefetch is refused as "no gain", not as "no
    room": the room is there (and nothing moves)."""
    h = Lazy(pool=1024, host=4096, device_tails=False)
    h.turn(ids(6, 300), "soon")
    h.pause("soon", LONG, tool_class="ci_run")
    for k in range(2):
        h.turn(ids(300 + k, 500), f"other{k}")  # the paused branch goes to host
    pauses = h.cache.pauses
    soon_key = BranchKey(NS, "soon", "main")
    on_host = h.on_host("soon")
    assert on_host > 0
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=1024))  # free room: that is not what stops it
        pauses.settings.prefill_tokens_per_s = 1e12  # re-prefill beats any reload
        pauses.settings.prefetch_budget_tokens = 1024
        got = pauses.prefetch_branch(soon_key)
    assert got["prefetched"] is False and "saves nothing" in got["reason"], got
    assert pauses.prefetch["refused_no_gain"] == 1 and pauses.prefetch["refused_room"] == 0
    assert h.on_host("soon") == on_host and pauses.prefetch["issued"] == 0 and h.resident("soon") == 0
    h.assert_clean()


def test_a_prefetch_without_room_in_free_memory_is_refused():
    """A prefetch never evicts: with the device full of other (unlocked) KV it is refused for room."""
    h = Lazy(pool=1024, host=4096, device_tails=False)
    h.turn(ids(6, 300), "soon")
    h.pause("soon", LONG, tool_class="ci_run")
    for k in range(2):
        h.turn(ids(300 + k, 500), f"other{k}")
    pauses = h.cache.pauses
    pauses.settings.prefetch_budget_tokens = 1024
    assert h.on_host("soon") > h.driver.free_tokens()
    with h.driver.activated():
        got = pauses.prefetch_branch(BranchKey(NS, "soon", "main"))
    assert got["prefetched"] is False and pauses.prefetch["refused_room"] == 1 and h.resident("soon") == 0
    h.assert_clean()


def test_decisions_follow_the_tools_distribution():
    """The decision is still priced per pause (a mix, not one answer): a fast tool's branch is kept,
    a long-tailed one's is advised to host."""
    h = Lazy(pool=1024, host=4096)
    h.turn(ids(8, 300), "fast")
    h.turn(ids(9, 300), "slow")
    assert h.pause("fast", SHORT, tool_class="grep")["action"] == "keep"
    assert h.pause("slow", LONG, tool_class="ci_run")["action"] == "offload"
    assert {k: v for k, v in h.cache.pauses.counters["decisions"].items() if v} == {"keep": 1, "offload": 1}
    assert h.cache.pauses.advice == {BranchKey(NS, "fast", "main"): PauseAction.KEEP,
                                     BranchKey(NS, "slow", "main"): PauseAction.OFFLOAD}
    h.assert_clean()


def test_closing_or_forcing_a_lazily_paused_branch_drops_its_advice():
    h = Lazy(pool=1024, host=4096)
    h.turn(ids(10, 300), "closed")
    h.turn(ids(11, 300), "forced")
    h.pause("closed", LONG, tool_class="ci_run")
    h.pause("forced", LONG, tool_class="ci_run")
    pauses = h.cache.pauses
    closed, forced = BranchKey(NS, "closed", "main"), BranchKey(NS, "forced", "main")
    assert set(pauses.advice) == {closed, forced}
    with h.driver.activated():
        h.cache.close_branch(closed)
        # A forced action (the replayer's baselines, a control op) applies at once and ends the advice.
        result = h.cache.pauses.pause(forced, LONG, tool_class="ci_run", force=PauseAction.DISCARD)
    assert result["action"] == "discard" and result["forced"] and "lazy" not in result  # applied, not advice
    assert not pauses.advice and closed not in pauses.records
    assert pauses.records[forced].advice is None and h.resident("forced") == 0
    h.assert_clean()


def test_a_fork_advised_offload_keeps_its_host_copy_below_its_over_quota_lead():
    """The lead is over its quota (its nodes go first, TRIM on either tier); the fork below it is
    advised OFFLOAD. Pressure pushes both to host: the fork's host copy stays protected, and the
    fork resumes from host with its lead's history."""
    h = Lazy(pool=1024, host=4096)
    lead = ids(12, 300)
    h.turn(lead, "L", out=(7,))
    fork = {"parent_branch": "main", "fork_point_tokens": 301}
    h.turn(lead + [7] + ids(13, 200), "L", branch="w", extra=fork)
    lead_key = BranchKey(NS, "L", "main")
    assert h.pause("L", LONG, branch="w", tool_class="ci_run")["action"] == "offload"
    h.cache.quotas.put(lead_key, 16)  # the lead is over its quota: its leaves go first
    for k in range(3):
        h.turn(ids(400 + k, 500), f"other{k}")
    assert h.resident("L") == 0 and h.resident("L", "w") == 0
    assert h.on_host("L", "w") >= 200 and h.host_only_bands("L", "w") == {Band.PROTECTED}
    assert h.host_only_bands("L") <= {Band.TRIM}
    assert h.turn(lead + [7] + ids(13, 200) + [7, 9], "L", branch="w", extra=fork) >= 500  # whole, from host
    h.assert_clean()


def test_over_quota_beats_offload_advice_on_host():
    """OFFLOAD advice does not protect what a branch holds on host over its quota: its host copies rank
    first (TRIM); host tokens count toward the quota (``branch_tokens``)."""
    h = Lazy(pool=1024, host=4096, device_tails=False)
    h.cache.session_quota_tokens = 512  # half the pool (the default is the whole pool)
    h.turn(ids(16, 600), "big")
    big = BranchKey(NS, "big", "main")
    assert h.pause("big", LONG, tool_class="ci_run")["action"] == "offload"
    for k in range(2):
        h.turn(ids(420 + k, 500), f"other{k}")
    assert h.resident("big") == 0 and h.on_host("big") == 600
    assert h.cache.branch_tokens(big) == 600 and h.cache.over_quota(big)  # 600 > the 512-token session quota
    assert h.host_only_bands("big") == {Band.TRIM}
    h.cache.quotas.put(big, 1024)
    assert not h.cache.over_quota(big) and h.host_only_bands("big") == {Band.PROTECTED}
    h.cache.quotas.put(big, 16)
    assert h.cache.over_quota(big) and h.host_only_bands("big") == {Band.TRIM}
    assert h.turn(ids(16, 600) + [7, 9], "big") >= 600  # free room kept them: the resume loads them back
    h.assert_clean()


def test_a_prefetch_is_judged_by_its_own_path_not_by_the_branchs_other_resident_tokens():
    """A prefetched tail evicted again before the resume is a wasted prefetch, even though the branch
    still has as many other tokens on the device as the prefetch brought."""
    h = Lazy(pool=1024, host=4096, device_tails=False)
    head, tail = ids(20, 400), ids(21, 200)
    h.turn(head, "a")
    h.turn(head + [7] + tail, "a")  # two nodes: head (kept below) and tail (the leaf eviction takes)
    a = BranchKey(NS, "a", "main")
    pauses = h.cache.pauses
    pauses.settings.prefetch_budget_tokens = 1024
    assert h.pause("a", LONG, tool_class="ci_run")["action"] == "offload"
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=len(tail)))
    h.driver.step()
    assert h.resident("a") == len(head) and h.on_host("a") == len(tail) + 1  # the tail node: [7] + tail
    with h.driver.activated():
        got = pauses.prefetch_branch(a)
    h.driver.idle_poll()
    assert got["prefetched"] and got["restored_tokens"] == len(tail) + 1, got
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=len(tail)))  # gone again before the tool returns
    h.driver.step()
    assert h.resident("a") >= got["restored_tokens"]  # the old, biased rule would call it used
    assert h.turn(head + [7] + tail + [7, 9], "a") >= len(head) + len(tail)  # loaded back at the resume
    assert pauses.prefetch["wasted"] == 1 and pauses.prefetch["used"] == 0
    h.assert_clean()


def test_a_pause_prices_the_host_entries_its_offload_would_displace():
    """Free host room costs nothing; a full host costs the learned reuse rate times what a host copy
    saves, per token the copy would push out (the retention policy's value). Without HiCache there
    is no host room at all (and so nothing displaced, and no offload)."""
    agent = BranchKey(NS, "agent", "main")
    none = Lazy(pool=1024, host=None)
    none.turn(ids(3, 300), "agent")
    assert none.cache.pauses.inputs(agent, LONG).host_free_bytes == 0

    roomy = Lazy(pool=1024, host=4096)
    roomy.turn(ids(3, 300), "agent")
    inputs = roomy.cache.pauses.inputs(agent, LONG)
    assert inputs.host_displaced_s == 0.0 and inputs.host_free_bytes == 4096 * 36 * 1024

    tight = Lazy(pool=1024, host=600)
    for k in range(3):  # fill the host pool with other sessions' evicted history
        tight.turn(ids(100 + k, 450), f"other{k}")
    tight.turn(ids(3, 300), "agent")
    cache = tight.cache
    free, room = cache.host_room()
    inputs = cache.pauses.inputs(agent, LONG)
    assert inputs.host_free_bytes == room * cache.pauses.settings.bytes_per_token
    past_free = inputs.retained_tokens - free
    assert past_free > 0 and cache.tree_core.host_holders()
    model = cache.retention
    per_token = cache.host_reuse_rate() * (model.recompute_s - model.reload_s)
    assert inputs.host_displaced_s == pytest.approx(past_free * per_token)
    tight.assert_clean()
