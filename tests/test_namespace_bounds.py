"""One rule for every structure tenants' requests can grow (issue #38): it is bounded per namespace, and
none is consulted on another namespace's behalf. A namespace's flood forgets only its own entries.

``RULED`` lists each such structure with a check that floods one namespace past the bounds and finds
another namespace's entry untouched and the flooding namespace within its own bound. ``EXEMPT`` lists
the containers that are not per namespace, each with why. ``test_every_container_is_listed`` scans
the package for every bounded map, LRU, deque, window and heap it constructs and fails on one that is
in neither list: a structure added later must say which it is.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

import sgl_agentcache
from sgl_agentcache.chat_infer import ChatInference, ChatTurn
from sgl_agentcache.fork_points import BranchContexts
from sgl_agentcache.lifecycle import BranchKey, RecentBranches
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.idle import IdleBranches
from sgl_agentcache.policy.join import Subagents
from sgl_agentcache.policy.latency import LatencyBook

A, B = "ns-flooding", "ns-other"
FLOOD = 200


def _recent_branches():
    closed = RecentBranches(limit=16, namespace_limit=4)
    closed.add(BranchKey(B, "s", "main"))
    for i in range(FLOOD):
        closed.add(BranchKey(A, f"s{i}", "main"))
    assert BranchKey(B, "s", "main") in closed and sum(b.namespace == A for b in closed) <= 4


def _namespaced(lru: NamespacedLRU, key_of):
    lru.put(key_of(B, 0), "b")
    for i in range(FLOOD):
        lru.put(key_of(A, i), "a")
    assert lru.get(key_of(B, 0)) == "b" and lru.namespace_size(A) <= lru.namespace_limit


def _quotas():  # AgentRadixCache.quotas: a branch's quota, as its own requests set it
    from sgl_agentcache.server.scheduler.offline import build_offline_cache

    cache = build_offline_cache(pool_tokens=256)
    cache.quotas.limit, cache.quotas.namespace_limit = 16, 4
    _namespaced(cache.quotas, lambda ns, i: BranchKey(ns, f"s{i}", "main"))
    assert cache.quota_of(BranchKey(B, "s0", "main")) == "b"


def _contexts():
    contexts = BranchContexts(limit=16, namespace_limit=4)
    contexts.record(BranchKey(B, "s", "main"), list(range(40)), [1])
    for i in range(FLOOD):
        contexts.record(BranchKey(A, f"s{i}", "main"), list(range(40)), [i])
    assert contexts.fork_point(BranchKey(B, "s", "main"), list(range(40)) + [1]) == 41 and len(contexts) <= 16


def _idle():
    idle = IdleBranches(LatencyBook(), limit=16, namespace_limit=4)
    idle.answered(B, "s", "main", 0.0)
    for i in range(FLOOD):
        idle.answered(A, f"s{i}", "main", 0.0)
    assert (B, "s", "main") in idle.since and idle.since.namespace_size(A) <= 4


def _subagents():
    subagents = Subagents(LatencyBook(), limit=16, namespace_limit=4)
    subagents.started(B, "s", "w0", "main", 0.0)
    for i in range(FLOOD):
        subagents.started(A, f"s{i}", "w0", "main", 0.0)
    assert (B, "s", "main") in subagents.running and subagents.running.namespace_size(A) <= 4
    assert len(subagents.lead_of) == len(subagents.running)


def _latency_book():
    book = LatencyBook(limit=16, namespace_limit=4)
    book.observe(B, "grep", 0.5)
    for i in range(FLOOD):
        book.observe(A, f"tool{i}", 0.5)
    assert book.peek(B, "grep").observations == 1


def _chat_sessions():
    inf = ChatInference(max_sessions=16, max_fingerprints=400, max_sessions_per_namespace=4,
                        max_fingerprints_per_namespace=100)
    mine, assignment = inf.assign(B, ChatTurn.from_messages([{"role": "user", "content": "b"}]), 0.0)
    inf.commit(assignment)
    inf.done(B, mine.session, mine.branch, 0.0)
    for i in range(FLOOD):
        messages = [{"role": "user", "content": f"a{i}.{j}"} for j in range(1 + i % 30)]
        got, assignment = inf.assign(A, ChatTurn.from_messages(messages), float(i))
        inf.commit(assignment)
        inf.done(A, got.session, got.branch, float(i))
    assert (B, mine.session) in inf.sessions
    assert inf.sessions.namespace_size(A) <= 4 and inf.fingerprints_by_namespace[A] <= 100


def _stable_cache():
    from sgl_agentcache.server.front.chat_hooks import _stable_cache

    fresh = NamespacedLRU(_stable_cache.limit, _stable_cache.namespace_limit)
    _namespaced(fresh, lambda ns, i: (ns, i.to_bytes(4, "little")))


def _coordinator():
    """The HTTP side's per-namespace state: background pauses pending, branches paused, prefetch lead
    windows. A's pauses past its bounds are shed or refused; B's go through, B's window stays."""
    from sgl_agentcache.server.front.coordinator import LEAD_WINDOW, PauseCoordinator

    async def send(op, args):
        return 200, {"paused": True, "action": "offload", "tokens": 8, "prefetched": True}

    now = [0.0]
    coordinator = PauseCoordinator(send=send, clock=lambda: now[0], max_pending=4, max_paused=8, idle_sweep_s=0)
    pause = dict(tool_class="ci_run", deadline_ms=None, priority=0, resume_required=True)

    async def main():
        await coordinator.pause(B, "s", "main", **pause)
        await coordinator.prefetch(B, "s", "main", None)
        now[0] += 5.0
        await coordinator.resume(B, "s", "main")  # B's window: one 5 s lead
        shed = [coordinator.pause_soon(A, f"p{i}", "main", **pause) for i in range(FLOOD)]
        assert sum(task is None for task in shed) == FLOOD - 4
        await coordinator.settle()
        statuses = [(await coordinator.pause(A, f"q{i}", "main", **pause))[0] for i in range(FLOOD)]
        assert statuses.count(200) == 8 - 4 and coordinator.active.namespace_size(A) == 8
        for i in range(FLOOD):  # A's leads: its own window, at most LEAD_WINDOW of them
            key = (A, f"q{i % 8}", "main") if i < 8 else None
            if key is not None:
                await coordinator.prefetch(*key, None)
                await coordinator.resume(*key)
        assert len(coordinator.leads.get(A)) <= LEAD_WINDOW and list(coordinator.leads.get(B)) == [5.0]
        assert (await coordinator.pause(B, "s2", "main", **pause))[0] == 200
        coordinator.purge(A)
        coordinator.purge(B)

    asyncio.run(main())


