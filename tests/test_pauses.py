"""Tool pauses on the real cache (offline driver, SGLang's CPU pools), eager mode: keep / offload /
discard / release carried out at the pause, caps, prefetch accounting, and what each does on both
kinds of server: without a host tier (stock SGLang: an offload can only be a discard) and on SGLang's
HiCache (``OfflineHiCache``: an offload demotes the branch's movable suffix into HiCache's host pool,
its next call loads it back through HiCache; a release, an expiry, a close or a flush deletes it on
every tier). (The default, lazy mode -- a decision is advice to eviction and HiCache's host eviction
-- is tested in ``test_lazy_pauses.py``; these mechanisms serve eager mode, forced actions and the
replayed baselines.)

Each test ends with the integrity check and a leak check: device free + cached == pool, the pause
book's pins and advice belong to paused branches, and no host room is priced without HiCache.
"""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.distributions import LogNormal, PointMass
from sgl_agentcache.policy.pause import PauseAction, Placement
from sgl_agentcache.server.scheduler.branch_walks import movable_suffix
from sgl_agentcache.server.scheduler.offline import OfflineDriver, OfflineHiCache, build_offline_cache

NS = namespace_key(None, None)
STABLE = 32
HOST = 2048  # HiCache host pool of the HiCache tests: room for every offload below


def hint(session: str, branch: str = "main", **extra) -> dict:
    return {"session": session, "branch": branch, "stable_prefix_tokens": STABLE, **extra}


class Harness:
    """``hicache``: HiCache's host pool in tokens (None: no host tier, as stock SGLang without it)."""

    def __init__(self, pool_tokens: int = 1024, page_size: int = 1, hicache: int | None = None,
                 write_policy: str = "write_back", **settings):
        self.cache = build_offline_cache(
            pool_tokens=pool_tokens, page_size=page_size,
            hicache=OfflineHiCache(hicache, write_policy) if hicache is not None else None)
        assert self.cache.on_hicache == (hicache is not None)
        settings.setdefault("lazy", False)
        for name, value in settings.items():
            setattr(self.cache.pauses.settings, name, value)
        self.driver = OfflineDriver(self.cache)
        self.kv = self.cache.token_to_kv_pool_allocator.get_kvcache()
        self.n = 0

    def turn(self, session: str, prompt: list[int], out: list[int], branch: str = "main", stamp: float | None = None,
             capture: int = 0, **extra):
        """One call: admit, (optionally) stamp its KV with recognisable values, decode ``out``, finish.
        ``capture``: keep the KV of the first ``capture`` prompt tokens as admitted (``req.captured``)."""
        self.n += 1
        req = self.driver.admit(f"r{self.n}", prompt, kv_hints=lifecycle_envelope(hint(session, branch, **extra),
                                                                                  message_id=f"m{self.n}"))
        if stamp is not None:
            idx = self.driver.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(prompt)]
            for buf in self.kv.k_buffer + self.kv.v_buffer:
                buf[idx] = (torch.arange(len(prompt), dtype=buf.dtype) + stamp).view(-1, 1, 1)
        if capture:
            req.captured = self.kv_of(req, capture)
        self.driver.extend(req, out)
        self.driver.finish(req)
        return req

    def kv_of(self, req, n: int) -> list[torch.Tensor]:
        idx = self.driver.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
        return [buf[idx].flatten().clone() for buf in self.kv.k_buffer + self.kv.v_buffer]

    def pause(self, session: str, branch: str = "main", **kwargs) -> dict:
        """Pause, then run the scheduler's next step (HiCache's events acknowledge the offload's backups)."""
        with self.driver.activated():
            result = self.cache.pauses.pause(BranchKey(NS, session, branch), **kwargs)
        self.driver.step()
        return result

    def call(self, method: str, session: str, branch: str = "main") -> dict:
        with self.driver.activated():
            result = getattr(self.cache.pauses, method)(BranchKey(NS, session, branch))
        if method == "prefetch_branch":
            self.driver.idle_poll()  # the scheduler acknowledges the load at its next loop iteration
        return result

    def host_tokens(self, session: str, branch: str = "main") -> int:
        """Tokens ``session/branch`` holds in HiCache's host pool."""
        key = BranchKey(NS, session, branch)
        return sum(len(n.component_data[0].host_value) for n in self.cache.tree_core.host_holders()
                   if n.agent.owner == key)

    def device_tokens(self, session: str, branch: str = "main") -> int:
        return self.cache.tree_core.resident_owned_tokens(BranchKey(NS, session, branch))

    def host_free(self) -> int:
        return self.cache.cache_controller.mem_pool_host.available_size()

    def assert_clean(self) -> None:
        report = self.driver.check()
        assert report.ok, report.errors
        assert self.driver.idle_free_tokens() == self.driver.pool_tokens
        pauses = self.cache.pauses
        assert set(pauses.kept) <= set(pauses.records) and set(pauses.advice) <= set(pauses.records)
        if not self.cache.on_hicache:
            assert self.cache.host_room() == (0, 0) and self.cache.agent_stats()["hicache"] == {"attached": False}


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids in [3, 400), a different sequence for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


