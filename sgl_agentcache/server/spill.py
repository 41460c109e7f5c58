"""Node-granular host spill: what eviction takes from the device pool is copied to host, and a later
match copies it back (SGLang HiCache's ``write_back`` semantics, on our host tier).

When stock eviction takes a device leaf (memory pressure; never a close, an eager discard or a context
edit, which free state nobody should read again; an over-quota or DISCARD-advised branch's leaf only
into free host room, first in line to be dropped), its KV is copied to the host tier as one
:class:`SpillEntry`, with the node's tokens, namespace and lifecycle state. An entry *hangs from* what
its tokens continue: the device node that was its parent (``anchor``), or, once that node has been
evicted too, that node's own entry (``parent``). So the host side is a forest of entries whose roots
hang from device nodes, exactly the shape of HiCache's host-only tree nodes, kept beside SGLang's tree
instead of inside it (SGLang's in-tree host nodes come with its CUDA cache controller, which cannot
run on CPU).

Load-back runs when the scheduler matches a request for a batch (``AgentRadixCache.match_prefix``):
from the end of the device match, the longest chain of entries that continues the request's key is
copied back into fresh slots and re-inserted with each entry's state, and the match is taken again.
Entries hang from device nodes on the matched path (usually its last node; an ancestor when another
request re-created part of the entry's tokens on the device since), so a chain is found with a few
dictionary lookups and token comparisons, never a scan of the tier.

Capacity is the host tier's, shared with paused branches' copies (one byte budget per server,
``AGENTCACHE_HOST_TOKENS``). When a copy needs room, host *leaves* (entries nothing hangs from) are
dropped lowest retention value first (:mod:`~sgl_agentcache.policy.retention`: band TRIM, then VALUED,
then PROTECTED; least recently spilled first within a band): dropping an inner entry would strand
the entries below it. Nothing is spilled when a host copy would save nothing (reloading a token costs
at least re-prefilling it, at the profile's rates). A
branch's entries go when the branch closes (every tier), a namespace's when it is purged, all of
them with the tree on a reset. Every decision depends on tree state and a step counter, never a
clock, so every TP rank takes the same ones; a copy that fails falls back to plain eviction (spill)
or to recompute (load-back), counted, on every rank when it failed on any (``AgentRadixCache.agree``).
No failure of a load-back, expected or not, reaches the scheduler.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.lifecycle import UNTAGGED_STATE, BranchKey, NodeState
from sgl_agentcache.policy.retention import Band, host_band, learned_rate
from sgl_agentcache.server.host_tier import HostTier, nbytes_of

logger = logging.getLogger(__name__)
FULL = ComponentType.FULL

#: "1" (the default): device evictions are spilled to the host tier and loaded back on a later match;
#: "0": evicted KV is dropped, as stock SGLang does.
HOST_SPILL_ENV = "AGENTCACHE_HOST_SPILL"


@dataclass(eq=False)
class SpillEntry:
    """One evicted node on host: its tokens continue ``anchor`` (a device node) or ``parent``."""

    tokens: array  # the node's key tokens (array('q'))
    extra_key: str | None
    cache_salt: str | None
    state: NodeState  # class and owner when it left the device (never terminated)
    kv: Any = field(repr=False)  # the allocator's CPU copy
    nbytes: int = 0
    anchor: Any = None  # the device node it continues, when it hangs from the device
    parent: "SpillEntry | None" = None  # the entry it continues, when its anchor was evicted too
    children: list = field(default_factory=list, repr=False)
    protected: bool = False  # its branch is paused with OFFLOAD advice: dropped for room only after the rest
    low_value: bool = False  # over quota or DISCARD-advised when spilled: first to go, never protected or charged

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class PreparedLoad:
    """A load-back between its halves (:meth:`SpillTier.prepare_load`, :meth:`SpillTier.finish_load`)."""

    key: RadixKey
    chain: list  # the entries, top-down
    start: int  # the key offset where the first entry's tokens begin
    anchor: Any  # the device node the first entry hangs from
    last_node: Any  # the device match's last node when prepared
    device_prefix_len: int
    new: torch.Tensor = field(repr=False)  # the chain's device slots
    lock: Any = None  # held asynchronous loads: the match's lock
    seconds: float = 0.0  # the copy's duration


class SpillTier:
    """Spilled nodes of one cache (see the module docstring). Owned by the scheduler thread."""

    def __init__(self, cache, host: HostTier, enabled: bool):
        self.cache = cache
        self.host = host
        self.enabled = enabled
        self.by_anchor: dict[Any, list[SpillEntry]] = {}  # device node -> entries hanging from it
        self.lru: OrderedDict[SpillEntry, None] = OrderedDict()  # every entry, least recently used first
        self.by_owner: dict[BranchKey, set[SpillEntry]] = {}
        self.owner_tokens: dict[BranchKey, int] = {}  # host tokens per owner
        self.charged_tokens: dict[BranchKey, int] = {}  # the part of them that counts toward its quota
        self.advice: dict[BranchKey, Any] = {}  # paused branches' lazy pause decisions (PauseBook._advise)
        self.protected_tokens = 0
        self.tokens = 0
        self._spilled: dict[Any, SpillEntry] = {}  # node being evicted -> its new entry (see on_node_removed)
        self._twins: set = set()  # nodes of _spilled whose entry was already on host (see _twin)
        self._pinned: set[SpillEntry] = set()  # a chain being loaded back: never dropped for room
        self.loading: set[SpillEntry] = set()  # chains asynchronous loads hold (server/async_load.py)
        self.counters = {"spills": 0, "spilled_tokens": 0, "spill_refused_full": 0, "spill_failed": 0,
                         "spill_skipped_discard": 0, "spill_skipped_over_quota": 0, "spill_skipped_no_gain": 0,
                         "spill_twins": 0, "loads": 0, "loaded_tokens": 0, "load_failed": 0,
                         "load_no_room": 0, "load_errors": 0,
                         "dropped_tokens": {"room": 0, "closed": 0, "orphaned": 0, "purged": 0}}
        host.spill = self

    # ---- device -> host ----

    def spill(self, node, low_value: bool = False) -> bool:
        """Stock eviction is about to take device leaf ``node``: copy it to host if there is room; True
        when it did. Terminated nodes (their branch ended) are never kept, unless live entries hang from
        them (then they are kept as those entries' own context).

        A low-value node (its branch is over its quota, ``low_value``, or was advised DISCARD at a pause)
        goes only into free host room, never displacing another entry; its entry is the first dropped
        for room later, is never protected, and does not count toward the branch's quota (so a branch
        spilled into free room is not held over quota by it): a quota is a fairness bound under
        pressure, not a cap while memory is free. A node other entries hang from is spilled as an
        ordinary one, even when they are low-value themselves: a long over-quota context is evicted
        leaf first, and treating its inner nodes as low-value too would orphan the whole chain the
        moment free room ran out (measured: at a 4x host tier on the real Claude Code sessions, 1.33x
        write-back's recompute against 0.94x with this rule)."""
        state = node.agent
        if not self.enabled:
            return False
        if not self.cache.retention.host_copies_pay():
            self.counters["spill_skipped_no_gain"] += 1
            return False
        if state.terminated:
            # An ended branch's node is kept only when live entries hang from it: it is then part of
            # their context (a subagent closed after creating the first tokens past its lead's history,
            # which the lead's later turns continue), and dropping it would orphan them all. It goes to
            # host as theirs: the most valuable state among them.
            below = self.by_anchor.get(node)
            if not below:
                return False
            state = max((e.state for e in below), key=lambda s: s.cls)
        advice = self.advice.get(state.owner) if self.advice and state.owner is not None else None
        twin = self._twin(node, state)
        if twin is not None:
            # The same tokens after the same prefix are on host already (this node was recomputed while
            # they waited there): that entry serves as this node's copy, and what hangs from the node
            # hangs from it. A second copy would split the host chains in two, and a later match would
            # follow whichever copy it met first (measured: sessions lost their history behind a
            # re-spilled system prompt on stable_prompts with a 4x host tier).
            self.lru.move_to_end(twin)
            self._spilled[node] = twin
            self._twins.add(node)
            self.counters["spill_twins"] += 1
            return True
        discard = advice is not None and advice.value == "discard"
        low_value = (low_value or discard) and node not in self.by_anchor
        n = len(node.key)
        if low_value and n > self.host.free_tokens():
            self.counters["spill_skipped_discard" if discard else "spill_skipped_over_quota"] += 1
            return False
        if n == 0 or not self.make_room(n):
            self.counters["spill_refused_full"] += 1
            return False
        kv, failure = None, None
        made = self.cache.copy_ahead.take(node)  # made by the worker before eviction needed it
        if made is not None and not self.host.failure_armed("demote"):
            kv = made[0]
            self.host.demotes.add(n, nbytes_of(kv), made[1])
        else:
            try:
                kv = self.host.copy_out(node.component_data[FULL].value)
            except Exception as exc:  # noqa: BLE001 - any failure: plain eviction
                failure = exc
        if not self.cache.agree(failure is None):  # failed here or on another rank: no rank keeps a copy
            self.counters["spill_failed"] += 1
            logger.info("agentcache: spill of %d tokens failed%s, evicting without a host copy: %s", n,
                        "" if failure is not None else " on another rank", failure)
            return False
        key = node.key
        entry = SpillEntry(array("q", key.token_ids[:n]), key.extra_key, key.cache_salt, state, kv, nbytes_of(kv),
                           protected=advice is not None and advice.value == "offload" and not low_value,
                           low_value=low_value)
        self._hang(entry, anchor=node.parent)
        self._add(entry)
        if low_value:
            self.lru.move_to_end(entry, last=False)  # first to go when room is needed
        self._spilled[node] = entry
        self.counters["spills"] += 1
        self.counters["spilled_tokens"] += n
        return True

    def _twin(self, node, state: NodeState) -> SpillEntry | None:
        """A host entry with exactly ``node``'s tokens hanging from ``node``'s parent (the same KV) and
        the same class and owner (it goes when and where the node's copy would), free to serve as its
        copy (not being loaded back)."""
        siblings = self.by_anchor.get(node.parent)
        if not siblings:
            return None
        key = node.key
        tokens = None  # built once, for the first sibling that matches on everything else
        for entry in siblings:
            if (len(entry) == len(key) and entry.state.owner == state.owner and entry.state.cls == state.cls
                    and entry.extra_key == key.extra_key and entry.cache_salt == key.cache_salt
                    and entry not in self.loading and entry not in self._pinned):
                tokens = array("q", key.token_ids[: len(key)]) if tokens is None else tokens
                if entry.tokens == tokens:
                    return entry
        return None

    def on_node_removed(self, node) -> None:
        """``node`` left the tree (tree-core hook). What hung from it hangs from its new entry if it was
        just spilled, and is dropped otherwise (nothing on either tier continues it any more)."""
        self.cache.copy_ahead.forget(node)
        self._twins.discard(node)
        entry = self._spilled.pop(node, None)
        orphans = self.by_anchor.pop(node, None)
        if not orphans:
            return
        if entry is not None:
            for child in orphans:
                child.anchor, child.parent = None, entry
            entry.children.extend(orphans)
        else:
            for child in orphans:
                child.anchor = None
                self._drop_tree(child, "orphaned")

    def settle_eviction(self, node) -> None:
        """After stock eviction of ``node``: if the node is still on the device after all (eviction did
        not take it), its host copy is redundant and goes."""
        entry = self._spilled.pop(node, None)
        if node in self._twins:  # the entry was on host before: it stays
            self._twins.discard(node)
        elif entry is not None and node.component_data[FULL].value is not None:
            self._drop_tree(entry, "orphaned")

    # ---- host -> device ----

    def load_back(self, key: RadixKey, last_device_node, device_prefix_len: int, *, evict: bool = True) -> int:
        """Copy back the longest chain of entries continuing ``key`` past ``device_prefix_len`` (the
        device match ending at ``last_device_node``) and insert it into the tree. Returns the tokens
        that became device-resident past the old match (0: nothing found, no room, or a failed copy).
        Without ``evict`` (speculation) it only uses free device memory. The copy runs here, on the
        caller's thread; ``server/async_load.py`` runs the same three steps across two scheduler steps."""
        load = self.prepare_load(key, last_device_node, device_prefix_len, evict=evict)
        if load is None:
            return 0
        failure = None
        try:
            load.seconds = self.copy_chain(load)
        except Exception as exc:  # noqa: BLE001 - a TransferError, or anything else: never the scheduler's
            failure = exc
        return self.finish_load(load, failure)

    def prepare_load(self, key: RadixKey, last_device_node, device_prefix_len: int, *, evict: bool = True,
                     hold: bool = False) -> "PreparedLoad | None":
        """Find the chain to load and allocate its device slots (the scheduler thread's half of a
        load-back). ``hold`` (an asynchronous load): the match stays locked and the chain pinned until
        :meth:`release_load`, since the copy and :meth:`finish_load` come a scheduler step later."""
        if not self.lru or device_prefix_len >= len(key):
            return None
        chain, start, anchor = self._find_chain(key, last_device_node, device_prefix_len)
        if not chain:
            return None
        cache = self.cache
        allocator = cache.token_to_kv_pool_allocator
        n = sum(len(e) for e in chain)
        self._pinned.update(chain)
        # The prefix the chain continues must survive the eviction below (and, held, until the finish:
        # the whole match then, so the finish finds the tree as it is now).
        lock = cache.lock(last_device_node.id if hold else anchor.id)
        new = None
        try:
            short = n - allocator.available_size()
            # Evict only if that makes room: an eviction that still leaves too little frees KV other
            # requests may need and loads nothing (running requests hold the rest of the pool).
            if evict and 0 < short <= cache.evictable_size():
                cache.evict(EvictParams(num_tokens=short))
            new = allocator.alloc(n) if allocator.available_size() >= n else None
        finally:
            if new is None or not hold:
                cache.unlock(lock)
                self._pinned.difference_update(chain)
        if new is None:
            self.counters["load_no_room"] += 1
            return None
        if any(e not in self.lru for e in chain) or anchor.component_data[FULL].value is None:
            allocator.free(new)  # the eviction above dropped part of the chain (cannot happen: pinned)
            if hold:
                cache.unlock(lock)
                self._pinned.difference_update(chain)
            self.counters["load_failed"] += 1
            return None
        return PreparedLoad(key, chain, start, anchor, last_device_node, device_prefix_len, new,
                            lock if hold else None)

    def copy_chain(self, load: "PreparedLoad") -> float:
        """Copy the chain's host KV into its slots; returns the seconds it took. Touches nothing but
        the entries' host tensors and the slots' KV, so it may run on a worker thread: the entries are
        pinned (never dropped for room) and the slots belong to nobody else until :meth:`finish_load`."""
        began, offset = time.perf_counter(), 0
        for entry in load.chain:
            self.host.load_in(entry.kv, load.new[offset: offset + len(entry)])
            offset += len(entry)
        return time.perf_counter() - began

    def release_load(self, load: "PreparedLoad") -> None:
        """Undo :meth:`prepare_load`'s hold (an asynchronous load's lock and pins)."""
        if load.lock is not None:
            self.cache.unlock(load.lock)
            load.lock = None
        self._pinned.difference_update(load.chain)

    def still_current(self, load: "PreparedLoad") -> bool:
        """Whether the tree and the tier are still as ``load`` found them: the same device match, and
        the same chain hanging from the same node (a close, a purge or another request's insert on the
        path changes them between an asynchronous load's two steps)."""
        if any(e not in self.lru for e in load.chain):
            return False
        core = self.cache.tree_core
        match = self.cache.match_prefix(MatchPrefixParams(key=load.key))
        if match.device_prefix_len != load.device_prefix_len or match.last_device_node != load.last_node.id:
            return False
        chain, start, anchor = self._find_chain(load.key, core.node_by_id(match.last_device_node),
                                                load.device_prefix_len, loading=())
        return chain == load.chain and start == load.start and anchor is load.anchor

    def finish_load(self, load: "PreparedLoad", failure: BaseException | None) -> int:
        """Insert a copied chain (the scheduler thread's second half), or free its slots when the copy
        failed here or on another rank (every rank then recomputes). Returns the tokens that became
        device-resident past the old match."""
        cache, allocator, chain, new = self.cache, self.cache.token_to_kv_pool_allocator, load.chain, load.new
        n = len(new)
        if failure is None:
            self.host.promotes.add(n, sum(e.nbytes for e in chain), load.seconds)
        else:
            self.host.promotes.failures += 1
        if not self.cache.agree(failure is None):  # failed here or on another rank: every rank recomputes
            allocator.free(new)
            self.counters["load_failed"] += 1
            logger.info("agentcache: load-back of %d tokens failed%s, recomputing: %s", n,
                        "" if failure is not None else " on another rank", failure)
            for entry in chain:  # a failed copy may have left the entry unreadable: drop it
                if entry in self.lru:
                    self._drop_tree(entry, "orphaned")
            return 0
        key, start = load.key, load.start
        try:
            self._insert_chain(key, chain, start, load.anchor, new)
        except Exception:  # noqa: BLE001 - the chain is lost, the request recomputes, no slot leaks
            logger.exception("agentcache: re-inserting %d loaded-back tokens failed; recomputing", n)
            path = array("q", key.token_ids[:start])
            for entry in chain:
                path.extend(entry.tokens)
            cache.free_unheld(RadixKey(path, key.extra_key, cache_salt=key.cache_salt), new)
            cache.tree_core.insert_state = None
            cache.tree_core.take_fresh()
            for entry in chain:  # what was not re-inserted, and everything hanging from it
                self._drop_tree(entry, "orphaned")
            self.counters["load_errors"] += 1
            return 0
        self.counters["loads"] += 1
        loaded = max(start + n - load.device_prefix_len, 0)
        self.counters["loaded_tokens"] += loaded
        return loaded

    def has_chain(self, key: RadixKey, last_device_node, device_prefix_len: int) -> bool:
        """Whether host entries continue ``key`` past its device match (what :meth:`prepare_load` would
        load, found without allocating or evicting anything)."""
        if not self.lru or device_prefix_len >= len(key):
            return False
        chain, _, _ = self._find_chain(key, last_device_node, device_prefix_len)
        return bool(chain)

    def continues_into_loading(self, key: RadixKey, last_device_node, device_prefix_len: int) -> bool:
        """Whether what continues ``key`` past its device match starts with an entry an asynchronous load
        holds for another request (its slots are being filled; a step later it is on the device)."""
        if not self.loading:
            return False
        chain, _, _ = self._find_chain(key, last_device_node, device_prefix_len, loading=frozenset())
        return bool(chain) and chain[0] in self.loading

    def _find_chain(self, key: RadixKey, last_device_node, device_prefix_len: int, loading=None):
        """The entries to load: the first hangs from a device node on the matched path and reaches past
        the match; each next one is a child of the previous that continues the key, as long as the
        previous matched the key entirely. Returns (chain, offset of the first, its anchor).

        An entry whose tokens are all on the device again (another request recomputed them while it
        waited on host) is a bridge: its children, if they continue the key past the match from a node
        boundary of the matched path, are found through it (else a session's history spilled below a
        re-computed system prompt could never come back).

        An entry an asynchronous load holds (``loading``, by default :attr:`loading`) is not found
        again: its slots are already being filled for another request, which inserts it a step later."""
        loading = self.loading if loading is None else loading
        core = self.cache.tree_core
        node = last_device_node
        end = core.depth(node) + len(node.key) if node is not core.root_node else 0  # where its tokens end
        ends: dict[int, Any] = {}  # node boundaries of the matched path: offset -> the node ending there
        bridged = None
        while node is not None:
            ends[end] = node
            best, best_reach = None, 0
            for entry in self.by_anchor.get(node, ()):
                if entry.extra_key != key.extra_key or entry.cache_salt != key.cache_salt:
                    continue
                if entry in loading:
                    continue
                m = _common(entry.tokens, key, end)
                if end + m > device_prefix_len and m > 0:
                    # Several entries can start here with the same tokens (a prefix spilled twice, cut
                    # at other node boundaries): the one whose chain reaches furthest along the key.
                    chain = self._chain_from(entry, m, key, end, loading)
                    reach = _reach(chain, key, end)
                    if reach > best_reach:
                        best, best_reach = chain, reach
                elif bridged is None and m == len(entry) and entry.children:
                    bridged = (entry, end + m)
            if best is not None:
                return best, end, node
            if node is core.root_node:
                break
            end -= len(node.key)
            node = node.parent
        if bridged is not None and bridged[1] in ends:
            entry, start = bridged
            for child in entry.children:
                m = _common(child.tokens, key, start)
                if start + m > device_prefix_len and m > 0 and child not in loading:
                    return self._chain_from(child, m, key, start, loading), start, ends[start]
        return [], 0, None

    def _chain_from(self, first: SpillEntry, matched: int, key: RadixKey, start: int, loading) -> list:
        chain = self._extend_chain(first, matched, key, start + len(first))
        if loading:
            chain = chain[:next((i for i, e in enumerate(chain) if e in loading), len(chain))]
        return chain

    def _extend_chain(self, first: SpillEntry, matched: int, key: RadixKey, offset: int) -> list:
        chain, entry = [first], first
        while matched == len(entry) and offset < len(key):
            best, best_m = None, 0
            for child in entry.children:
                m = _common(child.tokens, key, offset)
                if m > best_m:
                    best, best_m = child, m
            if best is None:
                break
            chain.append(best)
            entry, matched, offset = best, best_m, offset + len(best)
        return chain

    def _insert_chain(self, key: RadixKey, chain: list, start: int, anchor, new: torch.Tensor) -> None:
        """Insert ``chain`` (loaded into ``new``) below ``anchor``, one insert per entry so each node
        gets its entry's state; re-hang what hung from the entries on the nodes they became."""
        cache, core = self.cache, self.cache.tree_core
        path = array("q", key.token_ids[:start])
        prefix = cache.path_device_indices(anchor.id)[:start]
        value, offset = prefix.to(new.dtype), 0
        for entry in chain:  # top-down: each leaves its parent's children while that list is intact
            self._remove(entry)
        for entry in chain:
            path.extend(entry.tokens)
            value = torch.cat([value, new[offset: offset + len(entry)]])
            offset += len(entry)
            core.insert_state = entry.state
            try:
                # A fresh array per insert: the tree's keys may be views of the buffer they were given.
                result = cache.insert(InsertParams(key=RadixKey(array("q", path), entry.extra_key,
                                                                cache_salt=entry.cache_salt),
                                                   value=value, prev_prefix_len=len(path) - len(entry)))
            finally:
                core.insert_state = None
            core.take_fresh()  # created nodes were born with the entry's state (insert_state)
            node = core.node_by_id(result.last_device_node)
            for child in entry.children:  # chain members already left this list
                self._hang(child, anchor=node)
            entry.children = []

    # ---- bookkeeping ----

    def _hang(self, entry: SpillEntry, anchor) -> None:
        entry.anchor, entry.parent = anchor, None
        self.by_anchor.setdefault(anchor, []).append(entry)

    def _add(self, entry: SpillEntry) -> None:
        self.lru[entry] = None
        owner = entry.state.owner
        if owner is not None:
            self.by_owner.setdefault(owner, set()).add(entry)
            self.owner_tokens[owner] = self.owner_tokens.get(owner, 0) + len(entry)
            if not entry.low_value:
                self.charged_tokens[owner] = self.charged_tokens.get(owner, 0) + len(entry)
        self.tokens += len(entry)
        if entry.protected:
            self.protected_tokens += len(entry)
        self.host.charge(len(entry), entry.nbytes)

    def _remove(self, entry: SpillEntry) -> None:
        """Take ``entry`` off the tier (its children stay where they are; the caller re-hangs them)."""
        del self.lru[entry]
        owner = entry.state.owner
        if owner is not None:
            _take(self.owner_tokens, owner, len(entry))
            if not entry.low_value:
                _take(self.charged_tokens, owner, len(entry))
            mine = self.by_owner.get(owner)
            if mine is not None:
                mine.discard(entry)
                if not mine:
                    del self.by_owner[owner]
        if entry.anchor is not None:
            siblings = self.by_anchor.get(entry.anchor)
            if siblings is not None:
                siblings.remove(entry)
                if not siblings:
                    del self.by_anchor[entry.anchor]
                    if getattr(entry.anchor, "agent", None) is not None and entry.anchor.agent.terminated:
                        # it was kept for them (AgentRadixCache.reclaim_terminated)
                        self.cache.tree_core.mark_reclaim_due()
        elif entry.parent is not None:
            entry.parent.children.remove(entry)
        entry.anchor = entry.parent = None
        self.tokens -= len(entry)
        if entry.protected:
            self.protected_tokens -= len(entry)
        self.host.release(len(entry), entry.nbytes)

    def _drop_tree(self, entry: SpillEntry, reason: str) -> int:
        """Drop ``entry`` and everything that hangs from it; returns the tokens freed."""
        freed = 0
        if entry in self.lru:
            self._remove(entry)  # leaves its parent's (or anchor's) list, which stays intact
            freed += len(entry)
        stack, entry.children = entry.children, []
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            e.children, e.parent = [], None  # its parent is going too: no list to leave
            if e in self.lru:
                self._remove(e)
                freed += len(e)
        self.counters["dropped_tokens"][reason] += freed
        return freed

    def make_room(self, n: int) -> bool:
        """Free host room for ``n`` tokens by dropping host leaves (never a chain being loaded back),
        lowest :func:`~sgl_agentcache.policy.retention.host_band` first and least recently spilled
        first within it. False when even that leaves too little (paused branches' copies hold the rest).

        Two lazy scans of the spill order, each stopping at its first hit (no list per victim): the
        first takes bands below PROTECTED, the second anything. That is band order because a TRIM
        entry is put at the front of the order when it is spilled, and an entry's band is fixed at
        its spill except for protection (:meth:`advise`)."""
        host = self.host
        if n > host.capacity_tokens:
            return False
        while host.free_tokens() < n:
            victim = next((e for e in self.lru if not e.children and e not in self._pinned
                           and host_band(low_value=e.low_value, protected=e.protected) < Band.PROTECTED),
                          None) or next((e for e in self.lru if not e.children and e not in self._pinned), None)
            if victim is None:
                return False
            self._drop_tree(victim, "room")
        return True

    def reuse_rate(self) -> float:
        """The learned share of host tokens used again (loaded back, against dropped for room): the
        host reuse probability of the retention policy. Tree counters only, the same on every rank."""
        return learned_rate(self.counters["loaded_tokens"], self.counters["dropped_tokens"]["room"])

    def advise(self, branch: BranchKey, action) -> None:
        """A paused ``branch``'s lazy decision (a PauseAction, or None when the pause ends): OFFLOAD
        protects what is and will be spilled of it, DISCARD lets it be spilled only into free room."""
        if action is None:
            self.advice.pop(branch, None)
        else:
            self.advice[branch] = action
        protect = action is not None and action.value == "offload"
        for entry in self.by_owner.get(branch, ()):
            wanted = protect and not entry.low_value  # a low-value entry stays first in line
            if entry.protected != wanted:
                entry.protected = wanted
                self.protected_tokens += len(entry) if wanted else -len(entry)

    def droppable_tokens(self) -> int:
        """Host tokens that room can be made from (spilled, not protected)."""
        return self.tokens - self.protected_tokens

    def drop_owner(self, branch: BranchKey) -> int:
        """``branch`` ended: its entries go, with whatever hangs from them (a closed branch's scratch is
        freed on every tier). Returns host tokens freed."""
        return sum(self._drop_tree(e, "closed") for e in list(self.by_owner.get(branch, ())) if e in self.lru)

    def disown(self, branch: BranchKey) -> int:
        """``branch`` ended but its state stays cached (a close only inferred): its entries become
        untagged host cache, no longer charged, advised or protected. Returns their tokens."""
        self.advice.pop(branch, None)
        kept = 0
        for entry in self.by_owner.pop(branch, ()):
            kept += len(entry)
            _take(self.owner_tokens, branch, len(entry))
            if not entry.low_value:
                _take(self.charged_tokens, branch, len(entry))
            if entry.protected:
                entry.protected = False
                self.protected_tokens -= len(entry)
            entry.state = UNTAGGED_STATE
        return kept

    def drop_salt(self, salt: str) -> int:
        """Every entry of the namespaces salted ``salt`` (a tenant purge)."""
        return sum(self._drop_tree(e, "purged") for e in list(self.lru) if e in self.lru and e.cache_salt == salt)

    def reset(self) -> int:
        """The tree was rebuilt empty: every entry hung from it."""
        freed = self.tokens
        for entry in list(self.lru):
            self._remove(entry)
        self.by_anchor.clear()
        self._spilled.clear()
        self._twins.clear()
        self.advice.clear()
        return freed

    def stats(self) -> dict:
        return {"enabled": self.enabled, "entries": len(self.lru), "tokens": self.tokens,
                "protected_tokens": self.protected_tokens, "advised_branches": len(self.advice),
                "anchors": len(self.by_anchor), **self.counters}


def _take(counts: dict, key, n: int) -> None:
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _reach(chain: list, key: RadixKey, start: int) -> int:
    """How far along ``key`` a chain starting at ``start`` matches it."""
    offset = start
    for entry in chain:
        m = _common(entry.tokens, key, offset)
        offset += m
        if m < len(entry):
            break
    return offset


def _common(entry_tokens: array, key: RadixKey, offset: int) -> int:
    """How many of ``entry_tokens`` equal the key's tokens from ``offset`` on."""
    key_tokens = key.token_ids  # may run past len(key): a RadixKey can be a view of a longer buffer
    n = min(len(entry_tokens), len(key) - offset)
    if n <= 0:
        return 0
    if entry_tokens[:n] == array("q", key_tokens[offset: offset + n]):
        return n
    i = 0
    while i < n and entry_tokens[i] == key_tokens[offset + i]:
        i += 1
    return i


__all__ = ["HOST_SPILL_ENV", "PreparedLoad", "SpillEntry", "SpillTier"]
