"""Spill copies made ahead of eviction by a worker thread (server/copy_ahead.py).

On the real cache offline (SGLang's CPU pools, the real allocator's ``get_cpu_copy``): under pressure
the next victims are copied on the worker thread and eviction uses those copies; the tree, the host
tier and the bytes loaded back are exactly those of the same run without copy-ahead; a copy whose node
was split or closed meanwhile is never used; a failed one falls back to the spill's own copy. The
allocator is wrapped only to record which thread copied (the real copy still runs). Token ids < 512.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kv_stamps import path_kv, stamp_prompt_kv

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.server.copy_ahead import COPY_AHEAD_ENV, COPY_AHEAD_TOKENS_ENV, copy_ahead_wanted
from sgl_agentcache.server.offline import OfflineDriver, build_offline_cache

NS = namespace_key(None, None)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Run:
    """One cache with the node spill on; every turn stamps its prompt's KV with known values."""

    def __init__(self, monkeypatch, ahead: bool, pool: int = 1024, host: int = 4096):
        monkeypatch.setenv(COPY_AHEAD_ENV, "1" if ahead else "0")
        monkeypatch.setenv(COPY_AHEAD_TOKENS_ENV, "320")
        self.cache = build_offline_cache(pool_tokens=pool)
        self.cache.set_host_spill(True)
        self.cache.pauses.host.capacity_tokens = host
        self.driver = OfflineDriver(self.cache)
        self.copied_on: list[int] = []  # thread ident of every get_cpu_copy
        allocator = self.cache.token_to_kv_pool_allocator
        real = allocator.get_cpu_copy

        def recording(indices, *args, **kwargs):
            self.copied_on.append(threading.get_ident())
            return real(indices, *args, **kwargs)

        allocator.get_cpu_copy = recording
        self.n = 0

    def turn(self, prompt, session, stamp: int, branch: str = "main"):
        self.n += 1
        hint = lifecycle_envelope({"session": session, "branch": branch}, message_id=f"m{self.n}")
        req = self.driver.admit(f"r{self.n}", prompt, kv_hints=hint)
        cached = req.cached_tokens
        stamp_prompt_kv(self.driver, req, prompt, stamp, start=cached)
        self.driver.extend(req, [7])
        self.driver.finish(req)
        self.cache.copy_ahead.wait_idle()  # a test's tick: let the worker finish what it was given
        return cached

    def kv_of_path(self, prompt):
        return path_kv(self.driver, prompt)

    def host_view(self):
        return sorted((tuple(e.tokens), e.state, e.protected, e.low_value) for e in self.cache.spill.lru)

    def assert_clean(self):
        report = self.driver.check()
        assert report.ok, report.errors
        assert self.driver.idle_free_tokens() == self.driver.pool_tokens
        assert self.cache.copy_ahead.pending_tokens == sum(a.tokens for a in self.cache.copy_ahead.pending.values())


PROMPTS = [ids(10 + k, 300) for k in range(7)]


def _workload(run: Run) -> list[int]:
    cached = [run.turn(p, f"s{k}", stamp=1000 * k) for k, p in enumerate(PROMPTS)]
    cached.append(run.turn(PROMPTS[0] + ids(99, 40), "s0", stamp=0))  # s0 comes back: loaded from host
    return cached


