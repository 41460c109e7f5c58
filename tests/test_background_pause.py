"""A hinted pause runs in the background: the response's final chunk is not held back for it, and order
is kept where it matters (the branch's next request, its resume, every control route).

The coordinator and the ingress hooks are the real ones; only the scheduler round trip (``send``) is a
stand-in whose replies the test releases, because the point is what happens while it is outstanding.
The real-server paths (a pause hint, then stats, resume and the next turn) are covered by
tests/test_pauses_server.py and tests/test_lazy_pauses_server.py, which run through the same code.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.server.front import ingress, shared
from sgl_agentcache.server.front.coordinator import PauseCoordinator

NS = namespace_key(None, None)
KEY = (NS, "s1", "main")


class HeldScheduler:
    """``send`` for the coordinator: every op is logged; a pause waits until the test releases it."""

    def __init__(self):
        self.ops: list[str] = []
        self.release = asyncio.Event()
        self.fail = False

    async def send(self, op: str, args: dict):
        self.ops.append(f"{op}:start")
        if op == "pause":
            await self.release.wait()
            if self.fail:
                raise ConnectionError("scheduler went away")
        self.ops.append(f"{op}:done")
        return 200, {"paused": True, "action": "offload", "tokens": 64}


@pytest.fixture
def held(monkeypatch):
    scheduler = HeldScheduler()
    coordinator = PauseCoordinator(send=scheduler.send, clock=lambda: 0.0)
    monkeypatch.setattr(shared, "coordinator", coordinator)
    return scheduler, coordinator


def _request(**hint):
    envelope = lifecycle_envelope({"session": "s1", "branch": "main", **hint}, message_id="m1")
    return SimpleNamespace(kv_hints=envelope, extra_key=None, cache_salt=None)


def _turn(ops: list[str], name: str):
    """A stand-in for SGLang's generate_request: logs when it starts, yields a final chunk."""

    async def generate(tokenizer_manager, obj):
        ops.append(f"{name}:start")
        yield {"text": "ok", "meta_info": {"finish_reason": {"type": "stop"}}}

    return generate


def test_final_chunk_is_not_held_back_by_the_pause(held):
    scheduler, coordinator = held

    async def main():
        gen = ingress._around_generate_request(_turn(scheduler.ops, "turn1"), None, _request(tool_class="bash"))
        chunks = [item async for item in gen]
        # The final chunk is out while the pause's scheduler round trip is still outstanding.
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
        assert scheduler.ops == ["turn1:start"] and coordinator.has_pending([KEY])
        await asyncio.sleep(0.01)
        assert scheduler.ops == ["turn1:start", "pause:start"]
        assert coordinator.has_pending([KEY]) and KEY not in coordinator.active
        scheduler.release.set()
        await coordinator.settle()
        assert scheduler.ops[-1] == "pause:done"
        assert KEY in coordinator.active and not coordinator.pending
        coordinator.forget(NS, "s1")  # cancel the deadline timer

    asyncio.run(main())


def test_next_request_of_the_branch_waits_for_its_pause(held):
    scheduler, coordinator = held

    async def main():
        first = ingress._around_generate_request(_turn(scheduler.ops, "turn1"), None, _request(tool_class="bash"))
        [item async for item in first]
        nxt = _request()
        ingress._note_arrivals(nxt)  # the BEFORE hook: the tool returned
        second = ingress._around_generate_request(_turn(scheduler.ops, "turn2"), None, nxt)
        other = ingress._around_generate_request(_turn(scheduler.ops, "other"), None,
                                                 SimpleNamespace(kv_hints=lifecycle_envelope(
                                                     {"session": "s2", "branch": "main"}, message_id="m2"),
                                                     extra_key=None, cache_salt=None))
        consumer = asyncio.create_task(_drain(second))
        await _drain(other)  # another branch does not wait
        await asyncio.sleep(0.01)
        assert "turn2:start" not in scheduler.ops and "other:start" in scheduler.ops
        scheduler.release.set()
        await consumer
        assert scheduler.ops.index("pause:done") < scheduler.ops.index("turn2:start")
        await asyncio.sleep(0)  # the resume noted by the BEFORE hook runs after the pause too
        assert KEY not in coordinator.active and coordinator.counters["resumes_by_request"] == 1

    asyncio.run(main())


