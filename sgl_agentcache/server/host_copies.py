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
``offload_fallbacks``, ``anchor_spill*``...).
"""

from __future__ import annotations

import logging
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.lifecycle import BranchKey, NodeClass
from sgl_agentcache.server.host_tier import HostTier

logger = logging.getLogger(__name__)
FULL = ComponentType.FULL

#: Tokens of other branches' small nodes copied just above an offloaded suffix (see HostCopies._lead_in).
LEAD_IN_TOKENS = 64


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

    def offload(self, branch: BranchKey, evict: bool = True) -> int | None:
        """Copy the movable suffix (with its lead-in, see :meth:`_lead_in`) to host and (``evict``) free
        the suffix's device slots; returns the tokens freed (or copied, without ``evict``), None if it
        could not be stored."""
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
        failure = None
        try:
            entry = self.host.demote(branch, tokens, key.extra_key, key.cache_salt, start, segments, indices)
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: never the scheduler's
            entry, failure = None, exc
        if not self.cache.agree(failure is None):  # failed here or on another rank: every rank discards
            if entry is not None:
                self.host.delete(branch)
            logger.warning("agentcache: offload of %s/%s failed%s, discarding instead: %s", branch.session,
                           branch.branch, "" if failure is not None else " on another rank", failure)
            self.counters["offload_fallbacks"]["transfer_failed"] += 1
            return None
        if entry is None:
            self.counters["offload_fallbacks"]["host_full"] += 1
            return None
        # The anchor (protected while the copy exists) is the node the suffix hangs from, not the top
        # of the lead-in: the lead-in is insurance against losing it, not a reason to protect more.
        self._hang(entry, chain[0].parent)
        moved = sum(len(n.key) for n in chain)
        if not evict:
            return moved
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
        stays and None says "try again at the request's next match"."""
        entry = self.host.entries.get(branch)
        if entry is None:
            return 0
        cache, core = self.cache, self.cache.tree_core
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
        failure = None
        try:
            self.host.promote(entry, first, new)
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: never the scheduler's
            failure = exc
        if not self.cache.agree(failure is None):  # failed here or on another rank: every rank recomputes
            logger.warning("agentcache: restore of %s/%s failed%s, recomputing: %s", branch.session, branch.branch,
                           "" if failure is not None else " on another rank", failure)
            allocator.free(new)
            self.counters["restore_failures"]["transfer_failed"] += 1
            self.drop(branch)
            return 0
        prefix = cache.path_device_indices(match.last_device_node)[:begin]
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
        fresh = core.take_fresh()
        bounds = [s for s, _ in entry.segments[1:]]
        cache.classify_created(result.last_device_node, fresh, bounds,
                               lambda node, start: core.set_state(node, entry.state_at(start)))
        if not keep_host:
            self.drop(branch)
        restored = entry.end - max(result.prefix_len, begin)
        self.counters["restores"] += 1
        self.counters["restored_tokens"] += restored
        return restored

    def reset(self) -> int:
        """The tree was rebuilt empty: every host copy and anchor referred to it. Returns host tokens freed."""
        freed = sum(self.host.delete(branch) for branch in list(self.host.entries))
        self.anchors.clear()
        return freed


__all__ = ["LEAD_IN_TOKENS", "HostCopies"]
