"""Tool pauses on the real cache (offline driver, SGLang's CPU pools), eager mode: keep / offload /
discard / release carried out at the pause, the host tier's byte-exact round trip, caps, prefetch
accounting and every fault path. (The default, lazy mode -- a decision is advice to eviction and the
node spill -- is tested in ``test_lazy_pauses.py``; these mechanisms serve eager mode, forced actions
and the replayed baselines.)

Each test ends with the integrity check and a leak check: device free + cached == pool, the host tier
holds exactly what the pause book says, and nothing a closed or released branch owned remains.
"""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.distributions import LogNormal, PointMass
from sgl_agentcache.policy.pause import PauseAction
from sgl_agentcache.server.offline import OfflineDriver, build_offline_cache
from sgl_agentcache.server.request_state import state_of

NS = namespace_key(None, None)
STABLE = 32


def hint(session: str, branch: str = "main", **extra) -> dict:
    return {"session": session, "branch": branch, "stable_prefix_tokens": STABLE, **extra}


class Harness:
    def __init__(self, pool_tokens: int = 1024, page_size: int = 1, spill: bool = False, **settings):
        self.cache = build_offline_cache(pool_tokens=pool_tokens, page_size=page_size)
        self.cache.set_host_spill(spill)  # the host tier holds pause copies only, as the checks below expect
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
        """Pause, then run the scheduler's next step, where an offload's copy (made by a worker
        thread, ``AGENTCACHE_ASYNC_OFFLOAD``) lands and the suffix is freed."""
        with self.driver.activated():
            result = self.cache.pauses.pause(BranchKey(NS, session, branch), **kwargs)
            self.cache.flush_pending_backups()
        return result

    def call(self, method: str, session: str, branch: str = "main") -> dict:
        with self.driver.activated():
            return getattr(self.cache.pauses, method)(BranchKey(NS, session, branch))

    def assert_clean(self) -> None:
        report = self.driver.check()
        assert report.ok, report
        host = self.cache.pauses.host
        assert host.used_tokens == sum(e.num_tokens for e in host.entries.values())
        assert set(host.entries) <= set(self.cache.pauses.records)
        anchored = sum(1 for e in host.entries.values() if e.anchor is not None)
        assert sum(self.cache.copies.anchors.values()) == anchored  # every anchor belongs to a live copy


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids in [3, 400), a different sequence for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def test_offload_frees_device_and_restore_is_byte_exact():
    h = Harness()
    prompt = ids(0, 300)
    first = h.turn("s", prompt, [7, 8, 9], stamp=1000.0)
    resident = h.cache.resident_tokens_by_class()
    free_before = h.driver.free_tokens()
    result = h.pause("s", force=PauseAction.OFFLOAD)
    moved = 300 + 2 - STABLE  # the prompt and the outputs with KV, past the shared stable prefix
    assert result["action"] == "offload" and result["tokens"] == moved
    assert h.driver.free_tokens() == free_before + moved
    assert h.cache.resident_tokens_by_class()["session"] == resident["session"] - moved
    assert h.cache.pauses.host.used_tokens == moved and h.cache.pauses.host.used_bytes > 0
    h.assert_clean()

    second = h.turn("s", prompt + [7, 8, 9] + ids(500, 20), [11], capture=300)  # the tool returned
    assert second.cached_tokens == 300 + 2  # the whole retained prefix, restored from host
    assert len(second.captured) == 2  # K and V of the one layer, each exactly as written before the pause
    assert all(torch.equal(kv, torch.arange(300.0) + 1000.0) for kv in second.captured)
    assert h.cache.pauses.host.used_tokens == 0 and not h.cache.pauses.records
    assert h.cache.pauses.counters["restores"] == 1
    assert h.cache.resident_tokens_by_class()["session"] >= resident["session"]
    del first
    h.assert_clean()


def test_paged_pool_round_trip():
    h = Harness(page_size=4)
    prompt = ids(3, 203)
    h.turn("p", prompt, [5, 6])
    result = h.pause("p", force=PauseAction.OFFLOAD)
    assert result["tokens"] % 4 == 0 and result["tokens"] > 0
    again = h.turn("p", prompt + [5, 6] + ids(900, 9), [1])
    assert again.cached_tokens == (203 + 1) // 4 * 4
    h.assert_clean()


def test_discard_frees_now_and_the_next_call_recomputes():
    h = Harness()
    prompt = ids(10, 250)
    h.turn("d", prompt, [4, 5])
    result = h.pause("d", force=PauseAction.DISCARD)
    assert result["action"] == "discard" and result["tokens"] == 250 + 1 - STABLE
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "d", "main")) == 0
    again = h.turn("d", prompt + [4, 5], [6])
    assert again.cached_tokens == STABLE
    h.assert_clean()


def test_keep_pins_the_branch_above_everything_unpinned():
    h = Harness(pool_tokens=1024)
    kept_prompt = ids(20, 300)
    h.turn("k", kept_prompt, [3, 4])
    assert h.pause("k", force=PauseAction.KEEP)["action"] == "keep"
    for i in range(6):  # unrelated sessions, each with its own stable prefix, fill the pool many times
        h.turn(f"other{i}", ids(1000 + 97 * i, 300), [9], stable_prefix_tokens=300)
    again = h.turn("k", kept_prompt + [3, 4], [5])
    assert again.cached_tokens == 300 + 1  # still all there: pinned above stable prefixes
    assert not h.cache.pauses.kept  # the request resumed it: unpinned
    h.assert_clean()


