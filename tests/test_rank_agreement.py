"""TP ranks take the same fallback when a host<->device copy fails on one of them (issue #22 item 11).

Two processes stand for two TP ranks: each builds the real ``AgentRadixCache`` offline over a gloo
process group (the CPU group SGLang hands the cache as ``tp_cache_group``) and drives it with the same
calls, as every scheduler rank is driven by the same messages. Rank 1's copies are made to fail at one
point per scenario -- an offload, a restore (a transfer error and an unexpected error), the spill of a
copy's anchor, a node spill, a load-back -- and the two trees must end identical: nodes, slots,
classes and owners, LRU order, host copies, spilled entries, pause records, counters, free slots.

The same scenarios run once more with each rank deciding alone (the agreement replaced by the local
outcome, as before the fix): the trees then differ, so the comparison does see a divergence.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest

FAILING_RANK = 1
WORLD = 2
STABLE = 32


def _ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


class _Rank:
    """One rank's cache and driver, with the offline harness calls the scenarios need."""

    def __init__(self, group, faulty: bool, local: bool, *, pool_tokens: int = 2048, spill: bool = False,
                 host_tokens: int | None = None):
        from sgl_agentcache.server.agreement import local_agreement
        from sgl_agentcache.server.offline import OfflineDriver, build_offline_cache

        self.cache = build_offline_cache(pool_tokens=pool_tokens, max_reqs=8, tp_group=group)
        assert self.cache.tp_world_size == WORLD
        if local:
            self.cache.agreement = local_agreement
        if spill:
            self.cache.set_host_spill(True)
        if host_tokens is not None:
            self.cache.pauses.host.capacity_tokens = host_tokens
        self.driver = OfflineDriver(self.cache)
        self.faulty = faulty
        self.n = 0

    def arm(self, kind: str, unexpected: bool = False) -> None:
        if self.faulty:
            self.cache.pauses.host.fail_next(kind, 1, unexpected=unexpected)

    def turn(self, session: str | None, prompt: list[int], out: list[int], branch: str = "main", **extra) -> int:
        from sgl_agentcache.hints import lifecycle_envelope

        self.n += 1
        hints = None
        if session is not None:
            hints = lifecycle_envelope({"session": session, "branch": branch, "stable_prefix_tokens": STABLE, **extra},
                                       message_id=f"m{self.n}")
        req = self.driver.admit(f"r{self.n}", prompt, kv_hints=hints)
        cached = req.cached_tokens
        self.driver.extend(req, out)
        self.driver.finish(req)
        return cached

    def offload(self, session: str, branch: str = "main") -> str:
        from sgl_agentcache.lifecycle import BranchKey, namespace_key
        from sgl_agentcache.policy.pause import PauseAction

        with self.driver.activated():
            key = BranchKey(namespace_key(None, None), session, branch)
            action = self.cache.pauses.pause(key, force=PauseAction.OFFLOAD)["action"]
            self.cache.flush_pending_backups()  # the next step: an asynchronous offload's copy lands (agreed)
            return action

    def evict_everything(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        with self.driver.activated():
            self.cache.evict(EvictParams(num_tokens=self.driver.pool_tokens))


# ---- scenarios: each returns what the calls returned (identical on both ranks when they agree) ----


def _offload(rank: _Rank) -> list:
    prompt = _ids(1, 300)
    rank.turn("s", prompt, [3])
    rank.arm("demote")
    action = rank.offload("s")
    return [action, rank.turn("s", prompt + [3], [4])]


def _restore(rank: _Rank, unexpected: bool = False) -> list:
    prompt = _ids(2, 300)
    rank.turn("s", prompt, [3])
    action = rank.offload("s")
    rank.arm("promote", unexpected)
    return [action, rank.turn("s", prompt + [3], [4])]


def _anchor_spill(rank: _Rank) -> list:
    lead = _ids(3, 300) + [5]
    rank.turn("s", lead[:-1], [5, 6])
    fork_prompt = lead + _ids(4, 100)
    fork = {"branch": "w", "parent_branch": "main", "fork_point_tokens": len(lead)}
    rank.turn("s", fork_prompt, [7, 8], **fork)
    action = rank.offload("s", "w")
    rank.arm("demote")
    rank.evict_everything()  # takes the anchor: its KV is copied in front of the copy (or not, everywhere)
    return [action, rank.turn("s", fork_prompt + [7, 8], [9], **fork)]


def _spill(rank: _Rank) -> list:
    a = _ids(5, 200)
    rank.turn(None, a, [1])
    rank.arm("demote")
    rank.turn(None, _ids(6, 150), [1])  # evicts a: spilled to host, or not, on every rank
    return [rank.turn(None, a + [1, 2], [1])]


def _load_back(rank: _Rank) -> list:
    a = _ids(7, 200)
    rank.turn(None, a, [1])
    rank.turn(None, _ids(8, 150), [1])  # a goes to host
    rank.arm("promote")
    return [rank.turn(None, a + [1, 2], [1])]


SCENARIOS = {
    "offload": (_offload, {}),
    "restore": (_restore, {}),
    "restore-unexpected": (lambda rank: _restore(rank, unexpected=True), {}),
    "anchor-spill": (_anchor_spill, {}),
    "spill": (_spill, {"pool_tokens": 300, "spill": True, "host_tokens": 2000}),
    "load-back": (_load_back, {"pool_tokens": 300, "spill": True, "host_tokens": 2000}),
}


def fingerprint(cache) -> dict:
    """Everything later decisions read, in a form two processes can compare."""
    from sgl_agentcache.server.tree_core import FULL

    core = cache.tree_core

    def path(node) -> list[int]:
        chunks = []
        while node is not None and node is not core.root_node:
            chunks.append(list(node.key.token_ids[: len(node.key)]))
            node = node.parent
        return [t for chunk in reversed(chunks) for t in chunk]

    def state(s) -> list:
        return [s.cls.name, None if s.owner is None else list(s.owner), s.terminated]

    nodes = [n for n in core.all_nodes() if n is not core.root_node]
    value = lambda n: None if n.component_data[FULL].value is None else [int(v) for v in n.component_data[FULL].value]  # noqa: E731
    pauses, spill = cache.pauses, cache.spill
    return {
        "nodes": sorted([path(n), state(n.agent), value(n), n.component_data[FULL].lock_ref] for n in nodes),
        "lru": [path(n) for n in sorted(nodes, key=lambda n: (n.last_access_time, n.id))],
        "host": sorted([list(b), e.start, e.end, [[off, *state(st)] for off, st in e.segments],
                        None if e.anchor is None else path(e.anchor)] for b, e in pauses.host.entries.items()),
        "host_used": pauses.host.used_tokens,
        "spill": [[list(e.tokens), state(e.state), None if e.anchor is None else path(e.anchor),
                   None if e.parent is None else list(e.parent.tokens)] for e in spill.lru],
        "records": sorted([list(b), r.placement.value, r.resuming] for b, r in pauses.records.items()),
        "pause_counters": pauses.counters,
        "spill_counters": spill.counters,
        "free_slots": cache.token_to_kv_pool_allocator.available_size(),
        "evictable": cache.evictable_size(),
    }


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """One TP rank: every scenario, with the agreement and (``local``) without it."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        results = {}
        for local in (False, True):
            for name, (scenario, build) in SCENARIOS.items():
                r = _Rank(dist.group.WORLD, rank == FAILING_RANK, local, **build)
                returned = scenario(r)
                report = r.driver.check()
                results[f"{name}{'/local' if local else ''}"] = {
                    "returned": returned, "fingerprint": fingerprint(r.cache), "ok": report.ok,
                    "errors": list(report.errors), "votes": dict(r.cache.transfer_votes)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(out / "pg-init"), str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_copy_failing_on_one_rank_makes_every_rank_take_the_fallback(ranks, scenario):
    healthy, failing = ranks[1 - FAILING_RANK][scenario], ranks[FAILING_RANK][scenario]
    assert failing["votes"]["failed_here"] >= 1  # the fault really fired, on the failing rank only
    assert healthy["votes"] == {"failed_here": 0, "failed_elsewhere": failing["votes"]["failed_here"]}
    assert healthy["ok"] and failing["ok"], (healthy["errors"], failing["errors"])
    assert healthy["returned"] == failing["returned"]
    for part in healthy["fingerprint"]:
        assert healthy["fingerprint"][part] == failing["fingerprint"][part], part


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_without_the_agreement_the_ranks_trees_diverge(ranks, scenario):
    """The same calls with each rank acting on its own outcome (before the fix): the trees differ, so
    the test above compares something that can differ."""
    healthy, failing = ranks[1 - FAILING_RANK][f"{scenario}/local"], ranks[FAILING_RANK][f"{scenario}/local"]
    assert healthy["fingerprint"] != failing["fingerprint"]
