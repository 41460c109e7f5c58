"""``AgentTreeCore``: SGLang's Python tree core whose nodes carry :class:`~sgl_agentcache.lifecycle.NodeState`.

The stock Rust core cannot hold per-node Python state, so the agentcache backend always runs on this
subclass of ``UnifiedTreeCore``. It overrides only node birth, split, death and reset (all pinned in
``pins.py``) and keeps two indexes that follow the tree exactly:

- ``owner_index``: branch -> the nodes it owns. A branch's charge is ``sum(len(node.key))`` over them,
  derived on demand, so it can never drift from the tree (a split moves tokens between two nodes of
  the same owner; a deleted node leaves the index in ``_unregister_node``).
- ``terminated``: nodes whose owner ended and that are waiting to be reclaimed; ``reclaim_due`` says
  that one of them may have become an evictable device leaf since the last reclaim (every addition to
  SGLang's ``evictable_device_leaves`` goes through ``_update_evictable_leaf_sets``, which sets it), so
  the per-step reclaim costs one attribute test when nothing changed.

During an insert the cache sets ``insert_state``; every node the insert creates is stamped with it and
recorded in ``fresh`` (split fragments of a fresh node are fresh too), so the cache can classify
exactly the created tokens afterwards (``settle``). Matched nodes are never touched.

The cache also sets ``insert_from``, the node its request holds locked, and the insert then starts
there instead of at the root (:meth:`_skip_locked_prefix`). SGLang's walk re-compares and re-slices
the request's whole key node by node, although the locked path already is exactly its first
``cache_protected_len`` tokens: that re-walk was about a quarter of stock's cache time on our agent
streams. Every side effect the walk has on those nodes (LRU stamp, priority, hit count) is replayed
in the same order, so the tree, its LRU order and every later decision are the same as stock's.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from typing import Optional

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, UnifiedTreeNode
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import EvictDeviceLeafResult

from sgl_agentcache.lifecycle import UNTAGGED_STATE, BranchKey, NodeState
from sgl_agentcache.server.scheduler.hicache_moves import host_tail


FULL = ComponentType.FULL
# Stock methods our overrides call directly (cheaper than super(): each runs per node an insert or match
# touches). All pinned in pins.py.
_STOCK_UPDATE_LEAF_SETS = UnifiedTreeCore._update_evictable_leaf_sets
_STOCK_NEW_NODE = UnifiedTreeCore._new_node
_STOCK_ADD_NEW_NODE = UnifiedTreeCore._add_new_node
_STOCK_INSERT_WALK_STEP = UnifiedTreeCore._insert_walk_step
_STOCK_INC_HIT_COUNT_AND_CHECK = UnifiedTreeCore._inc_hit_count_and_check
_SKIP_READS = ("enable_hicache", "enable_external_cache_linker", "is_eagle", "components", "root_node")


class AgentTreeCore(UnifiedTreeCore):
    """Python tree core with lifecycle state and ownership on every node."""

    def __init__(self, params, components):
        # Set before super().__init__: it calls reset(), which creates the root through _new_node.
        self.insert_state: Optional[NodeState] = None
        self.insert_from: Optional[UnifiedTreeNode] = None
        self.fresh: set[UnifiedTreeNode] = set()
        # Every node deletion, in order, when AGENTCACHE_RECORD_EVICTIONS=1 (tests compare the
        # server's decisions with the replayer's): (crc32 of the node's tokens, tokens, class).
        self.deletions: Optional[deque] = None  # see record_deletions
        # HiCache write-through: ``backup_veto(node)`` True keeps a node the policy does not value on
        # host from being backed up at insert (the cache sets it when HiCache attaches).
        self.backup_veto = None
        self.vetoed_backup_tokens = 0
        # HiCache's host pool, as the retention policy learns its reuse rate: tokens loaded back to the
        # device, and tokens of live branches its host eviction dropped (a closed branch's are freed,
        # not lost). Tree facts, the same on every rank.
        self.host_loaded_tokens = 0
        self.host_lost_tokens = 0
        # Eviction drops only the tail a need requires of its last leaf, on host (hicache_moves.host_tail)
        # and device (leaf_tails.device_tail); off for replayed baselines, which keep SGLang's whole-leaf
        # eviction. The host target is set only inside drive_host_eviction: every other host deletion
        # (a close, a purge) takes whole nodes.
        self.trim_host_tails = True
        self.trim_device_tails = True
        self.host_evict_target: Optional[int] = None
        self.host_trims = {"leaves": 0, "kept_tokens": 0}
        self.device_trims = {"leaves": 0, "kept_tokens": 0}
        # The least tail a split takes on each tier (leaf_tails.tail_floor), set once the pools are known.
        self.device_tail_floor = 0
        self.host_tail_floor = 0
        super().__init__(params, components)
        # Read by every insert (_skip_locked_prefix); pins.py checks methods, not attributes, so a
        # rename in a later SGLang must stop the server here rather than at its first request.
        missing = [a for a in _SKIP_READS if not hasattr(self, a)]
        if missing:
            raise RuntimeError(f"UnifiedTreeCore no longer has {missing}: the locked-prefix skip needs them")

    # ---- SGLang overrides (pinned) ----

    def record_deletions(self) -> None:
        """Keep every node deletion, in order (``AGENTCACHE_RECORD_EVICTIONS=1``: tests compare the
        server's decisions with the replayer's): (crc32 of the node's tokens, tokens, class)."""
        self.deletions = deque(maxlen=65536)

    def reset(self) -> None:
        self.owner_index: dict[BranchKey, set[UnifiedTreeNode]] = {}
        self.owned_count: dict[BranchKey, int] = {}  # tokens per owner, kept with owner_index (O(1) quota checks)
        self.terminated: set[UnifiedTreeNode] = set()
        self.reclaim_due = False
        self.fresh = set()
        super().reset()

    def drive_host_eviction(self, component_type, num_tokens):
        """SGLang's host eviction, told how many tokens it must free (:meth:`_evict_host_leaf` reads
        it to take only the tail of the last leaf it needs; see :func:`hicache_moves.host_tail`)."""
        self.host_evict_target = num_tokens if component_type == FULL and self.trim_host_tails else None
        try:
            return super().drive_host_eviction(component_type, num_tokens)
        finally:
            self.host_evict_target = None

    def _evict_host_leaf(self, node, tracker, device_frees, host_frees, cache_actions) -> None:
        target = self.host_evict_target
        if target is not None and not node.agent.terminated:
            node = host_tail(self, node, target - tracker[FULL])
        if not node.agent.terminated:
            host_value = node.component_data[FULL].host_value
            self.host_lost_tokens += len(host_value) if host_value is not None else 0
        super()._evict_host_leaf(node, tracker, device_frees, host_frees, cache_actions)

    def _new_node(self, priority: int = 0) -> UnifiedTreeNode:
        node = _STOCK_NEW_NODE(self, priority=priority)
        node.agent = UNTAGGED_STATE  # shared and never mutated: states are replaced, not edited
        return node

    def _add_new_node(self, parent, key, value, priority=0, session_id=None, rotation_base=None):
        node = _STOCK_ADD_NEW_NODE(
            self, parent, key, value, priority=priority, session_id=session_id, rotation_base=rotation_base
        )
        state = self.insert_state
        if state is not None:
            self.fresh.add(node)
            self._adopt(node, state)  # born UNTAGGED: nothing to forget first
        return node

    def _split_node(self, key, child, split_len):
        new_node, action = super()._split_node(key, child, split_len)
        owner = child.agent.owner
        if owner is not None:  # the child lost the front of its key to new_node, which set_state re-adds
            self.owned_count[owner] -= len(new_node.key)
        self.set_state(new_node, child.agent)
        if child in self.fresh:
            self.fresh.add(new_node)
        return new_node, action

    def _insert_walk_step(self, state) -> None:
        start = self.insert_from
        if start is not None and state.node is self.root_node and state.total_prefix_length == 0:
            self._skip_locked_prefix(state, start)
        _STOCK_INSERT_WALK_STEP(self, state)

    def _skip_locked_prefix(self, state, start: UnifiedTreeNode) -> None:
        """Move a fresh insert walk from the root down ``start``'s path, as far as the insert's key
        reaches and no further than ``prev_prefix_len`` (the tokens the request already holds from the
        tree, so the walk would free no duplicate there), doing what the walk does to each node passed.

        The caller vouches that ``start``'s path spells the key's first tokens: it is the node the
        request holds locked, whose path's KV slots are the first ``cache_protected_len`` of the
        request's row, so SGLang's attention already relies on exactly that (the passed path's first
        and last tokens are spot-checked too). These leave the walk to SGLang unchanged: a start node
        not locked on the device, or detached; another namespace; a failed spot check; auxiliary
        components (SWA, Mamba); HiCache or external write-through (a hit may fire a backup at a walk
        barrier); bigram keys; rotation bases. ``tests/test_locked_prefix_skip.py`` checks the tree
        and its LRU order against the full walk after every operation of an agent stream.
        """
        if (self.enable_hicache or self.enable_external_cache_linker or self.is_eagle
                or len(self.components) != 1 or state.params.rotation_base is not None):
            return
        # Locked and on the device: then so is its whole path (a lock holds every ancestor; HiCache is
        # off, so nothing locked is ever off the device), and no node needs its own test.
        data = start.component_data[FULL]
        if data.lock_ref <= 0 or data.value is None:
            return
        path, node = [], start
        while node is not self.root_node:
            if node is None:  # detached
                return
            path.append(node)
            node = node.parent
        if not path:  # the start is the root: nothing to skip
            return
        path.reverse()  # from the root down
        key = state.key
        top = path[0].key
        if top.extra_key != key.extra_key or top.cache_salt != key.cache_salt:
            return
        limit = min(len(key), state.params.prev_prefix_len)
        ends, total = [], 0  # where each passed node's tokens end in the key (len(RadixKey) is not free)
        for node in path:
            end = total + len(node.key)
            if end > limit:
                break
            ends.append(end)
            total = end
        if not ends:
            return
        # Spot check, not proof (that would be the comparison we skip): the path's first and last
        # passed tokens must be the key's, or a start node off the key (a caller's mistake, a future
        # SGLang flow) falls back to SGLang's walk before anything changed.
        tokens, last = key.token_ids, path[len(ends) - 1].key
        if top.token_ids[0] != tokens[0] or last.token_ids[len(last) - 1] != tokens[total - 1]:
            return
        # What _insert_walk_step does to a fully matched, device-resident node of the base component:
        # stamp its LRU time, raise its priority, count the hit (never a backup here: HiCache and the
        # external linker are off), and move on -- node by node from the root, as the walk would.
        inserted, priority = state.params.inserted_len, state.priority
        for node, end in zip(path, ends):
            self._touch_node(node)
            if node.priority < priority:
                node.priority = priority
            if end > inserted:
                self._inc_hit_count_and_check(node)
        state.node = path[len(ends) - 1]
        state.total_prefix_length = total
        state.key = key[total:]
        state.value = state.value[total:]

    def _inc_hit_count_and_check(self, node: UnifiedTreeNode) -> bool:
        backup = _STOCK_INC_HIT_COUNT_AND_CHECK(self, node)
        veto = self.backup_veto
        if backup and veto is not None and veto(node):
            # Not now; a later hit asks again (the branch may be back under its quota by then), and a
            # backed-up descendant's chain still takes it along (the host prefix stays contiguous).
            self.vetoed_backup_tokens += len(node.key)
            return False
        return backup

    def _update_evictable_leaf_sets(self, node: UnifiedTreeNode) -> None:
        _STOCK_UPDATE_LEAF_SETS(self, node)
        # Under HiCache a terminated node can also become deletable as a host leaf (its last L3 write
        # or load-back let go of it): every lock release and ack comes through here.
        if self.terminated and node in self.terminated and (
                node in self.evictable_device_leaves or node in self.evictable_host_leaves):
            self.reclaim_due = True

    def _unregister_node(self, node: UnifiedTreeNode) -> None:
        if self.deletions is not None and node.key is not None:
            tokens = node.key.token_ids[: len(node.key)]
            self.deletions.append((zlib.crc32(array("q", tokens).tobytes()), len(node.key), node.agent.cls.name))
        super()._unregister_node(node)
        self._forget(node)
        self.fresh.discard(node)

    # ---- ownership ----

    def set_state(self, node: UnifiedTreeNode, state: NodeState) -> None:
        """Give ``node`` a new state, keeping the owner and terminated indexes exact."""
        self._forget(node)
        self._adopt(node, state)

    def _adopt(self, node: UnifiedTreeNode, state: NodeState) -> None:
        """Index ``node`` under ``state``; the node must be in no index (just born, or forgotten)."""
        node.agent = state
        owner = state.owner
        if owner is not None:
            nodes = self.owner_index.get(owner)
            if nodes is None:
                nodes = self.owner_index[owner] = set()
            nodes.add(node)
            self.owned_count[owner] = self.owned_count.get(owner, 0) + len(node.key)
        if state.terminated:
            self.terminated.add(node)
            if node in self.evictable_device_leaves or node in self.evictable_host_leaves:
                self.reclaim_due = True

    def _forget(self, node: UnifiedTreeNode) -> None:
        state = getattr(node, "agent", None)
        if state is None:
            return
        if state.owner is not None:
            nodes = self.owner_index.get(state.owner)
            if nodes is not None and node in nodes:
                nodes.discard(node)
                left = self.owned_count[state.owner] - len(node.key)
                if nodes:
                    self.owned_count[state.owner] = left
                else:
                    del self.owner_index[state.owner]
                    del self.owned_count[state.owner]
        self.terminated.discard(node)

    def owned_tokens(self, branch: BranchKey) -> int:
        """Tokens ``branch`` is charged for: every node it owns, on any tier."""
        return self.owned_count.get(branch, 0)

    def resident_owned_tokens(self, branch: BranchKey) -> int:
        """Tokens ``branch`` owns that are on the device now (owned_tokens counts every tier)."""
        full = ComponentType.FULL
        return sum(len(n.key) for n in self.owner_index.get(branch, ()) if n.component_data[full].value is not None)

    def path_to(self, node: UnifiedTreeNode) -> list[UnifiedTreeNode]:
        """The nodes from the root's child down to ``node`` (empty for the root itself)."""
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def depth(self, node: UnifiedTreeNode) -> int:
        """Token offset at which ``node``'s key starts (the sum of its ancestors' key lengths)."""
        depth, node = 0, node.parent
        while node is not None and node is not self.root_node:
            depth += len(node.key)
            node = node.parent
        return depth

    def take_fresh(self) -> set[UnifiedTreeNode]:
        """The nodes created since the last call (the caller must not keep the empty set it may get)."""
        fresh = self.fresh
        if fresh:
            self.fresh = set()
        return fresh

    def all_nodes(self) -> list[UnifiedTreeNode]:
        """Every node reachable from the root, root included."""
        return self._collect_all_nodes()

    def reclaimable(self) -> bool:
        """Some terminated node may be an evictable device leaf now (false: certainly none is). The
        cheap test before a reclaim; the reclaim clears it (:meth:`reclaimed`)."""
        return self.reclaim_due

    def reclaimed(self) -> None:
        """Every terminated evictable device leaf that may go was just freed; a terminated node kept
        back (locked, or a HiCache copy in flight) sets ``reclaim_due`` again through
        :meth:`mark_reclaim_due` when what held it lets go."""
        self.reclaim_due = False

    def mark_reclaim_due(self) -> None:
        """Something that kept a terminated leaf from being reclaimed let go of it."""
        self.reclaim_due = bool(self.terminated)

    def attached(self, node: UnifiedTreeNode) -> bool:
        """``node`` is still in the tree. Deleting a leaf only unlinks it from its parent (its key,
        value and parent stay set), and leaves go before their parents, so the parent's link decides."""
        parent = node.parent
        return parent is not None and parent.children.get(node.key.child_key(self.page_size)) is node

    def is_device_leaf(self, node: UnifiedTreeNode) -> bool:
        """Unlocked, device-resident, no device-resident children: evictable right now."""
        return node in self.evictable_device_leaves

    def host_holders(self) -> list[UnifiedTreeNode]:
        """Every node holding HiCache host slots (its base component's ``host_value`` is set)."""
        return [n for n in self._collect_all_nodes()
                if n is not self.root_node and n.component_data[FULL].host_value is not None]

    def awaits_reclaim(self, node: UnifiedTreeNode) -> bool:
        """A reclaim would free ``node`` now, if it is terminated: an unlocked device leaf, or under
        HiCache a node :meth:`deletable_everywhere` allows (a device leaf with host-only children stays)."""
        return self.deletable_everywhere(node) if self.enable_hicache else node in self.evictable_device_leaves

    # ---- deletion on every tier (HiCache attached) ----

    def deletable_everywhere(self, node: UnifiedTreeNode) -> bool:
        """``node`` can leave the tree now, with its device and HiCache host copies: in the tree, no
        children on any tier (deleting it would orphan their host slots), KV on some tier, no lock on
        either tier (a running request, an L3 write or a load-back reading it), no copy in flight."""
        if node is self.root_node or node.children or not self.attached(node):
            return False
        if node.write_through_pending_id is not None or node.load_back_pending_id is not None:
            return False
        if node.evicted and not node.backuped:  # a tombstone: SGLang's own cascade removes those
            return False
        return all(cd.lock_ref <= 0 and cd.host_lock_ref <= 0 for cd in node.component_data)

    def delete_everywhere(self, node: UnifiedTreeNode) -> EvictDeviceLeafResult:
        """Delete a node :meth:`deletable_everywhere` allows, freeing its device and host slots (the
        caller drains the result with ``_apply_eviction_result``). Stock eviction would *demote* a
        backed-up device node to host instead: right for a cold prefix, wrong for a closed branch."""
        if not self.deletable_everywhere(node):
            raise ValueError(f"node {node.id} cannot be deleted on every tier now")
        result = EvictDeviceLeafResult()
        frees = (result.tracker, result.device_frees, result.host_frees, result.cache_actions)
        if node.evicted:
            self._evict_host_leaf(node, *frees)
        else:
            if node.backuped:  # the stock delete records the device copy's removal only
                self.kv_events.record_remove(node, medium=StorageMedium.CPU)
            self._delete_unbacked_device_leaf(node, *frees)
        return result
