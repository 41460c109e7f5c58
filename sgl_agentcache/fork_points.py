"""Where a fork's inherited history ends, when its hint does not say (pure: stdlib only).

A fork's hint names its parent; ``fork_point_tokens`` (how much of the prompt is the parent's
history) is optional, and most harnesses do not know token counts. Without it, every token the fork
*creates* in the tree past the stable prefix is its own scratch -- including the parent's history,
when that was evicted before the fork ran and the fork had to recompute it. Those nodes then die with
the fork (a finished subagent's scratch is reclaimed first), and the lead's next turn and its next
subagents lose the history they share.

So the cache remembers, per branch, the end of its last finished request: the prompt's length and
the prompt-plus-output's length, each with a fingerprint of the tokens just before it. A fork whose
prompt has the same tokens at the same offset continues that context, and its fork point is that
length (the longer one that matches). A window, not the whole prefix: two prompts that agree on the
last :data:`WINDOW` tokens before the same offset and differ earlier do not occur in practice, and a
wrong guess changes only who is charged for some nodes (retention), never which KV is reused (the
radix tree matches exactly). Fingerprints are Python hashes of int tuples: the same on every
tensor-parallel rank.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from sgl_agentcache.namespaced_lru import NamespacedLRU

#: Tokens fingerprinted before a context's end.
WINDOW = 32
#: Branches remembered, in all and per namespace (the least recently finished of the namespace over
#: its share are forgotten first; branch keys start with their namespace).
LIMIT = 65_536
NAMESPACE_LIMIT = 16_384


def _fingerprint(tail: Sequence[int]) -> int:
    return hash(tuple(tail))


class BranchContexts:
    """Each branch's last finished context end, for inferring fork points (see the module docstring)."""

    def __init__(self, limit: int = LIMIT, namespace_limit: int | None = NAMESPACE_LIMIT):
        self._ends: NamespacedLRU[Hashable, tuple[tuple[int, int], ...]] = NamespacedLRU(limit, namespace_limit)

    def __len__(self) -> int:
        return len(self._ends)

    def record(self, branch: Hashable, prompt: Sequence[int], output: Sequence[int]) -> None:
        """``branch`` finished a request with ``prompt`` and ``output`` token ids."""
        marks = [(len(prompt), _fingerprint(prompt[-WINDOW:]))]
        if output:
            tail = (list(prompt[-WINDOW:]) + list(output))[-WINDOW:]
            marks.insert(0, (len(prompt) + len(output), _fingerprint(tail)))
        self._ends.put(branch, tuple(marks))

    def fork_point(self, parent: Hashable, prompt: Sequence[int]) -> int | None:
        """How much of ``prompt`` continues ``parent``'s last context (None: unknown or no match)."""
        for end, mark in self._ends.get(parent, ()):
            if end <= len(prompt) and _fingerprint(prompt[max(end - WINDOW, 0):end]) == mark:
                return end
        return None

    def forget(self, branch: Hashable) -> None:
        self._ends.pop(branch)

    def forget_where(self, predicate: Callable[[Hashable], bool]) -> None:
        for branch in [b for b in self._ends if predicate(b)]:
            self._ends.pop(branch)


__all__ = ["BranchContexts", "LIMIT", "WINDOW"]