def test_keep_beyond_the_namespace_cap_is_clipped_to_offload():
    h = Harness(max_kept_branches=1)
    h.turn("a", ids(0, 200), [3])
    h.turn("b", ids(300, 200), [3])
    assert h.pause("a", force=PauseAction.KEEP)["action"] == "keep"
    clipped = h.pause("b", force=PauseAction.KEEP)
    assert clipped["decided"] == "keep" and clipped["action"] == "offload"
    assert h.cache.pauses.counters["kept_clipped"] == 1
    h.assert_clean()


def test_policy_keeps_a_short_tool_and_offloads_a_long_tailed_one():
    h = Harness(bytes_per_token=36 * 1024)  # priced as the seed's 36 KiB/token model
    h.turn("fast", ids(0, 300), [3])
    h.turn("slow", ids(400, 300), [3])
    fast = h.pause("fast", latency=PointMass(0.05), tool_class="grep")
    slow = h.pause("slow", latency=LogNormal(60.0, 1.5), tool_class="ci_run")
    assert fast["action"] == "keep", fast
    assert slow["action"] == "offload", slow
    assert set(slow["costs"]) == {"keep", "offload", "discard"} and slow["inputs"]["retained_tokens"] > 0
    assert h.cache.pauses.counters["decisions"]["keep"] == 1
    h.assert_clean()


def test_tenant_caps_only_lower_the_server_caps():
    h = Harness(max_kept_branches=4)
    for i, name in enumerate("abc"):
        h.turn(name, ids(100 * i, 200), [3])
    caps = {"max_kept_branches": 1}
    assert h.pause("a", force=PauseAction.KEEP, caps=caps)["action"] == "keep"
    assert h.pause("b", force=PauseAction.KEEP, caps=caps)["action"] == "offload"  # the tenant's cap
    assert h.pause("c", force=PauseAction.KEEP, caps={"max_kept_branches": 99})["action"] == "keep"
    assert h.cache.pauses._cap("max_kept_branches", {"max_kept_branches": 99}) == 4  # never raised
    h.assert_clean()


def test_measured_bandwidth_enters_decisions_only_as_relayed_message_data():
    h = Harness(bytes_per_token=36 * 1024)
    book = h.cache.pauses
    for i in range(5):  # enough copies in both directions to trust the measurement
        h.turn(f"s{i}", ids(500 + i, 300), [3])
        assert h.pause(f"s{i}", force=PauseAction.OFFLOAD)["action"] == "offload"
        assert h.call("resume", f"s{i}")["resumed"]
    measured = book.measured()
    assert set(measured) == {"d2h_bytes_per_s", "h2d_bytes_per_s"} and min(measured.values()) > 0
    h.turn("x", ids(900, 300), [3])
    branch = BranchKey(NS, "x", "main")
    slow = {"h2d_bytes_per_s": 1e3, "d2h_bytes_per_s": 1e3}  # as if rank 0 had measured a crawl
    with h.driver.activated():
        book.settings.use_measured_bandwidth = False
        assert book.inputs(branch, PointMass(5.0), measured=slow).h2d_bandwidth_Bps == book.settings.h2d_bytes_per_s
        book.settings.use_measured_bandwidth = True
        assert book.inputs(branch, PointMass(5.0)).h2d_bandwidth_Bps == book.settings.h2d_bytes_per_s  # none sent
        assert book.inputs(branch, PointMass(5.0), measured=slow).h2d_bandwidth_Bps == 1e3
        decided = book.pause(branch, LogNormal(60.0, 1.5), tool_class="ci_run", measured=slow)
    assert decided["inputs"]["bandwidth_source"] == "measured" and decided["action"] != "offload", decided
    assert "measured" in decided
    h.assert_clean()


def test_release_below_min_tokens_and_expire_releases_every_tier():
    h = Harness()
    h.turn("tiny", ids(0, STABLE + 20), [3])
    owned = h.cache.tree_core.owned_tokens(BranchKey(NS, "tiny", "main"))
    small = h.pause("tiny", latency=LogNormal(5.0, 1.0))  # 20 tokens < min_tokens: not worth a decision
    assert small["action"] == "none" and not small["paused"]
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "tiny", "main")) == owned  # left to eviction
    assert h.cache.pauses.counters["too_small"] == 1 and not h.cache.pauses.records

    h.turn("e", ids(100, 300), [3])
    h.pause("e", force=PauseAction.OFFLOAD)
    assert h.cache.pauses.host.used_tokens > 0
    result = h.call("expire", "e")
    assert result["expired"] and result["freed_tokens"] > 0
    assert h.cache.pauses.host.used_tokens == 0 and not h.cache.pauses.records
    assert h.cache.tree_core.owned_tokens(BranchKey(NS, "e", "main")) == 0
    assert h.cache.pauses.counters["deadline_releases"] == 1
    assert h.call("expire", "e")["expired"] is False  # idempotent
    h.assert_clean()


def test_close_deletes_the_host_copy():
    h = Harness()
    h.turn("c", ids(0, 300), [3])
    h.pause("c", force=PauseAction.OFFLOAD)
    with h.driver.activated():
        closed = h.cache.close_branch(BranchKey(NS, "c", "main"))
    assert closed["host_freed_tokens"] > 0
    assert h.cache.pauses.host.used_tokens == 0 and not h.cache.pauses.records
    assert h.pause("c", force=PauseAction.OFFLOAD)["paused"] is False  # closed stays closed
    h.assert_clean()


