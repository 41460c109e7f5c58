"""Load-backs of spilled KV for a request being admitted, copied off the scheduler thread.

A request's admission match (``AgentRadixCache.match_prefix``, not a ranking match) that finds spilled
entries continuing its device match used to copy them back right there, on the scheduler thread, before
the batch could be built. Here that match only *issues* the load (:meth:`AsyncLoads.issue`): it finds
the chain and allocates its slots (``SpillTier.prepare_load``, holding the match locked and the chain
pinned) and hands the copy to a worker thread (on CUDA, its own stream). The scheduler then skips the
request for that step (the plugin's hook on ``PrefillAdder.add_one_req`` returns ``CONTINUE`` without
adding it, the same way SGLang skips a request whose HiCache storage prefetch is still running) and
goes on with the rest of the queue. At the request's next admission match the load is *finished*
(:meth:`AsyncLoads.finish`): the copy is joined (usually done by then: it ran beside a forward pass),
the chain inserted, and the request matched and admitted with it.

Every TP rank takes the same decisions: the load is issued and finished at the same matches on every
rank (their order is the scheduler's, never the worker's pace), the join waits for the copy however
long it takes, and a failed copy is agreed on (``AgentRadixCache.agree``) so every rank recomputes.
Between the two steps the tree may change: the finish inserts only if the device match and the chain
are still exactly what the issue found (``SpillTier.still_current``); otherwise it frees the slots and
the request is matched as things are now (counted ``abandoned["changed"]``). If the load's slots
came out of memory the requests already in the batch being built were admitted against (the adder's
budget went negative), the hook gives them back at once and the request is added as it is,
recomputing what it lacks (``abandoned["no_room"]``). A request aborted while
its load is in flight (``release_aborted_request``) and a cache reset drop the load: the copy is
joined first (the worker may still be writing the slots), then the slots are freed.

``AGENTCACHE_ASYNC_LOAD``: ``auto`` (default: on for CPU pools, off for CUDA ones until the side-stream
path has run on a GPU), ``1``, ``0`` (load-backs copy on the scheduler thread, as before). Speculative
loads (prefetch) and eager pauses' restores still copy on the scheduler thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from sgl_agentcache.server.spill import PreparedLoad
from sgl_agentcache.server.transfer_worker import TransferWorker, wanted

logger = logging.getLogger(__name__)
ASYNC_LOAD_ENV = "AGENTCACHE_ASYNC_LOAD"


def async_load_wanted(kv_device) -> bool:
    """Whether load-backs are asynchronous for a pool on ``kv_device`` (``AGENTCACHE_ASYNC_LOAD``)."""
    return wanted(ASYNC_LOAD_ENV, kv_device)


@dataclass
class _InFlight:
    load: PreparedLoad
    future: Future  # -> seconds the copy took


class AsyncLoads:
    """The load-backs in flight of one cache, by request id (see the module docstring). Owned by the
    scheduler thread; the worker only runs ``SpillTier.copy_chain``."""

    def __init__(self, cache, enabled: bool):
        self.cache = cache
        self.enabled = enabled
        self.by_rid: dict[str, _InFlight] = {}
        device = getattr(cache.token_to_kv_pool_allocator, "device", "cpu")
        self._worker = TransferWorker(device, "agentcache-load")  # its thread starts at the first load
        self.counters = {"issued": 0, "issued_tokens": 0, "finished": 0, "loaded_tokens": 0,
                         "joined_running": 0, "abandoned": {"changed": 0, "no_room": 0, "aborted": 0, "unfinished": 0,
                                                      "reset": 0}}

    def pending(self, rid) -> bool:
        """Whether ``rid`` has a load in flight (the scheduler skips it until its next match)."""
        return bool(self.by_rid) and rid in self.by_rid

    def in_flight_tokens(self) -> int:
        """Device slots allocated to loads in flight (neither free nor in the tree: the integrity
        check's conservation counts them)."""
        return sum(len(f.load.new) for f in self.by_rid.values())

    def issue(self, rid, key, last_device_node, device_prefix_len: int) -> bool:
        """Start loading back what continues ``key`` past its device match, for request ``rid``.
        Returns False when there is nothing to load (or no room): the request is admitted as it is."""
        spill = self.cache.spill
        load = spill.prepare_load(key, last_device_node, device_prefix_len, hold=True)
        if load is None:
            return False
        spill.loading.update(load.chain)
        self.by_rid[rid] = _InFlight(load, self._worker.submit(spill.copy_chain, load))
        self.counters["issued"] += 1
        self.counters["issued_tokens"] += len(load.new)
        return True

    def finish(self, rid) -> int:
        """Join ``rid``'s copy and insert what it loaded; returns the tokens that became
        device-resident past the old match (0 when the copy failed or the tree changed meanwhile)."""
        flight = self.by_rid.pop(rid)
        load, spill = flight.load, self.cache.spill
        failure = self._join(flight)
        spill.loading.difference_update(load.chain)
        spill.release_load(load)
        # Tree state, the same on every rank (so no agreement needed): only the copy's outcome is agreed on.
        if not spill.still_current(load):
            self._free(load)
            self.counters["abandoned"]["changed"] += 1
            logger.info("agentcache: a load-back of %d tokens was overtaken by the tree; matching as it is now",
                        len(load.new))
            return 0
        loaded = spill.finish_load(load, failure)
        self.counters["finished"] += 1
        self.counters["loaded_tokens"] += loaded
        return loaded

    def cancel(self, rid, reason: str = "aborted") -> None:
        """Drop ``rid``'s load (the request left the queue, or the tree was reset)."""
        flight = self.by_rid.pop(rid, None)
        if flight is None:
            return
        self._join(flight)  # the worker may still be writing the slots
        spill = self.cache.spill
        spill.loading.difference_update(flight.load.chain)
        spill.release_load(flight.load)
        self._free(flight.load)
        self.counters["abandoned"][reason] += 1

    def reset(self) -> None:
        """The tree is being rebuilt empty: every load in flight goes (before the pools are cleared)."""
        for rid in list(self.by_rid):
            self.cancel(rid, "reset")

    def stats(self) -> dict:
        return {"enabled": self.enabled, "in_flight": len(self.by_rid), **self.counters}

    def _join(self, flight: _InFlight) -> BaseException | None:
        if not flight.future.done():
            self.counters["joined_running"] += 1
        try:
            flight.load.seconds = flight.future.result()
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: recomputed
            return exc
        return None

    def _free(self, load: PreparedLoad) -> None:
        self.cache.token_to_kv_pool_allocator.free(load.new)


__all__ = ["ASYNC_LOAD_ENV", "AsyncLoads", "async_load_wanted"]