# ---- offload on HiCache ----


def test_offload_on_hicache_frees_the_device_and_the_next_call_loads_it_back_byte_exact():
    h = Harness(hicache=HOST)
    prompt = ids(0, 300)
    h.turn("s", prompt, [7, 8, 9], stamp=1000.0)
    resident = h.cache.resident_tokens_by_class()
    free_before, host_before = h.driver.free_tokens(), h.host_free()
    result = h.pause("s", force=PauseAction.OFFLOAD)
    moved = 300 + 2 - STABLE  # the prompt and the outputs with KV, past the shared stable prefix
    assert result["action"] == result["decided"] == "offload" and result["tokens"] == result["moved_tokens"] == moved
    assert h.driver.free_tokens() == free_before + moved and h.host_free() == host_before - moved
    assert h.cache.resident_tokens_by_class()["session"] == resident["session"] - moved
    assert h.cache.hicache_stats()["host_tokens_by_class"]["session"] == moved
    assert h.host_tokens("s") == moved and h.device_tokens("s") == 0
    branch = BranchKey(NS, "s", "main")
    record = h.cache.pauses.records[branch]
    assert record.placement is Placement.DEVICE and record.advice is PauseAction.OFFLOAD  # ranked protected on host
    assert h.cache.pauses.advice == {branch: PauseAction.OFFLOAD}
    assert h.cache.pauses.counters["hicache_offloaded_tokens"] == moved
    assert h.cache.pauses.counters["offload_partial"] == 0 and h.cache.pauses.counters["forced"] == 1
    h.assert_clean()

    second = h.turn("s", prompt + [7, 8, 9] + ids(500, 20), [11], capture=300)  # the tool returned
    assert second.cached_tokens == 300 + 2 and second.host_loaded_length == moved  # all of it, from host
    assert len(second.captured) == 2  # K and V of the one layer, each exactly as written before the pause
    assert all(torch.equal(kv, torch.arange(300.0) + 1000.0) for kv in second.captured)
    assert not h.cache.pauses.records and not h.cache.pauses.advice  # its request ended the pause
    assert h.cache.resident_tokens_by_class()["session"] >= resident["session"]
    h.assert_clean()


def test_paged_pool_offload_round_trip_on_hicache():
    h = Harness(page_size=4, hicache=HOST)
    prompt = ids(3, 203)
    h.turn("p", prompt, [5, 6])
    result = h.pause("p", force=PauseAction.OFFLOAD)
    assert result["tokens"] % 4 == 0 and result["moved_tokens"] == result["tokens"] > 0
    again = h.turn("p", prompt + [5, 6] + ids(900, 9), [1])
    assert again.cached_tokens == (203 + 1) // 4 * 4 and again.host_loaded_length == result["tokens"]
    h.assert_clean()