def _control_channel():
    """Each namespace's control ops queue in its own lane, served in turn (see test_background_pause)."""
    from sgl_agentcache.server.front.control_channel import ControlChannel

    async def main():
        order = []

        async def send_batch(ops):
            order.extend(args["ns"] for _, args in ops)
            return [(200, {})] * len(ops)

        channel = ControlChannel(send_batch, max_batch=2)
        calls = [channel.call(A, "pause", {"ns": A}) for _ in range(10)] + [channel.call(B, "stats", {"ns": B})]
        await asyncio.gather(*calls)
        assert order.index(B) <= 2  # behind at most one batch of A's, not all ten

    asyncio.run(main())


def _tombstones():
    """Replay protection: each tenant's closed sessions, bounded per tenant (earliest-expiring first)."""
    from sgl_agentcache import tenancy as tn

    config = tn.TenancyConfig(tenants={"a": tn.TenantSpec(keys=["ak-a-0123456789abcdef"]),
                                       "b": tn.TenantSpec(keys=["ak-b-0123456789abcdef"])})
    tenancy = tn.Tenancy(config, b"s" * 32, "bind")
    limit, tn.MAX_TOMBSTONES = tn.MAX_TOMBSTONES, 8
    try:
        theirs = tenancy.issue_session("b", 0, ttl_s=10)[0]
        tenancy.tombstone("b", theirs, 0)
        for i in range(FLOOD):
            tenancy.tombstone("a", tenancy.issue_session("a", 0, ttl_s=100 + i)[0], 0)
    finally:
        tn.MAX_TOMBSTONES = limit
    with pytest.raises(tn.CredentialError, match="closed"):
        tenancy.verify_session("b", theirs, 1)
    assert len(tenancy._tombstones["a"]) == 8


