"""Lifecycle state carried by every radix node (pure; no SGLang, no torch).

A node's *class* says how valuable its KV is likely to be to future turns:

- ``STABLE``  -- system prompt, tool schema: reused by nearly every turn of every session.
- ``SESSION`` -- the growing conversation of one trajectory.
- ``SCRATCH`` -- branch-local state of a forked subagent (or low-value reasoning text).

``terminated`` is a state, not a class: the owner ended, so the node is reclaimable now.
Traffic without hints gets :data:`UNTAGGED` (class ``SESSION``, no owner), which ranks all such nodes
equally and leaves eviction to recency, exactly like stock SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class NodeClass(IntEnum):
    """Lifecycle class; a higher value is more valuable (evicted later)."""

    SCRATCH = 1
    SESSION = 2
    STABLE = 3


@dataclass(frozen=True, slots=True)
class BranchKey:
    """Identity of a branch: namespace (tenant cache namespace), session (trajectory) and branch id."""

    namespace: str
    session: str
    branch: str


@dataclass(slots=True)
class NodeState:
    """Per-node agent state. ``owner`` is the branch charged for the node's tokens (None: shared)."""

    cls: NodeClass = NodeClass.SESSION
    owner: BranchKey | None = None
    terminated: bool = False

    def copy(self) -> "NodeState":
        return NodeState(self.cls, self.owner, self.terminated)


def untagged() -> NodeState:
    """State for nodes inserted by requests that carry no lifecycle hint."""
    return NodeState()