def test_eager_offload_without_hicache_falls_back_to_discard():
    """No HiCache, no host tier: an applied offload can only free the branch (counted as a fallback
    for want of host room); its next call recomputes past the stable prefix."""
    h = Harness()
    prompt = ids(1, 300)
    h.turn("f", prompt, [3])
    free_before = h.driver.free_tokens()
    result = h.pause("f", force=PauseAction.OFFLOAD)
    assert result["decided"] == "offload" and result["action"] == "discard" and result["paused"]
    assert result["tokens"] == 300 - STABLE and "moved_tokens" not in result
    pauses = h.cache.pauses
    assert pauses.counters["offload_fallbacks"]["host_full"] == 1
    assert pauses.counters["decisions"]["discard"] == 1 and pauses.counters["hicache_offloaded_tokens"] == 0
    assert h.driver.free_tokens() == free_before + result["tokens"] and h.device_tokens("f") == 0
    assert pauses.records[BranchKey(NS, "f", "main")].placement is Placement.NONE and not pauses.advice
    assert h.turn("f", prompt + [3], [4]).cached_tokens == STABLE
    h.assert_clean()


def test_without_a_host_tier_the_policy_never_offers_an_offload():
    """Host room is priced from HiCache's pool (``host_room``): without it an offload is infeasible, so
    a long-tailed tool's branch is kept or discarded; on HiCache the same pause offloads."""
    for hicache, expected in ((None, {"keep", "discard"}), (HOST, {"offload"})):
        h = Harness(hicache=hicache, bytes_per_token=36 * 1024)  # priced as the seed's 36 KiB/token model
        h.turn("slow", ids(400, 300), [3])
        slow = h.pause("slow", latency=LogNormal(60.0, 1.5), tool_class="ci_run")
        assert slow["action"] in expected, (hicache, slow)
        assert ("offload" in slow["costs"]) == (hicache is not None), slow
        assert (slow["inputs"]["host_free_bytes"] > 0) == (hicache is not None)
        assert h.cache.pauses.counters["offload_fallbacks"]["host_full"] == 0  # decided, not fallen back
        h.assert_clean()


# ---- discard, keep, caps ----


@pytest.mark.parametrize("hicache", [None, HOST], ids=["no-host", "hicache"])
def test_discard_frees_now_and_the_next_call_recomputes(hicache):
    h = Harness(hicache=hicache)
    prompt = ids(10, 250)
    h.turn("d", prompt, [4, 5])
    result = h.pause("d", force=PauseAction.DISCARD)
    assert result["action"] == "discard" and result["tokens"] == 250 + 1 - STABLE
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "d", "main")) == 0
    again = h.turn("d", prompt + [4, 5], [6])
    assert again.cached_tokens == STABLE and again.host_loaded_length == 0
    h.assert_clean()


def test_keep_pins_the_branch_above_everything_unpinned():
    h = Harness(pool_tokens=1024)
    kept_prompt = ids(20, 300)
    h.turn("k", kept_prompt, [3, 4])
    assert h.pause("k", force=PauseAction.KEEP)["action"] == "keep"
    assert h.cache.pauses.kept == {BranchKey(NS, "k", "main"): 300 + 1 - STABLE}
    for i in range(6):  # unrelated sessions, each with its own stable prefix, fill the pool many times
        h.turn(f"other{i}", ids(1000 + 97 * i, 300), [9], stable_prefix_tokens=300)
    again = h.turn("k", kept_prompt + [3, 4], [5])
    assert again.cached_tokens == 300 + 1  # still all there: pinned above stable prefixes
    assert not h.cache.pauses.kept  # the request resumed it: unpinned
    h.assert_clean()


def test_keep_beyond_the_namespace_cap_is_clipped_to_an_offload_that_discards_without_hicache():
    h = Harness(max_kept_branches=1)
    h.turn("a", ids(0, 200), [3])
    h.turn("b", ids(300, 200), [3])
    assert h.pause("a", force=PauseAction.KEEP)["action"] == "keep"
    clipped = h.pause("b", force=PauseAction.KEEP)
    assert clipped["decided"] == "keep" and clipped["action"] == "discard"  # offload, with no host: discard
    counters = h.cache.pauses.counters
    assert counters["kept_clipped"] == 1 and counters["offload_fallbacks"]["host_full"] == 1
    assert set(h.cache.pauses.kept) == {BranchKey(NS, "a", "main")} and h.device_tokens("b") == 0
    h.assert_clean()


