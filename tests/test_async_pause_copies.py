"""Eager pauses' copies made by worker threads, both ways (server/host_copies.py, server/async_load.py).

Offloads (``AGENTCACHE_ASYNC_OFFLOAD``), on the real cache offline (SGLang's CPU pools, the real
allocator's ``get_cpu_copy``): a pause's offload returns before its device->host copy is made; the
suffix stays in the tree, ranked first for eviction, until the copy lands at the scheduler's next step
(``flush_pending_backups``). Eviction that needs the suffix's slots first waits for the copy; a branch
that continues before the copy landed gets its device KV back without any copy; a close, a reset or a
failed copy leaves nothing behind.

Restores (``AGENTCACHE_ASYNC_LOAD``, ``load_cpu_copy``): the resumed request's admission match
allocates the slots and hands the host->device copy to a worker; the scheduler skips the request for
the step and its next match inserts the copy. A close or an abort in between frees the slots.

The allocator is wrapped only to record which thread copied and to hold a copy back (the real copy
runs). Every test ends with the integrity and leak checks of ``test_pauses``. Token ids < 400.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_pauses import NS, STABLE, Harness, hint, ids

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.policy.pause import PauseAction


class GatedCopies:
    """Wraps the allocator's ``get_cpu_copy``: records the copying thread; while ``gate`` is clear, a
    copy waits for it (bounded: a test that forgets to open it fails instead of hanging)."""

    def __init__(self, harness: Harness):
        self.threads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        allocator = harness.cache.token_to_kv_pool_allocator
        real = allocator.get_cpu_copy

        def gated(*args, **kwargs):
            self.threads.append(threading.get_ident())
            self.started.set()
            assert self.gate.wait(timeout=30), "a copy waited for a gate nobody opened"
            return real(*args, **kwargs)

        allocator.get_cpu_copy = gated


def branch(session: str) -> BranchKey:
    return BranchKey(NS, session, "main")


def pause_in_flight(h: Harness, session: str) -> dict:
    """Pause with a forced offload and do *not* run the next step: the copy has not landed."""
    with h.driver.activated():
        return h.cache.pauses.pause(branch(session), force=PauseAction.OFFLOAD)


def test_the_pause_returns_before_the_copy_and_the_copy_lands_at_the_next_step():
    h = Harness()
    copies, pauses = h.cache.copies, h.cache.pauses
    assert copies.async_offload  # the default on a CPU pool
    gated = GatedCopies(h)
    prompt = ids(0, 300)
    h.turn("s", prompt, [7, 8, 9], stamp=1000.0)
    free_before = h.driver.free_tokens()
    gated.gate.clear()
    result = pause_in_flight(h, "s")  # returns while the copy is held back on the worker
    moved = 300 + 2 - STABLE
    assert result["action"] == "offload" and result["tokens"] == moved
    assert gated.started.wait(timeout=30) and gated.threads[0] != threading.get_ident()
    assert pauses.stats()["offload_copies"] == {"async": True, "in_flight": 1, "joined_running": 0}
    assert h.driver.free_tokens() == free_before  # nothing freed before the copy exists
    assert pauses.host.used_tokens == moved  # its room is reserved
    gated.gate.set()
    h.driver.step()  # the scheduler's next step: the copy lands, the suffix leaves the device
    assert not copies.offloading and not copies.leaving
    assert h.driver.free_tokens() == free_before + moved
    assert pauses.counters["offloads_async"] == 1 and pauses.host.used_bytes > 0
    h.assert_clean()
    again = h.turn("s", prompt + [7, 8, 9] + ids(500, 20), [11], capture=300)
    assert again.cached_tokens == 302 and pauses.counters["restores"] == 1
    assert all(torch.equal(kv, torch.arange(300.0) + 1000.0) for kv in again.captured)  # byte-exact
    assert pauses.host.used_tokens == 0
    h.assert_clean()


def test_eviction_before_the_copy_landed_takes_the_leaving_suffix_first_and_waits_for_the_copy():
    """The pool is short while the copy is still running: the offloaded suffix is the first victim
    (its device copy is worth nothing more), the other session's history stays, and eviction joined
    the running copy before reusing its slots -- the restore is still byte-exact."""
    h = Harness()
    pauses = h.cache.pauses
    gated = GatedCopies(h)
    a, b = ids(0, 300), ids(1, 300)
    h.turn("a", a, [5], stamp=2000.0)
    h.turn("b", b, [6], stamp=3000.0)
    gated.gate.clear()
    assert pause_in_flight(h, "a")["action"] == "offload"
    assert gated.started.wait(timeout=30)
    threading.Timer(0.2, gated.gate.set).start()  # the copy finishes while eviction waits for it
    h.turn("c", ids(2, 500), [4])  # needs slots: 1024-slot pool, ~600 held by a and b
    assert h.cache.copies.joined_running == 1
    again_b = h.turn("b", b + [6], [9])
    assert again_b.cached_tokens == 300  # untouched (b's last output has no KV yet)
    h.driver.step()
    h.assert_clean()
    again_a = h.turn("a", a + [5] + ids(600, 10), [8], capture=300)
    assert again_a.cached_tokens == 300 and pauses.counters["restores"] == 1
    assert all(torch.equal(kv, torch.arange(300.0) + 2000.0) for kv in again_a.captured)
    h.assert_clean()


def test_a_branch_that_continues_before_the_copy_landed_keeps_its_device_kv_without_a_copy():
    h = Harness()
    pauses = h.cache.pauses
    gated = GatedCopies(h)
    prompt = ids(0, 300)
    h.turn("s", prompt, [7, 8])
    assert pause_in_flight(h, "s")["action"] == "offload"
    again = h.turn("s", prompt + [7, 8] + ids(500, 10), [3])  # the tool came back at once
    assert again.cached_tokens == 301
    assert pauses.counters["offload_cancelled"] == 1 and pauses.counters["restores"] == 0
    assert pauses.host.used_tokens == 0 and not h.cache.copies.offloading
    assert gated.threads and threading.get_ident() not in gated.threads  # copied out by the worker only
    h.assert_clean()


def test_a_resume_after_part_of_the_suffix_was_evicted_restores_only_that_part():
    h = Harness()
    pauses = h.cache.pauses
    prompt = ids(0, 300)
    h.turn("s", prompt, [7], stamp=500.0)
    second = prompt + [7] + ids(700, 20)
    h.turn("s", second, [8], stamp=500.0)
    chain = h.cache.copies.movable_suffix(branch("s"))
    assert [len(n.key) for n in chain] == [300 - STABLE, 21]
    assert pause_in_flight(h, "s")["action"] == "offload"
    with h.driver.activated():  # memory pressure before the step: the leaving leaf goes first
        h.cache._evict_nodes([chain[-1]], budget=None)
    again = h.turn("s", second + [8], [9], capture=321)
    assert again.cached_tokens == 321 and pauses.counters["restores"] == 1
    assert pauses.counters["offload_cancelled"] == 0
    assert all(torch.equal(kv, torch.arange(321.0) + 500.0) for kv in again.captured)
    h.assert_clean()


@pytest.mark.parametrize("ending", ["close", "reset"])
def test_a_close_or_reset_while_the_copy_runs_leaves_nothing(ending):
    h = Harness()
    pauses = h.cache.pauses
    gated = GatedCopies(h)
    h.turn("s", ids(0, 300), [7])
    h.turn("t", ids(1, 100), [8])
    gated.gate.clear()
    assert pause_in_flight(h, "s")["action"] == "offload"
    threading.Timer(0.2, gated.gate.set).start()
    if ending == "close":
        with h.driver.activated():
            h.cache.close_branch(branch("s"))
    else:
        h.driver.flush_cache()  # Scheduler.flush_cache: the reset joins the copy before the pool is cleared
    h.driver.step()
    assert not h.cache.copies.offloading and not h.cache.copies.leaving
    assert pauses.host.used_tokens == 0 and not pauses.host.entries
    if ending == "close":
        assert h.cache.branch_tokens(branch("s")) == 0
        assert h.turn("t", ids(1, 100) + [8], [9]).cached_tokens == 100
    h.assert_clean()


def test_synchronous_and_asynchronous_offloads_end_in_the_same_state():
    """The same pauses and turns with the copy on the worker and on the scheduler thread: the same
    prefix hits, the same device and host occupancy after every step, the same bytes restored."""
    def run(async_offload: bool) -> list:
        h = Harness()
        h.cache.copies.async_offload = async_offload
        seen = []
        histories = {s: ids(10 + k, 200) for k, s in enumerate("abc")}
        for round_ in range(3):
            for k, (s, hist) in enumerate(histories.items()):
                req = h.turn(s, hist, [3 + round_], stamp=100.0 * (k + 1), capture=len(hist) - 1)
                seen.append((req.cached_tokens, [kv.sum().item() for kv in req.captured]))
                h.pause(s, force=PauseAction.OFFLOAD)
                seen.append((h.driver.free_tokens(), h.cache.pauses.host.used_tokens))
                histories[s] = hist + [3 + round_] + ids(100 * round_ + k, 30)
        h.assert_clean()
        return seen

    assert run(True) == run(False)


def test_a_busy_step_lands_only_copies_already_made_and_never_waits():
    """The server's step (``step_waits`` off): a copy still running is left for a later step, which
    lands it once it is made; the step itself does not wait (the gate is still closed when it returns)."""
    h = Harness()
    copies, pauses = h.cache.copies, h.cache.pauses
    copies.step_waits = False
    gated = GatedCopies(h)
    h.turn("s", ids(0, 300), [7, 8])
    h.turn("t", ids(1, 200), [9])
    gated.gate.clear()
    assert pause_in_flight(h, "s")["action"] == "offload"
    assert pause_in_flight(h, "t")["action"] == "offload"
    h.driver.step()  # both copies wait on the gate: nothing lands, and the step returned regardless
    assert list(copies.offloading) == [branch("s"), branch("t")] and copies.joined_running == 0
    gated.gate.set()
    for flight in list(copies.offloading.values()):
        flight.future.result(timeout=30)  # made (not landed: only a step lands them)
    assert len(copies.offloading) == 2
    h.driver.step()
    assert not copies.offloading and pauses.counters["offloads_async"] == 2
    assert pauses.host.used_tokens == (300 + 1 - STABLE) + (200 - STABLE)
    h.assert_clean()


# ---- restores ----


def loads_recorded(h: Harness) -> list[int]:
    """The threads of every ``load_cpu_copy`` (host->device) from now on."""
    threads: list[int] = []
    allocator = h.cache.token_to_kv_pool_allocator
    real = allocator.load_cpu_copy

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    allocator.load_cpu_copy = recording
    return threads


def paused_with_a_waiting_request(h: Harness, session: str = "s"):
    """``session`` offloaded, and its next request queued and matched once for admission: its restore
    is in flight (the scheduler skips it this step)."""
    prompt = ids(0, 300)
    h.turn(session, prompt, [7, 8], stamp=700.0)
    h.pause(session, force=PauseAction.OFFLOAD)
    req = h.driver.queue("late", prompt + [7, 8] + ids(9, 10),
                         kv_hints=lifecycle_envelope(hint(session), message_id="late"), max_new_tokens=4)
    h.driver.admission_step(req)
    assert h.cache.loads.pending("late") and h.cache.loads.restoring == {branch(session): "late"}
    return req


def test_a_restore_is_copied_back_by_a_worker_between_two_matches():
    h = Harness()
    assert h.cache.loads.enabled  # the default on a CPU pool
    threads = loads_recorded(h)
    prompt = ids(0, 300)
    h.turn("s", prompt, [7, 8], stamp=700.0)
    h.pause("s", force=PauseAction.OFFLOAD)
    again = h.turn("s", prompt + [7, 8] + ids(9, 10), [3], capture=300)  # the driver matches twice
    assert again.cached_tokens == 301
    assert all(torch.equal(kv, torch.arange(300.0) + 700.0) for kv in again.captured)  # byte-exact
    assert threads and threading.get_ident() not in threads  # copied back by the worker only
    loads, pauses = h.cache.loads.counters, h.cache.pauses
    assert loads["restores_issued"] == loads["restores_finished"] == 1
    assert pauses.counters["restores"] == 1 and pauses.host.promotes.tokens == 301 - STABLE
    assert not pauses.records and pauses.host.used_tokens == 0 and not h.cache.loads.restoring
    h.assert_clean()


def test_a_close_while_the_restore_is_copied_frees_its_slots_and_the_request_recomputes():
    h = Harness()
    req = paused_with_a_waiting_request(h)
    with h.driver.activated():
        h.cache.close_branch(branch("s"))
    assert not h.cache.loads.pending("late") and h.cache.loads.counters["abandoned"]["dropped"] == 1
    assert h.cache.loads.in_flight_tokens() == 0 and not h.cache.loads.restoring
    admitted = h.driver.admit_queued(req)  # the next match: the closed branch's own KV is gone
    assert admitted.cached_tokens == STABLE  # the shared stable prefix is not the branch's
    h.driver.abort(admitted)
    assert h.cache.pauses.host.used_tokens == 0 and not h.cache.pauses.records
    h.assert_clean()


def test_an_abort_while_the_restore_is_copied_ends_the_pause_and_leaves_nothing():
    h = Harness()
    req = paused_with_a_waiting_request(h)
    with h.driver.activated():  # Scheduler._release_aborted_request for a request still queued
        h.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
    assert not h.cache.loads.pending("late") and h.cache.loads.counters["abandoned"]["aborted"] == 1
    assert not h.cache.pauses.records and h.cache.pauses.host.used_tokens == 0
    h.assert_clean()


def test_a_restore_whose_copy_fails_on_the_worker_recomputes():
    h = Harness()
    h.cache.pauses.host.fail_next("promote")
    req = paused_with_a_waiting_request(h)
    admitted = h.driver.admit_queued(req)  # the finishing match agrees on the failure
    assert admitted.cached_tokens == STABLE
    pauses = h.cache.pauses
    assert pauses.counters["restore_failures"]["transfer_failed"] == 1 and pauses.host.promotes.failures == 1
    h.driver.extend(admitted, [1])
    h.driver.finish(admitted)
    assert not pauses.records and pauses.host.used_tokens == 0
    h.assert_clean()


# ---- prefetches ----

PREFETCH = {"prefetch_budget_tokens": 1024}  # room for one branch's speculative restore


def offloaded(h: Harness, session: str, seed: int = 0) -> list[int]:
    prompt = ids(seed, 300)
    h.turn(session, prompt, [7, 8], stamp=900.0)
    h.pause(session, force=PauseAction.OFFLOAD)
    return prompt + [7, 8]


def test_a_prefetch_is_copied_by_a_worker_and_lands_at_the_next_step():
    h = Harness(**PREFETCH)
    threads = loads_recorded(h)
    history = offloaded(h, "s")
    owner, pauses = branch("s"), h.cache.pauses
    out = h.call("prefetch_branch", "s")
    assert out == {"prefetched": True, "restored_tokens": 301 - STABLE}
    assert owner in h.cache.loads.prefetches and h.cache.tree_core.resident_owned_tokens(owner) == 0
    h.driver.step()  # lands: the branch's KV is on the device (and still on host: it has not resumed)
    assert not h.cache.loads.prefetches and h.cache.loads.counters["prefetches_landed"] == 1
    assert h.cache.tree_core.resident_owned_tokens(owner) == 301 - STABLE
    assert threads and threading.get_ident() not in threads
    again = h.turn("s", history + ids(9, 10), [3], capture=300)
    assert again.cached_tokens == 301 and pauses.prefetch["used"] == 1
    assert all(torch.equal(kv, torch.arange(300.0) + 900.0) for kv in again.captured)
    assert pauses.host.used_tokens == 0 and not pauses.records
    h.assert_clean()


def test_a_request_that_comes_before_its_prefetch_landed_lands_it_first():
    h = Harness(**PREFETCH)
    history = offloaded(h, "s")
    pauses = h.cache.pauses
    assert h.call("prefetch_branch", "s")["prefetched"] is True
    again = h.turn("s", history + ids(9, 10), [3])  # no step in between
    assert again.cached_tokens == 301 and pauses.prefetch["used"] == 1 and pauses.prefetch["wasted"] == 0
    assert h.cache.loads.counters["restores_issued"] == 0  # the prefetch brought it all back
    assert pauses.host.used_tokens == 0 and not pauses.records and not h.cache.loads.prefetches
    h.assert_clean()


@pytest.mark.parametrize("ending", ["close", "expire", "reset"])
def test_a_prefetch_in_flight_is_dropped_with_its_branch(ending):
    h = Harness(**PREFETCH)
    offloaded(h, "s")
    assert h.call("prefetch_branch", "s")["prefetched"] is True
    if ending == "close":
        with h.driver.activated():
            h.cache.close_branch(branch("s"))
    elif ending == "expire":
        h.call("expire", "s")
    else:
        h.driver.flush_cache()
    assert not h.cache.loads.prefetches and h.cache.loads.counters["abandoned"][
        "reset" if ending == "reset" else "dropped"] == 1
    assert h.cache.loads.in_flight_tokens() == 0 and h.cache.pauses.host.used_tokens == 0
    h.assert_clean()


def test_a_prefetch_whose_copy_fails_lands_as_nothing_and_the_request_recomputes():
    h = Harness(**PREFETCH)
    history = offloaded(h, "s")
    pauses = h.cache.pauses
    pauses.host.fail_next("promote")
    assert h.call("prefetch_branch", "s")["prefetched"] is True  # issued; the copy fails on the worker
    h.driver.step()
    record = pauses.records[branch("s")]
    assert record.prefetched_tokens == 0 and record.placement.value == "none"
    assert pauses.counters["restore_failures"]["transfer_failed"] == 1 and pauses.prefetch["tokens_prefetched"] == 0
    again = h.turn("s", history + ids(9, 10), [3])
    assert again.cached_tokens == STABLE
    assert pauses.host.used_tokens == 0 and not pauses.records
    h.assert_clean()


def test_the_resume_routes_restore_is_copied_by_a_worker_and_lands_like_a_prefetch():
    """``/agentcache/resume`` on an offloaded branch, before its request: the pause ends at once, the
    copy back is made by the worker and lands at the next step; the request then hits it."""
    h = Harness()
    threads = loads_recorded(h)
    history = offloaded(h, "s")
    out = h.call("resume", "s")
    assert out["resumed"] and out["restored_tokens"] == 301 - STABLE
    assert branch("s") not in h.cache.pauses.records and branch("s") in h.cache.loads.prefetches
    h.driver.step()
    assert not h.cache.loads.prefetches and h.cache.pauses.host.used_tokens == 0  # landed, copy dropped
    assert threads and threading.get_ident() not in threads
    again = h.turn("s", history + ids(9, 10), [3], capture=300)
    assert again.cached_tokens == 301
    assert all(torch.equal(kv, torch.arange(300.0) + 900.0) for kv in again.captured)
    h.assert_clean()


def test_a_request_right_after_the_resume_route_lands_its_restore_first():
    h = Harness()
    history = offloaded(h, "s")
    assert h.call("resume", "s")["resumed"]
    again = h.turn("s", history + ids(9, 10), [3])  # no step in between: its match lands the copy
    assert again.cached_tokens == 301 and not h.cache.loads.prefetches
    assert h.cache.pauses.host.used_tokens == 0
    h.assert_clean()
