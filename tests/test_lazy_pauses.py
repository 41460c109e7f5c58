"""Lazy tool pauses (the default): a decision is advice to eviction and the node spill; nothing moves
at the pause.

On the real cache offline (SGLang's CPU pools): KEEP leaves the branch as it is (no pin), OFFLOAD
protects what eviction later spills of it on the host tier, DISCARD lets it onto host only into free
room, first to be dropped; the
branch's next request loads back what was spilled, byte for byte; a prefetch does it earlier into
free memory; a deadline releases every tier; nothing leaks. Token ids stay below 512.
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
from sgl_agentcache.server.offline import OfflineDriver, build_offline_cache

NS = namespace_key(None, None)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Lazy:
    def __init__(self, pool: int = 1024, host: int = 4096):
        self.cache = build_offline_cache(pool_tokens=pool)
        self.cache.set_host_spill(True)
        self.cache.pauses.host.capacity_tokens = host
        assert self.cache.pauses.settings.lazy  # the default
        # Decisions priced as the seed profile's deployment (36 KiB per token), not the 8-byte test pool.
        self.cache.pauses.settings.bytes_per_token = 36 * 1024
        self.driver = OfflineDriver(self.cache)
        self.n = 0

    def turn(self, prompt, session=None, branch="main", out=(7,), stamp=None):
        self.n += 1
        hint = None if session is None else lifecycle_envelope({"session": session, "branch": branch},
                                                               message_id=f"m{self.n}")
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

    def assert_clean(self):
        report = self.driver.check()
        assert report.ok, report.errors
        assert self.driver.idle_free_tokens() == self.driver.pool_tokens


LONG = LogNormal(median_s=60.0, sigma=1.5)  # a long-tailed tool: worth keeping on host, not on the device
SHORT = PointMass(0.01)


def test_a_lazy_pause_decides_but_moves_and_pins_nothing():
    h = Lazy()
    prompt = ids(1, 300)
    h.turn(prompt, "a")
    before = h.resident("a")
    result = h.pause("a", LONG, tool_class="ci_run")
    assert result["lazy"] is True and result["action"] in ("keep", "offload", "discard")
    assert h.resident("a") == before and not h.cache.pauses.host.entries and not h.cache.pauses.kept
    assert h.cache.pauses.counters["decisions"][result["action"]] == 1
    h.assert_clean()


def test_offload_advice_protects_the_spilled_branch_and_the_resume_loads_it_back_exactly():
    h = Lazy(pool=1024, host=900)
    prompt = ids(2, 400)
    h.turn(prompt, "agent", stamp=0.25)
    before = h.kv_of_path(prompt)
    assert h.pause("agent", LONG, tool_class="ci_run")["action"] == "offload"
    for k in range(4):  # other agents' one-shot sessions: fill the device, spill, churn the host tier
        h.turn(ids(100 + k, 500), f"other{k}")
    spill = h.cache.spill
    agent = BranchKey(NS, "agent", "main")
    assert spill.owner_tokens.get(agent, 0) > 0 and spill.protected_tokens > 0
    assert spill.counters["dropped_tokens"]["room"] > 0  # others' entries went first
    assert all(e.protected for e in spill.by_owner[agent])
    cached = h.turn(prompt + ids(3, 20), "agent")  # the tool returned
    assert cached >= 400
    assert all(torch.equal(a, b) for a, b in zip(h.kv_of_path(prompt), before))
    assert agent not in h.cache.pauses.records and not spill.advice
    h.assert_clean()


def _discarded(host: int) -> "Lazy":
    """``early`` (500 tokens, ordinary) is evicted and spilled first; then ``gone`` (300 tokens,
    advised DISCARD) is evicted."""
    h = Lazy(pool=1024, host=host)
    h.turn(ids(3, 500), "early")
    h.turn(ids(4, 300), "gone")
    settings = h.cache.pauses.settings
    rate, settings.prefill_tokens_per_s = settings.prefill_tokens_per_s, 1e12  # recompute is free: DISCARD
    result = h.pause("gone", LONG, tool_class="ci_run", resume_probability=0.05)
    assert result["action"] == "discard", result
    settings.prefill_tokens_per_s = rate  # at the real rate host copies pay again (the spill needs that)
    for k in range(2):
        h.turn(ids(200 + k, 500), f"other{k}")
    return h


def test_discard_advice_spills_only_into_free_host_room_and_goes_first():
    gone, early = BranchKey(NS, "gone", "main"), BranchKey(NS, "early", "main")
    full = _discarded(host=700)  # early's copy leaves 200 tokens free: gone does not displace it
    spill = full.cache.spill
    assert spill.counters["spill_skipped_discard"] > 0 and spill.counters["dropped_tokens"]["room"] == 0
    assert spill.owner_tokens.get(gone, 0) == 0 and spill.owner_tokens.get(early, 0) >= 500
    full.assert_clean()

    roomy = _discarded(host=4096)  # free room: kept, but ahead of every other entry for the next drop
    spill = roomy.cache.spill
    held = spill.owner_tokens.get(gone, 0)
    assert held > 0 and spill.counters["spill_skipped_discard"] == 0
    assert next(iter(spill.lru)).state.owner == gone  # spilled after early's copy, yet first in line
    others = {b: t for b, t in spill.owner_tokens.items() if b != gone}
    assert spill.make_room(spill.host.free_tokens() + 1)
    assert spill.owner_tokens.get(gone, 0) < held
    assert {b: t for b, t in spill.owner_tokens.items() if b != gone} == others
    roomy.assert_clean()


def test_an_over_quota_branch_spills_only_into_free_host_room():
    """A quota bounds fairness under pressure: with free host room an over-quota branch's evicted
    leaves are kept there (not trimmed); with too little free room they never displace another
    entry (``early``'s copy), they are trimmed."""
    early = BranchKey(NS, "early", "main")
    for host, kept in ((4096, True), (700, False)):
        h = Lazy(pool=1024, host=host)
        h.turn(ids(15, 500), "early")
        h.turn(ids(14, 600), "big")  # early is evicted for it: spilled, 500 of the host's tokens
        big = BranchKey(NS, "big", "main")
        assert h.cache.spill.owner_tokens.get(early, 0) >= 500
        h.cache.quotas.put(big, 16)  # now over its quota: it goes first
        h.turn(ids(410, 500), "other0")
        spill = h.cache.spill
        assert h.resident("big") < 600 and spill.owner_tokens.get(early, 0) >= 500
        if kept:
            assert spill.owner_tokens.get(big, 0) > 0 and h.cache.quota_trimmed_tokens == 0
        else:
            assert spill.counters["spill_skipped_over_quota"] > 0 and h.cache.quota_trimmed_tokens > 0
            assert spill.owner_tokens.get(big, 0) == 0 and spill.counters["dropped_tokens"]["room"] == 0
        h.assert_clean()


def test_a_deadline_releases_every_tier_and_a_prefetch_loads_back_into_free_memory():
    h = Lazy(pool=1024, host=4096)
    late, soon = ids(5, 300), ids(6, 300)
    h.turn(late, "late")
    h.turn(soon, "soon")
    h.pause("late", LONG, tool_class="ci_run")
    h.pause("soon", LONG, tool_class="ci_run")
    for k in range(2):
        h.turn(ids(300 + k, 500), f"other{k}")  # both branches spill
    spill, pauses = h.cache.spill, h.cache.pauses
    late_key, soon_key = BranchKey(NS, "late", "main"), BranchKey(NS, "soon", "main")
    assert spill.owner_tokens.get(late_key, 0) > 0 and spill.owner_tokens.get(soon_key, 0) > 0
    with h.driver.activated():
        expired = pauses.expire(late_key)
    assert expired["expired"] and spill.owner_tokens.get(late_key, 0) == 0 and late_key not in pauses.records
    h.driver.step()
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=1024))  # room: a prefetch only uses free memory
        pauses.settings.prefetch_budget_tokens = 1024  # the default (an eighth of the pool) is too small here
        got = pauses.prefetch_branch(soon_key)
    assert got["prefetched"] is True and got["restored_tokens"] > 0, got
    assert h.turn(soon + ids(7, 10), "soon") >= 300
    assert pauses.prefetch["used"] == 1
    h.assert_clean()