def test_keep_beyond_the_namespace_cap_on_hicache_is_demoted_to_host():
    """The clipped KEEP becomes an OFFLOAD on HiCache: the branch's suffix goes to HiCache's host pool
    now, recorded as OFFLOAD advice (its host copies rank protected), and its next call loads it back."""
    h = Harness(hicache=HOST, max_kept_branches=1)
    h.turn("a", ids(0, 200), [3])
    prompt = ids(300, 200)
    h.turn("b", prompt, [3])
    assert h.pause("a", force=PauseAction.KEEP)["action"] == "keep"
    clipped = h.pause("b", force=PauseAction.KEEP)
    moved = 200 - STABLE
    assert clipped["decided"] == "keep" and clipped["action"] == "offload" and clipped["paused"]
    assert clipped["moved_tokens"] == clipped["tokens"] == moved
    pauses, b = h.cache.pauses, BranchKey(NS, "b", "main")
    assert pauses.counters["kept_clipped"] == 1 and pauses.counters["offload_fallbacks"]["host_full"] == 0
    assert pauses.counters["hicache_offloaded_tokens"] == moved
    assert b not in pauses.kept and pauses.advice[b] is PauseAction.OFFLOAD
    assert h.device_tokens("b") == 0 and h.host_tokens("b") == moved
    h.assert_clean()
    again = h.turn("b", prompt + [3], [4])
    assert again.cached_tokens == 200 and again.host_loaded_length == moved
    h.assert_clean()


def test_policy_keeps_a_short_tool_and_offloads_a_long_tailed_one_on_hicache():
    h = Harness(hicache=HOST, bytes_per_token=36 * 1024)  # priced as the seed's 36 KiB/token model
    h.turn("fast", ids(0, 300), [3])
    h.turn("slow", ids(400, 300), [3])
    fast = h.pause("fast", latency=PointMass(0.05), tool_class="grep")
    slow = h.pause("slow", latency=LogNormal(60.0, 1.5), tool_class="ci_run")
    assert fast["action"] == "keep", fast
    assert slow["action"] == "offload" and slow["moved_tokens"] == slow["tokens"] > 0, slow
    assert set(slow["costs"]) == {"keep", "offload", "discard"} and slow["inputs"]["retained_tokens"] > 0
    assert h.cache.pauses.counters["decisions"]["keep"] == 1 and h.cache.pauses.counters["forced"] == 0
    assert BranchKey(NS, "fast", "main") in h.cache.pauses.kept
    h.assert_clean()


def test_tenant_caps_only_lower_the_server_caps():
    h = Harness(max_kept_branches=4)
    for i, name in enumerate("abc"):
        h.turn(name, ids(100 * i, 200), [3])
    caps = {"max_kept_branches": 1}
    assert h.pause("a", force=PauseAction.KEEP, caps=caps)["action"] == "keep"
    clipped = h.pause("b", force=PauseAction.KEEP, caps=caps)  # the tenant's cap
    assert clipped["decided"] == "keep" and clipped["action"] == "discard"
    assert h.pause("c", force=PauseAction.KEEP, caps={"max_kept_branches": 99})["action"] == "keep"
    assert h.cache.pauses._cap("max_kept_branches", {"max_kept_branches": 99}) == 4  # never raised
    h.assert_clean()


# ---- release, expiry, close, flush ----


def test_a_pause_too_small_for_a_decision_is_left_to_eviction():
    h = Harness()
    h.turn("tiny", ids(0, STABLE + 20), [3])
    owned = h.cache.tree_core.owned_tokens(BranchKey(NS, "tiny", "main"))
    small = h.pause("tiny", latency=LogNormal(5.0, 1.0))  # 20 tokens < min_tokens: not worth a decision
    assert small["action"] == "none" and not small["paused"]
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "tiny", "main")) == owned  # left to eviction
    assert h.cache.pauses.counters["too_small"] == 1 and not h.cache.pauses.records
    h.assert_clean()


def test_expire_on_hicache_deletes_the_branchs_host_copies():
    h = Harness(hicache=HOST)
    h.turn("e", ids(100, 300), [3])
    moved = h.pause("e", force=PauseAction.OFFLOAD)["moved_tokens"]
    assert moved > 0 and h.host_tokens("e") == moved
    host_free, deleted = h.host_free(), dict(h.cache.hicache_deletes)
    result = h.call("expire", "e")
    assert result["expired"] and result["freed_tokens"] == 0  # nothing of it was left on the device
    assert result["host_freed_tokens"] == moved == h.cache.pauses.counters["released_tokens"]
    assert h.cache.hicache_deletes["host_tokens"] - deleted["host_tokens"] == moved
    assert h.host_free() == host_free + moved and h.host_tokens("e") == 0
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "e", "main")) == 0
    pauses = h.cache.pauses
    assert not pauses.records and not pauses.advice and pauses.counters["deadline_releases"] == 1
    assert h.call("expire", "e")["expired"] is False  # idempotent
    assert h.turn("e", ids(100, 300) + [3], [4]).cached_tokens == STABLE  # nothing left to load back
    h.assert_clean()


