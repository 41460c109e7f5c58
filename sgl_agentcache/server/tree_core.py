"""``AgentTreeCore``: SGLang's Python tree core whose nodes carry :class:`~sgl_agentcache.lifecycle.NodeState`.

The stock Rust core cannot hold per-node Python state, so the agentcache backend always runs on this
subclass of ``UnifiedTreeCore``. It overrides only node birth, split and death (pinned in ``pins.py``):

- ``_new_node``        every node is born with an ``agent`` attribute (untagged state);
- ``_add_new_node``    a new leaf takes the state of the insert in progress (``insert_state``);
- ``_split_node``      the new parent fragment inherits the child's state (a split never changes owner);
- ``_unregister_node`` a deleted node is reported to ``on_node_deleted`` listeners.

Everything else (matching, locking, LRU, eviction mechanics, HiCache) is SGLang's own code.
"""

from __future__ import annotations

from typing import Callable, Optional

from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, UnifiedTreeNode

from sgl_agentcache.lifecycle import NodeState, untagged


class AgentTreeCore(UnifiedTreeCore):
    """Python tree core with lifecycle state on every node."""

    def __init__(self, params, components):
        # Set before super().__init__: it calls reset(), which creates the root through _new_node.
        self.insert_state: Optional[NodeState] = None
        self.node_deleted_listeners: list[Callable[[UnifiedTreeNode], None]] = []
        super().__init__(params, components)

    def _new_node(self, priority: int = 0) -> UnifiedTreeNode:
        node = super()._new_node(priority=priority)
        node.agent = untagged()
        return node

    def _add_new_node(self, parent, key, value, priority=0, session_id=None, rotation_base=None):
        node = super()._add_new_node(
            parent, key, value, priority=priority, session_id=session_id, rotation_base=rotation_base
        )
        if self.insert_state is not None:
            node.agent = self.insert_state.copy()
        return node

    def _split_node(self, key, child, split_len):
        new_node, action = super()._split_node(key, child, split_len)
        new_node.agent = child.agent.copy()
        return new_node, action

    def _unregister_node(self, node: UnifiedTreeNode) -> None:
        super()._unregister_node(node)
        for listener in self.node_deleted_listeners:
            listener(node)

    def all_nodes(self) -> list[UnifiedTreeNode]:
        """Every node reachable from the root, root included."""
        return self._collect_all_nodes()
