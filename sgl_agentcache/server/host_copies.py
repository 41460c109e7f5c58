"""Paused branches' KV on the host tier: what can move, the copy out, the anchors, the copy back.

The mechanism under eager pause decisions (:mod:`sgl_agentcache.server.pauses` decides; this module
moves). One :class:`HostCopies` per :class:`~sgl_agentcache.server.cache.AgentRadixCache`, shared by
its :class:`~sgl_agentcache.server.pauses.PauseBook`. The cache talks to it through two things only:
:attr:`HostCopies.anchors` (nodes copies hang from rank like a stable prefix for eviction and are not
reclaimed while a copy needs them) and :meth:`HostCopies.spill_anchor` (eviction is about to take
such a node).

- A branch's *movable suffix* is the chain of device nodes it owns at the end of its path that nothing
  else holds (unlocked, no other device children; never the shared prefix).
- :meth:`HostCopies.offload` copies the suffix to the host tier and frees its device slots; a few
  small nodes above it (usually other branches') are copied too but stay (the lead-in, see
  ``_lead_in``). A full host tier or a failed copy returns None (the caller discards instead).
  With ``AGENTCACHE_ASYNC_OFFLOAD`` (default on CPU and CUDA pools) the copy runs on a worker thread (on CUDA,
  its own stream): the pause returns at once, the host room is reserved, and the suffix stays in the
  tree -- ranked first for eviction (``leaving``) -- until the copy *lands* at the scheduler's next
  step (:meth:`HostCopies.land`, from ``flush_pending_backups``). Eviction of a node the copy reads
  first joins it (:meth:`HostCopies.before_free`); a branch that continues before its copy landed
  keeps its device KV and the copy is dropped (:meth:`HostCopies.cancel_offload`); a failed copy is
  agreed on when it lands and the branch discarded then.
- The node a copy hangs from (its *anchor*) ranks like a stable prefix. When stock eviction takes it
  anyway (every lower-ranked leaf is gone), its KV is first copied in front of each copy hanging from
  it (:meth:`HostCopies.spill_anchor`), which then hangs from the node's parent: under pressure a copy
  grows upward instead of losing its prefix, within the branch's quota and the host tier's room.
- :meth:`HostCopies.restore` allocates slots, copies back what the device lost and re-inserts the
  nodes with their classes and owner. Restores that cannot happen (the prefix the suffix hangs from is
  gone, no room, a failed copy) delete the host copy and leave the request to recompute: nothing
  leaks, and each case is counted. No failure of a copy or a re-insert, expected or not, reaches the
  scheduler. Whether a copy worked is agreed by every TP rank before anyone acts on it
  (``AgentRadixCache.agree``): a copy that failed on one rank makes every rank take the fallback, so
  the ranks' trees never diverge.

Counts go into the pause book's ``counters`` (one stats block: ``restores``, ``restore_failures``,
``offload_fallbacks``, ``anchor_spill*``, ``offloads_async``, ``offload_cancelled``...); how often a
copy in flight had to be waited for is :attr:`HostCopies.joined_running` (a rank's pace: stats only).
"""

from __future__ import annotations

import logging
from array import array
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.lifecycle import BranchKey, NodeClass
from sgl_agentcache.server.host_tier import HostEntry, HostTier
from sgl_agentcache.server.transfer_worker import TransferWorker, wanted

logger = logging.getLogger(__name__)
FULL = ComponentType.FULL

#: Tokens of other branches' small nodes copied just above an offloaded suffix (see HostCopies._lead_in).
LEAD_IN_TOKENS = 64
#: ``auto`` (default: on for CPU and CUDA pools, see transfer_worker.CHECKED_DEVICE_TYPES),
#: ``1``, ``0``: an offload's device->host copy runs on a worker thread (see HostCopies.offload).
ASYNC_OFFLOAD_ENV = "AGENTCACHE_ASYNC_OFFLOAD"


