"""Our nodes across HiCache's tiers where SGLang's own moves do not fit the lifecycle.

- :func:`back_up_head`: write-back of the head of a device leaf that does not fit the host pool whole.
- :func:`demote_chain`: an applied pause offload (forced by a baseline, or ``AGENTCACHE_PAUSE_MODE=eager``)
  moves a paused branch's movable suffix to the host pool now, as HiCache's eviction would later.

SGLang 0.5.23's write-back backs up an evicted device leaf as one unit: when the host pool cannot take
all of it (``_execute_kv_backup`` evicts host leaves, then gives up), ``_drop_subtree_no_host`` drops the
whole leaf and everything under it on host. Measured on the real Claude Code mix (host 0.5x of the
pool, one seed): 33 leaves went that way, 12 longer than the whole host pool (a fresh 1,900-token
context against 1,649 host slots) and 21 while a load-back held most of the pool locked (its chain
stays host-locked until the copy lands).

A resume reads a prefix: the first ``room`` tokens of that leaf are worth keeping even when its tail is
not. So, under write-back, a leaf longer than the host room is split at the room (page aligned), its
tail dropped without a copy (as SGLang would have dropped it all), and its head backed up and
demoted as SGLang demotes a leaf. Nothing else changes: a leaf that fits, one with no room at all, a
terminated one (deleted on both tiers instead) or one whose subtree holds a lock takes the stock path.

Everything here runs on the scheduler thread inside SGLang's eviction walk, with the same inputs on
every TP rank (tree shape and host pool occupancy), so every rank splits alike.
"""

from __future__ import annotations

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

FULL = ComponentType.FULL


def _subtree_unlocked(node) -> bool:
    """No lock, host lock, load or pending write in ``node``'s subtree: SGLang's drop would decline."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur.write_through_pending_id is not None or cur.load_back_pending_id is not None:
            return False
        if any(cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in cur.component_data):
            return False
        stack.extend(cur.children.values())
    return True


def head_len(length: int, room: int, page_size: int) -> int:
    """Tokens of a ``length``-token leaf to back up into ``room`` host slots: 0 when it fits whole (the
    stock path) or when not one page fits (nothing to keep)."""
    if length <= room:
        return 0
    return room // page_size * page_size


def back_up_head(cache, node, tracker) -> bool:
    """If ``node`` (an unbacked device leaf chosen for write-back eviction) is longer than the host room
    ``cache.host_room()`` reports, split it there, drop the tail and back up and demote the head.
    Returns whether it did (the eviction step is then complete: the walk goes on from the head)."""
    core = cache.tree_core
    if not cache.is_write_back or node.backuped:
        return False
    if len(node.key) <= cache.cache_controller.mem_pool_host.available_size():
        return False  # fits in free slots: the common case, without walking the host leaves for the room
    if not _subtree_unlocked(node):
        return False
    keep = head_len(len(node.key), cache.host_room()[1], cache.page_size)
    if keep <= 0:
        return False
    head, action = core._split_node(node.key, node, keep)
    if action is not None:
        cache._apply_cache_actions([action])
    tail_tokens = len(node.key)
    if not cache._drop_subtree_no_host(node.id, tracker):  # cannot happen (checked above); stock walk goes on
        return False
    kept = cache.backup_node_for_write_back(head.id)
    if kept:
        cache._demote(head.id, tracker)
    elif not cache._drop_subtree_no_host(head.id, tracker):
        return True  # the head stays on the device (SGLang's own "drop declined" outcome)
    counts = cache.partial_backups
    counts["leaves"] += 1
    counts["kept_tokens"] += keep if kept else 0
    counts["dropped_tokens"] += tail_tokens + (0 if kept else keep)
    # The walk pushes its last victim's parent when that becomes a device leaf; the victim it knows
    # (the tail) is gone, so name the head, whose parent is the one that may now be a leaf.
    full = core.components_by_type[FULL]
    if getattr(full, "_evict_device_last_node", None) is node:
        full._evict_device_last_node = head
    return True


def demote_chain(cache, chain: list) -> int:
    """Back up (where not backed up yet) and demote ``chain`` -- a top-down chain of unlocked device
    nodes, each with no device child but the next (``HostCopies.movable_suffix``) -- bottom-up, as
    HiCache's eviction demotes leaves: the device slots are freed, the host copies stay in the tree,
    and the next match of that path loads them back through HiCache. Host room comes from HiCache's
    host eviction (our host ranking). Stops at the first node that cannot be backed up (no host room):
    what is above it stays on the device. Returns the tokens demoted."""
    tracker = {ct: 0 for ct in cache.tree_components}
    moved = 0
    for node in reversed(chain):
        data = node.component_data[FULL]
        if data.value is None:
            continue
        if data.lock_ref > 0 or any(c.component_data[FULL].value is not None for c in node.children.values()):
            break  # locked by a request since, or a device child appeared: not a leaf to demote
        if not node.backuped and not cache.backup_node_for_write_back(node.id):
            break
        cache._demote(node.id, tracker)
        moved += len(node.key)
    return moved
