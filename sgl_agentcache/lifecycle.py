"""Lifecycle state carried by every radix node, and the pure rules over it (no SGLang, no torch).

A node's *class* says how valuable its KV is likely to be to future turns (what that is worth, per
token and per tier, is the retention policy's business: :mod:`sgl_agentcache.policy.retention`):

- ``STABLE``  -- system prompt, tool schema: reused by nearly every turn of every session.
- ``SESSION`` -- the growing conversation of one trajectory (a branch that was not forked).
- ``SCRATCH`` -- tokens a forked branch created past its fork point.

``terminated`` is a state, not a class: the owning branch ended, so the node is reclaimable now.
Traffic without hints is ``UNTAGGED`` (no owner). It ranks with SCRATCH: nothing declared a future
value for it, so it competes by recency with live branch scratch and yields to declared session and
stable state. When all traffic is untagged, eviction is exactly stock SGLang's recency order.

Ownership: a node with an ``owner`` charges ``len(node.key)`` tokens to that branch while it is in the
tree (on any tier). Shared nodes (stable prefix, nodes matched from the parent) have no owner or keep
the parent's; a child branch is never charged for them.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple

from sgl_agentcache.namespaced_lru import NamespacedLRU


class NodeClass(IntEnum):
    """Lifecycle class of a node's tokens."""

    UNTAGGED = 0
    SCRATCH = 1
    SESSION = 2
    STABLE = 3


class BranchKey(NamedTuple):
    """Identity of a branch: cache namespace, session (trajectory) and branch id.

    A named tuple rather than a frozen dataclass: branches key every per-branch index, several
    lookups per insert, and a tuple hashes and compares in C (a quarter of a dataclass's lookup time).
    """

    namespace: str
    session: str
    branch: str

    def to_dict(self) -> dict:
        return {"namespace": self.namespace, "session": self.session, "branch": self.branch}


class NodeState(NamedTuple):
    """Per-node agent state. ``owner`` is the branch charged for the node's tokens (None: shared).
    ``kept``: untagged KV that a close the server only guessed kept as cache (chat inference's idle
    close, ``AgentRadixCache.close_branch(keep_cached=True)``); it ranks as any untagged node, but it is
    the server's own guess, not traffic that sent no hints, so its device leaves may lose only a tail
    under pressure as a branch's do (``leaf_tails.device_tail``).

    Immutable, so one state is shared by every node an insert creates (no copy per node); a node's
    state is replaced, never edited. A named tuple, built in C: plans make two per request.
    """

    cls: NodeClass = NodeClass.UNTAGGED
    owner: BranchKey | None = None
    terminated: bool = False
    kept: bool = False

    def ended(self) -> "NodeState":
        """The same state with its branch ended."""
        return self if self.terminated else NodeState(self.cls, self.owner, True)


#: The one state every node is born with, and that of every node a request without a lifecycle hint
#: inserts (states are immutable, so one value serves them all).
UNTAGGED_STATE = NodeState()

#: The state of KV that a guessed close kept as cache (see ``NodeState.kept``).
KEPT_ON_CLOSE_STATE = NodeState(kept=True)


class InsertPlan:
    """How the tokens of one request are classified, by absolute offset in the request.

    ``[0, stable_end)`` is STABLE and unowned; ``[stable_end, fork_point)`` belongs to ``parent``
    (the parent's session history, when the request is a fork); from ``fork_point`` on, tokens belong
    to ``own`` (SCRATCH of the branch for a fork, else SESSION of the branch). Only nodes the request's
    insert *creates* are classified; nodes it matched keep their state and owner.

    Immutable by contract: one plan serves every insert of its request. A slots class rather than a
    frozen dataclass, whose ``__init__`` pays an ``object.__setattr__`` per field: one plan is built
    per request on the scheduler thread.
    """

    __slots__ = ("own", "stable_end", "fork_point", "parent", "boundaries")

    def __init__(self, own: NodeState, stable_end: int = 0, fork_point: int = 0,
                 parent: NodeState | None = None):
        self.own, self.stable_end, self.fork_point, self.parent = own, stable_end, fork_point, parent
        #: Offsets where a created node must be split so every node has exactly one class: the
        #: distinct positive ones of ``stable_end`` and ``fork_point``, ascending.
        low, high = (stable_end, fork_point) if stable_end <= fork_point else (fork_point, stable_end)
        self.boundaries: tuple[int, ...] = (low, high) if 0 < low < high else (high,) if high > 0 else ()

    def __repr__(self) -> str:
        return (f"InsertPlan(own={self.own!r}, stable_end={self.stable_end}, fork_point={self.fork_point}, "
                f"parent={self.parent!r})")

    def state_at(self, offset: int) -> NodeState:
        if offset < self.stable_end:
            return STABLE_STATE
        if offset < self.fork_point and self.parent is not None:
            return self.parent
        return self.own


STABLE_STATE = NodeState(NodeClass.STABLE)
UNTAGGED_PLAN = InsertPlan(own=UNTAGGED_STATE)


