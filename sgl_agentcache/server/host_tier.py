"""The host tier: paused branches' KV copied out of the device pool, and back (one entry per branch).

A small interface -- :meth:`HostTier.demote` (device -> host), :meth:`HostTier.promote` (host ->
device), :meth:`HostTier.delete` -- over SGLang's own byte movers, the KV allocator's
``get_cpu_copy(indices)`` / ``load_cpu_copy(copy, indices)`` (the pair SGLang uses to back up a retracted
request). They exist for every KV pool layout SGLang supports and work on CUDA and on CPU, so the tier
is real on both: offload really moves KV bytes out of the device pool and restore really writes them
back. Bytes and seconds of every transfer are measured (for stats and metrics only: no cache decision
reads a clock, so every TP rank decides the same).

Why not SGLang's HiCache here: HiCache is node-granular write-through (every inserted node is backed
up, evicted ones are loaded back on a later match). A tool pause needs the opposite grain -- one
explicit move of one branch's private suffix, at a moment the policy chooses -- and HiCache cannot
start on CPU (``cudaHostRegister``, see ``docs/cpu-sglang-recipe.md``). HiCache is not run beside this
tier: it would keep on its own host pool the nodes our closes and offloads free (start-up refuses the
combination, ``server/topology.py``); the node spill (:mod:`~sgl_agentcache.server.spill`) gives its
write-back semantics here.

Capacity is in tokens (``AGENTCACHE_HOST_TOKENS``, default 4x the device pool), one budget
shared with the node spill (:mod:`~sgl_agentcache.server.spill`, evicted nodes kept on host): a copy
that needs room drops spilled nodes least recently used first, and is refused, never partial, when
paused branches' copies hold the rest. Fault injection (``fail_next``) exists for tests: it makes
the next transfers of a kind raise, exactly where a real transfer error would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_agentcache.lifecycle import BranchKey, NodeState

HOST_TOKENS_ENV = "AGENTCACHE_HOST_TOKENS"


class TransferError(RuntimeError):
    """A host<->device copy failed; the caller falls back to recompute."""


@dataclass
class HostEntry:
    """One branch's offloaded suffix: tokens ``[start, end)`` of ``tokens`` (the branch's path key)."""

    branch: BranchKey
    tokens: Any  # the path's token ids [0, end) (array('q'))
    extra_key: str | None
    cache_salt: str | None
    start: int
    segments: list[tuple[int, NodeState]]  # (absolute offset, state) of each offloaded node, in order
    kv: list = field(repr=False)  # the allocator's CPU copy of each segment
    nbytes: int = 0
    anchor: Any = None  # the device node the copy hangs from (protected while the copy exists)
    anchor_owner: BranchKey | None = None  # the branch that owns it (a fork's parent): restored first if gone

    @property
    def end(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def segment_end(self, i: int) -> int:
        return self.segments[i + 1][0] if i + 1 < len(self.segments) else self.end

    def first_missing(self, have: int) -> int:
        """Index of the segment holding token ``have`` (a restore starts there; what the device still
        holds before it is not copied again)."""
        i = 0
        while i + 1 < len(self.segments) and self.segments[i + 1][0] <= have:
            i += 1
        return i

    def state_at(self, offset: int) -> NodeState:
        state = self.segments[0][1]
        for seg_start, seg_state in self.segments:
            if seg_start > offset:
                break
            state = seg_state
        return state


def nbytes_of(obj: Any) -> int:
    """Total bytes of the tensors in a (nested) CPU copy."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.element_size() * obj.numel()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(x) for x in obj)
    return 0


