"""Device->host copies made ahead of eviction, off the scheduler thread.

Without it, every spill copies its node's KV when eviction takes the node: on the scheduler thread, in
the middle of making room for a batch (and on CUDA, SGLang's ``get_cpu_copy`` synchronizes the whole
device around the copy). With it, once the free pool runs low, the leaves eviction ranks lowest are
copied by a worker thread (on CUDA, on its own stream) while the scheduler goes on; when eviction then
takes such a leaf, the spill uses the copy already made (joining it if it is still running) instead of
copying.

What the tree does never depends on this: the same nodes are spilled, with the same bytes, at the same
point in the message order, whether a copy was made ahead, is still running, failed or went stale
(then the spill copies as before). So every TP rank takes the same decisions although their workers
run at their own pace. A copy made ahead is used only if the node still has exactly the device slots it
was copied from (a split or a re-insert changes them); its bytes cannot have changed meanwhile (a
cached node's KV is written once, and its slots are freed only after it leaves the tree, which drops
the copy). Copies made ahead wait in host memory outside the host tier's capacity, bounded by
``AGENTCACHE_COPY_AHEAD_TOKENS`` (staging, like HiCache's write buffers); one that eviction no longer
ranks next is dropped at the next planning step.

``AGENTCACHE_COPY_AHEAD``: ``auto`` (default: on for CUDA pools, off for CPU and other devices), ``1``
on, ``0`` off. On CUDA the worker's copy runs on a stream of its own beside the forward pass; on a CPU
pool it takes a core the forward pass needs, and the real-server benchmark measured it costing more
than it saves (bench/README.md, "Where ours loses"), so ``auto`` leaves it off there.
tests/test_copy_ahead.py runs the CPU path with the switch on; the CUDA path (the worker on its own
stream, its device set) is checked on a GPU by ``bench/gpu/side_stream_check.py``.
"""

from __future__ import annotations

import heapq
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.server.transfer_worker import TransferWorker, wanted

logger = logging.getLogger(__name__)
FULL = ComponentType.FULL
COPY_AHEAD_ENV = "AGENTCACHE_COPY_AHEAD"
COPY_AHEAD_TOKENS_ENV = "AGENTCACHE_COPY_AHEAD_TOKENS"
_CANDIDATES = 64  # leaves ranked per planning step (the budget usually stops well before)
#: Pool devices ``auto`` turns copy-ahead on for: CUDA only (see the module docstring).
AUTO_DEVICE_TYPES = ("cuda",)


def copy_ahead_wanted(kv_device: torch.device | str | None) -> bool:
    """Whether copy-ahead runs for a pool on ``kv_device`` (see ``AGENTCACHE_COPY_AHEAD``)."""
    return wanted(COPY_AHEAD_ENV, kv_device, AUTO_DEVICE_TYPES)


@dataclass
class _Ahead:
    value: torch.Tensor  # the node's slot tensor when the copy was issued (SGLang replaces it, never edits it)
    tokens: int
    future: Future  # -> (kv, seconds)