#: Branches one namespace's sets remember (its least recently used are forgotten past it), and all
#: namespaces' together (past it, the largest namespace's least recently used go).
BRANCHES_PER_NAMESPACE = 16_384
BRANCHES_TOTAL = 131_072


class RecentBranches:
    """A bounded set of branches: the closed ones, the ones seen.

    The closed set lets a request of a closed branch that finishes late be stamped terminated and
    reclaimed at once instead of resurrecting the branch; the seen set lets a fork name its parent. The
    bounds keep a long-running server's memory flat, and they are per namespace (a tenant): one
    namespace's flood of branch names forgets only its own oldest, never another's (see
    :class:`~sgl_agentcache.namespaced_lru.NamespacedLRU`). A branch for which ``retained`` holds (it
    still owns tokens) is never forgotten.
    """

    def __init__(self, limit: int = BRANCHES_TOTAL, by_session: bool = False, *,
                 namespace_limit: int = BRANCHES_PER_NAMESPACE, retained: Callable[[BranchKey], bool] | None = None):
        self._branches: NamespacedLRU[BranchKey, None] = NamespacedLRU(limit, namespace_limit, retained=retained)
        self.version = 0  # changes with every add and discard: "has the set changed since?" in O(1)
        # session id -> its branches here (when asked for): a session close must not scan every branch.
        self._sessions: dict[str, dict[BranchKey, None]] | None = {} if by_session else None

    @property
    def limit(self) -> int:
        """Branches remembered in all namespaces together."""
        return self._branches.limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._branches.limit = value

    @property
    def namespace_limit(self) -> int:
        return self._branches.namespace_limit

    @namespace_limit.setter
    def namespace_limit(self, value: int) -> None:
        self._branches.namespace_limit = value

    def add(self, branch: BranchKey) -> None:
        self.version += 1
        forgotten = self._branches.put(branch, None)
        if self._sessions is not None:
            self._sessions.setdefault(branch.session, {})[branch] = None
            for old, _ in forgotten:
                self._unindex(old)

    def discard(self, branch: BranchKey) -> None:
        self.version += 1
        if branch in self._branches:
            self._branches.pop(branch)
            self._unindex(branch)

    def _unindex(self, branch: BranchKey) -> None:
        if self._sessions is not None:
            same = self._sessions[branch.session]
            del same[branch]
            if not same:
                del self._sessions[branch.session]

    def of_session(self, session: str) -> list[BranchKey]:
        """The branches here of ``session``, in any namespace (needs ``by_session``)."""
        if self._sessions is None:
            raise TypeError("this RecentBranches was built without by_session")
        return list(self._sessions.get(session, ()))

    def __contains__(self, branch: object) -> bool:
        return branch in self._branches

    def __len__(self) -> int:
        return len(self._branches)

    def __iter__(self):
        return iter(self._branches)


def _escape(part: str | None) -> str:
    return (part or "").replace("\\", "\\\\").replace("|", "\\|")


def namespace_key(extra_key: str | None, cache_salt: str | None) -> str:
    """The cache namespace of a tree path: SGLang's ``extra_key`` and ``cache_salt`` (either may be unset).

    Injective on what SGLang tells apart (it treats ``""`` as unset for both): the two parts are joined
    by ``|`` after each has its ``\\`` and ``|`` escaped with a backslash, so ``("a|", "b")`` and
    ``("a", "|b")`` are two namespaces. Parts without either character read as before (``"a|b"``;
    ``"|"`` when both are unset). :func:`split_namespace` is the inverse.
    """
    return f"{_escape(extra_key)}|{_escape(cache_salt)}"


def split_namespace(namespace: str) -> tuple[str | None, str | None]:
    """``(extra_key, cache_salt)`` of a :func:`namespace_key` (unset parts are None); ``ValueError`` if
    ``namespace`` is not one."""
    parts, part, chars = [], [], iter(namespace)
    for char in chars:
        if char == "\\":
            escaped = next(chars, None)
            if escaped not in ("\\", "|"):
                raise ValueError(f"not a namespace key: {namespace!r}")
            part.append(escaped)
        elif char == "|":
            parts.append("".join(part))
            part = []
        else:
            part.append(char)
    parts.append("".join(part))
    if len(parts) != 2:
        raise ValueError(f"not a namespace key: {namespace!r}")
    return parts[0] or None, parts[1] or None


def namespace_salt(namespace: str) -> str | None:
    """The ``cache_salt`` part of a :func:`namespace_key`; None if unset or ``namespace`` is not a key."""
    try:
        return split_namespace(namespace)[1]
    except ValueError:
        return None


def parent_refusal(parent: BranchKey, seen, closed) -> str | None:
    """Why a fork of ``parent`` must be refused, or None (pure)."""
    if parent in closed:
        return f"parent branch {parent.session}/{parent.branch} is closed"
    if parent not in seen:
        return f"unknown parent branch {parent.session}/{parent.branch}"
    return None