@dataclass
class TransferStats:
    count: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    def add(self, tokens: int, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.tokens += tokens
        self.bytes += nbytes
        self.seconds += seconds

    def to_dict(self) -> dict:
        rate = self.bytes / self.seconds if self.seconds > 0 else 0.0
        return {"count": self.count, "tokens": self.tokens, "bytes": self.bytes, "seconds": self.seconds,
                "failures": self.failures, "effective_bytes_per_s": rate}


class HostTier:
    """Branch-keyed host copies of KV, bounded in tokens. Not thread-safe: the scheduler thread owns it;
    only :meth:`copy_segments`, :meth:`copy_back` and :meth:`load_in` may run on a worker (they touch no
    bookkeeping, and their callers keep the entry and slots they read unchanged until they join)."""

    def __init__(self, allocator, capacity_tokens: int):
        self.allocator = allocator
        self.capacity_tokens = max(int(capacity_tokens), 0)
        self.entries: dict[BranchKey, HostEntry] = {}
        self.used_tokens = 0
        self.used_bytes = 0
        self.demotes = TransferStats()
        self.promotes = TransferStats()
        self.refused_full = 0
        self._fail_next = {"demote": [0, False], "promote": [0, False]}  # kind -> [count, unexpected]
        self.spill = None  # the SpillTier sharing this capacity (it registers itself)

    # ---- the interface ----

    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def bytes_per_token(self) -> int:
        """Measured from the copies made so far (0 before the first)."""
        return self.demotes.bytes // self.demotes.tokens if self.demotes.tokens else 0

    def tokens_of(self, branch: BranchKey) -> int:
        entry = self.entries.get(branch)
        return entry.num_tokens if entry is not None else 0

    def demote(self, branch: BranchKey, tokens, extra_key, cache_salt, start: int,
               segments: Sequence[tuple[int, NodeState]], device_indices) -> HostEntry | None:
        """Copy ``device_indices`` (the KV of ``tokens[start:]``) to host, one copy per segment (so a
        restore can skip segments the device still holds). None when the tier is full; raises
        :class:`TransferError` when the copy fails (nothing is stored then). The copy on the calling
        thread: :meth:`reserve`, :meth:`copy_segments`, :meth:`count_copy` and :meth:`fill` are its
        steps, for a copy made by a worker thread (``HostCopies``' asynchronous offload)."""
        n = len(device_indices)
        entry = self.reserve(branch, tokens, extra_key, cache_salt, start, segments, n)
        if entry is None:
            return None
        try:
            kv, seconds = self.copy_segments(entry, device_indices)
        except Exception as exc:  # noqa: BLE001 - nothing stays reserved; the caller falls back
            self.delete(branch)
            self.count_copy(exc, n)
            raise
        self.count_copy((kv, seconds), n)
        self.fill(entry, kv)
        return entry

    def reserve(self, branch: BranchKey, tokens, extra_key, cache_salt, start: int,
                segments: Sequence[tuple[int, NodeState]], n_indices: int) -> HostEntry | None:
        """Make ``branch``'s entry for ``tokens[start:]`` and count its tokens against the capacity, its
        KV still to come (:meth:`fill`); None when the tier is full (dropping spilled nodes for room
        first). Until filled, an entry must not be promoted."""
        n = len(tokens) - start
        if n <= 0 or n_indices != n:
            raise ValueError(f"demote: {n_indices} indices for {n} tokens")
        if branch in self.entries:
            self.delete(branch)
        if not self.has_room(n):
            return None
        entry = HostEntry(branch, tokens, extra_key, cache_salt, start, list(segments), [], 0)
        self.entries[branch] = entry
        self.used_tokens += n
        return entry

    @staticmethod
    def segment_bounds(entry: HostEntry, n: int) -> list[int]:
        """Where each of a just-reserved entry's segments starts in its ``n`` device indices, and ``n``."""
        return [off - entry.start for off, _ in entry.segments] + [n]

    def copy_segments(self, entry: HostEntry, device_indices, bounds: list[int] | None = None) -> tuple[list, float]:
        """The device->host copy of a reserved entry, one copy per segment: ``(kv, seconds)``. Touches
        no bookkeeping (a worker thread may run it; its caller counts; ``bounds``, from
        :meth:`segment_bounds` taken on the caller's thread, keep it from reading the entry at all).
        Raises :class:`TransferError`."""
        self._maybe_fail("demote", wrapped=False)
        began = time.perf_counter()
        try:
            self._maybe_fail("demote")
            if bounds is None:
                bounds = self.segment_bounds(entry, len(device_indices))
            kv = [self.allocator.get_cpu_copy(device_indices[a:b]) for a, b in zip(bounds, bounds[1:])]
        except Exception as exc:  # noqa: BLE001 - any copy failure degrades to recompute
            raise TransferError(f"device->host copy of {len(device_indices)} tokens failed: {exc}") from exc
        return kv, time.perf_counter() - began

    def count_copy(self, outcome, tokens: int) -> None:
        """Count one :meth:`copy_segments` of ``tokens`` in :attr:`demotes`: its ``(kv, seconds)``, or
        the exception it raised. Every copy made counts, stored or not (a cancelled offload's bytes
        crossed the link too)."""
        if isinstance(outcome, BaseException):
            if isinstance(outcome, TransferError):
                self.demotes.failures += 1
            return
        kv, seconds = outcome
        self.demotes.add(tokens, nbytes_of(kv), seconds)

    def fill(self, entry: HostEntry, kv: list) -> None:
        """A reserved entry's KV arrived (after any segments :meth:`prepend` put in front meanwhile)."""
        nbytes = nbytes_of(kv)
        entry.kv.extend(kv)
        entry.nbytes += nbytes
        self.used_bytes += nbytes

    def copy_out(self, device_indices):
        """One device->host copy of ``device_indices`` (for :meth:`prepend`, which may hand the same
        copy to several entries); raises :class:`TransferError` when it fails."""
        self._maybe_fail("demote", wrapped=False)
        began = time.perf_counter()
        try:
            self._maybe_fail("demote")
            kv = self.allocator.get_cpu_copy(device_indices)
        except Exception as exc:  # noqa: BLE001 - any copy failure leaves every entry as it was
            self.demotes.failures += 1
            raise TransferError(f"device->host copy of {len(device_indices)} tokens failed: {exc}") from exc
        self.demotes.add(len(device_indices), nbytes_of(kv), time.perf_counter() - began)
        return kv

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more tokens fit, after dropping spilled nodes for them if need be; a refusal
        is counted (``refused_full``)."""
        if n <= self.free_tokens() or (self.spill is not None and self.spill.make_room(n)):
            return True
        self.refused_full += 1
        return False

    def charge(self, tokens: int, nbytes: int) -> None:
        """Count ``tokens`` held by the spill tier against the capacity (it made room first)."""
        self.used_tokens += tokens
        self.used_bytes += nbytes

    def release(self, tokens: int, nbytes: int) -> None:
        """The spill tier let go of ``tokens``."""
        self.used_tokens -= tokens
        self.used_bytes -= nbytes

    def copy_in(self, kv, device_indices) -> None:
        """One host->device copy of ``kv`` (a :meth:`copy_out`) into ``device_indices``, counted in
        :attr:`promotes`; raises :class:`TransferError` when it fails."""
        began = time.perf_counter()
        try:
            self.load_in(kv, device_indices)
        except TransferError:
            self.promotes.failures += 1
            raise
        self.promotes.add(len(device_indices), nbytes_of(kv), time.perf_counter() - began)

    def load_in(self, kv, device_indices) -> None:
        """:meth:`copy_in` without the counting, for a worker thread (its caller counts on the
        scheduler thread); raises :class:`TransferError` when it fails."""
        self._maybe_fail("promote", wrapped=False)
        try:
            self._maybe_fail("promote")
            self.allocator.load_cpu_copy(kv, device_indices)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"host->device copy of {len(device_indices)} tokens failed: {exc}") from exc

    def prepend(self, entry: HostEntry, state: NodeState, kv, n: int) -> None:
        """Make ``kv`` (a :meth:`copy_out` of the ``n`` tokens just in front of ``entry``, ``[start - n,
        start)``) the entry's new first segment; the caller checked :meth:`has_room` before copying.
        Entries may share one copy; each counts it against the capacity (conservative: host memory
        holds it once)."""
        if n <= 0 or n > entry.start:
            raise ValueError(f"prepend: {n} tokens in front of offset {entry.start}")
        if n > self.free_tokens():
            raise ValueError(f"prepend: {n} tokens do not fit in {self.free_tokens()} free host tokens")
        nbytes = nbytes_of(kv)
        entry.start -= n
        entry.segments.insert(0, (entry.start, state))
        entry.kv.insert(0, kv)
        entry.nbytes += nbytes
        self.used_tokens += n
        self.used_bytes += nbytes
        return True

    def promote(self, entry: HostEntry, first: int, device_indices) -> None:
        """Write ``entry``'s segments from index ``first`` on into ``device_indices`` (freshly
        allocated by the caller, one slot per token from ``segments[first]`` to the end); raises
        :class:`TransferError` on failure. The entry stays until :meth:`delete`."""
        try:
            seconds = self.copy_back(entry, first, device_indices)
        except TransferError as exc:
            self.count_promote(entry, first, exc)
            raise
        self.count_promote(entry, first, seconds)

    def copy_back(self, entry: HostEntry, first: int, device_indices) -> float:
        """:meth:`promote` without the counting, for a worker thread (its caller counts with
        :meth:`count_promote` on the scheduler thread); returns the seconds it took."""
        begin = entry.segments[first][0]
        if len(device_indices) != entry.end - begin:
            raise ValueError(f"promote: {len(device_indices)} indices for {entry.end - begin} tokens")
        self._maybe_fail("promote", wrapped=False)
        began = time.perf_counter()
        try:
            self._maybe_fail("promote")
            for i in range(first, len(entry.segments)):
                a, b = entry.segments[i][0] - begin, entry.segment_end(i) - begin
                self.allocator.load_cpu_copy(entry.kv[i], device_indices[a:b])
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"host->device copy of {entry.end - begin} tokens failed: {exc}") from exc
        return time.perf_counter() - began

    def count_promote(self, entry: HostEntry, first: int, outcome) -> None:
        """Count one :meth:`copy_back` of ``entry`` from segment ``first`` in :attr:`promotes`: the
        seconds it took, or the exception it raised (as :meth:`count_copy` does for the other way)."""
        if isinstance(outcome, BaseException):
            if isinstance(outcome, TransferError):
                self.promotes.failures += 1
            return
        self.promotes.add(entry.end - entry.segments[first][0], nbytes_of(entry.kv[first:]), outcome)

    def delete(self, branch: BranchKey) -> int:
        """Drop ``branch``'s host copy; returns the tokens freed."""
        entry = self.entries.pop(branch, None)
        if entry is None:
            return 0
        self.used_tokens -= entry.num_tokens
        self.used_bytes -= entry.nbytes
        return entry.num_tokens

    # ---- faults and views ----

    def fail_next(self, kind: str, count: int = 1, *, unexpected: bool = False) -> None:
        """Make the next ``count`` transfers of ``kind`` ("demote" or "promote") fail (tests only): as a
        :class:`TransferError`, or with ``unexpected`` as a bare ``ValueError`` raised before the copy
        (what a caller's bad argument raises, e.g. :meth:`promote`'s length check)."""
        if kind not in self._fail_next:
            raise ValueError(f"unknown transfer kind {kind!r}")
        self._fail_next[kind] = [count, unexpected]

    def failure_armed(self, kind: str) -> bool:
        """A test armed a failure of the next ``kind`` transfer (a copy made ahead must not dodge it)."""
        return self._fail_next[kind][0] > 0

    def _maybe_fail(self, kind: str, wrapped: bool = True) -> None:
        armed = self._fail_next[kind]
        if armed[0] > 0 and armed[1] != wrapped:
            armed[0] -= 1
            if wrapped:
                raise RuntimeError(f"injected {kind} failure")
            raise ValueError(f"injected unexpected {kind} failure")

    def stats(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "used_tokens": self.used_tokens,
                "used_bytes": self.used_bytes, "entries": len(self.entries), "refused_full": self.refused_full,
                "demote": self.demotes.to_dict(), "promote": self.promotes.to_dict()}
