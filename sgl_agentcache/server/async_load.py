"""Host->device copies for a request being admitted, and prefetches, made off the scheduler thread.

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

An eager pause's restore for the branch's next request goes the same way
(:meth:`AsyncLoads.issue_restore`: ``HostCopies.prepare_restore`` allocates the slots and holds the
prefix, the next match inserts with ``HostCopies.finish_restore`` and ends the pause), and so does a
fork's restore of its paused parent's history (which leaves the parent paused; a sibling fork that
needs it too waits for it to land, as for a load-back). A prefetch
("the tool is nearly done", :meth:`AsyncLoads.issue_prefetch`) belongs to no request: it lands at a
later scheduler step (:meth:`AsyncLoads.land_prefetches`; a busy step lands only copies already made
on every rank, an idle poll waits), or as soon as anything touches the branch (:meth:`AsyncLoads.settle`:
its request, a resume, another restore).

Every TP rank takes the same decisions: the load is issued and finished at the same matches on every
rank (their order is the scheduler's, never the worker's pace), the join waits for the copy however
long it takes, and a failed copy is agreed on (``AgentRadixCache.agree``) so every rank recomputes.
Between the two steps the tree may change: the finish inserts only if the device match and the chain
are still exactly what the issue found (``SpillTier.still_current``; for a restore, the held prefix's
match); otherwise it frees the slots and the request is matched as things are now (counted
``abandoned["changed"]``). If the load's slots came out of memory the requests already in the batch
being built were admitted against (the adder's budget went negative), the hook gives them back at once
and the request is added as it is, recomputing what it lacks (``abandoned["no_room"]``). A request
aborted while its load is in flight (``release_aborted_request``), a branch closed or discarded while
its copy comes back (``abandoned["dropped"]``) and a cache reset drop the copy: it is joined first (the
worker may still be writing the slots), then the slots are freed.

A request whose key continues into entries another request's load holds (siblings forked together
reach the scheduler in one step, and the first one's match issued the load of their parent's spilled
history) is skipped too, rather than admitted to prefill those tokens itself: at its next match they
are on the device and it hits them (:meth:`AsyncLoads.wait_for_other`, at most
:data:`MAX_WAIT_STEPS` steps, ``counters["waited_for_other"]``). The real server showed the loss this
avoids: on ``bench/server_recompute.py``'s trace such siblings recomputed 124-240 tokens each.

``AGENTCACHE_ASYNC_LOAD``: ``auto`` (default: on for CPU and CUDA pools, see
``transfer_worker.CHECKED_DEVICE_TYPES``), ``1``, ``0`` (every host->device copy on the scheduler thread, as before). Eager
offloads (device->host) copy on a worker too (``AGENTCACHE_ASYNC_OFFLOAD``,
:mod:`~sgl_agentcache.server.host_copies`). The resume route's restore (``/agentcache/resume`` on an offloaded
branch, before its request comes) lands like a prefetch.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.server.host_copies import PreparedRestore
from sgl_agentcache.server.spill import PreparedLoad
from sgl_agentcache.server.transfer_worker import TransferWorker, wanted

logger = logging.getLogger(__name__)
ASYNC_LOAD_ENV = "AGENTCACHE_ASYNC_LOAD"
#: Scheduler steps a request waits for another request's load-back of what it continues into before
#: it is admitted as it is (recomputing those tokens): a bound, in case the loader itself keeps waiting.
MAX_WAIT_STEPS = 4


def async_load_wanted(kv_device) -> bool:
    """Whether load-backs are asynchronous for a pool on ``kv_device`` (``AGENTCACHE_ASYNC_LOAD``)."""
    return wanted(ASYNC_LOAD_ENV, kv_device)


@dataclass
class _InFlight:
    load: PreparedLoad
    future: Future  # -> seconds the copy took

    @property
    def slots(self) -> int:
        return len(self.load.new)


@dataclass
class _Restoring:
    """An eager pause's host copy being copied back (``HostCopies.prepare_restore``): for the branch's
    request (keyed by its rid), or ahead of it (a prefetch, the resume route; keyed by branch)."""

    prepared: PreparedRestore
    future: Future  # -> seconds the copy took
    seconds: float = 0.0
    for_fork: bool = False  # a paused parent's history for its fork's request: the parent stays paused

    @property
    def slots(self) -> int:
        return len(self.prepared.new)


class AsyncLoads:
    """The host->device copies in flight of one cache: by request id (spill load-backs, eager restores)
    and by branch (prefetches); see the module docstring. Owned by the scheduler thread; the worker only
    runs ``SpillTier.copy_chain`` and ``HostTier.copy_back``."""

    def __init__(self, cache, enabled: bool):
        self.cache = cache
        self.enabled = enabled
        self.by_rid: dict[str, _InFlight | _Restoring] = {}
        self.restoring: dict[BranchKey, str] = {}  # branch -> the request its eager restore is copied for
        self.prefetches: dict[BranchKey, _Restoring] = {}  # copies back ahead of a request, in issue order
        self.waiting: dict[str, int] = {}  # rid -> steps it has waited for another request's load
        device = getattr(cache.token_to_kv_pool_allocator, "device", "cpu")
        self._worker = TransferWorker(device, "agentcache-load")  # its thread starts at the first load
        self.counters = {"issued": 0, "issued_tokens": 0, "finished": 0, "loaded_tokens": 0,
                         "joined_running": 0, "abandoned": {"changed": 0, "no_room": 0, "aborted": 0, "unfinished": 0,
                                                      "reset": 0, "dropped": 0},
                         "restores_issued": 0, "restores_finished": 0, "prefetches_issued": 0,
                         "prefetches_landed": 0, "waited_for_other": 0, "waits_given_up": 0, "landed_idle": 0}

    def pending(self, rid) -> bool:
        """Whether ``rid`` has a load in flight (the scheduler skips it until its next match)."""
        return bool(self.by_rid) and rid in self.by_rid

    def holds_back(self, rid) -> bool:
        """Whether the scheduler skips ``rid`` this step: its own load is in flight, or it waits for
        another request's (:meth:`wait_for_other`)."""
        return (bool(self.by_rid) and rid in self.by_rid) or (bool(self.waiting) and rid in self.waiting)

    def take_waited(self, rid) -> int:
        """At ``rid``'s admission match: the steps it waited so far (it no longer waits until
        :meth:`wait_for_other` says so again)."""
        return self.waiting.pop(rid, 0) if self.waiting else 0

    def wait_for_other(self, rid, waited: int) -> bool:
        """``rid``'s key continues into entries another request's load holds: skip it this step (True),
        unless it already waited :data:`MAX_WAIT_STEPS` steps (False: it is admitted as it is)."""
        if waited >= MAX_WAIT_STEPS:
            self.counters["waits_given_up"] += 1
            return False
        self.waiting[rid] = waited + 1
        self.counters["waited_for_other"] += 1
        return True

    def in_flight_tokens(self) -> int:
        """Device slots allocated to loads in flight (neither free nor in the tree: the integrity
        check's conservation counts them)."""
        return sum(f.slots for f in self.by_rid.values()) + sum(f.slots for f in self.prefetches.values())

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

    def issue_restore(self, rid, prepared: PreparedRestore, *, for_fork: bool = False) -> None:
        """Copy an eager pause's host copy back for request ``rid`` (its slots allocated and its prefix
        held by ``HostCopies.prepare_restore(hold=True)``); finished at the request's next match. With
        ``for_fork`` it is a paused parent's copy that a fork needs: landing it does not end the pause."""
        flight = self._copy_back(prepared)
        flight.for_fork = for_fork
        self.by_rid[rid] = flight
        self.restoring[prepared.branch] = rid
        self.counters["restores_issued"] += 1

    def issue_prefetch(self, prepared: PreparedRestore) -> None:
        """Copy a branch's host copy back ahead of its request (a prefetch, or the resume route's
        restore; its slots allocated and its prefix held by ``HostCopies.prepare_restore(hold=True)``).
        It lands at a later step (:meth:`land_prefetches`), or when anything touches the branch first
        (:meth:`settle`)."""
        self.prefetches[prepared.branch] = self._copy_back(prepared)
        self.counters["prefetches_issued"] += 1

    def copying_back(self, branch: BranchKey) -> bool:
        """Whether ``branch``'s host copy is being copied back for its request (then nothing else may
        restore it: the finish inserts it)."""
        return bool(self.restoring) and branch in self.restoring

    def settle(self, branch: BranchKey) -> int | None:
        """Land ``branch``'s prefetch in flight now, if it has one (its request came, it resumes, it
        expires...): returns the tokens it restored, or None when none was in flight."""
        flight = self.prefetches.pop(branch, None) if self.prefetches else None
        return None if flight is None else self._land_prefetch(flight)

    def land_prefetches(self, *, wait: bool = True) -> None:
        """The scheduler's step: prefetches in flight land (without ``wait``, only those whose copy is
        made on every TP rank, in issue order: the worker makes them in that order)."""
        for branch, flight in list(self.prefetches.items()):
            if not wait and not self.cache.agreement(flight.future.done()):
                break
            del self.prefetches[branch]
            self._land_prefetch(flight)

    def drop_branch(self, branch: BranchKey) -> None:
        """``branch``'s host copy is being dropped: stop copying it back (slots freed, nothing inserted)."""
        if self.restoring and branch in self.restoring:
            self.cancel(self.restoring[branch], "dropped")
        flight = self.prefetches.pop(branch, None) if self.prefetches else None
        if flight is not None:
            self._abandon(flight, "dropped")

    def finish(self, rid) -> int:
        """Join ``rid``'s copy and insert what it loaded; returns the tokens that became
        device-resident past the old match (0 when the copy failed or the tree changed meanwhile)."""
        flight = self.by_rid.pop(rid)
        if isinstance(flight, _Restoring):
            return self._finish_restore(flight)
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

    def land_stranded(self) -> int:
        """An idle scheduler (no batch this step): finish every request's load still in flight now, its
        KV inserted into the tree (unlocked), instead of at its owner's next admission match. Returns
        the tokens that became device-resident.

        The scheduler reaches a waiting request only when every request ahead of it was skipped or
        admitted; one ahead that does not fit ends the step. A load whose owner sits behind such a
        request would keep its slots -- neither free nor evictable -- until that request fits, which
        those slots can prevent: the queue then never moves (seen behind the router: a 2,048-token
        pool with 876 slots held by one load, four requests waiting, the scheduler idle for minutes).
        Landed, the slots are evictable and the owner's next match hits what they hold. Every TP rank
        is idle at the same iteration (same messages, same batches), so they land at the same point;
        the join waits for copies still running. A failure leaves the owner to recompute."""
        landed = 0
        for rid in list(self.by_rid):
            try:
                landed += self.finish(rid)
            except Exception:  # noqa: BLE001 - never the scheduler's: the request recomputes
                logger.exception("agentcache: landing the load-back of %s while idle failed; recomputing", rid)
                self.cache.spill.counters["load_errors"] += 1
                self.cancel(rid, "unfinished")
            self.counters["landed_idle"] += 1
        return landed

    def cancel(self, rid, reason: str = "aborted") -> None:
        """Drop ``rid``'s load (the request left the queue, or the tree was reset)."""
        if self.waiting:
            self.waiting.pop(rid, None)
        flight = self.by_rid.pop(rid, None)
        if flight is None:
            return
        if isinstance(flight, _Restoring):
            branch = flight.prepared.branch
            self.restoring.pop(branch, None)
            self._abandon(flight, reason)
            if reason != "dropped" and not flight.for_fork:  # its request ran or left without it: the
                self.cache.pauses.end_resume(branch, abandoned=True)  # pause ends, recomputed
            return
        self._join(flight)  # the worker may still be writing the slots
        spill = self.cache.spill
        spill.loading.difference_update(flight.load.chain)
        spill.release_load(flight.load)
        self._free(flight.load)
        self.counters["abandoned"][reason] += 1

    def reset(self) -> None:
        """The tree is being rebuilt empty: every load in flight goes (before the pools are cleared)."""
        self.waiting.clear()
        for rid in list(self.by_rid):
            self.cancel(rid, "reset")
        for branch in list(self.prefetches):
            self._abandon(self.prefetches.pop(branch), "reset")

    def stats(self) -> dict:
        return {"enabled": self.enabled, "in_flight": len(self.by_rid), "prefetches_in_flight": len(self.prefetches),
                "waiting": len(self.waiting), **self.counters}

    def _copy_back(self, prepared: PreparedRestore) -> _Restoring:
        host = self.cache.pauses.host
        return _Restoring(prepared, self._worker.submit(host.copy_back, prepared.entry, prepared.first, prepared.new))

    def _finish_restore(self, flight: _Restoring) -> int:
        branch = flight.prepared.branch
        self.restoring.pop(branch, None)
        restored = self._insert(flight)
        if flight.for_fork:
            self.cache.pauses.fork_restore_landed(branch, restored)
        else:
            self.cache.pauses.end_resume(branch)
        self.counters["restores_finished"] += 1
        return restored

    def _land_prefetch(self, flight: _Restoring) -> int:
        restored = self._insert(flight)
        self.cache.pauses.prefetch_landed(flight.prepared.branch, restored, flight.seconds)
        self.counters["prefetches_landed"] += 1
        return restored

    def _insert(self, flight: _Restoring) -> int:
        """Join a restore's copy, count it, and insert it (``HostCopies.finish_restore``, which agrees on
        the outcome); returns the tokens restored."""
        prepared, cache = flight.prepared, self.cache
        failure = self._join(flight)
        copies = cache.copies
        cache.pauses.host.count_promote(prepared.entry, prepared.first,
                                        flight.seconds if failure is None else failure)
        # The prefix was held, so it is still there; only a suffix someone else inserted meanwhile (a
        # request with the same tokens) changes the tree under the copy: then restore as things are now.
        if cache.resident_prefix_len(prepared.key) != prepared.have:
            copies.abandon_restore(prepared)
            self.counters["abandoned"]["changed"] += 1
            return copies.restore(prepared.branch, keep_host=prepared.keep_host)
        return copies.finish_restore(prepared, failure)

    def _abandon(self, flight: _Restoring, reason: str) -> None:
        self._join(flight)  # the worker may still be writing the slots
        self.cache.copies.abandon_restore(flight.prepared)
        self.counters["abandoned"][reason] += 1

    def _join(self, flight) -> BaseException | None:
        if not flight.future.done():
            self.counters["joined_running"] += 1
        try:
            seconds = flight.future.result()
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: recomputed
            return exc
        if isinstance(flight, _Restoring):
            flight.seconds = seconds
        else:
            flight.load.seconds = seconds
        return None

    def _free(self, load: PreparedLoad) -> None:
        self.cache.token_to_kv_pool_allocator.free(load.new)


__all__ = ["ASYNC_LOAD_ENV", "MAX_WAIT_STEPS", "AsyncLoads", "async_load_wanted"]