def test_host_full_falls_back_to_discard():
    h = Harness()
    h.cache.pauses.host.capacity_tokens = 100
    h.turn("f", ids(0, 300), [3])
    result = h.pause("f", force=PauseAction.OFFLOAD)
    assert result["decided"] == "offload" and result["action"] == "discard"
    assert h.cache.pauses.counters["offload_fallbacks"]["host_full"] == 1
    assert h.cache.pauses.host.used_tokens == 0
    h.assert_clean()


@pytest.mark.parametrize("kind", ["demote", "promote"])
@pytest.mark.parametrize("async_offload", [False, True], ids=["sync", "async"])
def test_failed_transfers_fall_back_to_recompute(kind, async_offload):
    """A failed device->host copy discards the branch: at once when the copy runs in the pause, when it
    lands (the next step) when a worker made it -- the pause has answered "offload" by then."""
    h = Harness()
    h.cache.copies.async_offload = async_offload
    prompt = ids(0, 300)
    h.turn("x", prompt, [3])
    h.cache.pauses.host.fail_next(kind)
    result = h.pause("x", force=PauseAction.OFFLOAD)  # the harness runs the next step: it has landed
    placement = h.cache.pauses.records[BranchKey(NS, "x", "main")].placement.value
    again = h.turn("x", prompt + [3], [4])
    assert again.cached_tokens == STABLE  # recomputed, correctly
    if kind == "demote":
        assert result["action"] == ("offload" if async_offload else "discard") and placement == "none"
        assert h.cache.pauses.counters["offload_fallbacks"]["transfer_failed"] == 1
    else:
        assert result["action"] == "offload"
        assert h.cache.pauses.counters["restore_failures"]["transfer_failed"] == 1
    assert h.cache.pauses.host.used_tokens == 0
    h.assert_clean()


def _raise_once(target, name: str, *, after: bool = False):
    """Make ``target.name`` raise a RuntimeError on its next call (``after``: once the real call has
    done its work, as an insert failing part-way would), then behave normally again."""
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


