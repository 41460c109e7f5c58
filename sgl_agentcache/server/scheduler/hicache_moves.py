"""Our nodes across HiCache's tiers where SGLang's own moves do not fit the lifecycle.

- :func:`back_up_head`: write-back of the head of a device leaf that does not fit the host pool whole.
- :func:`host_tail`: host eviction takes only the tail of its last leaf that a need requires.
- :func:`demote_chain`: an applied pause offload (forced by a baseline, or ``AGENTCACHE_PAUSE_MODE=eager``)
  moves a paused branch's movable suffix to the host pool now, as HiCache's eviction would later.
- :func:`fetch_from_storage` / :func:`end_storage_fetch`: a prefetch of a paused branch whose history
  left the host pool for L3 starts HiCache's own storage prefetch (L3 -> host) now, ahead of the
  request, under a request handle of our own.

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

from sgl_agentcache.server.scheduler.leaf_tails import settled, split_tail

FULL = ComponentType.FULL


def _subtree_unlocked(node) -> bool:
    """No lock, host lock, load or pending write in ``node``'s subtree: SGLang's drop would decline."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if not settled(cur):
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


def host_tail(core, node, need: int):
    """The part of host leaf ``node`` that host eviction should take when ``need`` more tokens must be
    freed: ``node`` itself when it is not longer than that (rounded up to whole pages), else its tail of
    that length, split off so that its head stays on host (:func:`leaf_tails.split_tail`: the tail keeps
    ``node``'s identity, the head its recency, so it ranks as ``node`` did and goes next if more room is
    wanted).

    Why: SGLang's host eviction frees whole leaves, and a leaf is often a whole conversation turn.
    A resume reads a prefix, so the head of a history is worth as much without its tail: measured on
    the real Claude Code mix (host 0.5x of the pool), a subagent's 268-token write-back took a
    neighbour's whole 1,526-token idle history off host, and its user came back to recompute it."""
    return split_tail(core, node, need, core.host_trims, core.host_tail_floor)


def host_evictable_tokens(cache, *, below=None) -> int:
    """Host tokens HiCache's host eviction can free: every host-only node (evicted, backed up, unlocked on
    both tiers, as ``UnifiedTreeCore._is_host_leaf`` asks) whose whole subtree is such nodes. Its
    eviction takes a host leaf, then the parent once that is a leaf (``FullComponent.drive_host_eviction``),
    so a host-only chain is free room all the way up, not only its last node.

    ``below`` (a :class:`~sgl_agentcache.policy.retention.Band`): count only subtrees whose every node
    ranks below it in our host order (``cache.hicache_host_key``), which eviction takes first: a node
    above it stays, and so does every ancestor it keeps from being a leaf.

    Climbs from HiCache's own index of host leaves, so it visits the evictable nodes and their parents
    only (it runs on every pause decision, and on a write-back eviction that does not fit free slots)."""
    core = cache.tree_core

    def evictable(node) -> bool:
        return (node is not core.root_node and node.evicted and node.backuped
                and not any(cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in node.component_data)
                and (below is None or cache.hicache_host_key(node, 0)[0] < below))

    frontier = [node for node in core.evictable_host_leaves if evictable(node)]
    counted = set(frontier)
    children_counted: dict = {}
    tokens = 0
    while frontier:
        node = frontier.pop()
        tokens += len(node.component_data[FULL].host_value)
        parent = node.parent
        if parent is None or parent in counted:
            continue
        children_counted[parent] = children_counted.get(parent, 0) + 1
        if children_counted[parent] == len(parent.children) and evictable(parent):
            counted.add(parent)
            frontier.append(parent)
    return tokens


def displaceable_host_tokens(cache) -> int:
    """Host slots a backup may take without losing a protected copy: free slots, write-back duplicates
    HiCache releases first (``cache.host_free()``), and host-only subtrees ranked below the protected
    band (ended, trimmed, valued: HiCache's host eviction takes those first, in our order)."""
    from sgl_agentcache.policy.retention import Band

    return cache.host_free() + host_evictable_tokens(cache, below=Band.PROTECTED)