@dataclass
class _Offloading:
    """An offload whose copy a worker is making: the suffix stays in the tree until it lands."""

    entry: HostEntry  # reserved on the host tier, its KV still to come
    chain: list  # the suffix to free when it lands
    read: list  # every node whose slots the copy reads (the lead-in too)
    tokens: int  # the copy's size (the lead-in too)
    future: Future  # -> (kv, seconds)
    outcome: tuple | BaseException | None = None  # set once joined


@dataclass
class PreparedRestore:
    """A restore with its slots allocated, its copy still to be made (``HostCopies.prepare_restore``)."""

    branch: BranchKey
    entry: HostEntry
    key: RadixKey
    last_node: object  # the device node the restored suffix continues (its path is the prefix)
    have: int  # device-resident prefix tokens when prepared
    first: int  # the first segment of ``entry`` to copy back
    begin: int  # its first token
    new: torch.Tensor  # the slots the copy fills, ``entry.end - begin`` of them
    keep_host: bool
    lock: object = None  # the prefix's lock while the copy is made across steps (``hold``)


def _key_tokens(key) -> array:
    return array("q", key.token_ids[: len(key)])


class HostCopies:
    """Host copies of paused branches, their anchors, and the moves between device and host."""

    def __init__(self, cache, host: HostTier, counters: dict):
        self.cache = cache
        self.host = host
        self.counters = counters  # the pause book's: one stats block
        # Device nodes host copies hang from -> how many copies (they rank like a stable prefix).
        self.anchors: dict = {}
        device = getattr(cache.token_to_kv_pool_allocator, "device", "cpu")
        self.async_offload = wanted(ASYNC_OFFLOAD_ENV, device)
        self._worker = TransferWorker(device, "agentcache-offload")  # its thread starts at the first copy
        self.offloading: dict[BranchKey, _Offloading] = {}  # offloads whose copy has not landed
        self.leaving: set = set()  # their suffixes' nodes (eviction takes them first: see cache._lifecycle_key)
        self._read_by: dict = {}  # node -> the branch whose offload copy reads its slots
        # Whether the scheduler's step waits for copies in flight (the offline driver: a step there
        # stands for as long as any copy takes, so replays do not depend on the worker's pace) or
        # lands only those already made (the server: the step never blocks on a copy).
        self.step_waits = False
        counters.setdefault("offloads_async", 0)
        counters.setdefault("offload_cancelled", 0)
        # Copies eviction, a resume or a step had to wait for: this rank's pace, so stats only (every
        # decision reads the counters above, which are the same on every rank).
        self.joined_running = 0

    def tip(self, branch: BranchKey):
        """The deepest device-resident node ``branch`` owns (its path's end), or None."""
        core = self.cache.tree_core
        best, best_depth = None, -1
        for node in core.owner_index.get(branch, ()):
            if node.component_data[FULL].value is None or node.agent.terminated:
                continue
            depth = core.depth(node) + len(node.key)
            if (depth, node.id) > (best_depth, -1 if best is None else best.id):
                best, best_depth = node, depth
        return best

    def movable_suffix(self, branch: BranchKey) -> list:
        """Top-down chain of the branch's own nodes at the end of its path that can leave the device:
        unlocked, with no other resident children, and no other host copy hanging from them."""
        core = self.cache.tree_core
        chain, node, below = [], self.tip(branch), None
        while node is not None and node is not core.root_node:
            data = node.component_data[FULL]
            if node.agent.owner != branch or node.agent.terminated or data.value is None or data.lock_ref > 0:
                break
            if node in self.anchors:  # another branch's host copy hangs from it (a sibling's shared preamble)
                break
            if any(c is not below and c.component_data[FULL].value is not None for c in node.children.values()):
                break
            chain.append(node)
            below, node = node, node.parent
        return chain[::-1]

    def path_of(self, node) -> tuple:
        """(tokens, extra_key, cache_salt) of the path from the root to the end of ``node``."""
        path, tokens = self.cache.tree_core.path_to(node), array("q")
        for part in path:
            tokens.extend(_key_tokens(part.key))
        return tokens, path[0].key.extra_key, path[0].key.cache_salt

    def drop(self, branch: BranchKey) -> int:
        """Delete ``branch``'s host copy and release its anchor; returns the tokens freed on host. An
        anchor whose own branch ended was kept only for this copy: it is reclaimed now if nothing else
        holds it (see ``AgentRadixCache.reclaim_terminated``)."""
        if branch in self.offloading:  # its copy is not needed any more: the suffix stays as it is
            self._stop_offload(branch)
            self.counters["offload_cancelled"] += 1
        self.cache.loads.drop_branch(branch)  # a worker copying it back stops (slots freed, nothing inserted)
        entry = self.host.entries.get(branch)
        freed = self.host.delete(branch)
        if entry is not None and entry.anchor is not None:
            anchor = entry.anchor
            if not self._unhang(entry) and anchor.agent.terminated:
                self.cache.tree_core.mark_reclaim_due()
                self.cache.reclaim_terminated()
        return freed

    def _hang(self, entry, anchor) -> None:
        """Record that ``entry`` continues the device node ``anchor`` (protected while the copy exists)."""
        if anchor is self.cache.tree_core.root_node:
            entry.anchor = entry.anchor_owner = None
            return
        entry.anchor, entry.anchor_owner = anchor, anchor.agent.owner
        self.anchors[anchor] = self.anchors.get(anchor, 0) + 1

    def _unhang(self, entry) -> int:
        """``entry`` no longer hangs from its anchor; returns how many copies still do."""
        anchor, entry.anchor, entry.anchor_owner = entry.anchor, None, None
        left = self.anchors.get(anchor, 0) - 1
        if left > 0:
            self.anchors[anchor] = left
        else:
            self.anchors.pop(anchor, None)
        return max(left, 0)

    def spill_anchor(self, node) -> None:
        """Eviction is about to take ``node``, which host copies hang from: stock eviction once every
        leaf ranked below it is gone (it ranks like a stable prefix; running requests hold the rest of
        the pool), or its own branch's discard, release or quota. Rather than leave those copies with a
        gap, copy the node's KV in front of each and let it hang from the node's parent. A copy keeps
        its gap when the host tier is full, the copy fails, or the branch would go over its quota (host
        tokens count toward it)."""
        cache, core = self.cache, self.cache.tree_core
        entries = [(b, e) for b, e in self.host.entries.items() if e.anchor is node]
        depth = core.depth(node)
        copies: dict[int, object] = {}  # tokens -> one host copy, shared by the copies that need as many
        for branch, entry in entries:
            n = entry.start - depth  # a copy's lead-in may hold the node's tail (or all of it) already
            if n > 0:
                if cache.branch_tokens(branch) + entry.num_tokens + n > cache.quota_of(branch):
                    self.counters["anchor_spill_refused"]["quota"] += 1
                    continue
                if not self.host.has_room(n):  # checked before copying: a refused spill copies nothing
                    self.counters["anchor_spill_refused"]["host_full"] += 1
                    continue
                if n not in copies:
                    kv, failure = None, None
                    try:
                        kv = self.host.copy_out(node.component_data[FULL].value[:n])
                    except Exception as exc:  # noqa: BLE001 - the copy keeps its gap
                        failure = exc
                    if not self.cache.agree(failure is None):  # here or on another rank: no rank spills
                        logger.info("agentcache: spill of %d prefix tokens into %s/%s's copy failed%s: %s", n,
                                    branch.session, branch.branch,
                                    "" if failure is not None else " on another rank", failure)
                        self.counters["anchor_spill_refused"]["transfer_failed"] += 1
                        continue
                    copies[n] = kv
                    self.counters["anchor_spill_copied_tokens"] += n
                self.host.prepend(entry, node.agent, copies[n], n)
                self.counters["anchor_spilled_tokens"] += n
            self._unhang(entry)
            self._hang(entry, self._in_front_of(node, depth, entry.start))
            self.counters["anchor_spills"] += 1

    def _in_front_of(self, node, depth: int, start: int):
        """The deepest ancestor of ``node`` (whose key starts at offset ``depth``) holding tokens before
        offset ``start``: what a copy starting there hangs from (the root: nothing)."""
        root, anchor = self.cache.tree_core.root_node, node.parent
        while anchor is not root and depth - len(anchor.key) >= start:
            depth -= len(anchor.key)
            anchor = anchor.parent
        return anchor

    def discard(self, branch: BranchKey) -> int:
        core = self.cache.tree_core
        return self.cache._evict_nodes(core.owner_index.get(branch, ()), budget=None)

    def _lead_in(self, chain: list) -> list:
        """Small nodes just above ``chain`` (not the stable prefix; usually other branches'), at most
        LEAD_IN_TOKENS in all, top-down. They are copied with the suffix but stay on the device, and
        count as the branch's host tokens (its quota) while the copy exists. They are what a fork's
        copy most often loses -- the parent's last output token, which the fork inserted and the
        parent's own copy ends before; a preamble a sibling created -- and a restore copies them back
        only if the device lost them. Only the node the suffix hangs from is
        protected as the anchor: protecting the whole lead-in costs more than it saves (replayer,
        branch_heavy under a tight pool, 3 seeds: 0.53x of stock's recompute against 0.40x)."""
        core, lead_in, total = self.cache.tree_core, [], 0
        node = chain[0].parent
        while node is not core.root_node and node.agent.cls is not NodeClass.STABLE:
            total += len(node.key)
            if total > LEAD_IN_TOKENS or node.component_data[FULL].value is None:
                break
            lead_in.append(node)
            node = node.parent
        return lead_in[::-1]

    def offload(self, branch: BranchKey) -> int | None:
        """Copy the movable suffix (with its lead-in, see :meth:`_lead_in`) to host and free the suffix's
        device slots; returns the tokens freed, None if it could not be stored.

        With ``AGENTCACHE_ASYNC_OFFLOAD`` the copy is made by a worker thread (on CUDA,
        on its own stream) and the call returns at once, the tokens it *will* free: the host entry is
        reserved, the suffix stays in the tree (ranked first for eviction) and is freed when the copy
        lands (:meth:`land`: at the scheduler's next step, or before anything else touches the branch).
        Eviction that takes a node the copy reads joins the copy first (:meth:`before_free`), so no slot
        is reused under it. A copy that fails is agreed on when it lands, and the branch is discarded
        then, as a failed synchronous copy would make it."""
        chain = self.movable_suffix(branch)
        if not chain:
            return 0
        copied = self._lead_in(chain) + chain
        path = self.cache.tree_core.path_to(chain[-1])
        tokens, segments, offset = array("q"), [], 0
        first = path.index(copied[0])
        for i, node in enumerate(path):
            if i == first:
                start = offset
            if i >= first:
                segments.append((offset, node.agent))
            tokens.extend(_key_tokens(node.key))
            offset += len(node.key)
        indices = torch.cat([n.component_data[FULL].value for n in copied])
        key = chain[-1].key
        self.drop(branch)
        moved = sum(len(n.key) for n in chain)
        if self.async_offload:
            return self._offload_async(branch, chain, copied, (tokens, key.extra_key, key.cache_salt, start, segments),
                                       indices, moved)
        failure = None
        try:
            entry = self.host.demote(branch, tokens, key.extra_key, key.cache_salt, start, segments, indices)
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: never the scheduler's
            entry, failure = None, exc
        if not self.cache.agree(failure is None):  # failed here or on another rank: every rank discards
            if entry is not None:
                self.host.delete(branch)
            self._log_failure(branch, failure)
            return None
        if entry is None:
            self.counters["offload_fallbacks"]["host_full"] += 1
            return None
        # The anchor (protected while the copy exists) is the node the suffix hangs from, not the top
        # of the lead-in: the lead-in is insurance against losing it, not a reason to protect more.
        self._hang(entry, chain[0].parent)
        return self._free_suffix(branch, chain, moved)

    def _offload_async(self, branch: BranchKey, chain: list, copied: list, where: tuple, indices,
                       moved: int) -> int | None:
        entry = self.host.reserve(branch, *where, len(indices))
        if entry is None:
            self.counters["offload_fallbacks"]["host_full"] += 1
            return None
        self._hang(entry, chain[0].parent)
        bounds = self.host.segment_bounds(entry, len(indices))  # now: a prepend may change the entry meanwhile
        flight = _Offloading(entry, chain, copied, len(indices),
                             self._worker.submit(self.host.copy_segments, entry, indices, bounds))
        self.offloading[branch] = flight
        self.leaving.update(chain)
        for node in copied:
            self._read_by[node] = branch
        self.counters["offloads_async"] += 1
        return moved

    def before_free(self, node) -> None:
        """``node``'s device slots are about to be freed (eviction): if an offload's copy reads them,
        wait for it. Only joins -- the tree is not touched -- so it is safe inside stock eviction."""
        branch = self._read_by.get(node) if self._read_by else None
        if branch is not None:
            self._finish_copy(self.offloading[branch])

    def land(self, branch: BranchKey | None = None, *, evict: bool = True, wait: bool = True) -> list[BranchKey]:
        """Finish the offloads in flight (all, or ``branch``'s): join each copy, store it, and free the
        suffix (without ``evict`` it stays on the device too: the branch continued before its copy landed). Returns
        the branches whose copy failed (here or on another rank): their host entry is gone and the
        caller discards them. Runs at points in the message order, the same on every rank.

        Without ``wait`` (a busy scheduler's step) only copies already made on every TP rank land, in
        submission order (the worker makes them in that order), so the step never waits for a copy;
        whether one is made is agreed on like an outcome, so every rank lands the same ones."""
        failed = []
        for b in ([branch] if branch is not None else list(self.offloading)):
            flight = self.offloading.get(b)
            if flight is None:
                continue
            if not wait and not self.cache.agreement(flight.outcome is not None or flight.future.done()):
                break  # the rest were submitted later: not made yet either
            outcome = self._stop_offload(b)
            ok = not isinstance(outcome, BaseException)
            if not self.cache.agree(ok):
                self.drop(b)
                self._log_failure(b, None if ok else outcome)
                failed.append(b)
                continue
            self.host.fill(flight.entry, outcome[0])
            if evict:
                resident = sum(len(n.key) for n in flight.chain if self._on_device(n))
                self._free_suffix(b, flight.chain, resident)
        return failed

    def cancel_offload(self, branch: BranchKey) -> bool:
        """The paused ``branch`` continues before its offload landed. Returns True when the device still
        holds its whole suffix: the copy is dropped, the branch is as if never offloaded. Otherwise
        (eviction took part of the suffix meanwhile) the copy is stored, for a restore to bring back
        what the device lost, and False is returned (also when the copy failed: nothing is on host)."""
        flight = self.offloading.get(branch)
        if flight is None:
            return False
        whole = all(self._on_device(n) for n in flight.chain)
        if whole:
            self.drop(branch)
            return True
        self.land(branch, evict=False)
        return False

    def _finish_copy(self, flight: _Offloading):
        if flight.outcome is None:
            if not flight.future.done():
                self.joined_running += 1
            try:
                flight.outcome = flight.future.result()
            except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: agreed on, recomputed
                flight.outcome = exc
            self.host.count_copy(flight.outcome, flight.tokens)  # made, whether it is stored or not
        return flight.outcome

    def _stop_offload(self, branch: BranchKey):
        """Join ``branch``'s copy in flight and forget it (its outcome is returned: the caller stores,
        drops or discards)."""
        flight = self.offloading.pop(branch)
        outcome = self._finish_copy(flight)
        self.leaving.difference_update(flight.chain)
        for node in flight.read:
            if self._read_by.get(node) == branch:
                del self._read_by[node]
        return outcome

    def _on_device(self, node) -> bool:
        """Still in the tree with its device KV (eviction unlinks a leaf; its value stays set)."""
        return self.cache.tree_core.attached(node) and node.component_data[FULL].value is not None

    def _log_failure(self, branch: BranchKey, failure) -> None:
        logger.warning("agentcache: offload of %s/%s failed%s, discarding instead: %s", branch.session,
                       branch.branch, "" if failure is not None else " on another rank", failure)
        self.counters["offload_fallbacks"]["transfer_failed"] += 1

    def _free_suffix(self, branch: BranchKey, chain: list, moved: int) -> int:
        freed = self.cache._evict_nodes(chain, budget=None)
        if freed != moved:
            # Some of the suffix stayed on the device (a node locked or kept since the copy, e.g. by a
            # backup in flight): the copy stays whole, and a restore copies back only what the device
            # lost. Counted; the tokens reported are those actually freed.
            self.counters["offload_partial"] += 1
            logger.info("agentcache: offload of %s/%s freed %d of its %d suffix tokens; the rest stays on "
                        "the device", branch.session, branch.branch, freed, moved)
        return freed

    def restore(self, branch: BranchKey, keep_host: bool = False, _chain: frozenset = frozenset(),
                defer: bool = False) -> int | None:
        """Bring ``branch``'s host copy back into the tree; returns tokens restored (0: recompute).
        The host copy is deleted, unless ``keep_host`` (a speculative or fork-driven restore keeps it
        until the branch resumes, whether it succeeded or not: if the device copy is evicted again
        meanwhile, or the prefix or the room was missing this time, a later restore can still serve).
        With ``defer`` (a restore for a waiting request), a lack of room is not a failure yet: the copy
        stays and None says "try again at the request's next match". The copy runs on this thread;
        :meth:`prepare_restore` and :meth:`finish_restore` are the two halves of one made elsewhere."""
        prepared = self.prepare_restore(branch, keep_host, _chain, defer)
        if not isinstance(prepared, PreparedRestore):
            return prepared
        failure = None
        try:
            self.host.promote(prepared.entry, prepared.first, prepared.new)
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: never the scheduler's
            failure = exc
        return self.finish_restore(prepared, failure)

    def prepare_restore(self, branch: BranchKey, keep_host: bool = False, _chain: frozenset = frozenset(),
                        defer: bool = False, hold: bool = False) -> PreparedRestore | int | None:
        """The first half of :meth:`restore`: find the prefix the copy hangs from, make room and
        allocate the slots. Returns what :meth:`restore` would (an int, or None with ``defer``) when
        there is nothing to copy, else the :class:`PreparedRestore` whose copy is still to be made
        (``HostTier.promote``, or ``copy_back`` on a worker) before :meth:`finish_restore`. ``hold``:
        the prefix stays locked until then (a copy made across scheduler steps)."""
        if branch in self.offloading:  # its callers land it first; a stray call must not read an unfilled copy
            self.land(branch, evict=False)
        loads = self.cache.loads
        loads.settle(branch)  # a prefetch in flight lands first (this restore may then find it all resident)
        entry = self.host.entries.get(branch)
        if entry is None or loads.copying_back(branch):  # gone, or being copied back for its request already
            return 0
        cache = self.cache
        key = RadixKey(entry.tokens, entry.extra_key, cache_salt=entry.cache_salt)
        match = cache.match_prefix(MatchPrefixParams(key=key))
        have = match.device_prefix_len
        parent = entry.anchor_owner
        if have < entry.start and parent is not None and parent in self.host.entries and parent not in _chain:
            # The prefix this copy hangs from is the parent's, and the parent has a host copy too (a
            # lead offloaded while its subagents ran): bring the parent back first.
            self.restore(parent, keep_host=True, _chain=_chain | {branch})
            match = cache.match_prefix(MatchPrefixParams(key=key))
            have = match.device_prefix_len
            self.counters["parent_restores"] += 1
        if have < entry.start:
            self.counters["restore_failures"]["gap"] += 1
            logger.info("agentcache: restore of %s/%s: only %d of the %d prefix tokens it hangs from are "
                        "resident%s", branch.session, branch.branch, have, entry.start,
                        "; the copy is kept for a later try" if keep_host else "; recomputing")
            if not keep_host:  # a kept copy (a paused parent's) may still serve once the prefix is back
                self.drop(branch)
            return 0
        if have >= entry.end:
            if not keep_host:
                self.drop(branch)
            return 0
        first = entry.first_missing(have)
        begin = entry.segments[first][0]  # copy back from the segment the device lost first
        n = entry.end - begin
        allocator = cache.token_to_kv_pool_allocator
        lock = cache.lock(match.last_device_node)  # the prefix we hang from must survive the eviction
        try:
            short = n - allocator.available_size()
            # Evict only if that makes room: an eviction that still leaves too little frees KV other
            # requests may need and restores nothing (running requests hold the rest of the pool).
            if 0 < short <= cache.evictable_size():
                cache.evict(EvictParams(num_tokens=short))
            new = allocator.alloc(n) if allocator.available_size() >= n else None
        finally:
            if not hold or new is None:
                cache.unlock(lock)
        if new is None and defer:
            self.counters["restores_deferred"] += 1
            return None
        if new is None:
            self.counters["restore_failures"]["no_room"] += 1
            logger.info("agentcache: restore of %s/%s: no room for %d tokens%s", branch.session, branch.branch, n,
                        "; the copy is kept for a later try" if keep_host else "; recomputing")
            if not keep_host:
                self.drop(branch)
            return 0
        return PreparedRestore(branch, entry, key, match.last_device_node, have, first, begin, new, keep_host,
                               lock if hold else None)

    def finish_restore(self, prepared: PreparedRestore, failure: BaseException | None) -> int:
        """The second half of :meth:`restore`: agree on the copy's outcome (``failure``: None when it
        worked here), insert the restored nodes with their classes and owner, and drop the host copy
        unless kept. Returns the tokens restored (0: the request recomputes; no slot leaks)."""
        p, cache, core = prepared, self.cache, self.cache.tree_core
        branch, entry, key, new, begin = p.branch, p.entry, p.key, p.new, p.begin
        allocator = cache.token_to_kv_pool_allocator
        try:
            if not self.cache.agree(failure is None):  # failed here or on another rank: every rank recomputes
                logger.warning("agentcache: restore of %s/%s failed%s, recomputing: %s", branch.session,
                               branch.branch, "" if failure is not None else " on another rank", failure)
                allocator.free(new)
                self.counters["restore_failures"]["transfer_failed"] += 1
                self.drop(branch)
                return 0
            prefix = cache.path_device_indices(p.last_node)[:begin]
            core.insert_state = entry.state_at(begin)
            try:
                result = cache.insert(InsertParams(key=key, value=torch.cat([prefix.to(new.dtype), new]),
                                                   prev_prefix_len=begin))
            except Exception:  # noqa: BLE001 - the copy is lost, the request recomputes, no slot leaks
                logger.exception("agentcache: re-inserting %s/%s's restored KV failed; recomputing", branch.session,
                                 branch.branch)
                cache.free_unheld(key, new)
                core.take_fresh()
                self.counters["restore_failures"]["error"] += 1
                self.drop(branch)
                return 0
            finally:
                core.insert_state = None
        finally:
            if p.lock is not None:
                cache.unlock(p.lock)
        fresh = core.take_fresh()
        bounds = [s for s, _ in entry.segments[1:]]
        cache.classify_created(result.last_device_node, fresh, bounds,
                               lambda node, start: core.set_state(node, entry.state_at(start)))
        if not p.keep_host:
            self.drop(branch)
        restored = entry.end - max(result.prefix_len, begin)
        self.counters["restores"] += 1
        self.counters["restored_tokens"] += restored
        return restored

    def abandon_restore(self, prepared: PreparedRestore) -> None:
        """A prepared restore whose copy will not be inserted (its request left, the copy was dropped, a
        reset): the slots are freed and the prefix unlocked; the host copy is left to the caller. The
        caller joined the copy first (a worker may still be writing the slots)."""
        self.cache.token_to_kv_pool_allocator.free(prepared.new)
        if prepared.lock is not None:
            self.cache.unlock(prepared.lock)
            prepared.lock = None

    def reset(self) -> int:
        """The tree was rebuilt empty: every host copy and anchor referred to it. Returns host tokens freed."""
        for branch in list(self.offloading):  # the worker may still read slots about to be freed
            self._stop_offload(branch)
        freed = sum(self.host.delete(branch) for branch in list(self.host.entries))
        self.anchors.clear()
        return freed


__all__ = ["ASYNC_OFFLOAD_ENV", "LEAD_IN_TOKENS", "HostCopies", "PreparedRestore"]
