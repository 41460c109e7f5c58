"""How long an inferred branch may wait before chat inference closes it, learned per namespace from
the gaps its own conversations showed (pure: no clock, no SGLang; the caller passes each gap).

Chat inference cannot see a harness end a conversation: a client sends no close. It guesses one when
a branch has waited longer than its conversations usually do. Two kinds of wait, learned apart:

- ``"tool"``: the branch's last reply called a tool; the gap ends when the tool's result comes back.
  A branch still waiting far past the namespace's tool gaps was abandoned (its conversation was
  rewritten from the first user message, or the harness gave up): its pause holds memory for nothing.
- ``"idle"``: the reply called no tool; the gap ends with the next user turn (or a retried one).

A bound is ``MARGIN`` times the longest of the namespace's last ``WINDOW`` gaps of that kind, never
under ``FLOOR_S``; the idle bound never over the operator's idle time, and neither is learned before
``min_gaps`` gaps (default :data:`MIN_GAPS`; then :meth:`GapBounds.bound` returns None and the
caller's fixed rule holds). Gaps past a bound are not observed (the branch is closed by then, its next
request opens a new one), so the longest gap seen is under the bound; the margin is what keeps the
bound from creeping down: it moves only when the longest gaps leave the window. A wrong guess is
cheap by design -- the caller closes with the KV kept as untagged cache -- so the bound may be tight
where the gaps are.

Bounded: at most ``limit`` namespaces (each holds two windows of ``WINDOW`` floats); past it the least
recently used namespace's gaps are forgotten (it falls back to the fixed rule until it learns again).
Operators set how many gaps it takes with ``AGENTCACHE_INFER_LEARN_AFTER`` (0: never learn; fixed bounds).
"""

from __future__ import annotations

from collections import deque

from sgl_agentcache.namespaced_lru import NamespacedLRU

__all__ = ["FLOOR_S", "KINDS", "MARGIN", "MIN_GAPS", "WINDOW", "GapBounds"]

KINDS = ("tool", "idle")
#: Gaps a namespace must have shown (of one kind) before its bound of that kind is learned (default).
MIN_GAPS = 16
#: The most recent gaps a namespace keeps per kind.
WINDOW = 256
#: The bound is MARGIN x the longest gap of the window (tool latencies are heavy-tailed: Terminal-Bench's
#: p99 is 180 s and its max 600 s; twice the 99th percentile, or twice the longest, closed live pauses)...
MARGIN = 4.0
#: ...and never shorter than this (a burst of instant tools must not make every pause a close).
FLOOR_S = 2.0


class _Window:
    __slots__ = ("gaps", "bound")

    def __init__(self) -> None:
        self.gaps: deque[float] = deque(maxlen=WINDOW)
        self.bound: float | None = None

    def observe(self, gap: float, min_gaps: int) -> None:
        self.gaps.append(gap)
        if len(self.gaps) >= min_gaps:
            self.bound = max(FLOOR_S, MARGIN * max(self.gaps))


class GapBounds:
    """Per namespace and kind (:data:`KINDS`): the gaps seen and the bound they set."""

    def __init__(self, limit: int = 4096, min_gaps: int = MIN_GAPS):
        if not 1 <= min_gaps <= WINDOW:
            raise ValueError(f"min_gaps must be within 1..{WINDOW}, got {min_gaps}")
        self.min_gaps = min_gaps
        self._windows: NamespacedLRU[tuple[str, str], _Window] = NamespacedLRU(2 * limit, len(KINDS))

    def observe(self, namespace: str, kind: str, gap: float) -> None:
        """A branch of ``namespace`` came back after ``gap`` seconds of waiting of ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"unknown gap kind {kind!r}; expected one of {KINDS}")
        key = (namespace, kind)
        window = self._windows.get(key)
        if window is None:
            window = _Window()
            self._windows.put(key, window)
        else:
            self._windows.touch(key)
        window.observe(max(gap, 0.0), self.min_gaps)

    def bound(self, namespace: str, kind: str) -> float | None:
        """The learned bound (seconds), or None before ``min_gaps`` gaps of ``kind`` were seen."""
        window = self._windows.get((namespace, kind))
        return None if window is None else window.bound

    def seen(self, namespace: str, kind: str) -> int:
        window = self._windows.get((namespace, kind))
        return 0 if window is None else len(window.gaps)

    def forget_namespace(self, namespace: str) -> None:
        self._windows.pop_namespace(namespace)