def test_evictions_use_copies_the_worker_made_and_change_nothing_else(monkeypatch):
    plain, ahead = Run(monkeypatch, ahead=False), Run(monkeypatch, ahead=True)
    assert not plain.cache.copy_ahead.enabled and ahead.cache.copy_ahead.enabled
    assert _workload(ahead) == _workload(plain)
    stats = ahead.cache.copy_ahead.stats()
    assert stats["used"] > 0 and stats["used_tokens"] >= 300, stats
    main = threading.get_ident()
    assert any(t != main for t in ahead.copied_on), "no copy ran on the worker thread"
    assert all(t == main for t in plain.copied_on)
    # The same tree, the same host tier, the same bytes: copy-ahead changed when copies ran, nothing else.
    assert ahead.host_view() == plain.host_view()
    for key in ("spills", "spilled_tokens", "loads", "loaded_tokens"):
        assert ahead.cache.spill.counters[key] == plain.cache.spill.counters[key], key
    assert ahead.cache.spill.counters["loaded_tokens"] >= 300
    for prompt in PROMPTS:
        assert ahead.kv_of_path(prompt)[0] == plain.kv_of_path(prompt)[0]
        assert all(torch.equal(a, b) for a, b in zip(ahead.kv_of_path(prompt)[1], plain.kv_of_path(prompt)[1]))
    resident, kv = ahead.kv_of_path(PROMPTS[0])
    assert resident == 300 and all(torch.equal(t, torch.arange(300, dtype=t.dtype).repeat_interleave(t.numel() // 300))
                                   for t in kv)  # s0's KV came back from host byte for byte
    ahead.assert_clean()
    plain.assert_clean()


def test_a_copy_whose_node_was_split_or_closed_is_never_used(monkeypatch):
    run = Run(monkeypatch, ahead=True)
    for k in range(3):
        run.turn(PROMPTS[k], f"s{k}", stamp=1000 * k)
    pending = run.cache.copy_ahead.pending
    assert pending, "under pressure the next victims are copied ahead"
    victim = next(iter(pending))
    session = victim.agent.owner.session
    k = int(session[1:])
    # A request sharing half of the victim's tokens splits its node: the copy no longer matches.
    run.turn(PROMPTS[k][:150] + ids(77, 100), "other", stamp=50_000)
    for j in range(3, 6):
        run.turn(PROMPTS[j], f"s{j}", stamp=1000 * j)
    stats = run.cache.copy_ahead.stats()
    assert stats["stale"] >= 1, stats  # the split node was evicted later: its copy was not used
    resident, kv = run.kv_of_path(PROMPTS[k] + [1])
    if resident:  # whatever of it came back holds its own bytes, never another node's copy
        want = torch.arange(resident, dtype=kv[0].dtype) + 1000 * k
        assert all(torch.equal(t, want.repeat_interleave(t.numel() // resident)) for t in kv)
    # Closing a branch whose node is being copied ahead drops the copy: nothing pending is left behind.
    closed = {node.agent.owner for node in run.cache.copy_ahead.pending}
    assert closed
    dropped = run.cache.copy_ahead.counters["dropped"]
    with run.driver.activated():
        for owner in closed:
            run.cache.close_branch(owner)
    assert not any(n.agent.owner in closed for n in run.cache.copy_ahead.pending)
    assert run.cache.copy_ahead.counters["dropped"] > dropped
    run.assert_clean()


def test_a_failed_copy_ahead_falls_back_to_the_spills_own_copy(monkeypatch):
    run = Run(monkeypatch, ahead=True)
    allocator = run.cache.token_to_kv_pool_allocator
    recording = allocator.get_cpu_copy
    main = threading.get_ident()

    def failing_on_the_worker(indices, *args, **kwargs):
        if threading.get_ident() != main:
            raise RuntimeError("worker copy failed")
        return recording(indices, *args, **kwargs)

    allocator.get_cpu_copy = failing_on_the_worker
    cached = _workload(run)
    stats = run.cache.copy_ahead.stats()
    assert stats["failed"] > 0 and stats["used"] == 0, stats
    assert run.cache.spill.counters["spills"] > 0 and cached[-1] >= 300  # spilled and loaded back anyway
    run.assert_clean()


def test_an_armed_transfer_failure_is_not_dodged_by_a_copy_made_ahead(monkeypatch):
    run = Run(monkeypatch, ahead=True)
    for k in range(3):
        run.turn(PROMPTS[k], f"s{k}", stamp=1000 * k)
    assert run.cache.copy_ahead.pending
    run.cache.pauses.host.fail_next("demote", 1)
    run.turn(PROMPTS[3], "s3", stamp=3000)
    assert run.cache.spill.counters["spill_failed"] == 1
    run.assert_clean()


def test_the_switch(monkeypatch):
    """On by default on CUDA (the worker's own stream beside the forward; bench/gpu/side_stream_check.py
    on an H200); off on CPU, where the copy takes a core the forward needs, and on devices it never ran on."""
    monkeypatch.delenv(COPY_AHEAD_ENV, raising=False)
    assert copy_ahead_wanted("cuda") and not copy_ahead_wanted("cpu") and not copy_ahead_wanted("xpu")


@pytest.mark.parametrize("value, device, wanted", [("1", "xpu", True), ("0", "cuda", False), ("0", "cpu", False),
                                                   ("auto", "cpu", False), ("1", "cpu", True)])
def test_the_switch_from_the_environment(monkeypatch, value, device, wanted):
    monkeypatch.setenv(COPY_AHEAD_ENV, value)
    assert copy_ahead_wanted(device) is wanted


def test_a_bad_switch_stops_start_up(monkeypatch):
    monkeypatch.setenv(COPY_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        copy_ahead_wanted("cpu")