def test_a_prefetch_that_would_save_nothing_is_refused_and_counted_as_such():
    """Where re-prefilling is cheaper than reloading, a prefetch is refused as "no gain", not as "no
    room": the room is there (and nothing moves)."""
    h = Lazy(pool=1024, host=4096)
    h.turn(ids(6, 300), "soon")
    h.pause("soon", LONG, tool_class="ci_run")
    for k in range(2):
        h.turn(ids(300 + k, 500), f"other{k}")  # the paused branch spills
    spill, pauses = h.cache.spill, h.cache.pauses
    soon_key = BranchKey(NS, "soon", "main")
    on_host = spill.owner_tokens.get(soon_key, 0)
    assert on_host > 0
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=1024))  # free room: that is not what stops it
        pauses.settings.prefill_tokens_per_s = 1e12  # re-prefill beats any reload
        pauses.settings.prefetch_budget_tokens = 1024
        got = pauses.prefetch_branch(soon_key)
    assert got["prefetched"] is False and "saves nothing" in got["reason"], got
    assert pauses.prefetch["refused_no_gain"] == 1 and pauses.prefetch["refused_room"] == 0
    assert spill.owner_tokens.get(soon_key, 0) == on_host and pauses.prefetch["issued"] == 0
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
    h.assert_clean()


