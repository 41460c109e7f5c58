"""The HTTP process's one path to the schedulers: control ops batched, namespaces served in turn.

SGLang's ``FanOutCommunicator`` carries one control message at a time (its replies carry no request
id, so a second message waits until the first one's replies are in), and each round trip costs up to
one scheduler iteration. Sent op by op in arrival order, one tenant's burst of background pauses (a
hinted call with ``tool_class`` pauses its branch when it finishes) queued every other tenant's
control routes behind it: another tenant's ``GET /agentcache/stats`` took 24 s (issue #38 item 3).

:class:`ControlChannel` keeps one queue (a *lane*) per namespace and sends whatever is queued as one
``batch`` op (:func:`~sgl_agentcache.server.control.handle_batch`: the schedulers apply the ops in the
batch's order, every TP rank alike, and answer each). A batch takes one op from each lane in turn, up
to :data:`MAX_BATCH_OPS`, so an op waits for at most the batch in flight and one op of each other
lane ahead of it in the next, however long another lane's queue is. Within a lane the order is the
arrival order (a branch's pause, then its resume), and the batch keeps it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Awaitable, Callable

#: Ops sent in one batch at most (the rest go in the next; each lane gets its turn first).
MAX_BATCH_OPS = 64

SendBatch = Callable[[list[tuple[str, dict]]], Awaitable[list[tuple[int, dict]]]]


class ControlChannel:
    """Queues control ops by lane (a namespace; ``""`` for operator ops) and sends them in batches;
    ``send_batch`` is the one scheduler round trip for a list of ``(op, args)``, answering a
    ``(status, result)`` per op, in order."""

    def __init__(self, send_batch: SendBatch, max_batch: int = MAX_BATCH_OPS):
        self.send_batch = send_batch
        self.max_batch = max_batch
        self.lanes: OrderedDict[str, deque] = OrderedDict()
        self._pump: asyncio.Task | None = None
        self.counters = {"batches": 0, "ops": 0, "largest_batch": 0}

    async def call(self, lane: str, op: str, args: dict) -> tuple[int, dict]:
        """Queue ``op`` in ``lane`` and return its reply once the batch carrying it is answered. A
        caller cancelled before its op is sent drops the op; once sent, the op is applied regardless."""
        future = asyncio.get_running_loop().create_future()
        self.lanes.setdefault(lane, deque()).append((op, args, future))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())
        return await future

    def queued(self, lane: str | None = None) -> int:
        """Ops waiting to be sent (in ``lane``, or in all)."""
        if lane is not None:
            return len(self.lanes.get(lane, ()))
        return sum(len(queue) for queue in self.lanes.values())

    def take(self) -> list[tuple[str, dict, asyncio.Future]]:
        """The next batch: one op from each lane in turn until :attr:`max_batch` or nothing is left.
        Lanes it empties are dropped; the lane after the last one served starts the next batch."""
        batch = []
        while self.lanes and len(batch) < self.max_batch:
            lane, queue = next(iter(self.lanes.items()))
            self.lanes.move_to_end(lane)
            item = queue.popleft()
            if not queue:
                del self.lanes[lane]
            if not item[2].cancelled():
                batch.append(item)
        return batch

    async def _run(self) -> None:
        while self.lanes:
            batch = self.take()
            if not batch:
                continue
            self.counters["batches"] += 1
            self.counters["ops"] += len(batch)
            self.counters["largest_batch"] = max(self.counters["largest_batch"], len(batch))
            try:
                replies = await self.send_batch([(op, args) for op, args, _ in batch])
                if len(replies) != len(batch):
                    raise RuntimeError(f"{len(replies)} replies to a batch of {len(batch)} ops")
            except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the failure
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (*_, future), reply in zip(batch, replies):
                if not future.done():
                    future.set_result(reply)

    def stats(self) -> dict:
        return {"queued": self.queued(), "lanes": len(self.lanes), **self.counters}


__all__ = ["MAX_BATCH_OPS", "ControlChannel"]