class CopyAhead:
    """Copies of the next eviction victims, made by one worker thread (see the module docstring).
    ``plan`` runs on the scheduler's per-step tick; ``take`` and ``forget`` on its eviction path."""

    def __init__(self, cache, budget_tokens: int, enabled: bool):
        self.cache = cache
        self.budget_tokens = max(int(budget_tokens), 0)
        self.enabled = enabled and self.budget_tokens > 0
        self.pending: dict = {}  # node -> _Ahead
        self.pending_tokens = 0
        device = getattr(cache.token_to_kv_pool_allocator, "device", "cpu")
        self._worker = TransferWorker(device, "agentcache-copy-ahead")  # its thread starts at the first copy
        self.counters = {"issued": 0, "issued_tokens": 0, "used": 0, "used_tokens": 0, "joined_running": 0,
                         "stale": 0, "dropped": 0, "failed": 0, "worker_copy_s": 0.0}

    # ---- the scheduler's tick ----

    def plan(self) -> None:
        """Under pressure (free pool below twice the budget: evictions are near), copy ahead the leaves
        eviction ranks lowest, up to the budget; drop copies of leaves it no longer ranks next. Runs
        only when the pending copies fell below half the budget, so a busy step pays for one ranking
        of the evictable leaves at most every few evictions."""
        cache = self.cache
        if not cache.spill.enabled:
            return
        free = cache.token_to_kv_pool_allocator.available_size()
        if free >= 2 * self.budget_tokens:
            if self.pending:
                self._drop_all()  # no pressure: nothing needs staging memory
            return
        if self.pending_tokens > self.budget_tokens // 2:
            return
        rank = cache.components[FULL].session_ref_eviction_strategy
        leaves = [n for n in cache.tree_core.evictable_device_leaves if not n.agent.terminated]
        chosen, tokens = [], 0
        for node in heapq.nsmallest(_CANDIDATES, leaves, key=rank):
            n = len(node.key)
            if tokens + n > self.budget_tokens:
                break
            chosen.append(node)
            tokens += n
        keep = set(chosen)
        for node in [n for n in self.pending if n not in keep]:
            self._drop(node, "dropped")
        for node in chosen:
            if node not in self.pending:
                self._issue(node)

    def _issue(self, node) -> None:
        value = node.component_data[FULL].value
        n = len(value)
        self.pending[node] = _Ahead(value, n, self._worker.submit(self._copy, value))
        self.pending_tokens += n
        self.counters["issued"] += 1
        self.counters["issued_tokens"] += n

    def _copy(self, slots: torch.Tensor):  # slots: a cached node's, never written while it is in the tree
        """On the worker thread: the allocator's own copy (the bytes a spill would have made)."""
        began = time.perf_counter()
        kv = self.cache.token_to_kv_pool_allocator.get_cpu_copy(slots)
        return kv, time.perf_counter() - began

    # ---- the eviction path ----

    def take(self, node):
        """The copy made ahead for ``node`` as ``(kv, seconds)``, or None (none made, stale, failed):
        the caller copies then. Joins a copy still running."""
        ahead = self.pending.pop(node, None) if self.pending else None
        if ahead is None:
            return None
        self.pending_tokens -= ahead.tokens
        if node.component_data[FULL].value is not ahead.value:  # split or re-inserted since: other slots
            ahead.future.cancel()
            self.counters["stale"] += 1
            return None
        if not ahead.future.done():
            self.counters["joined_running"] += 1
        try:
            kv, seconds = ahead.future.result()
        except Exception:  # noqa: BLE001 - the spill copies instead (and reports its own failure)
            self.counters["failed"] += 1
            logger.debug("agentcache: a copy made ahead failed; the spill copies itself", exc_info=True)
            return None
        self.counters["used"] += 1
        self.counters["used_tokens"] += ahead.tokens
        self.counters["worker_copy_s"] += seconds
        return kv, seconds

    def forget(self, node) -> None:
        """``node`` left the tree other than by a spill: its copy goes."""
        if self.pending and node in self.pending:
            self._drop(node, "dropped")

    def _drop(self, node, reason: str) -> None:
        ahead = self.pending.pop(node)
        ahead.future.cancel()  # a running copy finishes on the worker; its result is never read
        self.pending_tokens -= ahead.tokens
        self.counters[reason] += 1

    def _drop_all(self) -> None:
        for node in list(self.pending):
            self._drop(node, "dropped")

    def reset(self) -> None:
        """The tree was rebuilt empty."""
        self._drop_all()

    def wait_idle(self) -> None:
        """Block until the worker has finished everything issued (tests, shutdown)."""
        for ahead in list(self.pending.values()):
            if not ahead.future.cancelled():
                try:
                    ahead.future.result()
                except Exception:  # noqa: BLE001 - take() reports it
                    pass

    def stats(self) -> dict:
        return {"enabled": self.enabled, "budget_tokens": self.budget_tokens, "pending": len(self.pending),
                "pending_tokens": self.pending_tokens, **self.counters}