def test_closing_or_forcing_a_lazily_paused_branch_drops_its_advice():
    h = Lazy(pool=1024, host=4096)
    h.turn(ids(10, 300), "closed")
    h.turn(ids(11, 300), "forced")
    h.pause("closed", LONG, tool_class="ci_run")
    h.pause("forced", LONG, tool_class="ci_run")
    spill = h.cache.spill
    closed, forced = BranchKey(NS, "closed", "main"), BranchKey(NS, "forced", "main")
    assert set(spill.advice) == {closed, forced}
    with h.driver.activated():
        h.cache.close_branch(closed)
        # A forced action (the replayer's baselines, a control op) applies at once and ends the advice.
        h.cache.pauses.pause(forced, LONG, tool_class="ci_run", force=PauseAction.DISCARD)
    assert not spill.advice and spill.protected_tokens == 0
    h.assert_clean()


def test_an_over_quota_leaf_is_still_spilled_when_other_branches_copies_hang_from_it():
    """Trimming an over-quota branch must not orphan a fork's spilled (protected) scratch below it."""
    h = Lazy(pool=1024, host=4096)
    lead = ids(12, 300)
    h.turn(lead, "L", out=(7,))
    fork_hint = lifecycle_envelope({"session": "L", "branch": "w", "parent_branch": "main",
                                    "fork_point_tokens": 301}, message_id="fork")
    req = h.driver.admit("fork", lead + [7] + ids(13, 200), kv_hints=fork_hint)
    h.driver.extend(req, [7])
    h.driver.finish(req)
    worker, lead_key = BranchKey(NS, "L", "w"), BranchKey(NS, "L", "main")
    assert h.pause("L", LONG, branch="w", tool_class="ci_run")["action"] == "offload"
    h.cache.quotas.put(lead_key, 16)  # the lead is over its quota: its leaves go first and are not kept
    for k in range(3):
        h.turn(ids(400 + k, 500), f"other{k}")
    spill = h.cache.spill
    assert h.resident("L") == 0 and h.cache.quota_trimmed_tokens == 0  # spilled for the fork, not trimmed
    assert spill.owner_tokens.get(worker, 0) >= 200 and spill.counters["dropped_tokens"]["orphaned"] == 0
    assert h.turn(lead + [7] + ids(13, 200) + [7, 9], "L", branch="w") >= 500  # the fork resumes from host
    h.assert_clean()


