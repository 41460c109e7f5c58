"""Eviction takes only the tail of a leaf that its need requires, on the device and on HiCache's host.

SGLang 0.5.23 evicts whole leaves on both tiers: an allocation that is short by 24 tokens frees the
first leaf of its eviction order whole, and a leaf is often a whole conversation turn or a session's
whole history. A resume reads a prefix, so the head of a history is worth as much without its tail.
Measured on the real Claude Code mix (host 1x of the pool): a 24-token allocation took a paused
session's whole 4,867-token history off the device, and its next call, 14 s later, waited 1.36 s to
load it back (SGLang's HiCache, whose LRU order picked a 27-token leaf there, answered in 13 ms).

So the eviction walk's last victim is split where the need ends (whole pages): its tail is evicted
(demoted, backed up then demoted, or deleted, as SGLang evicts a leaf) and its head stays, keeping the
leaf's recency stamp, so it ranks as the leaf did and goes next if more room is wanted. The worst case
is SGLang's own outcome, one split later.

A tail is at least :data:`TAIL_FLOOR_SHARE` of its tier's pool. SGLang asks eviction for exactly the
shortfall, and under pressure every decode step is short by its batch size: a tail of only that split
a leaf at every step (``bench/tree_overhead.py``, ``branch_heavy``: 14,168 one-token splits for 200
requests, our cache time 9.4x stock's). SGLang's whole leaf is the other extreme; the floor spreads one
split over many steps and still keeps a long history's head.

Not split on the device: a node no branch owns (untagged traffic is evicted exactly as SGLang evicts
it, so a server that sends no hints and infers none runs SGLang's own tree) unless a guessed close kept
it as cache (``NodeState.kept``: a conversation chat inference closed as idle, whose user may return to
read its head), a terminated node (deleted
whole, nobody reads it again), a node with a copy in flight or a host lock, or a need of the whole leaf
or more. Replayed baselines keep SGLang's whole-leaf eviction
(``AgentRadixCache.set_eviction_key``). Everything here runs on the scheduler thread inside SGLang's
eviction walk with the same inputs on every TP rank (tree shape, pool occupancy), so every rank splits
alike.
"""

from __future__ import annotations

#: The least share of a tier's pool an eviction that splits a leaf takes (see the module docstring).
TAIL_FLOOR_SHARE = 1 / 64


def tail_floor(pool_tokens: int, page: int) -> int:
    """The least tail (tokens, whole pages) an eviction splits off a leaf on a tier of ``pool_tokens``."""
    pages = int(pool_tokens * TAIL_FLOOR_SHARE) // page
    return max(pages, 1) * page


def split_tail(core, node, need: int, counts: dict, floor: int = 0):
    """Split leaf ``node`` so that its last ``need`` tokens, at least ``floor`` (both rounded up to whole
    pages), are a node of their own, when that leaves a head of at least one page. Returns the node to
    evict: ``node``, whose identity the tail keeps (the head is a new node, given ``node``'s recency).
    No need (``need`` <= 0) takes the leaf whole. Counts a split in ``counts`` (``leaves``,
    ``kept_tokens``)."""
    if need <= 0:
        return node
    page = core.page_size
    take = -(-max(need, floor) // page) * page
    length = len(node.key)
    if length - take < page:
        return node
    stamp = node.last_access_time
    head, action = core._split_node(node.key, node, length - take)
    assert action is None, "a node with a copy in flight is not split"
    head.last_access_time = stamp  # a split is not an access
    counts["leaves"] += 1
    counts["kept_tokens"] += length - take
    return node


def settled(node) -> bool:
    """No lock, host lock, load or pending write on ``node`` itself (what SGLang's moves wait for)."""
    if node.write_through_pending_id is not None or node.load_back_pending_id is not None:
        return False
    return not any(cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in node.component_data)


def device_tail(core, node, need: int):
    """The part of device leaf ``node`` (the eviction walk's victim) that eviction should take when
    ``need`` more device tokens must be freed (see the module docstring). Returns ``node``."""
    state = node.agent
    if not core.trim_device_tails or (state.owner is None and not state.kept) or state.terminated \
            or not settled(node):
        return node
    return split_tail(core, node, need, core.device_trims, core.device_tail_floor)
