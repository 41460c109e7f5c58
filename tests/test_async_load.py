"""Load-backs copied by a worker thread between two admission matches (server/async_load.py).

On the real cache offline (SGLang's CPU pools, the real allocator's ``load_cpu_copy``): a request whose
device match is continued by spilled entries gets its load issued at one admission match and finished
at the next; the scheduler's hook skips it in between. The result (what is cached, the bytes on
device, the host tier) is exactly that of the synchronous load-back; an abort, a reset, a failed copy
or a tree that changed between the steps each leave nothing behind. The allocator is wrapped only to
record which thread copied (the real copy still runs). Token ids < 512.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from sglang.srt.managers.schedule_policy import AddReqResult
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

from kv_stamps import path_kv, stamp_prompt_kv

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.server.admission import after_on_idle, around_add_one_req
from sgl_agentcache.server.async_load import ASYNC_LOAD_ENV, MAX_WAIT_STEPS, async_load_wanted
from sgl_agentcache.server.copy_ahead import COPY_AHEAD_ENV
from sgl_agentcache.server.offline import OfflineDriver, OfflineOutOfMemory, build_offline_cache


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


PROMPTS = [ids(20 + k, 300) for k in range(5)]  # 1500 tokens through a 1024-token pool


class Run:
    """A cache with the node spill on; every turn stamps its prompt's KV with known values."""

    def __init__(self, monkeypatch, asynchronous: bool):
        monkeypatch.setenv(ASYNC_LOAD_ENV, "1" if asynchronous else "0")
        monkeypatch.setenv(COPY_AHEAD_ENV, "0")  # spills copy on this thread: only loads vary
        self.cache = build_offline_cache(pool_tokens=1024)
        self.cache.set_host_spill(True)
        self.cache.pauses.host.capacity_tokens = 4096
        self.driver = OfflineDriver(self.cache)
        self.loaded_on: list[int] = []  # thread ident of every load_cpu_copy
        allocator = self.cache.token_to_kv_pool_allocator
        real = allocator.load_cpu_copy

        def recording(*args, **kwargs):
            self.loaded_on.append(threading.get_ident())
            return real(*args, **kwargs)

        allocator.load_cpu_copy = recording
        self.n = 0

    def hint(self, session: str):
        self.n += 1
        return lifecycle_envelope({"session": session}, message_id=f"m{self.n}")

    def turn(self, prompt, session: str, stamp: int) -> int:
        req = self.driver.admit(f"r{self.n}", prompt, kv_hints=self.hint(session))
        cached = req.cached_tokens
        stamp_prompt_kv(self.driver, req, prompt, stamp, start=cached)
        self.driver.extend(req, [7])
        self.driver.finish(req)
        return cached

    def fill(self) -> None:
        """Five sessions through the pool: s0's prompt is spilled to host."""
        for k, prompt in enumerate(PROMPTS):
            self.turn(prompt, f"s{k}", stamp=1000 * k)
        assert self.resident(PROMPTS[0]) < 300 and self.cache.spill.tokens > 0

    def queue(self, rid, prompt, session):
        # The budget reserves what it decodes (one token here).
        return self.driver.queue(rid, prompt, kv_hints=self.hint(session), max_new_tokens=1)

    def step(self, req) -> None:
        """One scheduler step for a queued ``req`` (its host copies come back if it passes the budget)."""
        self.driver.admission_step(req)

    def queued_return(self):
        """s0 comes back: queued, then one scheduler step: its admission match notes its host copy and
        the plugin's hook, on a real PrefillAdder, issues the copy's load (the request passes the budget)."""
        req = self.queue(f"back{self.n}", PROMPTS[0] + ids(99, 20), "s0")
        self.step(req)
        return req

    def resident(self, prompt) -> int:
        return path_kv(self.driver, prompt)[0]

    def kv_of(self, prompt):
        return path_kv(self.driver, prompt)[1]

    def abort_queued(self, req) -> None:
        """Scheduler._release_aborted_request for a request that never ran (still queued)."""
        with self.driver.activated():
            self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def assert_clean(self) -> None:
        report = self.driver.check()
        assert report.ok, report.errors
        assert self.driver.idle_free_tokens() == self.driver.pool_tokens
        assert not self.cache.loads.by_rid and not self.cache.spill.loading and not self.cache.spill._pinned
        assert not self.cache.loads.waiting