def _pause_book_prefetch_windows():
    from sgl_agentcache.server.scheduler.offline import build_offline_cache

    pauses = build_offline_cache(pool_tokens=256).pauses
    window = pauses.settings.prefetch_window
    pauses._outcomes.put(B, [__import__("collections").deque([True], maxlen=window), 0])
    for _ in range(FLOOD):  # A's outcomes go into A's own window only
        state = pauses._outcomes.get(A) or [__import__("collections").deque(maxlen=window), 0]
        pauses._outcomes.put(A, state)
        state[0].append(False)
    assert list(pauses._outcomes.get(B)[0]) == [True] and len(pauses._outcomes.get(A)[0]) == window
    assert pauses._prefetch_enabled(B)


def _program_ledger():  # program-aware admission's memory of programs and branch paths
    from sgl_agentcache.policy.admission_order import ProgramLedger

    ledger = ProgramLedger(limit=16, namespace_limit=4)
    ledger.receive((B, "s"), BranchKey(B, "s", "main"))
    ledger.answer((B, "s"))
    for i in range(FLOOD):
        ledger.receive((A, f"s{i}"), BranchKey(A, f"s{i}", "main"))
    assert ledger.returning((B, "s")) and BranchKey(B, "s", "main") in ledger.path
    assert ledger.programs.namespace_size(A) <= 4 and ledger.path.namespace_size(A) <= 4


def _gap_bounds():  # chat inference's learned wait bounds, per namespace
    from sgl_agentcache.policy.gap_bounds import GapBounds

    bounds = GapBounds(limit=2)
    bounds.observe(B, "tool", 1.0)
    for _ in range(FLOOD):
        bounds.observe(A, "tool", 1.0)
        bounds.observe(A, "idle", 1.0)
    assert bounds.seen(B, "tool") == 1 and bounds.seen(A, "idle") <= 256
    assert bounds._windows.namespace_size(A) <= 2


#: Structure (file:attribute) -> the check that floods one namespace and finds another untouched.
RULED = {
    "lifecycle.py:_branches": _recent_branches,  # cache.closed and cache.seen (RecentBranches)
    "server/scheduler/cache.py:closed": _recent_branches,
    "server/scheduler/cache.py:seen": _recent_branches,
    "server/scheduler/cache.py:quotas": _quotas,
    "fork_points.py:_ends": _contexts,
    "policy/idle.py:since": _idle,
    "policy/join.py:running": _subagents,
    "policy/latency.py:_models": _latency_book,
    "chat_infer.py:sessions": _chat_sessions,
    "policy/gap_bounds.py:_windows": _gap_bounds,
    "chat_infer.py:fingerprints_by_namespace": _chat_sessions,
    "server/front/chat_hooks.py:_stable_cache": _stable_cache,
    "server/front/coordinator.py:active": _coordinator,
    "server/front/coordinator.py:leads": _coordinator,
    "server/front/coordinator.py:window": _coordinator,
    "server/front/coordinator.py:pending_by_namespace": _coordinator,
    "server/front/control_channel.py:lanes": _control_channel,
    "tenancy.py:_tombstones": _tombstones,
    "tenancy.py:_expiries": _tombstones,
    "tenancy.py:heap": _tombstones,
    "server/scheduler/pauses.py:_outcomes": _pause_book_prefetch_windows,
    "server/scheduler/pauses.py:state": _pause_book_prefetch_windows,
    "policy/admission_order.py:programs": _program_ledger,
    "policy/admission_order.py:path": _program_ledger,
}