def test_a_release_on_hicache_frees_the_branch_on_the_device_and_in_the_host_pool():
    """Write-through: the branch's nodes are on both tiers at once; RELEASE (the deadline passed)
    deletes them from both, and the pause is over."""
    h = Harness(hicache=HOST, write_policy="write_through")
    h.turn("r", ids(200, 300), [3])
    owned = h.cache.tree_core.owned_tokens(BranchKey(NS, "r", "main"))
    assert h.host_tokens("r") == h.device_tokens("r") == owned == 300 - STABLE  # backed up at insert
    deleted = dict(h.cache.hicache_deletes)
    free_before, host_free = h.driver.free_tokens(), h.host_free()
    result = h.pause("r", force=PauseAction.RELEASE)
    assert result["action"] == "release" and not result["paused"] and result["tokens"] == owned
    assert h.cache.hicache_deletes["device_tokens"] - deleted["device_tokens"] == owned
    assert h.cache.hicache_deletes["host_tokens"] - deleted["host_tokens"] == owned
    assert h.driver.free_tokens() == free_before + owned and h.host_free() == host_free + owned
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "r", "main")) == 0
    # Slots freed on every tier: the device's and the host pool's.
    assert h.cache.pauses.counters["released_tokens"] == 2 * owned and not h.cache.pauses.records
    h.assert_clean()


def test_close_on_hicache_deletes_the_host_copy():
    h = Harness(hicache=HOST)
    h.turn("c", ids(0, 300), [3])
    moved = h.pause("c", force=PauseAction.OFFLOAD)["moved_tokens"]
    host_free = h.host_free()
    with h.driver.activated():
        closed = h.cache.close_branch(BranchKey(NS, "c", "main"))
    assert closed["host_freed_tokens"] == moved and h.host_free() == host_free + moved
    assert h.host_tokens("c") == 0 and not h.cache.pauses.records and not h.cache.pauses.advice
    assert h.pause("c", force=PauseAction.OFFLOAD)["paused"] is False  # closed stays closed
    assert h.cache.pauses.counters["refused_closed"] == 1
    h.assert_clean()


def test_flush_cache_drops_every_pause_and_host_copy_with_the_tree():
    """``/flush_cache`` (and a weight update) resets the tree: pauses and HiCache's host copies go with it."""
    h = Harness(hicache=HOST)
    h.turn("off", ids(40, 300), [3, 4])
    h.turn("kept", ids(41, 200), [5])
    h.turn("gone", ids(42, 200), [6])
    assert h.pause("off", force=PauseAction.OFFLOAD)["action"] == "offload"
    assert h.pause("kept", force=PauseAction.KEEP)["action"] == "keep"
    with h.driver.activated():
        h.cache.close_branch(BranchKey(NS, "gone", "main"))
    assert h.host_tokens("off") > 0 and h.cache.pauses.kept and h.cache.pauses.advice

    h.driver.flush_cache()

    pauses = h.cache.pauses
    assert not pauses.records and not pauses.kept and not pauses.advice
    assert h.driver.free_tokens() == h.driver.pool_tokens and not h.cache.tree_core.host_holders()
    h.assert_clean()
    again = h.turn("off", ids(40, 300) + [3, 4] + ids(43, 10), [7])  # resumes as a plain recompute
    assert again.cached_tokens == 0 and again.host_loaded_length == 0
    assert h.pause("gone", force=PauseAction.OFFLOAD)["paused"] is False  # closed stays closed
    h.assert_clean()


# ---- subagents and shared nodes on HiCache ----