def demote_chain(cache, chain: list) -> int:
    """Back up (where not backed up yet) and demote ``chain`` -- a top-down chain of unlocked device
    nodes, each with no device child but the next (``branch_walks.movable_suffix``) -- bottom-up, as
    HiCache's eviction demotes leaves: the device slots are freed, the host copies stay in the tree,
    and the next match of that path loads them back through HiCache. Host room comes from free slots
    and HiCache's host eviction of entries below the protected band (:func:`displaceable_host_tokens`):
    a backup never pushes out a protected copy -- another paused branch's, or the tail this chain just
    demoted. Stops at the first node that cannot be backed up: what is above it stays on the device.
    Returns the tokens demoted."""
    tracker = {ct: 0 for ct in cache.tree_components}
    moved = 0
    room = displaceable_host_tokens(cache)  # each backup takes its slots (from free or by eviction)
    for node in reversed(chain):
        data = node.component_data[FULL]
        if data.value is None:
            continue
        if data.lock_ref > 0 or any(c.component_data[FULL].value is not None for c in node.children.values()):
            break  # locked by a request since, or a device child appeared: not a leaf to demote
        if not node.backuped:
            if len(node.key) > room or not cache.backup_node_for_write_back(node.id):
                break
            room -= len(node.key)
        cache._demote(node.id, tracker)
        moved += len(node.key)
    return moved


#: The request-id prefix of our storage prefetches (SGLang's logs and prefetch stats name them so).
FETCH_RID_PREFIX = "agentcache-prefetch"


def fetch_from_storage(cache, key, rid: str, max_tokens: int):
    """Start HiCache's storage prefetch (L3 -> host pool) for the part of ``key`` past its device and host
    match, at most ``max_tokens`` of it (SGLang aligns it to pages), under a request handle with id
    ``rid`` (the caller's, the same on every rank: control messages reach every rank in one order).

    It is SGLang's own path, the one its scheduler takes for a waiting request
    (``UnifiedRadixCache.prefetch_from_storage``): the storage hit query, host allocation and page reads
    run on HiCache's IO threads, and the storage drain (``check_hicache_events``, every scheduler step,
    rank-agreed counts) inserts the fetched pages into the host pool when the reads finish. The branch's
    next request then matches them on host and loads them back (HiCache's load path). Our only addition
    is that nothing waits for a request: the fetch starts when the tool is nearly done.

    Returns ``(handle, tokens)``: the handle to pass to :func:`end_storage_fetch` and the tokens asked
    of L3 (whether L3 holds them is known when the reads finish), or ``(None, 0)`` without an L3 store,
    when nothing of ``key`` lies past its host match, when the match ends on a node with no host copy
    (its page hash chain is unknown: SGLang's own gate), below SGLang's prefetch threshold, or while
    SGLang's storage prefetch is rate-limited."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams

    if not getattr(cache, "enable_storage", False) or cache.cache_controller is None or \
            cache.host_memory_mode == "buffer_only":  # buffer mode anchors differently; not wired here
        return None, 0
    result = cache.match_prefix(MatchPrefixParams(key=key))
    matched = int(result.device_prefix_len) + int(result.host_hit_length)
    tokens = key.raw_token_ids()  # an array('q'), as the tree's keys: a list key would break matching
    anchor = result.last_host_node
    rest = tokens[matched:matched + max(int(max_tokens), 0)]
    if not rest or not (cache.is_root(anchor) or cache.is_backuped(anchor)):
        return None, 0
    handle = CacheRequestHandle(rid=rid, attempt_id=0)
    prefix_keys = cache.get_prefix_hash_values(anchor) if cache.hicache_storage_pass_prefix_keys else None
    cache.prefetch_from_storage(handle, anchor, rest, cache.get_last_hash_value(anchor), prefix_keys,
                                matched_prefix_tokens=tokens[:matched], extra_key=key.extra_key,
                                cache_salt=key.cache_salt)
    if not cache.has_ongoing_prefetch(handle):
        cache.release_aborted_request(handle)  # declined: drop whatever accounting it left
        return None, 0
    return handle, len(rest) // cache.page_size * cache.page_size


def end_storage_fetch(cache, handle) -> int:
    """The branch resumed, closed or expired: forget the fetch. One still reading is stopped (SGLang
    releases its host pages); one that finished has its pages in the host pool already, as ordinary
    host entries. Returns the tokens it brought from L3 into the host pool (0 while still reading)."""
    loaded = cache.pop_prefetch_loaded_tokens(handle)
    cache.release_aborted_request(handle)
    return int(loaded)