def test_control_routes_and_waiters_see_the_pause_and_never_cancel_it(held):
    scheduler, coordinator = held

    async def main():
        task = coordinator.pause_soon(*KEY, tool_class="bash", deadline_ms=None, priority=0, resume_required=True)
        waiter = asyncio.create_task(coordinator.settle())
        await asyncio.sleep(0.01)
        waiter.cancel()  # a client that disconnects while waiting
        await asyncio.sleep(0)
        assert not task.done()
        resume = asyncio.create_task(coordinator.resume(*KEY))  # the route waits, then resumes
        await asyncio.sleep(0.01)
        assert "resume:start" not in scheduler.ops
        scheduler.release.set()
        status, _ = await resume
        assert status == 200 and task.done()
        assert scheduler.ops == ["pause:start", "pause:done", "resume:start", "resume:done"]

    asyncio.run(main())


def test_a_failed_background_pause_is_logged_and_cleared(held, caplog):
    scheduler, coordinator = held
    scheduler.fail = True

    async def main():
        task = coordinator.pause_soon(*KEY, tool_class="bash", deadline_ms=None, priority=0, resume_required=True)
        scheduler.release.set()
        assert await task is None
        assert not coordinator.pending and KEY not in coordinator.active

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "pause of s1/main failed" in caplog.text


async def _drain(gen):
    return [item async for item in gen]


def test_a_fork_of_a_branch_waits_for_its_parents_pause(held):
    scheduler, coordinator = held

    async def main():
        first = ingress._around_generate_request(_turn(scheduler.ops, "lead"), None, _request(tool_class="bash"))
        [item async for item in first]
        fork = SimpleNamespace(kv_hints=lifecycle_envelope({"session": "s1", "branch": "sub1", "parent_branch": "main"},
                                                           message_id="m3"), extra_key=None, cache_salt=None)
        consumer = asyncio.create_task(_drain(ingress._around_generate_request(_turn(scheduler.ops, "fork"), None, fork)))
        await asyncio.sleep(0.01)
        assert "fork:start" not in scheduler.ops
        scheduler.release.set()
        await consumer
        assert scheduler.ops.index("pause:done") < scheduler.ops.index("fork:start")
        coordinator.forget(NS, "s1")

    asyncio.run(main())


def test_a_pause_ended_by_a_close_lowers_the_next_pauses_resume_probability():
    """Close likelihood on the HTTP side: a branch closed while paused on a tool counts against that
    class's resume rate, and the next pause of the class carries the lower probability to the scheduler
    (a client that does not require the resume halves it further)."""
    sent: list[dict] = []

    async def send(op: str, args: dict):
        sent.append(args | {"op": op})
        return 200, {"paused": True, "action": "keep", "tokens": 64}

    coordinator = PauseCoordinator(send=send, clock=lambda: 0.0)

    async def main():
        pause = dict(tool_class="subagents", deadline_ms=None, priority=0)
        await coordinator.pause(NS, "s1", "w0", resume_required=True, **pause)
        first = sent[-1]["resume_probability"]
        coordinator.forget(NS, "s1", "w0")  # closed while it waited on its tool
        await coordinator.pause(NS, "s1", "w1", resume_required=True, **pause)
        second = sent[-1]["resume_probability"]
        await coordinator.pause(NS, "s1", "w2", resume_required=False, **pause)
        assert second < first and sent[-1]["resume_probability"] == pytest.approx(second / 2)
        await coordinator.pause(NS, "s1", "w3", resume_required=True, tool_class="bash", deadline_ms=None,
                                priority=0)
        assert sent[-1]["resume_probability"] == pytest.approx(first)  # another class is unaffected
        coordinator.forget(NS, "s1")

    asyncio.run(main())