def test_a_load_back_runs_on_the_worker_and_changes_nothing_else(monkeypatch):
    sync, ahead = Run(monkeypatch, asynchronous=False), Run(monkeypatch, asynchronous=True)
    assert not sync.cache.loads.enabled and ahead.cache.loads.enabled
    for run in (sync, ahead):
        run.fill()
    back = [run.turn(PROMPTS[0] + ids(99, 20), "s0", stamp=0) for run in (sync, ahead)]
    assert back[0] == back[1] >= 290  # s0 came back from host, as much of it either way
    stats = ahead.cache.loads.stats()
    assert stats["issued"] == stats["finished"] >= 1 and stats["loaded_tokens"] >= 200, stats
    assert not any(stats["abandoned"].values()), stats
    main = threading.get_ident()
    assert ahead.loaded_on and all(t != main for t in ahead.loaded_on), "the load ran on the scheduler thread"
    assert sync.loaded_on and all(t == main for t in sync.loaded_on)
    assert sync.cache.spill.counters["loaded_tokens"] == ahead.cache.spill.counters["loaded_tokens"]
    assert ahead.cache.pauses.host.promotes.tokens == sync.cache.pauses.host.promotes.tokens > 0
    want = torch.arange(300, dtype=torch.float32)  # stamp 0: s0's own bytes, copied back exactly
    assert all(torch.equal(t.float(), want.repeat_interleave(t.numel() // 300)) for t in ahead.kv_of(PROMPTS[0]))
    for prompt in PROMPTS:
        assert all(torch.equal(a, b) for a, b in zip(ahead.kv_of(prompt), sync.kv_of(prompt)))
    ahead.assert_clean()
    sync.assert_clean()


def test_the_scheduler_skips_the_request_until_its_next_match(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    req = run.queued_return()
    assert run.cache.loads.pending(req.rid) and req.prefix_len < 300  # issued; not loaded yet
    # The plugin's hook on PrefillAdder.add_one_req: the request is passed over, nothing is added.
    adder = type("Adder", (), {"tree_cache": run.cache, "rem_total_tokens": 10, "cur_rem_tokens": 10})()
    added = []
    assert around_add_one_req(lambda *a, **k: added.append(a), adder, req, False, None) is AddReqResult.CONTINUE
    assert not added
    other = type("Req", (), {"rid": "someone-else"})()
    around_add_one_req(lambda *a, **k: added.append(a), adder, other, False, None)
    assert len(added) == 1  # a request with nothing in flight goes to the real add_one_req
    with run.driver.activated():
        req.init_next_round_input(run.cache)  # the next step's admission match finishes the load
    assert not run.cache.loads.pending(req.rid) and req.prefix_len >= 290
    run.abort_queued(req)  # the scheduler aborts it (it never ran): nothing of it is held
    run.assert_clean()


def _skipped_by_the_hook(cache, req) -> bool:
    """The plugin's hook on PrefillAdder.add_one_req passes ``req`` over (nothing reaches the real one)."""
    adder = type("Adder", (), {"tree_cache": cache, "rem_total_tokens": 10, "cur_rem_tokens": 10})()
    added = []
    skipped = around_add_one_req(lambda *a, **k: added.append(a), adder, req, False, None) is AddReqResult.CONTINUE
    return skipped and not added


def test_a_request_continuing_into_another_requests_load_waits_a_step_and_hits_it(monkeypatch):
    """Siblings reach the scheduler in one step: the first one's admission match issues the load of
    what they share; the others' matches, in the same step, must not admit them to recompute those
    tokens (the entries are skipped by their own chain search) but hold them back a step, after which
    they hit what the load brought back. One load, no recompute of the shared tokens."""
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    first = run.queued_return()
    loads = run.cache.loads
    assert loads.pending(first.rid)
    second = run.queue("sibling", PROMPTS[0] + ids(98, 20), "s7")
    with run.driver.activated():
        second.init_next_round_input(run.cache)
    assert loads.waiting == {second.rid: 1} and not loads.pending(second.rid) and second.prefix_len < 300
    assert loads.holds_back(second.rid) and _skipped_by_the_hook(run.cache, second)
    with run.driver.activated():  # the next step: the loader's match inserts the chain, the waiter hits it
        first.init_next_round_input(run.cache)
        second.init_next_round_input(run.cache)
    assert first.prefix_len >= 290 and second.prefix_len >= 290
    assert not loads.waiting and not loads.holds_back(second.rid)
    assert loads.counters["issued"] == loads.counters["finished"] == 1 and loads.counters["waited_for_other"] == 1
    run.abort_queued(first)
    run.abort_queued(second)
    run.assert_clean()
    assert not loads.waiting


def test_a_waiter_whose_loader_left_loads_for_itself_and_a_waiter_never_waits_forever(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    first = run.queued_return()
    loads = run.cache.loads
    second = run.queue("sibling", PROMPTS[0] + ids(98, 20), "s7")
    third = run.queue("cousin", PROMPTS[0] + ids(97, 20), "s8")
    with run.driver.activated():
        for _ in range(MAX_WAIT_STEPS):  # the loader is never matched again (a full batch, say)
            third.init_next_round_input(run.cache)
        assert third.rid in loads.waiting
        third.init_next_round_input(run.cache)  # the bound: it goes ahead as it is
        assert third.rid not in loads.waiting and loads.counters["waits_given_up"] == 1
        assert not loads.holds_back(third.rid) and third.prefix_len < 300
        second.init_next_round_input(run.cache)
        assert second.rid in loads.waiting
    run.abort_queued(first)  # the loader leaves: its load goes, the entries are free to load again
    with run.driver.activated():
        run.step(second)  # its match notes the host copy; the hook issues its own load
        assert loads.pending(second.rid) and second.rid not in loads.waiting
        second.init_next_round_input(run.cache)
    assert second.prefix_len >= 290
    for req in (second, third):
        run.abort_queued(req)
    run.assert_clean()
    assert not loads.waiting


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_request_refused_by_the_prefill_budget_moves_and_evicts_nothing(monkeypatch, asynchronous):
    """SGLang loads a HiCache host hit only after the request passed the prefill budget counting
    those tokens as new (PrefillAdder.add_one_req): a request that will not be admitted this step must
    not copy its host entries back, evicting others for them. Here it decodes more than the pool."""
    run = Run(monkeypatch, asynchronous=asynchronous)
    run.fill()
    req = run.queue("greedy", PROMPTS[0] + ids(99, 20), "s0")
    req.sampling_params.max_new_tokens = 2000  # > the 1024-token pool
    allocator, spill = run.cache.token_to_kv_pool_allocator, run.cache.spill
    before = (allocator.available_size(), run.cache.evictable_size(), spill.tokens, spill.counters["loaded_tokens"])
    run.step(req)
    assert run.cache.host_loads_refused == 1 and not run.cache.loads.pending(req.rid)
    assert (allocator.available_size(), run.cache.evictable_size(), spill.tokens,
            spill.counters["loaded_tokens"]) == before
    assert req.prefix_len < 300  # as it stood: the real add_one_req then refuses it (NO_TOKEN)
    req.sampling_params.max_new_tokens = 1  # it fits now: the next step loads its host copy
    run.step(req)
    run.step(req)  # (asynchronous: the copy lands at the next match)
    assert req.prefix_len >= 290 and run.cache.host_loads_refused == 1
    run.abort_queued(req)
    run.assert_clean()


def test_the_replay_scheduler_refuses_before_loading(monkeypatch):
    """The replay's admission (OfflineDriver.admit with a budget) checks the budget before a host hit
    comes back: a refusal raises with nothing moved; admitted, the request hits its host copy."""
    run = Run(monkeypatch, asynchronous=False)
    run.fill()
    allocator, spill = run.cache.token_to_kv_pool_allocator, run.cache.spill
    before = (allocator.available_size(), run.cache.evictable_size(), spill.tokens)
    with pytest.raises(OfflineOutOfMemory):
        run.driver.admit("big", PROMPTS[0] + ids(99, 20), kv_hints=run.hint("s0"), budget=2000)
    assert (allocator.available_size(), run.cache.evictable_size(), spill.tokens) == before
    req = run.driver.admit("fits", PROMPTS[0] + ids(99, 20), kv_hints=run.hint("s0"), budget=1)
    assert req.cached_tokens >= 290
    run.driver.extend(req, [7])
    run.driver.finish(req)
    run.assert_clean()


def test_a_load_that_took_memory_the_batch_was_admitted_against_gives_it_back(monkeypatch):
    """The adder admits requests against free + evictable memory; a load issued later in the same
    step takes slots out of it. With the adder's budget negative the hook frees the load's slots and
    the request goes to the real add_one_req as it is (recomputing what it lacks), never an OOM."""
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    req = run.queued_return()
    free = run.cache.token_to_kv_pool_allocator.available_size()
    adder = type("Adder", (), {"tree_cache": run.cache, "rem_total_tokens": -5, "cur_rem_tokens": 100})()
    added = []
    around_add_one_req(lambda *a, **k: added.append(a) or AddReqResult.CONTINUE, adder, req, False, None)
    assert len(added) == 1 and not run.cache.loads.pending(req.rid)
    assert run.cache.loads.counters["abandoned"]["no_room"] == 1
    assert run.cache.token_to_kv_pool_allocator.available_size() > free  # the slots came back
    run.abort_queued(req)
    run.assert_clean()


def test_an_idle_scheduler_lands_a_load_whose_owner_the_step_never_reached(monkeypatch):
    """The scheduler stops scanning its queue at the first request that does not fit: a load issued for
    a request behind it is never finished at its owner's match, and its slots (neither free nor
    evictable) can keep the request ahead from ever fitting. Seen behind the router: a worker's queue
    stuck for minutes. The plugin's AFTER hook on Scheduler.on_idle lands it: its KV joins the tree,
    evictable, and the owner's next match hits it."""
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    req = run.queued_return()
    loads, allocator = run.cache.loads, run.cache.token_to_kv_pool_allocator
    held = loads.in_flight_tokens()
    assert held >= 290 and loads.pending(req.rid)
    evictable = run.cache.evictable_size()
    scheduler = type("Scheduler", (), {"tree_cache": run.cache})()
    with run.driver.activated():
        assert after_on_idle(None, scheduler) is None  # the scheduler found no batch this step
    assert not loads.pending(req.rid) and loads.in_flight_tokens() == 0 and loads.counters["landed_idle"] == 1
    assert run.cache.evictable_size() >= evictable + held  # the slots are the tree's now: evictable
    run.step(req)  # its next admission match hits what the load brought
    assert req.prefix_len >= 290
    run.abort_queued(req)
    run.assert_clean()


def test_an_abort_while_the_load_is_in_flight_frees_it_and_keeps_the_host_copy(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    req = run.queued_return()
    assert run.cache.loads.in_flight_tokens() > 0
    on_host = run.cache.spill.tokens  # (making room for the load spilled another session)
    run.abort_queued(req)  # Scheduler._release_aborted_request for a queued request
    assert run.cache.loads.counters["abandoned"]["aborted"] == 1
    assert run.cache.spill.tokens == on_host  # the spilled entries stay for a later match
    run.assert_clean()
    assert run.turn(PROMPTS[0] + ids(98, 20), "s0", stamp=0) >= 290


def test_a_tree_changed_between_the_steps_abandons_the_load(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    req = run.queued_return()
    # Another request on the same path meanwhile: the chain in flight is not found for it (no second
    # load of the same entries), it prefills the tokens itself and they land on the path.
    run.turn(PROMPTS[0], "s9", stamp=9000)
    with run.driver.activated():
        req.init_next_round_input(run.cache)
    assert run.cache.loads.counters["abandoned"]["changed"] == 1 and run.cache.loads.counters["finished"] == 0
    assert req.prefix_len >= 290  # matched as the tree is now
    run.abort_queued(req)
    run.assert_clean()


def test_a_failed_copy_recomputes_and_leaks_nothing(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    run.cache.pauses.host.fail_next("promote", 1)
    failed = run.cache.spill.counters["load_failed"]
    assert run.turn(PROMPTS[0] + ids(97, 20), "s0", stamp=0) < 290  # recomputed
    assert run.cache.spill.counters["load_failed"] == failed + 1
    assert run.cache.pauses.host.promotes.failures == 1
    run.assert_clean()


@pytest.mark.parametrize("where", ["insert", "finish"])
def test_a_failure_when_the_load_finishes_recomputes_and_leaks_nothing(monkeypatch, where):
    """A re-insert that raises, or anything else raising in the finish, never reaches the scheduler:
    the request recomputes what it lacks, no slot leaks or is freed twice."""
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    target, name = (run.cache, "insert") if where == "insert" else (run.cache.loads, "finish")
    original = getattr(target, name)

    def failing(*args, **kwargs):
        setattr(target, name, original)
        raise RuntimeError(f"injected failure of {name}")

    setattr(target, name, failing)
    assert run.turn(PROMPTS[0] + ids(96, 20), "s0", stamp=0) < 290
    assert run.cache.spill.counters["load_errors"] == 1
    if where == "finish":  # the load it left behind went with the request
        assert run.cache.loads.counters["abandoned"]["unfinished"] == 1
    run.assert_clean()


def test_a_reset_drops_the_loads_in_flight(monkeypatch):
    run = Run(monkeypatch, asynchronous=True)
    run.fill()
    run.queued_return()
    run.driver.flush_cache()  # no live request: the queued one's load goes with the tree
    assert run.cache.loads.counters["abandoned"]["reset"] == 1
    run.assert_clean()


def test_the_switch(monkeypatch):
    monkeypatch.delenv(ASYNC_LOAD_ENV, raising=False)
    assert async_load_wanted("cpu") and async_load_wanted("cuda") and not async_load_wanted("xpu")
    monkeypatch.setenv(ASYNC_LOAD_ENV, "0")
    assert not async_load_wanted("cuda")
    monkeypatch.setenv(ASYNC_LOAD_ENV, "1")
    assert async_load_wanted("xpu")