def test_a_fork_of_an_offloaded_lead_loads_its_history_from_hicache_and_the_lead_stays_paused():
    """A lead is offloaded; a subagent forked from its history runs meanwhile: HiCache loads the lead's
    history back for the fork's match (not recomputed), and the lead's pause goes on (the fork's
    request is not the lead's). The subagent is offloaded too, everything evictable leaves the device,
    and its next request loads lead history and its own back whole."""
    h = Harness(pool_tokens=2048, hicache=4096)
    lead_prompt = ids(1, 400)
    h.turn("p", lead_prompt, [5, 6])
    lead = lead_prompt + [5, 6]
    assert h.pause("p", force=PauseAction.OFFLOAD)["moved_tokens"] == 400 + 1 - STABLE
    fork_prompt = lead + ids(2, 200)
    fork = dict(branch="w", parent_branch="main", fork_point_tokens=len(lead))
    first = h.turn("p", fork_prompt, [7, 8], **fork)
    assert first.cached_tokens == 400 + 1 and first.host_loaded_length == 400 + 1 - STABLE
    lead_key = BranchKey(NS, "p", "main")
    assert lead_key in h.cache.pauses.records and h.cache.pauses.advice[lead_key] is PauseAction.OFFLOAD
    assert h.pause("p", force=PauseAction.OFFLOAD, branch="w")["moved_tokens"] > 0
    with h.driver.activated():  # pressure: everything evictable goes (to host, under write-back)
        h.cache.evict(EvictParams(num_tokens=h.cache.evictable_size()))
    h.driver.step()
    again = h.turn("p", fork_prompt + [7, 8], [9], **fork)
    assert again.cached_tokens == len(fork_prompt) + 1 and again.host_loaded_length > 0
    assert lead_key in h.cache.pauses.records  # still paused: only its subagent came back
    h.assert_clean()


def _subagents_sharing_a_preamble(h: Harness):
    """A lead, then two subagents forked at its end whose prompts share a 100-token preamble past the
    fork point. The lead is over its quota, so the second subagent does not hand the preamble to it
    (``adopted_tokens``): the first subagent created it and owns it. Returns (fork fields, the second
    subagent's prompt)."""
    h.cache.session_quota_tokens = 50
    lead = ids(1, 300) + [5]
    h.turn("p", lead[:-1], [5, 6])
    shared = lead + ids(2, 100)  # the task preamble both subagents get
    first, second = shared + ids(3, 50), shared + ids(4, 80)
    fork = dict(parent_branch="main", fork_point_tokens=len(lead))
    h.turn("p", first, [7], branch="w1", **fork)
    h.turn("p", second, [8, 9], branch="w2", **fork)
    assert h.cache.adopted_tokens == 0
    owners = {len(n.key): n.agent.owner for n in h.cache.tree_core.all_nodes()[1:]}
    assert owners[100] == BranchKey(NS, "p", "w1")
    return fork, second


def test_closing_a_sibling_keeps_the_node_an_offloaded_branchs_host_copies_hang_from():
    """The second subagent is offloaded into HiCache, then the first closes: the preamble it owns is
    terminated, but the second's host nodes hang from it, so it is not deleted; the second comes
    back whole, its own tokens from host."""
    h = Harness(pool_tokens=2048, hicache=HOST)
    fork, second = _subagents_sharing_a_preamble(h)
    assert h.pause("p", branch="w2", force=PauseAction.OFFLOAD)["moved_tokens"] == 80 + 1
    with h.driver.activated():
        closed = h.cache.close_branch(BranchKey(NS, "p", "w1"))
    assert closed["closed"] and closed["freed_tokens"] == 50 + 1 - 1  # its own leaf, not the preamble
    h.driver.step()
    h.assert_clean()
    again = h.turn("p", second + [8, 9], [1], branch="w2", **fork)
    assert again.cached_tokens == len(second) + 1 and again.host_loaded_length == 80 + 1  # from host, not recomputed
    h.assert_clean()