def test_a_lead_paused_while_its_subagents_run_waits_on_their_join():
    """Fork/join on the HTTP side: subagents' lifetimes (first call to close) are learned; a lead that
    pauses while some run sends their lifetime model and ages (the scheduler prices the join), and a
    subagent that starts while its lead is paused re-prices the lead's pause."""
    from sgl_agentcache.policy.join import LIFETIME_CLASS, MIN_LIFETIMES

    now = [0.0]
    sent: list[dict] = []

    async def send(op: str, args: dict):
        sent.append(args | {"op": op})
        return 200, {"paused": True, "action": "offload", "tokens": 64}

    coordinator = PauseCoordinator(send=send, clock=lambda: now[0])

    async def main():
        for i in range(MIN_LIFETIMES):  # earlier subagents: 4 s each
            coordinator.note_fork(NS, "s0", f"w{i}", "main")
            now[0] += 4.0
            coordinator.finished(NS, "s0", f"w{i}", reason="hint")
        assert coordinator.book.peek(NS, LIFETIME_CLASS).observations == MIN_LIFETIMES
        coordinator.note_fork(NS, "s1", "w0", "main")
        now[0] += 1.0
        pause = dict(tool_class="subagents", deadline_ms=60_000, priority=0, resume_required=True)
        await coordinator.pause(NS, "s1", "main", **pause)
        assert sent[-1]["join_elapsed_s"] == [1.0] and sent[-1]["latency"]["observations"] == MIN_LIFETIMES
        now[0] += 0.5
        coordinator.note_fork(NS, "s1", "w1", "main")  # another starts while the lead waits: re-priced
        await coordinator.settle()
        assert sent[-1]["op"] == "pause" and sent[-1]["join_elapsed_s"] == [0.0, 1.5]
        assert sent[-1]["deadline_s"] == pytest.approx(59.5)  # what is left of the lead's deadline
        assert coordinator.counters["join_pauses"] == 1 and coordinator.counters["join_repriced"] == 1
        coordinator.note_fork(NS, "s1", "w1", "main")  # a later call of a running subagent: nothing
        await coordinator.settle()
        assert coordinator.counters["join_repriced"] == 1
        await coordinator.pause(NS, "s2", "main", **pause)  # no subagents: the tool class's own model
        assert "join_elapsed_s" not in sent[-1]
        coordinator.forget(NS, "s1")
        coordinator.forget(NS, "s2")
        assert not coordinator.subagents.running

    asyncio.run(main())


def test_an_idle_branch_is_priced_as_a_pause_on_idle_and_its_gap_is_learned():
    """Session idleness on the HTTP side: a branch answered without a tool or a close is idle; the sweep
    pauses it on the implicit tool ``@idle`` once it has been idle past its namespace's usual gap, with
    its idle time as elapsed and no deadline (advice only); its next request resumes it and the whole
    gap is learned."""
    from sgl_agentcache.policy.idle import DEFAULT_AFTER_S, IDLE_CLASS

    now = [0.0]
    sent: list[dict] = []

    async def send(op: str, args: dict):
        sent.append(args | {"op": op})
        return 200, {"paused": True, "action": "offload", "tokens": 64}

    coordinator = PauseCoordinator(send=send, clock=lambda: now[0], idle_sweep_s=0.001)

    async def main():
        coordinator.note_answered(NS, "s1", "main")
        await asyncio.sleep(0.01)
        assert not sent  # not idle long enough yet
        now[0] = DEFAULT_AFTER_S + 5.0
        for _ in range(100):
            await asyncio.sleep(0.001)
            if sent:
                break
        await coordinator.settle()
        pause = sent[-1]
        assert pause["op"] == "pause" and pause["tool_class"] == IDLE_CLASS and pause["deadline_s"] is None
        assert pause["elapsed_s"] == pytest.approx(DEFAULT_AFTER_S + 5.0)
        assert coordinator.counters["idle_pauses"] == 1 and KEY in coordinator.active
        assert coordinator.active[KEY].timer is None  # never released for being idle
        # Idle twice as long: priced again with the longer elapsed time (advice given at the usual gap
        # must not hold for hours), still once per doubling.
        now[0] = 2 * (DEFAULT_AFTER_S + 5.0)
        for _ in range(100):
            await asyncio.sleep(0.001)
            if len(sent) == 2:
                break
        await coordinator.settle()
        assert len(sent) == 2 and sent[-1]["elapsed_s"] == pytest.approx(2 * (DEFAULT_AFTER_S + 5.0))
        assert coordinator.counters["idle_repriced"] == 1 and coordinator.counters["idle_pauses"] == 1
        await asyncio.sleep(0.01)
        assert len(sent) == 2
        now[0] = 200.0 + 2 * DEFAULT_AFTER_S
        coordinator.note_request(NS, "s1", "main")  # it came back: resumed, the whole gap learned
        await asyncio.sleep(0.01)
        assert KEY not in coordinator.active
        gaps = coordinator.book.peek(NS, IDLE_CLASS)
        from sgl_agentcache.policy.latency import LatencyModel

        assert gaps.observations == 1 and gaps.survival(150.0) > 2 * LatencyModel().survival(150.0)  # ~320 s
        coordinator.note_answered(NS, "s1", "main")
        coordinator.forget(NS, "s1")  # a close forgets it
        assert not coordinator.idle.since

    asyncio.run(main())


# ---- one tenant's pauses never stall another's (issue #38 item 3) ----