#: Containers that are not per namespace, and why that is right.
EXEMPT = {
    "namespaced_lru.py:group": "the per-namespace groups of NamespacedLRU itself",
    "server/scheduler/tree_core.py:deletions": "diagnostics ring, only with AGENTCACHE_RECORD_EVICTIONS=1; never consulted",
    "server/scheduler/pauses.py:log": "the operator's ring of recent decisions (stats only; a tenant's stats never show "
                            "it); no decision reads it",
    "sim/replay.py:lost_queue": "the replay's model of Continuum's queueing signal (no tenants' requests)",
    "server/front/control_channel.py:setdefault": "a lane's queue: its entries are callers awaiting a reply (bounded "
                                            "by their concurrency), served in turn with the other lanes",
    "server/front/coordinator.py:Counter": "pending_by_namespace (ruled above)",
    "server/scheduler/cache.py:heap": "one eviction's candidate heap, local to the call",
    "server/metrics.py:counter": "Prometheus counters, labelled from fixed sets our code names",
    "server/metrics.py:events": "a Prometheus counter, labelled by the coordinator's fixed event names",
    "server/metrics.py:rejected": "a Prometheus counter, labelled by our fixed refusal reasons",
    "server/metrics.py:clipped": "a Prometheus counter, labelled by the hint fields a ceiling clips",
    "sim/replay.py:events": "the replay's event queue (no tenants' requests)",
    "sim/attribution_study.py:Counter": "an offline study's tallies over one trace's calls (no server state)",
    "sim/attribution_study.py:setdefault": "an offline study's summary, one entry per (step, host size)",
    "soak.py:counts": "the soak driver's own client-side tally",
    "trace/stats.py:events": "a trace file's summary, computed offline",
    "chat_infer.py:Counter": "fingerprints_by_namespace (ruled above)",
    "policy/gap_bounds.py:gaps": "one namespace's window of its own gaps, WINDOW at most (the windows: ruled above)",
    "policy/admission_order.py:recent": "admission's window of recent service, shared by every tenant on purpose: "
                                        "it measures each tenant's share of the server's work, and a flood fills it "
                                        "with the flooder's own charges (what holds the flooder back)",
}

_CONSTRUCTORS = re.compile(r"\b(OrderedDict|deque|NamespacedLRU|RecentBranches|Counter|heapq\.heappush)\(")
_ASSIGNED = re.compile(r"(?:self\.)?(\w+)(?:\s*:[^=]*)?\s*=[^=]")


def _constructions() -> list[tuple[str, str, int]]:
    """(file:attribute, line text, line number) of every container the package constructs."""
    root = Path(sgl_agentcache.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not _CONSTRUCTORS.search(code) or code.lstrip().startswith(("from ", "import ", "class ", "def ")):
                continue
            assigned = _ASSIGNED.match(code.strip())
            name = assigned.group(1) if assigned else _CONSTRUCTORS.search(code).group(1)
            if "setdefault(" in code:
                name = "setdefault"
            elif "heappush" in code:
                name = code.split("heappush(", 1)[1].split(",", 1)[0].strip().removeprefix("self.")
            found.append((f"{rel}:{name}", line.strip(), number))
    return found


def test_every_container_is_listed():
    unlisted = [f"{where} (line {n}): {text}" for where, text, n in _constructions()
                if where not in RULED and where not in EXEMPT]
    assert not unlisted, "containers neither ruled per namespace nor exempt:\n" + "\n".join(unlisted)


@pytest.mark.parametrize("where", sorted(RULED))
def test_a_namespaces_flood_never_reaches_another_namespace(where):
    RULED[where]()