def test_offloading_the_owner_of_a_shared_node_keeps_the_other_offloaded_branch_whole():
    """w2 is offloaded first (its host nodes hang from w1's preamble). When w1 is offloaded too, the
    preamble goes to host with it (nothing on the device continues it): w2's next call loads
    preamble and suffix back, nothing is recomputed."""
    h = Harness(pool_tokens=2048, hicache=HOST)
    fork, second = _subagents_sharing_a_preamble(h)
    assert h.pause("p", branch="w2", force=PauseAction.OFFLOAD)["moved_tokens"] == 80 + 1
    w1 = h.pause("p", branch="w1", force=PauseAction.OFFLOAD)
    assert w1["moved_tokens"] == w1["tokens"] == 50 + 100  # its own suffix and the preamble it owns
    again = h.turn("p", second + [8, 9], [1], branch="w2", **fork)
    assert again.cached_tokens == len(second) + 1 and again.host_loaded_length == 100 + 80 + 1
    h.assert_clean()


def _two_node_branch(h: Harness) -> list[int]:
    """Branch ``l``: a 300-token call, then one that continues it by 20 tokens; its movable suffix is
    two nodes, [268, 21]. Returns the second call's prompt."""
    prompt = ids(0, 300)
    h.turn("l", prompt, [3])
    second = prompt + [3] + ids(700, 20)
    h.turn("l", second, [4])
    chain = movable_suffix(h.cache.tree_core, BranchKey(NS, "l", "main"))
    assert [len(n.key) for n in chain] == [300 - STABLE, 21]
    return second


def test_an_offload_stops_at_a_node_locked_after_its_suffix_was_taken(monkeypatch):
    """Issue #22 item 14: a node of the suffix locked between the walk and the move (as a request
    admitted meanwhile does) stays on the device; the offload moves what is below it, counts the
    partial offload, and the branch still comes back whole (the head from the device, the tail from
    host)."""
    import sgl_agentcache.server.scheduler.pauses as pauses_module

    h = Harness(hicache=HOST)
    second = _two_node_branch(h)
    held, demote = {}, pauses_module.demote_chain

    def lock_then_demote(cache, chain):
        held["lock"] = cache.lock(chain[0].id)
        return demote(cache, chain)

    monkeypatch.setattr(pauses_module, "demote_chain", lock_then_demote)
    result = h.pause("l", force=PauseAction.OFFLOAD)
    assert result["action"] == "offload" and result["tokens"] == 300 - STABLE + 21
    assert result["moved_tokens"] == 21 and h.cache.pauses.counters["offload_partial"] == 1
    assert h.device_tokens("l") == 300 - STABLE and h.host_tokens("l") == 21
    with h.driver.activated():
        h.cache.unlock(held["lock"])
    h.assert_clean()
    again = h.turn("l", second + [4], [5])
    assert again.cached_tokens == 321 and again.host_loaded_length == 21
    h.assert_clean()


def test_an_offload_that_finds_no_host_room_for_all_of_it_leaves_the_rest_on_the_device():
    """HiCache's host pool (64 tokens) holds only the suffix's newest node (21): the offload demotes
    that, stops at the node it cannot back up (268), counts the partial offload, and the branch
    still comes back whole (the head from the device, the tail from host); another paused branch's
    host copy is not thrown out for a backup that cannot fit."""
    h = Harness(hicache=64)
    h.turn("x", ids(5, STABLE + 30), [3])
    assert h.pause("x", force=PauseAction.OFFLOAD)["moved_tokens"] == 30
    second = _two_node_branch(h)
    result = h.pause("l", force=PauseAction.OFFLOAD)
    assert result["action"] == "offload" and result["moved_tokens"] == 21
    assert h.cache.pauses.counters["offload_partial"] == 1
    assert h.device_tokens("l") == 300 - STABLE
    assert h.host_tokens("l") == 21 and h.host_tokens("x") == 30  # neither protected copy pushed out
    again = h.turn("l", second + [4], [5])
    assert again.cached_tokens == 321 and again.host_loaded_length == 21
    h.assert_clean()


# ---- prefetch, hysteresis, stats ----