NS_A, NS_B = namespace_key(None, "tenant-a"), namespace_key(None, "tenant-b")


def test_a_tenants_reads_wait_only_for_its_own_pending_pauses(held):
    """Every control route used to wait for all tenants' pending pauses (``settle()``); a tenant's own
    view now waits for its namespace only, a close for its branch or session."""
    scheduler, coordinator = held

    async def main():
        coordinator.pause_soon(NS_A, "s1", "main", tool_class="bash", deadline_ms=None, priority=0,
                               resume_required=True)
        await asyncio.sleep(0.01)  # A's pause is held at the scheduler
        await asyncio.wait_for(coordinator.settle(namespace=NS_B), 1.0)  # B's view: nothing of B pending
        await asyncio.wait_for(coordinator.settle([(NS_A, "s2", "main")]), 1.0)  # another branch of A's
        await asyncio.wait_for(coordinator.settle(namespace=NS_A, session="s2"), 1.0)
        own = asyncio.create_task(coordinator.settle(namespace=NS_A))
        everything = asyncio.create_task(coordinator.settle())  # an operator's view waits for all
        await asyncio.sleep(0.01)
        assert not own.done() and not everything.done()
        scheduler.release.set()
        await asyncio.wait_for(asyncio.gather(own, everything), 1.0)
        coordinator.forget(NS_A, "s1")

    asyncio.run(main())


def test_a_namespaces_pending_and_paused_branches_are_bounded(held):
    """A namespace's background pauses past ``max_pending`` are shed (the branch stays unpaused), and
    pauses past ``max_paused`` are refused with 429; another namespace is not affected by either."""
    scheduler, coordinator = held
    coordinator.max_pending, coordinator.max_paused = 3, 4
    pause = dict(tool_class="bash", deadline_ms=None, priority=0, resume_required=True)

    async def main():
        tasks = [coordinator.pause_soon(NS_A, f"s{i}", "main", **pause) for i in range(5)]
        assert tasks[3] is None and tasks[4] is None and coordinator.counters["pauses_shed"] == 2
        assert coordinator.pause_soon(NS_B, "s0", "main", **pause) is not None  # B's own bound
        scheduler.release.set()
        await coordinator.settle()
        assert await coordinator.pause(NS_A, "s3", "main", **pause) == (200, {"paused": True, "action": "offload",
                                                                              "tokens": 64, "deadline_s": 600.0})
        status, body = await coordinator.pause(NS_A, "s4", "main", **pause)
        assert status == 429 and "nothing changed" in body["error"] and (NS_A, "s4", "main") not in coordinator.active
        assert (await coordinator.pause(NS_A, "s0", "main", **pause))[0] == 200  # re-pausing a paused branch
        assert (await coordinator.pause(NS_B, "s1", "main", **pause))[0] == 200
        for ns in (NS_A, NS_B):
            coordinator.purge(ns)

    asyncio.run(main())


def test_the_control_channel_serves_each_namespace_in_turn_and_batches_what_is_queued():
    """SGLang's communicator carries one control message at a time; the channel sends what is queued as
    one batch, taking one op from each namespace in turn, so B's op never waits behind A's queue."""
    from sgl_agentcache.server.front.control_channel import ControlChannel

    batches: list[list[str]] = []
    gate = asyncio.Event()

    async def send_batch(ops):
        batches.append([args["name"] for _, args in ops])
        await gate.wait()
        return [(200, {"echo": args["name"]}) for _, args in ops]

    async def main():
        channel = ControlChannel(send_batch, max_batch=4)
        first = asyncio.create_task(channel.call("a", "pause", {"name": "a0"}))
        await asyncio.sleep(0)  # a0 is in flight alone
        a_calls = [asyncio.create_task(channel.call("a", "pause", {"name": f"a{i}"})) for i in range(1, 9)]
        b_call = asyncio.create_task(channel.call("b", "stats", {"name": "b0"}))
        await asyncio.sleep(0)
        gate.set()
        assert (await b_call) == (200, {"echo": "b0"})
        await asyncio.gather(first, *a_calls)
        assert batches[0] == ["a0"] and batches[1] == ["a1", "b0", "a2", "a3"]  # b0 in the very next batch
        assert [name for batch in batches for name in batch if name != "b0"] == [f"a{i}" for i in range(9)]
        assert channel.counters["largest_batch"] == 4 and channel.queued() == 0
        assert [(await c)[1]["echo"] for c in a_calls] == [f"a{i}" for i in range(1, 9)]

    asyncio.run(main())