def test_an_over_quota_branch_advised_offload_is_spilled_low_value_and_then_not_over_quota():
    """OFFLOAD advice does not protect what a branch spills over its quota (it stays first in line),
    and those low-value entries do not count toward the quota: once its device KV is gone the branch
    is no longer over quota, so its later KV is not the first to go."""
    h = Lazy(pool=1024, host=4096)
    h.turn(ids(16, 600), "big")
    big = BranchKey(NS, "big", "main")
    assert h.pause("big", LONG, tool_class="ci_run")["action"] == "offload"
    h.cache.quotas.put(big, 16)
    for k in range(2):
        h.turn(ids(420 + k, 500), f"other{k}")
    spill = h.cache.spill
    mine = set(spill.by_owner.get(big, ()))
    assert mine and all(e.low_value and not e.protected for e in mine)
    assert spill.owner_tokens[big] >= 600 and spill.charged_tokens.get(big, 0) == 0
    assert h.resident("big") == 0 and not h.cache.over_quota(big)
    assert next(iter(spill.lru)).state.owner == big and spill.protected_tokens == 0
    spill.advise(big, PauseAction.OFFLOAD)  # advice given again still leaves them first in line
    assert not any(e.protected for e in mine) and spill.protected_tokens == 0
    assert h.turn(ids(16, 600) + [7, 9], "big") >= 600  # free room kept them: the resume loads them back
    h.assert_clean()


def test_a_prefetch_is_judged_by_its_own_path_not_by_the_branchs_other_resident_tokens():
    """A prefetched tail evicted again before the resume is a wasted prefetch, even though the branch
    still has as many other tokens on the device as the prefetch brought."""
    h = Lazy(pool=1024, host=4096)
    head, tail = ids(20, 400), ids(21, 200)
    h.turn(head, "a")
    h.turn(head + [7] + tail, "a")  # two nodes: head (kept below) and tail (the leaf eviction takes)
    a = BranchKey(NS, "a", "main")
    pauses = h.cache.pauses
    pauses.settings.prefetch_budget_tokens = 1024
    assert h.pause("a", LONG, tool_class="ci_run")["action"] == "offload"
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=len(tail)))
    assert h.resident("a") == len(head)
    with h.driver.activated():
        got = pauses.prefetch_branch(a)
        assert got["prefetched"] and got["restored_tokens"] >= len(tail), got
        h.cache.evict(EvictParams(num_tokens=len(tail)))  # gone again before the tool returns
    assert h.resident("a") >= got["restored_tokens"]  # the old, biased rule would call it used
    assert h.turn(head + [7] + tail + [7, 9], "a") >= len(head) + len(tail)  # loaded back at the resume
    assert pauses.prefetch["wasted"] == 1 and pauses.prefetch["used"] == 0
    h.assert_clean()


def test_a_pause_prices_the_host_entries_its_offload_would_displace():
    """Free host room costs nothing; a full host costs the learned reuse rate times what a host copy
    saves, per token the copy would push out (the retention policy's value)."""
    roomy = Lazy(pool=1024, host=4096)
    roomy.turn(ids(3, 300), "agent")
    agent = BranchKey(NS, "agent", "main")
    assert roomy.cache.pauses.inputs(agent, LONG).host_displaced_s == 0.0

    tight = Lazy(pool=1024, host=600)
    for k in range(3):  # fill the host tier with other sessions' spilled history
        tight.turn(ids(100 + k, 450), f"other{k}")
    tight.turn(ids(3, 300), "agent")
    host = tight.cache.pauses.host
    inputs = tight.cache.pauses.inputs(agent, LONG)
    past_free = inputs.retained_tokens - host.free_tokens()
    assert past_free > 0 and tight.cache.spill.tokens > 0
    model = tight.cache.retention
    per_token = tight.cache.spill.reuse_rate() * (model.recompute_s - model.reload_s)
    assert inputs.host_displaced_s == pytest.approx(past_free * per_token)
    tight.assert_clean()


def test_nothing_is_spilled_when_a_host_copy_would_save_nothing():
    h = Lazy(pool=1024, host=4096)
    h.cache.pauses.settings.prefill_tokens_per_s = 1e12  # re-prefill is cheaper than any reload
    for k in range(4):
        h.turn(ids(10 + k, 450), f"s{k}")
    spill = h.cache.spill
    assert spill.tokens == 0 and spill.counters["spills"] == 0 and spill.counters["spill_skipped_no_gain"] > 0
    h.assert_clean()