def test_prefetch_used_wasted_budget_and_auto_off():
    h = Harness(hicache=4096, prefetch_budget_tokens=400, prefetch_window=8, prefetch_probe_every=4)
    prompt = ids(0, 300)
    h.turn("u", prompt, [3])
    h.pause("u", force=PauseAction.OFFLOAD)
    got = h.call("prefetch_branch", "u")
    assert got["prefetched"] is True and got["restored_tokens"] == 300 - STABLE
    assert h.device_tokens("u") == 300 - STABLE  # back on the device before the request
    used = h.turn("u", prompt + [3], [4])
    assert used.cached_tokens == 300 and used.host_loaded_length == 0  # nothing left to load at admission
    assert h.cache.pauses.prefetch["used"] == 1
    assert h.cache.pauses.prefetch["tokens_used"] == 300 - STABLE

    # Over budget: two branches' prefetches together exceed 400 unused speculative tokens.
    for s in ("v", "w"):
        h.turn(s, ids(500 if s == "v" else 800, 300), [3])
        h.pause(s, force=PauseAction.OFFLOAD)
    assert h.call("prefetch_branch", "v")["prefetched"] is True
    assert "budget" in h.call("prefetch_branch", "w")["reason"]
    assert h.cache.pauses.prefetch["refused_budget"] == 1
    h.call("expire", "v")  # the tool never came back: the prefetch was wasted
    assert h.cache.pauses.prefetch["wasted"] == 1
    assert h.call("prefetch_branch", "nobody")["prefetched"] is False

    # Precision collapses: after enough wasted prefetches, prefetch turns itself off, except for
    # every probe_every-th attempt (a probe, so that it can turn back on).
    issued = h.cache.pauses.prefetch["issued"]
    for i in range(8):
        h.turn(f"z{i}", ids(1100 + 50 * i, 200), [3])
        h.pause(f"z{i}", force=PauseAction.OFFLOAD)
        h.call("prefetch_branch", f"z{i}")
        h.call("expire", f"z{i}")
    refused = h.cache.pauses.prefetch["refused_disabled"]
    assert refused >= 5 and h.cache.pauses.prefetch["issued"] - issued == 8 - refused
    assert h.cache.agent_stats()["pauses"]["prefetch"]["precision"] < 0.5
    h.assert_clean()


def test_prefetch_needs_hicache():
    """Without a host tier nothing is on host to prefetch: refused, counted, nothing moves."""
    h = Harness()
    h.turn("n", ids(0, 300), [3])
    h.pause("n", force=PauseAction.KEEP)
    got = h.call("prefetch_branch", "n")
    assert got["prefetched"] is False and h.cache.pauses.prefetch["refused_nothing"] == 1
    assert h.cache.pauses.prefetch["issued"] == 0
    h.assert_clean()


def test_repeated_pause_is_held_by_hysteresis_and_stats_report_it():
    """A pause of a branch that is already paused re-evaluates it against the previous decision (the
    incumbent); an offloaded branch with nothing left on the device keeps its pause as it is."""
    h = Harness(hicache=HOST, bytes_per_token=36 * 1024)
    h.turn("k", ids(1, 300), [3])
    assert h.pause("k", latency=PointMass(0.05), tool_class="grep")["action"] == "keep"
    again = h.pause("k", latency=PointMass(0.05), tool_class="grep")
    assert again["action"] == "keep" and again["paused"]
    record = h.cache.pauses.records[BranchKey(NS, "k", "main")]
    assert record.decision.inputs.previous.action is PauseAction.KEEP  # decided against the incumbent
    assert list(h.cache.pauses.kept) == [BranchKey(NS, "k", "main")]

    h.turn("h", ids(0, 300), [3])
    first = h.pause("h", latency=LogNormal(60.0, 1.5))
    assert first["action"] == "offload" and first["moved_tokens"] > 0
    host_free = h.host_free()
    second = h.pause("h", latency=LogNormal(60.0, 1.5))
    assert second["paused"] and second["action"] == "none" and second["tokens"] == 0  # nothing on the device
    assert h.host_free() == host_free and h.cache.pauses.advice[BranchKey(NS, "h", "main")] is PauseAction.OFFLOAD
    stats = h.cache.agent_stats()["pauses"]
    assert stats["paused_branches"] == 2 and stats["paused_by_placement"]["device"] == 2
    assert stats["kept_branches"] == 1 and stats["decisions"]["keep"] == 2 and stats["decisions"]["offload"] == 1
    assert stats["hicache_offloaded_tokens"] == first["moved_tokens"] and stats["too_small"] == 1
    assert stats["recent_decisions"][-1]["action"] == "offload" and not stats["settings"]["lazy"]
    h.assert_clean()