@pytest.mark.parametrize("where", ["promote", "insert", "insert-after", "restore"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_any_failure_of_a_restore_in_the_match_falls_back_to_recompute(where, async_load):
    """Issue #22 item 10: a restore runs inside the scheduler's match (``match_prefix``), and only a
    ``TransferError`` was handled there: ``promote``'s ``ValueError``, a failing re-insert or anything
    else reached the scheduler, which dies with every request. Each now leaves the request to
    recompute, drops the copy, ends the pause, leaks no slot, and the next turn works. ``async_load``:
    the copy back is made by a worker between two matches (``AGENTCACHE_ASYNC_LOAD``)."""
    h = Harness()
    h.cache.loads.enabled = async_load
    pauses = h.cache.pauses
    prompt = ids(0, 300)
    h.turn("u", prompt, [3])
    assert h.pause("u", force=PauseAction.OFFLOAD)["action"] == "offload"
    if where == "promote":  # a bare ValueError, raised before the copy (promote's own length check)
        pauses.host.fail_next("promote", unexpected=True)
    elif where == "restore":  # anything at all, caught by match_prefix itself
        armed = _raise_once(pauses.copies, "prepare_restore" if async_load else "restore")
    else:
        armed = _raise_once(h.cache, "insert", after=where == "insert-after")
    again = h.turn("u", prompt + [3], [4])
    # Recomputed; except that an insert which did its work before raising left its nodes in the tree
    # (their KV had been copied back whole): the tree keeps those slots, only the others are freed.
    assert again.cached_tokens == (300 if where == "insert-after" else STABLE)
    if where != "promote":
        assert not armed["armed"]  # the failure was really injected
    failures = pauses.counters["restore_failures"]
    assert (failures["transfer_failed"], failures["error"]) == ((1, 0) if where == "promote" else (0, 1))
    assert pauses.host.used_tokens == 0 and not pauses.records
    h.assert_clean()
    assert h.driver.idle_free_tokens() == h.driver.pool_tokens  # no slot leaked, none freed twice
    h.pause("u", force=PauseAction.OFFLOAD)  # and the branch pauses and restores normally afterwards
    last = h.turn("u", prompt + [3, 4], [5])
    assert last.cached_tokens == 300 + 1 and pauses.counters["restores"] == 1  # all it has KV for
    h.assert_clean()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_failing_restore_of_a_paused_lead_for_its_fork_leaves_the_lead_paused_without_a_copy(async_load):
    """The fork's deferred restore of its paused lead's history raises: the fork recomputes, the lead
    stays paused (its tool still runs) with nothing on host."""
    h = Harness()
    h.cache.loads.enabled = async_load
    pauses = h.cache.pauses
    lead = ids(0, 200)
    h.turn("p", lead, [3, 4])
    h.pause("p", force=PauseAction.OFFLOAD)
    armed = _raise_once(pauses.copies, "prepare_restore") if async_load else _raise_once(pauses, "restore_for_fork")
    fork = h.turn("p", lead + [3, 4] + ids(900, 20), [7], branch="w", parent_branch="main",
                  fork_point_tokens=len(lead) + 2)
    assert not armed["armed"] and fork.cached_tokens == STABLE
    record = pauses.records[BranchKey(NS, "p", "main")]
    assert record.placement.value == "none" and pauses.host.used_tokens == 0
    assert pauses.counters["restore_failures"]["error"] == 1
    h.assert_clean()


def test_restore_with_its_prefix_gone_recomputes():
    h = Harness(pool_tokens=1024)
    prompt = ids(0, 300)
    h.turn("g", prompt, [3])
    h.pause("g", force=PauseAction.OFFLOAD)
    h.cache.pauses.host.capacity_tokens = h.cache.pauses.host.used_tokens  # no room to spill the prefix
    with h.driver.activated():  # the stable prefix the suffix hangs from is evicted meanwhile
        h.cache.evict(EvictParams(num_tokens=1024))
    assert h.cache.pauses.counters["anchor_spill_refused"]["host_full"] == 1
    again = h.turn("g", prompt + [3], [4])
    assert again.cached_tokens == 0
    assert h.cache.pauses.counters["restore_failures"]["gap"] == 1
    h.assert_clean()


def test_prefetch_used_wasted_budget_and_auto_off():
    h = Harness(prefetch_budget_tokens=400, prefetch_window=8, prefetch_probe_every=4)
    prompt = ids(0, 300)
    h.turn("u", prompt, [3])
    h.pause("u", force=PauseAction.OFFLOAD)
    assert h.call("prefetch_branch", "u")["prefetched"] is True
    used = h.turn("u", prompt + [3], [4])
    assert used.cached_tokens == 300
    assert h.cache.pauses.prefetch["used"] == 1

    # Over budget: two branches' prefetches together exceed 400 unused speculative tokens.
    for s in ("v", "w"):
        h.turn(s, ids(500 if s == "v" else 800, 300), [3])
        h.pause(s, force=PauseAction.OFFLOAD)
    assert h.call("prefetch_branch", "v")["prefetched"] is True
    assert "budget" in h.call("prefetch_branch", "w")["reason"]
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


def test_repeated_pause_is_held_by_hysteresis_and_stats_report_it():
    h = Harness(bytes_per_token=36 * 1024)
    h.turn("h", ids(0, 300), [3])
    first = h.pause("h", latency=LogNormal(60.0, 1.5))
    second = h.pause("h", latency=LogNormal(60.0, 1.5))
    assert first["action"] == second["action"] == "offload"
    stats = h.cache.agent_stats()["pauses"]
    assert stats["paused_branches"] == 1 and stats["paused_by_placement"]["host"] == 1
    assert stats["host"]["demote"]["count"] == 1  # the second evaluation moved nothing
    assert stats["recent_decisions"][-1]["action"] == "offload"
    h.assert_clean()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_subagent_restore_brings_back_its_paused_leads_history_first(async_load):
    """A lead is offloaded, a subagent forked from it runs and is offloaded too, then everything
    evictable leaves the device. The subagent's next request brings the lead's copy back first (the
    lead is still paused: its copy stays on host), then its own on top. ``async_load``: each copy is
    made by a worker, one per admission match (the lead's, then the subagent's)."""
    h = Harness(pool_tokens=2048)
    h.cache.loads.enabled = async_load
    lead_prompt = ids(1, 400)
    h.turn("p", lead_prompt, [5, 6])
    lead = lead_prompt + [5, 6]
    assert h.pause("p", force=PauseAction.OFFLOAD)["tokens"] == 400 + 1 - STABLE
    fork_prompt = lead + ids(2, 200)
    h.turn("p", fork_prompt, [7, 8], branch="w", parent_branch="main", fork_point_tokens=len(lead))
    assert h.cache.pauses.counters["fork_restores"] == 1  # the fork needed the lead's history
    assert h.pause("p", branch="w", force=PauseAction.OFFLOAD)["tokens"] > 0
    with h.driver.activated():  # pressure: everything but the stable prefix (the last leaf) goes,
        h.cache.evict(EvictParams(num_tokens=h.cache.evictable_size() - STABLE))  # anchor included
    again = h.turn("p", fork_prompt + [7, 8], [9], branch="w", parent_branch="main", fork_point_tokens=len(lead))
    # The lead's last output token (inserted by the fork, past the lead's own copy) came back from the
    # subagent's lead-in: without it the subagent's copy would have a one-token gap.
    assert again.cached_tokens == len(fork_prompt) + 1  # lead history + the subagent's own, all restored
    assert h.cache.pauses.counters["fork_restores"] == 2 and h.cache.pauses.counters["restore_failures"]["gap"] == 0
    assert h.cache.pauses.host.tokens_of(BranchKey(NS, "p", "main")) == 400 + 1 - STABLE  # still paused
    h.assert_clean()


def test_a_copy_hung_from_a_closed_siblings_prefix_is_still_restored():
    """Two subagents share a prefix past their fork point that the first one created (so it owns it).
    The second is offloaded, then the first closes: the shared node is terminated, but the second's
    host copy hangs from it, so it stays until that copy is restored (then reclaimed normally)."""
    h = Harness(pool_tokens=2048)
    lead = ids(1, 300) + [5]
    h.turn("p", lead[:-1], [5, 6])
    shared = lead + ids(2, 100)  # the task preamble both subagents get
    first = shared + ids(3, 50)
    second = shared + ids(4, 80)
    fork = dict(parent_branch="main", fork_point_tokens=len(lead))
    h.turn("p", first, [7], branch="w1", **fork)
    h.turn("p", second, [8, 9], branch="w2", **fork)
    assert h.pause("p", branch="w2", force=PauseAction.OFFLOAD)["action"] == "offload"
    with h.driver.activated():
        assert h.cache.close_branch(BranchKey(NS, "p", "w1"))["closed"]
    h.assert_clean()  # the terminated shared node is an anchor: resident, and not a lagging leaf
    again = h.turn("p", second + [8, 9], [1], branch="w2", **fork)
    assert again.cached_tokens == len(second) + 1  # restored, not recomputed
    assert h.cache.pauses.counters["restore_failures"]["gap"] == 0
    with h.driver.activated():
        h.cache.close_branch(BranchKey(NS, "p", "w2"))
    assert not h.cache.copies.anchors
    h.assert_clean()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_resume_restores_when_the_request_is_matched_for_a_batch_not_when_it_arrives(async_load):
    """Admission (request arrival) marks the pause resuming and leaves the host copy; the copy comes
    back, and the pause ends, when the scheduler admits the request to a batch. Restored at arrival,
    it would sit unlocked while the request waits, in the pool the running batch evicts from.
    ``async_load``: that match issues the copy to a worker (the scheduler skips the request for the
    step, ``admission.around_add_one_req``) and the next match inserts it."""
    from array import array

    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_agentcache.server.offline import OfflineReq

    h = Harness()
    h.cache.loads.enabled = async_load
    prompt = ids(0, 300)
    h.turn("s", prompt, [7, 8])
    owner = BranchKey(NS, "s", "main")
    moved = h.pause("s", force=PauseAction.OFFLOAD)["tokens"]
    follow = prompt + [7, 8] + ids(9, 10)
    envelope = decode_kv_hints_envelope(lifecycle_envelope(hint("s"), message_id="late"))
    req = OfflineReq("late", "", array("q", follow), SamplingParams(max_new_tokens=4), kv_hints=envelope)
    with h.driver.activated():
        assert h.cache.admit(req) is None
        assert h.cache.pauses.records[owner].resuming  # the request is here...
        assert h.cache.pauses.host.tokens_of(owner) == moved  # ...but the copy waits for the batch
        assert h.cache.tree_core.resident_owned_tokens(owner) == 0
        match = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", follow)), req=req))
        # The admission match only notes the host copy; it comes back once the request passed the
        # prefill budget (the plugin's add_one_req hook then matches it again, cleared).
        assert match.device_prefix_len == STABLE and state_of(req).host_pending
        assert h.cache.pauses.host.tokens_of(owner) == moved and not h.cache.loads.pending("late")
        with h.cache.host_loads_cleared(req):
            match = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", follow)), req=req))
        if async_load:
            assert match.device_prefix_len == STABLE and h.cache.loads.pending("late")  # copy in flight
            assert h.cache.pauses.records[owner].resuming
            assert h.cache.loads.in_flight_tokens() == 300 + 1 - STABLE  # neither free nor in the tree
            match = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", follow)), req=req))
            assert not h.cache.loads.pending("late") and h.cache.loads.counters["restores_finished"] == 1
    assert match.device_prefix_len == 300 + 1  # restored, then matched
    assert owner not in h.cache.pauses.records  # the pause is over
    assert h.cache.pauses.host.used_tokens == 0 and h.cache.pauses.counters["restores"] == 1
    h.assert_clean()


def _waiting_request(h: Harness, rid: str, session: str, tokens: list[int]):
    """A hinted request as the scheduler holds it in its waiting queue: admitted, not yet matched."""
    from array import array

    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_agentcache.server.offline import OfflineReq

    envelope = decode_kv_hints_envelope(lifecycle_envelope(hint(session), message_id=rid))
    req = OfflineReq(rid, "", array("q", tokens), SamplingParams(max_new_tokens=4), kv_hints=envelope)
    with h.driver.activated():
        assert h.cache.admit(req) is None
    return req


def _match(h: Harness, req) -> int:
    """The scheduler's match of a waiting request (``init_next_round_input``): prefix tokens found.
    A match that found host copies is run again as the plugin's ``add_one_req`` hook runs it once the
    request passed the prefill budget (these requests always pass; the budget's own tests are in
    test_async_load.py). A match that handed the request's restore to a worker is followed by the next
    step's match, which finishes it (the scheduler skips the request in between)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    with h.driver.activated():
        key = RadixKey(req.origin_input_ids)
        found = h.cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len
        if state_of(req).host_pending:
            with h.cache.host_loads_cleared(req):
                found = h.cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len
        if h.cache.loads.pending(req.rid):
            found = h.cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len
        return found


def test_a_restore_without_room_waits_for_the_requests_next_match():
    """Running requests hold the pool when the resumed request is first matched: its copy stays on host
    (no eviction, no failure) and comes back at a later match, once a request has finished."""
    h = Harness(pool_tokens=1024)
    prompt = ids(60, 300)
    h.turn("w", prompt, [3, 4])
    owner = BranchKey(NS, "w", "main")
    moved = h.pause("w", force=PauseAction.OFFLOAD)["tokens"]
    big = h.driver.admit("big", ids(61, 800), kv_hints=lifecycle_envelope(hint("big"), message_id="mb"))
    req = _waiting_request(h, "late", "w", prompt + [3, 4] + ids(62, 10))

    for _ in range(3):  # the scheduler matches a waiting request again every step
        assert _match(h, req) < 300
    pauses = h.cache.pauses
    assert pauses.records[owner].resuming and pauses.host.tokens_of(owner) == moved
    assert pauses.counters["restores_deferred"] == 3 and pauses.counters["restore_failures"]["no_room"] == 0

    h.driver.finish(big)  # room appears
    assert _match(h, req) == 300 + 1
    assert state_of(req).restores is None and owner not in pauses.records and pauses.host.used_tokens == 0
    assert pauses.counters["restores"] == 1
    h.assert_clean()


def test_a_request_that_runs_without_its_deferred_restore_drops_the_copy_at_release():
    """A scheduler may start a request whose copy found no room (a first chunk of a chunked prefill
    needs less than the copy): it recomputes, and its release ends the pause and drops the copy."""
    h = Harness(pool_tokens=1024)
    prompt = ids(70, 300)
    h.turn("a", prompt, [3, 4])
    owner = BranchKey(NS, "a", "main")
    h.pause("a", force=PauseAction.OFFLOAD)
    big = h.driver.admit("big", ids(71, 800), kv_hints=lifecycle_envelope(hint("big"), message_id="mb"))
    late = h.driver.admit("late", prompt + [3, 4] + ids(72, 10), max_prefill_tokens=64,
                          kv_hints=lifecycle_envelope(hint("a"), message_id="ml"))
    pauses = h.cache.pauses
    assert late.cached_tokens <= STABLE and pauses.records[owner].resuming  # started without the copy
    h.driver.abort(late)
    assert owner not in pauses.records and pauses.host.used_tokens == 0
    assert pauses.counters["restore_failures"]["no_room"] == 1
    h.driver.finish(big)
    h.assert_clean()


def test_an_offload_never_moves_the_node_another_copy_hangs_from():
    """w1 created the preamble both subagents share; w2 is offloaded first (its copy hangs from the
    preamble). When w1 is offloaded too, the preamble stays: moving it would leave w2's copy without
    its prefix."""
    h = Harness(pool_tokens=2048)
    lead = ids(1, 300) + [5]
    h.turn("p", lead[:-1], [5, 6])
    shared = lead + ids(2, 100)
    fork = dict(parent_branch="main", fork_point_tokens=len(lead))
    h.turn("p", shared + ids(3, 50), [7], branch="w1", **fork)
    second = shared + ids(4, 80)
    h.turn("p", second, [8, 9], branch="w2", **fork)
    assert h.pause("p", branch="w2", force=PauseAction.OFFLOAD)["tokens"] == 80 + 1
    assert h.pause("p", branch="w1", force=PauseAction.OFFLOAD)["tokens"] == 50  # not the 100 shared
    again = h.turn("p", second + [8, 9], [1], branch="w2", **fork)
    assert again.cached_tokens == len(second) + 1
    assert h.cache.pauses.counters["restore_failures"]["gap"] == 0
    h.assert_clean()


def test_flush_cache_drops_every_pause_and_host_copy_with_the_tree():
    """``/flush_cache`` (and a weight update) resets the tree: copies hung from it must not outlive it."""
    h = Harness()
    h.turn("off", ids(40, 300), [3, 4])
    h.turn("kept", ids(41, 200), [5])
    h.turn("gone", ids(42, 200), [6])
    assert h.pause("off", force=PauseAction.OFFLOAD)["action"] == "offload"
    assert h.pause("kept", force=PauseAction.KEEP)["action"] == "keep"
    with h.driver.activated():
        h.cache.close_branch(BranchKey(NS, "gone", "main"))
    assert h.cache.pauses.host.used_tokens > 0 and h.cache.copies.anchors

    h.driver.flush_cache()

    pauses = h.cache.pauses
    assert not pauses.records and not pauses.kept and not pauses.copies.anchors
    assert pauses.host.used_tokens == 0 and pauses.host.used_bytes == 0 and not pauses.host.entries
    assert h.driver.free_tokens() == h.driver.pool_tokens
    h.assert_clean()
    again = h.turn("off", ids(40, 300) + [3, 4] + ids(43, 10), [7])  # resumes as a plain recompute
    assert again.cached_tokens == 0 and pauses.counters["restores"] == 0
    assert h.pause("gone", force=PauseAction.OFFLOAD)["paused"] is False  # closed stays closed
    h.assert_clean()


def test_a_restore_that_cannot_make_room_evicts_nothing():
    """Running requests hold most of the pool: evicting every unlocked node would still leave too
    little for the copy, so the restore must fail without taking other branches' KV with it."""
    h = Harness(pool_tokens=1024)
    h.turn("r", ids(50, 300), [3, 4])
    moved = h.pause("r", force=PauseAction.OFFLOAD)["tokens"]
    big = h.driver.admit("big", ids(52, 780), kv_hints=lifecycle_envelope(hint("big"), message_id="mb"))
    h.turn("other", ids(51, 150), [5])
    evictable = h.cache.evictable_size()
    assert 0 < evictable and h.driver.free_tokens() + evictable < moved  # no room, even after evicting all

    assert h.call("resume", "r")["restored_tokens"] == 0
    assert h.cache.pauses.counters["restore_failures"]["no_room"] == 1
    assert h.cache.evictable_size() == evictable  # nothing was evicted for a restore that could not happen
    h.driver.finish(big)
    h.assert_clean()


def _offloaded_subagent(h: Harness, session: str, seed: int, lead_tokens: int, own_tokens: int):
    """A lead's call, a subagent forked at its end (``own_tokens`` of its own), the subagent offloaded.
    Returns the lead's history as the fork copied it, the fork's prompt and the tokens offloaded."""
    lead = ids(seed, lead_tokens) + [5]
    h.turn(session, lead[:-1], [5, 6])
    fork_prompt = lead + ids(seed + 1, own_tokens)
    h.turn(session, fork_prompt, [7, 8], branch="w", parent_branch="main", fork_point_tokens=len(lead))
    moved = h.pause(session, branch="w", force=PauseAction.OFFLOAD)["tokens"]
    return lead, fork_prompt, moved


def _evict_everything(h: Harness) -> None:
    with h.driver.activated():
        h.cache.evict(EvictParams(num_tokens=h.driver.pool_tokens))


def test_when_eviction_takes_the_prefix_a_copy_hangs_from_the_prefix_joins_the_copy():
    """Under pressure stock eviction reaches the anchor too (it ranks like a stable prefix, so only
    after every lower-ranked leaf). Instead of leaving the copy with a gap, each node it takes is copied
    in front of the copy, which then hangs from the node's parent: evict *everything*, and a paused
    subagent still comes back whole, its lead's history included, with the lead's class and owner."""
    h = Harness(pool_tokens=2048)  # a fork's quota is a quarter of the pool: 512 tokens, room for all
    lead, fork_prompt, moved = _offloaded_subagent(h, "s", 80, 300, 100)
    worker = BranchKey(NS, "s", "w")
    pauses = h.cache.pauses
    assert pauses.copies.anchors and pauses.host.tokens_of(worker) == moved
    _evict_everything(h)  # nothing evictable is left
    assert h.cache.evictable_size() == 0 and not pauses.copies.anchors  # the copy now starts at token 0
    entry = pauses.host.entries[worker]
    assert entry.start == 0 and pauses.host.tokens_of(worker) == len(fork_prompt) + 1
    assert pauses.counters["anchor_spills"] >= 2
    assert pauses.counters["anchor_spilled_tokens"] == len(fork_prompt) + 1 - moved
    h.assert_clean()

    again = h.turn("s", fork_prompt + [7, 8], [9], branch="w", parent_branch="main", fork_point_tokens=len(lead))
    assert again.cached_tokens == len(fork_prompt) + 1 and pauses.counters["restore_failures"]["gap"] == 0
    lead_owner = BranchKey(NS, "s", "main")
    assert h.cache.tree_core.owned_tokens(lead_owner) > 0  # the lead's history is the lead's again
    assert h.cache.resident_tokens_by_class()["stable"] >= STABLE
    h.assert_clean()


def test_an_anchor_spill_over_the_branch_quota_is_refused():
    """Host tokens count toward a branch's quota: a spill that would take the branch over it leaves the
    copy as it was (it will gap, and recompute), and is counted."""
    h = Harness(pool_tokens=2048)
    _, _, moved = _offloaded_subagent(h, "q", 82, 400, 150)
    worker = BranchKey(NS, "q", "w")
    h.cache.quotas.put(worker, moved + 10)  # no room in the quota for the lead's history
    _evict_everything(h)
    pauses = h.cache.pauses
    assert pauses.host.tokens_of(worker) == moved and pauses.counters["anchor_spill_refused"]["quota"] >= 1
    assert pauses.counters["anchor_spilled_tokens"] == 0
    h.assert_clean()


def test_copies_hanging_from_one_node_share_its_spilled_kv():
    """Two subagents forked at the same point, both offloaded: when eviction takes their lead's history,
    it is copied to host once per node and shared by both copies; each still comes back whole."""
    h = Harness(pool_tokens=2048)
    lead = ids(84, 300) + [5]
    h.turn("t", lead[:-1], [5, 6])
    prompts = {w: lead + ids(85 + i, 60) for i, w in enumerate(("w1", "w2"))}
    for w, prompt in prompts.items():
        h.turn("t", prompt, [7, 8], branch=w, parent_branch="main", fork_point_tokens=len(lead))
        h.pause("t", branch=w, force=PauseAction.OFFLOAD)
    pauses = h.cache.pauses
    demoted = pauses.host.demotes.tokens
    _evict_everything(h)
    spilled = pauses.counters["anchor_spilled_tokens"]
    copied = pauses.counters["anchor_spill_copied_tokens"]
    assert spilled > 0 and pauses.host.demotes.tokens - demoted == copied == spilled // 2  # one transfer, two copies
    assert all(pauses.host.entries[BranchKey(NS, "t", w)].start == 0 for w in prompts)
    h.assert_clean()
    for w, prompt in prompts.items():
        again = h.turn("t", prompt + [7, 8], [9], branch=w, parent_branch="main", fork_point_tokens=len(lead))
        assert again.cached_tokens == len(prompt) + 1
    h.assert_clean()


def test_discarding_a_lead_spills_the_node_its_subagents_copy_hangs_from():
    """Not only stock eviction: when the lead's own pause frees its nodes (DISCARD), the node a
    paused subagent's copy hangs from goes into that copy first, so the subagent still resumes whole."""
    h = Harness(pool_tokens=2048)
    lead, fork_prompt, _ = _offloaded_subagent(h, "d", 90, 300, 80)
    assert h.pause("d", force=PauseAction.DISCARD)["tokens"] > 0  # the lead's history leaves the device
    pauses = h.cache.pauses
    assert pauses.counters["anchor_spilled_tokens"] > 0 and pauses.counters["anchor_spills"] >= 1
    again = h.turn("d", fork_prompt + [7, 8], [9], branch="w", parent_branch="main", fork_point_tokens=len(lead))
    assert again.cached_tokens == len(fork_prompt) + 1 and pauses.counters["restore_failures"]["gap"] == 0
    h.assert_clean()


@pytest.mark.parametrize("async_offload", [False, True], ids=["sync", "async"])
def test_an_offload_that_frees_less_than_it_copied_is_handled_not_asserted(async_offload):
    """Issue #22 item 14: ``assert freed == moved`` ran in the serving path (an offload): a node of the
    suffix locked between the copy and the eviction -- as HiCache's backup in flight does -- killed
    the scheduler. The offload now frees what it can, counts the rest, keeps the copy whole, and the
    restore copies back only what the device lost."""
    h = Harness()
    pauses, prompt = h.cache.pauses, ids(0, 300)
    h.turn("l", prompt, [3])
    second = prompt + [3] + ids(700, 20)
    h.turn("l", second, [4])
    branch = BranchKey(NS, "l", "main")
    chain = pauses.copies.movable_suffix(branch)
    assert [len(n.key) for n in chain] == [300 - STABLE, 21]
    free_before, held = h.driver.free_tokens(), {}
    if async_offload:  # the copy is in flight; something locks the suffix's top node before it lands
        with h.driver.activated():
            result = pauses.pause(branch, force=PauseAction.OFFLOAD)
            held["lock"] = h.cache.lock(chain[0].id)
            h.cache.flush_pending_backups()
    else:
        pauses.copies.async_offload = False
        demote = pauses.host.demote

        def demote_then_lock(*args, **kwargs):  # the copy works, then something locks the suffix's top
            entry = demote(*args, **kwargs)
            held["lock"] = h.cache.lock(chain[0].id)
            return entry

        pauses.host.demote = demote_then_lock
        result = h.pause("l", force=PauseAction.OFFLOAD)
        pauses.host.demote = demote
    assert result["action"] == "offload" and pauses.counters["offload_partial"] == 1
    assert h.driver.free_tokens() == free_before + 21  # the unlocked leaf left the device, the top stayed
    assert pauses.host.tokens_of(branch) == 300 - STABLE + 21  # the copy is whole
    with h.driver.activated():
        h.cache.unlock(held["lock"])
    h.assert_clean()
    again = h.turn("l", second + [4], [5])
    assert again.cached_tokens == 321 and pauses.counters["restores"] == 1
    h.assert_clean()


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_waiting_request_is_restored_when_admitted_not_when_ranked(policy):
    """Issue #22 item 12: with a cache-aware schedule policy the scheduler matches every waiting request
    at every step to rank the queue (SchedulePolicy.calc_priority), and each of those matches ran the
    request's restore: KV copied back for requests that then kept waiting, unlocked, in the pool the
    running batch evicts from. Ranking matches leave the copy on host now; the admission match brings
    it back."""
    h = Harness()
    pauses = h.cache.pauses
    prompt = ids(0, 300)
    h.turn("w", prompt, [3])
    h.pause("w", force=PauseAction.OFFLOAD)
    on_host = pauses.host.used_tokens
    branch = BranchKey(NS, "w", "main")
    waiting = h.driver.queue("back", prompt + [3] + ids(600, 10),
                             kv_hints=lifecycle_envelope(hint("w"), message_id="back"))
    other = h.driver.queue("other", ids(800, 50))
    for _ in range(3):  # three scheduler steps in which the request is ranked but not admitted
        assert set(h.driver.rank([other, waiting], policy)) == {other, waiting}
    assert pauses.host.used_tokens == on_host and pauses.records[branch].resuming
    assert pauses.counters["restores"] == 0 and h.cache.ranking_deferred == 3
    admitted = h.driver.admit_queued(waiting)  # its admission match restores it
    assert admitted.cached_tokens == 300 and pauses.counters["restores"] == 1
    assert pauses.host.used_tokens == 0 and branch not in pauses.records
    h.driver.finish(admitted)
    h.driver.finish(h.driver.admit_queued(other))
    h.assert_clean()


def test_forks_matched_in_one_step_share_one_worker_restore_of_their_paused_lead():
    """Eager mode, asynchronous restores: two subagents of an offloaded lead reach the scheduler in one
    step. The first one's match issues the copy of the lead's history (the lead stays paused, its copy
    kept on host); the second's is held back instead of recomputing that history, and both hit it at
    their next match. One copy, no recompute of the lead's tokens."""
    h = Harness(pool_tokens=2048)
    loads, pauses = h.cache.loads, h.cache.pauses
    assert loads.enabled
    lead_prompt = ids(1, 400)
    h.turn("p", lead_prompt, [5, 6])
    lead = lead_prompt + [5, 6]
    h.pause("p", force=PauseAction.OFFLOAD)

    def fork(name: str, seed: int):
        envelope = lifecycle_envelope(hint("p", name, parent_branch="main", fork_point_tokens=len(lead)),
                                      message_id=name)
        return h.driver.queue(name, lead + ids(seed, 50), kv_hints=envelope, max_new_tokens=4)

    first, second = fork("wa", 11), fork("wb", 12)
    h.driver.admission_step(first)
    h.driver.admission_step(second)
    assert loads.pending("wa") and loads.waiting == {"wb": 1} and loads.copying_back(BranchKey(NS, "p", "main"))
    with h.driver.activated():  # the next step: the copy lands for the first, the second hits it
        first.init_next_round_input(h.cache)
        second.init_next_round_input(h.cache)
    assert first.prefix_len >= len(lead_prompt) + 1 and second.prefix_len >= len(lead_prompt) + 1
    assert loads.counters["restores_issued"] == loads.counters["restores_finished"] == 1
    assert pauses.counters["fork_restores"] == 1 and not loads.waiting
    record = pauses.records[BranchKey(NS, "p", "main")]
    assert record.placement.value == "host" and pauses.host.tokens_of(BranchKey(NS, "p", "main")) > 0
    for req in (first, second):  # they run: admitted, decode, finish
        h.driver.admit_queued(req)
        h.driver.extend(req, [9])
        h.driver.finish(req)
    h.assert_clean()
