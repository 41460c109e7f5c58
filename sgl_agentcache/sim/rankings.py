"""Eviction rankings of the replayed baselines, handed to the cache with ``set_eviction_key``.

Ours needs none (the cache's own lifecycle rank). Each key maps a candidate leaf to a sort key,
smallest evicted first; ``base`` is SGLang's configured priority (LRU time by default). Pins of a
KEEP decision (a TTL pin, a preserved request) rank above every unpinned node in all of them, as in
the cache's own rank.

- :class:`LruRanking`: stock SGLang order (session-radix references, then LRU).
- :class:`StepsRanking`: KVFlow's steps-to-execution (furthest next activation first, clipped at
  ``hold_step + 1`` as its ``AgentManager`` does; LRU breaks ties), from the agent step graph the
  replayer maintains (:class:`~sgl_agentcache.sim.stepgraph.StepGraph`), never from times.
- :class:`NextUseRanking`: Belady on true next use -- clairvoyant, for the clairvoyant heuristic only.
"""

from __future__ import annotations

import math

from sgl_agentcache.lifecycle import BranchKey


class LruRanking:
    """SGLang's stock order: unreferenced before session-referenced, then least recently used."""

    def __init__(self, cache):
        self.kept = cache.pauses.kept

    def key(self, node, session_ref: int, base) -> tuple:
        return (node.agent.owner in self.kept, session_ref > 0, session_ref, base)


class StepsRanking:
    """KVFlow: a node's priority is its owner's steps to execution (unowned, shared nodes: 0, the most
    urgent user); the furthest first, ties in LRU order."""

    def __init__(self, cache, hold_step: int = 4):
        self.kept = cache.pauses.kept
        self.cap = hold_step + 1
        self.steps: dict[BranchKey, int] = {}

    def key(self, node, session_ref: int, base) -> tuple:
        state = node.agent
        steps = self.cap if state.terminated else min(self.steps.get(state.owner, 0), self.cap) if state.owner else 0
        return (state.owner in self.kept, -steps, base)


class NextUseRanking:
    """Belady: the node whose owner is used furthest in the future goes first (never again: first of
    all; unowned, shared nodes count as needed now). ``next_use`` holds true times: clairvoyant."""

    def __init__(self, cache):
        self.kept = cache.pauses.kept
        self.next_use: dict[BranchKey, float] = {}

    def key(self, node, session_ref: int, base) -> tuple:
        state = node.agent
        when = math.inf if state.terminated else self.next_use.get(state.owner, 0.0) if state.owner else 0.0
        return (state.owner in self.kept, -when, base)


__all__ = ["LruRanking", "NextUseRanking", "StepsRanking"]
