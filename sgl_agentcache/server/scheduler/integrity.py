"""A read-only integrity check of the live tree: run it when the scheduler is idle.

It combines SGLang's own ``UnifiedTreeCore.sanity_check`` (leaf sets, LRU lists, size counters, lock
refs) with an independent recount of our own, so a bug in either shows:

- parent/child links agree and every child is stored under its key's first page;
- full-KV lock refs are non-negative and never larger on a child than on its parent (locks cover paths);
- evictable + protected device tokens equal the sum of the nodes' device values, split by lock state;
- no KV slot is referenced by two nodes;
- every node carries agent state; the owner and terminated indexes list exactly the nodes that say so;
- a terminated unlocked device leaf is always marked due for reclaim (the per-step reclaim skips when
  none is); idle only: none is left at all (reclaim never lags a step);
- idle only: allocator free slots + tree-held slots == pool capacity (nothing leaked outside the tree);
  with HiCache, the host slots the tree's nodes hold are exactly the host pool's used slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

FULL = ComponentType.FULL


@dataclass
class IntegrityReport:
    ok: bool
    errors: list[str] = field(default_factory=list)
    nodes: int = 0
    device_tokens: int = 0
    evictable_tokens: int = 0
    protected_tokens: int = 0
    available_tokens: int = 0
    pool_tokens: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_tree(cache, *, idle: bool, agent_state: bool = True) -> IntegrityReport:
    """Check ``cache`` (an ``AgentRadixCache``; with ``agent_state=False`` any ``UnifiedRadixCache`` on the
    Python core, e.g. the stock baseline). ``idle``: no request holds KV, so conservation must hold."""
    core = cache.tree_core
    errors: list[str] = []
    try:
        stock_args = ([], []) if idle else _ongoing(cache)
        core.sanity_check(*stock_args)
    except AssertionError as exc:
        errors.append(f"[sglang sanity_check] {exc}")

    nodes = core._collect_all_nodes()
    evictable = protected = 0
    seen_slots: set[int] = set()
    for node in nodes:
        if agent_state and not hasattr(node, "agent"):
            errors.append(f"node {node.id} has no agent state")
        for child_key, child in node.children.items():
            if child.parent is not node:
                errors.append(f"node {child.id}: parent link does not point back to {node.id}")
            if child.key is not None and child.key.child_key(core.page_size) != child_key:
                errors.append(f"node {child.id}: stored under a key that is not its first page")
        if node is core.root_node:
            continue
        data = node.component_data[FULL]
        if data.lock_ref < 0:
            errors.append(f"node {node.id}: negative lock_ref {data.lock_ref}")
        parent_lock = node.parent.component_data[FULL].lock_ref
        if node.parent is not core.root_node and data.lock_ref > parent_lock:
            errors.append(f"node {node.id}: lock_ref {data.lock_ref} > parent's {parent_lock}")
        if data.value is None:
            continue
        slots = data.value.tolist()
        if len(slots) != len(node.key):
            errors.append(f"node {node.id}: {len(slots)} KV slots for {len(node.key)} tokens")
        duplicated = seen_slots.intersection(slots)
        if duplicated:
            errors.append(f"node {node.id}: KV slots shared with another node: {sorted(duplicated)[:8]}")
        seen_slots.update(slots)
        if data.lock_ref > 0:
            protected += len(slots)
        else:
            evictable += len(slots)

    if agent_state:
        errors.extend(_check_ownership(core, nodes, idle=idle))
        if idle and getattr(cache, "on_hicache", False):
            errors.extend(_check_hicache_host(cache, nodes))

    if evictable != cache.evictable_size():
        errors.append(f"evictable recount {evictable} != evictable_size() {cache.evictable_size()}")
    if protected != cache.protected_size():
        errors.append(f"protected recount {protected} != protected_size() {cache.protected_size()}")

    allocator = cache.token_to_kv_pool_allocator
    available = allocator.available_size() if allocator is not None else 0
    pool = allocator.size if allocator is not None else 0
    if idle and allocator is not None:
        if protected:
            errors.append(f"idle but {protected} tokens are still locked")
        if available + evictable != pool:
            errors.append(f"idle conservation: free {available} + tree {evictable} != pool {pool}")

    return IntegrityReport(
        ok=not errors, errors=errors, nodes=len(nodes), device_tokens=evictable + protected,
        evictable_tokens=evictable, protected_tokens=protected, available_tokens=available, pool_tokens=pool,
    )


def _check_hicache_host(cache, nodes) -> list[str]:
    """Idle, HiCache attached: the host slots the tree's nodes hold are exactly the host pool's used
    slots (a deleted branch left none behind; nothing else holds any while no copy or L3 prefetch runs)."""
    held = sum(len(n.component_data[FULL].host_value) for n in nodes
               if n is not cache.tree_core.root_node and n.component_data[FULL].host_value is not None)
    host = cache.cache_controller.mem_pool_host
    used = int(host.size) - int(host.available_size())
    return [] if held == used else [f"HiCache host recount: the tree holds {held} host slots, the pool has {used} used"]


def _check_ownership(core, nodes, *, idle: bool) -> list[str]:
    """Owner and terminated indexes against the tree."""
    errors = []
    tree_nodes = set(nodes)
    owned: dict = {}
    for node in nodes:
        state = getattr(node, "agent", None)
        if node is core.root_node or state is None:
            continue
        if state.owner is not None:
            owned.setdefault(state.owner, set()).add(node)
        if state.terminated != (node in core.terminated):
            errors.append(f"node {node.id}: terminated={state.terminated} disagrees with the terminated index")
    if owned != core.owner_index:
        for branch in set(owned) | set(core.owner_index):
            have, indexed = owned.get(branch, set()), core.owner_index.get(branch, set())
            if have != indexed:
                errors.append(f"owner index for {branch}: {len(indexed)} indexed vs {len(have)} in tree")
    stale = core.terminated - tree_nodes
    if stale:
        errors.append(f"{len(stale)} terminated-index entries are not in the tree")
    lagging = [n.id for n in core.terminated if core.awaits_reclaim(n)]
    if lagging and not getattr(core, "reclaim_due", True):
        errors.append(f"terminated unlocked leaves {lagging[:8]} are not marked due for reclaim")
    if idle:
        if lagging:
            errors.append(f"terminated nodes still resident as unlocked leaves: {lagging[:8]}")
        if core.fresh:
            errors.append(f"{len(core.fresh)} fresh nodes were never settled")
    return errors


def _ongoing(cache) -> tuple[list, list]:
    write_through = [(i, wt.node_id) for i, wt in getattr(cache, "ongoing_write_through", {}).items()]
    load_back = [(i, lb.node_id) for i, lb in getattr(cache, "ongoing_load_back", {}).items()]
    return write_through, load_back
