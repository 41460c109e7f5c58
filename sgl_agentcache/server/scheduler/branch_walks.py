"""Walks over one branch's nodes in the agent tree: its tip, its movable suffix, its path's key.

Pure reads of :class:`~sgl_agentcache.server.scheduler.tree_core.AgentTreeCore` state (no SGLang call, no
clock), so every TP rank walks alike. Pause decisions price and move what these walks return
(``server/scheduler/pauses.py``); HiCache demotes the movable suffix (``server/scheduler/hicache_moves.py``).
"""

from __future__ import annotations

from array import array

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.lifecycle import BranchKey

FULL = ComponentType.FULL


def tip(core, branch: BranchKey):
    """The deepest device-resident, live node ``branch`` owns (its path's end), or None. Ties on depth
    go to the larger node id, so every rank picks the same node."""
    best, best_depth = None, -1
    for node in core.owner_index.get(branch, ()):
        if node.component_data[FULL].value is None or node.agent.terminated:
            continue
        depth = core.depth(node) + len(node.key)
        if (depth, node.id) > (best_depth, -1 if best is None else best.id):
            best, best_depth = node, depth
    return best


def movable_suffix(core, branch: BranchKey) -> list:
    """Top-down chain of ``branch``'s own nodes at the end of its path that can leave the device:
    live, device-resident, unlocked, and with no other device-resident child (never the shared
    prefix, never a node a sibling continues)."""
    chain, node, below = [], tip(core, branch), None
    while node is not None and node is not core.root_node:
        data = node.component_data[FULL]
        if node.agent.owner != branch or node.agent.terminated or data.value is None or data.lock_ref > 0:
            break
        if any(c is not below and c.component_data[FULL].value is not None for c in node.children.values()):
            break
        chain.append(node)
        below, node = node, node.parent
    return chain[::-1]


def path_of(core, node) -> tuple:
    """(tokens, extra_key, cache_salt) of the path from the root to the end of ``node``: plain data a
    pause record keeps, so a prefetch can match the path after its nodes left the device."""
    path, tokens = core.path_to(node), array("q")
    for part in path:
        tokens.extend(part.key.token_ids[: len(part.key)])
    return tokens, path[0].key.extra_key, path[0].key.cache_salt


def path_key(path: tuple) -> RadixKey:
    """The RadixKey of a path :func:`path_of` returned."""
    tokens, extra_key, salt = path
    return RadixKey(array("q", tokens), extra_key, cache_salt=salt)


__all__ = ["movable_suffix", "path_key", "path_of", "tip"]
