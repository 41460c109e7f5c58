"""Zero-config lifecycle for OpenAI-compatible chat clients (pure: stdlib only; no SGLang, no HTTP).

Most agent harnesses send plain ``/v1/chat/completions`` requests with ``tools`` and ``tool_calls``
and never add our hint header. The server infers a hint for each such request from the chat itself (on
by default with our backend; ``AGENTCACHE_INFER=off`` turns it off); an explicit hint (the header) always wins and is never mixed with an
inferred one. This module holds the inference state and rules; ``server/front/chat_hooks.py`` feeds it the
requests and carries out what it decides, and the replay (``sim/inferred.py``) drives the same class
with a trace's block fingerprints for the "ours, inferred" row.

Session identity, in order: OpenAI's ``prompt_cache_key``; ``safety_identifier``; ``user``; else a
hash of the conversation's first messages (its system messages and first user message). Ids are
hashed (``k-``, ``s-``, ``u-``, ``c-`` prefixes), so no client string reaches logs or the tree, and
they live in the caller's namespace (tenant): two tenants sending the same chat never share a session.

Branches: each session tracks the messages of each branch's last request as a chain of fingerprints
(one per message, each covering every message before it). A request whose messages extend a branch's
last request continues that branch (a tool result, the next user turn). One that shares history with
an idle branch (no request in flight) and then diverges is an *edit* of it (a compaction, a retried
turn): the branch goes on and its old suffix is freed at once (``edit_from_tokens``); a wrong guess --
the old suffix wanted again -- costs a recompute. A branch whose last reply called a tool is idle only
for a request that brings a tool result past the shared history: one that does not is a subagent the
tool started, not a rewrite. One that extends a branch whose own request is still running, or
diverges from a busy one, is a fork of it (a subagent, parallel samples: it shares the parent's exact
nodes and its own are its scratch). One that shares no message past the system messages with any
branch is an independent conversation of the session (a client reusing one ``prompt_cache_key`` for
unrelated chats): a new branch without a parent.
Branch names are never reused within a process (``m`` / ``f`` and a keyed hash of a counter), so a
branch closed when idle never receives tokens again; they reveal nothing of other tenants' chats.

Idle: a branch with no request in flight for its idle bound is closed, after the branches forked
from it (a parent's history stays while a fork may still use it). The close is a guess, so the caller
keeps the branch's KV as untagged cache rather than freeing it (a human back from a long pause still
finds what stock caching would have kept). The bounds are learned per namespace from the gaps its
branches waited before coming back (:mod:`sgl_agentcache.policy.gap_bounds`), apart for a branch
waiting on its tool's result and one waiting on its user: the idle bound is ``idle_s`` until learned
and never more; a branch waiting on its tool is left to the caller's pause (its deadline, the
server's maximum retention) until a tool bound is learned, and closed past that bound even while
paused -- its conversation went on elsewhere (a rewrite from the first user message) or was dropped.
Subagents: a branch that resumes with its tool's result closes its forks that have answered and wait
for nothing (a Task-style tool returns when its subagent is done); a wrong guess -- the fork sends
again -- costs little, as its KV stays cached and its next request starts a new branch.

Bounded per namespace and in all (sessions, message fingerprints; branches per session); past a bound
the least recently used idle session (or branch) *of the namespace over its share* is forgotten and
returned for closing, so one tenant's flood never forgets another's conversations. Forgetting only
costs cache reuse, never correctness: the next request of a forgotten session starts a new branch.
A request refused before it runs (too long for the context, a bad field) leaves nothing behind:
:meth:`ChatInference.assign` records, :meth:`~ChatInference.commit` counts once the request is
accepted, :meth:`~ChatInference.rollback` takes it back otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.gap_bounds import MIN_GAPS, GapBounds

_DIGEST = 16  # bytes per fingerprint (BLAKE2b): collisions are out of reach for a conversation's life
#: How many later user messages a new conversation offers as the first user message of the one it may
#: rewrite (a message inserted before it: see :attr:`ChatTurn.reopenings`).
MAX_REOPENINGS = 4


def _text(content: Any) -> str:
    """A message's content as text: strings as they are, parts by their text (others by type)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                parts.append(str(part.get("text", f"<{part.get('type', 'part')}>")))
            else:
                parts.append(str(part))
        return "\x1f".join(parts)
    return str(content)


def _arguments(value: Any) -> str:
    """Tool-call arguments in one canonical form (clients echo them as a string or as an object)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def canonical_message(message: Mapping) -> bytes:
    """The parts of a chat message that define the conversation (role, content, tool calls and ids),
    in a form that does not depend on how a client serialized them."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {} if isinstance(call, Mapping) else {}
        calls.append([str(function.get("name", "")), _arguments(function.get("arguments"))])
    record = [str(message.get("role", "")), _text(message.get("content")), calls,
              str(message.get("tool_call_id") or ""), str(message.get("name") or "")]
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()


def tool_names(message: Mapping) -> list[str]:
    """Function names of an assistant message's tool calls."""
    names = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and function.get("name"):
            names.append(str(function["name"]))
    return names


def _hashed(prefix: str, data: bytes) -> str:
    return prefix + hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True)
class ChatTurn:
    """What inference needs of one chat request (plain data)."""

    fingerprints: tuple[bytes, ...]  # one per message: a digest of it and every message before it
    leading_system: int  # how many messages the conversation opens with that are system/developer
    session: str  # inferred session id
    source: str  # where the session came from: prompt_cache_key, safety_identifier, user, conversation
    last_tool_result: int = -1  # index of the last tool-result message (-1: none)
    # A conversation rewritten at its very start (a message inserted before its first user message:
    # injected memory, a re-sent preamble) hashes to a new session. Per candidate: the session id it
    # had if a later message opened it, and that message's and the next one's fingerprints as they
    # chain right after the system messages -- what the rewritten branch's own fingerprints hold there.
    reopenings: tuple[tuple[str, bytes, bytes], ...] = ()

    @classmethod
    def from_messages(cls, messages: Iterable[Mapping], *, prompt_cache_key: str | None = None,
                      safety_identifier: str | None = None, user: str | None = None) -> "ChatTurn":
        fingerprints, digest, opening, datas, later_users = [], b"", [], [], []
        leading_system, first_user_seen, last_tool_result = 0, False, -1
        for i, message in enumerate(messages):
            data = canonical_message(message)
            datas.append(data)
            digest = hashlib.blake2b(digest + data, digest_size=_DIGEST).digest()
            fingerprints.append(digest)
            role = message.get("role")
            if role == "tool":
                last_tool_result = i
            if role in ("system", "developer") and leading_system == i:
                leading_system += 1
            if not first_user_seen:
                opening.append(data)
                first_user_seen = role == "user"
            elif role == "user" and len(later_users) < MAX_REOPENINGS:
                later_users.append(i)
        for source, value, prefix in (("prompt_cache_key", prompt_cache_key, "k-"),
                                      ("safety_identifier", safety_identifier, "s-"), ("user", user, "u-")):
            if isinstance(value, str) and value:
                return cls(tuple(fingerprints), leading_system, _hashed(prefix, value.encode()), source,
                           last_tool_result)
        system = datas[:leading_system]
        reopenings = reopening_candidates(fingerprints[leading_system - 1] if leading_system else b"",
                                          [_hashed("c-", b"\x1e".join(system + [datas[i]])) for i in later_users],
                                          [(datas[i], datas[i + 1] if i + 1 < len(datas) else None) for i in later_users])
        return cls(tuple(fingerprints), leading_system, _hashed("c-", b"\x1e".join(opening)), "conversation",
                   last_tool_result, reopenings)


def reopening_candidates(system_digest: bytes, sessions: list[str],
                         openers: list[tuple[bytes, bytes | None]]) -> tuple[tuple[str, bytes, bytes], ...]:
    """:attr:`ChatTurn.reopenings` from the system messages' chained digest, each candidate's session
    id, and its opening message and the one after it (the data the fingerprints chain); a candidate
    with nothing after it is left out (one message is too little evidence of a rewrite)."""
    out = []
    for session, (first, second) in zip(sessions, openers):
        if second is None:
            continue
        d1 = hashlib.blake2b(system_digest + first, digest_size=_DIGEST).digest()
        out.append((session, d1, hashlib.blake2b(d1 + second, digest_size=_DIGEST).digest()))
    return tuple(out)


@dataclass(frozen=True)
class Inferred:
    """The hint inferred for one request."""

    session: str
    branch: str
    parent: str | None  # set for a fork
    shared_messages: int  # for a fork or an edit: how many leading messages it shares with the branch
    source: str
    continued: bool  # it continues a branch's earlier request (a tool result or the next turn)
    edit: bool = False  # it rewrites its branch's history after ``shared_messages`` (a compaction)


@dataclass
class _Branch:
    fingerprints: tuple[bytes, ...]
    parent: str | None
    in_flight: int = 0
    last_seen: float = 0.0
    awaiting_tool: bool = False  # its last reply called a tool whose result has not come back


@dataclass
class _Session:
    branches: OrderedDict = field(default_factory=OrderedDict)  # name -> _Branch, least recently used first

    def fingerprints(self) -> int:
        return sum(len(b.fingerprints) for b in self.branches.values())

    def busy(self) -> bool:
        return any(b.in_flight for b in self.branches.values())


@dataclass(frozen=True)
class Assignment:
    """What :meth:`ChatInference.assign` recorded for one request, so that :meth:`ChatInference.commit`
    can make it count (the request was accepted) or :meth:`ChatInference.rollback` take it back (it
    was refused before it ran: then inference keeps nothing of it)."""

    namespace: str
    inferred: Inferred
    previous: tuple[bytes, ...] | None  # the branch's fingerprints before (None: the branch was new)
    recorded: tuple[bytes, ...]  # what this request set them to
    new_session: bool
    kind: str  # "continued", "edits", "forks" or "new_branches" (its counter)
    gap: tuple[str, float] | None = None  # a branch coming back: ("tool" | "idle", seconds it waited)
    rewritten: tuple[str, str] | None = None  # (namespace, session) this new conversation rewrote


class Closing(NamedTuple):
    """A branch inference forgot, for the caller to close, and why: ``"idle"`` (no request for its idle
    bound), ``"tool_bound"`` (waiting on its tool far past its namespace's tool gaps: abandoned),
    ``"subagent"`` (a finished fork of a branch resuming from its tool), ``"rewritten"`` (a session whose
    conversation came back with a message inserted before its first user message) or ``"bounds"``
    (state bounds)."""

    namespace: str
    session: str
    branch: str
    reason: str = "idle"


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the longest equal prefix: fingerprints chain, so equality is monotone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatInference:
    """Sessions and branches inferred from chat requests, per namespace (see the module docstring).
    Every method takes the caller's clock reading ``now``; nothing here reads a clock.

    Bounds, each per namespace and in all (a tenant's flood forgets only its own state, see
    :class:`~sgl_agentcache.namespaced_lru.NamespacedLRU`): ``max_sessions`` sessions in all and
    ``max_sessions_per_namespace`` in one; ``max_fingerprints`` message fingerprints in all and
    ``max_fingerprints_per_namespace`` in one (over the first, the namespace holding the most gives
    up its least recently used idle session); ``max_branches`` per session.

    Branch names are ``m`` / ``f`` and a keyed hash of a process-wide counter (``name_key``, random by
    default): unique for the process's life, and they tell a tenant nothing about how many chats other
    tenants started."""

    def __init__(self, idle_s: float = 300.0, max_sessions: int = 4096, max_branches: int = 32,
                 max_fingerprints: int = 1 << 20, *, max_sessions_per_namespace: int | None = None,
                 max_fingerprints_per_namespace: int | None = None, name_key: bytes | None = None,
                 infer_edits: bool = True, learn_after: int = MIN_GAPS):
        self.idle_s = idle_s
        # the gaps this namespace's branches waited before coming back, and the bounds they set
        # (learn_after: how many gaps it takes; 0: none, the bounds stay fixed)
        self.learned = GapBounds(max_sessions, learn_after) if learn_after else None
        self.infer_edits = infer_edits
        self.max_branches, self.max_fingerprints = max_branches, max_fingerprints
        self.max_fingerprints_per_namespace = min(max_fingerprints_per_namespace or max(max_fingerprints // 4, 1),
                                                  max_fingerprints)
        # (namespace, session) -> state, least recently used first within each namespace. A session with
        # a request in flight is passed over (the caller's closes must never cut one off).
        self.sessions: NamespacedLRU[tuple[str, str], _Session] = NamespacedLRU(
            max_sessions, max_sessions_per_namespace or max(max_sessions // 4, 1),
            retained=lambda key: self.sessions.get(key).busy())
        self.fingerprints_by_namespace: Counter = Counter()
        self.fingerprint_count = 0
        self._name_key = os.urandom(16) if name_key is None else name_key
        self._next = 0
        self.counters = {"requests": 0, "continued": 0, "edits": 0, "forks": 0, "new_branches": 0, "idle_closes": 0,
                         "tool_bound_closes": 0, "subagent_closes": 0, "rewritten_closes": 0, "forgotten_branches": 0,
                         "refused": 0}

    def _name(self, kind: str) -> str:
        self._next += 1
        return kind + hashlib.blake2b(self._next.to_bytes(8, "little"), key=self._name_key, digest_size=6).hexdigest()

    def _set_fingerprints(self, namespace: str, branch: _Branch, fps: tuple) -> None:
        delta = len(fps) - len(branch.fingerprints)
        self.fingerprint_count += delta
        self.fingerprints_by_namespace[namespace] += delta
        if not self.fingerprints_by_namespace[namespace]:
            del self.fingerprints_by_namespace[namespace]
        branch.fingerprints = fps

    def assign(self, namespace: str, turn: ChatTurn, now: float) -> tuple[Inferred, Assignment]:
        """The branch ``turn`` belongs to, recorded at once (marked in flight until :meth:`done`) so
        that requests arriving meanwhile see it, but not yet counted against the bounds: the caller
        :meth:`commit`s it once the request is accepted, or :meth:`rollback`s it if it is refused."""
        key = (namespace, turn.session)
        session = self.sessions.get(key)
        new_session = session is None
        if new_session:
            session = _Session()
            self.sessions.put(key, session, bound=False)  # the bounds apply at commit
        else:
            self.sessions.touch(key)
        fps = turn.fingerprints
        longest, longest_free, closest, closest_len = 0, None, None, 0
        extending: list[tuple[int, str]] = []  # branches whose whole last request this turn repeats
        for name, branch in session.branches.items():
            common = _common(branch.fingerprints, fps)
            if common and common == len(branch.fingerprints):
                extending.append((common, name))
                longest = max(longest, common)
            if common > closest_len:
                closest, closest_len = name, common
        for common, name in extending:
            branch = session.branches[name]
            # A branch waiting on its tool goes on only with a tool result: a request without one is
            # a subagent the tool started (a fork of it).
            if common == longest and branch.in_flight == 0 and (not branch.awaiting_tool
                                                                or turn.last_tool_result >= common):
                longest_free = name
        if longest_free is not None:  # a tool result, the next turn: the same branch goes on
            name, parent, shared, kind = longest_free, session.branches[longest_free].parent, 0, "continued"
        elif (self.infer_edits and closest is not None and closest_len > turn.leading_system
              and session.branches[closest].in_flight == 0
              and (not session.branches[closest].awaiting_tool or turn.last_tool_result >= closest_len)):
            # Keeps an idle branch's history, then takes it somewhere else: the client rewrote it (a
            # compaction, a retried last turn). The branch goes on; its old suffix is freed at once.
            # A branch waiting on its tool is rewritten only by a request that brings a tool result
            # past the shared history; one that does not is a subagent the tool started (a fork).
            name, parent, shared, kind = closest, session.branches[closest].parent, closest_len, "edits"
        elif closest is not None and closest_len > turn.leading_system:
            # Shares real history with a branch that is busy, or takes it somewhere else: a subagent.
            name, parent, shared, kind = self._name("f"), closest, closest_len, "forks"
        else:
            name, parent, shared, kind = self._name("m"), None, 0, "new_branches"
        branch = session.branches.get(name)
        previous = None if branch is None else branch.fingerprints
        gap = None
        if branch is None:
            branch = session.branches[name] = _Branch((), parent)
        elif branch.in_flight == 0:  # it comes back after a wait: for a tool's result, or for its user
            gap = ("tool" if branch.awaiting_tool else "idle", max(now - branch.last_seen, 0.0))
        self._set_fingerprints(namespace, branch, fps)
        branch.in_flight += 1
        branch.last_seen = now
        session.branches.move_to_end(name)
        inferred = Inferred(turn.session, name, parent, shared, turn.source, kind == "continued", kind == "edits")
        rewritten = self._rewritten(namespace, turn) if new_session and self.infer_edits else None
        return inferred, Assignment(namespace, inferred, previous, fps, new_session, kind, gap, rewritten)

    def _rewritten(self, namespace: str, turn: ChatTurn) -> tuple[str, str] | None:
        """The idle session ``turn`` (a new conversation) rewrote at its start, if any: one whose root
        branch's messages, right after the same system messages, are two of ``turn``'s later messages
        (:attr:`ChatTurn.reopenings`). Like an edit, a rewrite is of an idle conversation: none of its
        branches has a request in flight, and a root waiting on its tool needs a tool result here."""
        at = turn.leading_system
        for session, first, second in turn.reopenings:
            state = self.sessions.get((namespace, session))
            if state is None or state.busy():
                continue
            for branch in state.branches.values():
                fps = branch.fingerprints
                if (branch.parent is None and len(fps) > at + 1 and fps[at] == first and fps[at + 1] == second
                        and (not branch.awaiting_tool or turn.last_tool_result >= 0)):
                    return namespace, session
        return None

    def commit(self, assignment: Assignment) -> list[Closing]:
        """The request was accepted: count it, and enforce the bounds. Returns the branches this made
        inference forget, for the caller to close (keeping their KV cached): the finished subagents of
        a branch resuming from its tool (reason ``"subagent"``), the session this new conversation
        rewrote (``"rewritten"``: its history past the system messages is no prefix of anything now),
        then what the bounds forgot (``"bounds"``)."""
        self.counters["requests"] += 1
        self.counters[assignment.kind] += 1
        key = (assignment.namespace, assignment.inferred.session)
        closed = self._close_rewritten(assignment.rewritten) if assignment.rewritten is not None else []
        if assignment.gap is not None:
            if self.learned is not None:
                self.learned.observe(assignment.namespace, *assignment.gap)
            if assignment.gap[0] == "tool":
                closed += self._finished_forks(key, assignment.inferred.branch)
        return closed + self._bound(key)

    def _close_rewritten(self, key: tuple[str, str]) -> list[Closing]:
        """Forget the rewritten session ``key``, forks before parents, unless a request of it arrived
        since :meth:`assign` (then it was not rewritten after all)."""
        state = self.sessions.get(key)
        if state is None or state.busy():
            return []
        depth = {}
        for name in state.branches:
            d, parent = 0, state.branches[name].parent
            while parent in state.branches and d < len(state.branches):
                d, parent = d + 1, state.branches[parent].parent
            depth[name] = d
        closed = [Closing(*key, name, "rewritten") for name in sorted(state.branches, key=depth.__getitem__, reverse=True)]
        self.forget_session(*key)
        self.counters["rewritten_closes"] += len(closed)
        return closed

    def _finished_forks(self, key: tuple[str, str], lead: str) -> list[Closing]:
        """``lead`` resumes with its tool's result: the forks of it that answered and wait for nothing
        (no request in flight, no tool of their own pending, nor any fork of theirs) were the work the
        tool waited for -- a Task-style subagent -- and are done. Forget them, forks before parents."""
        session = self.sessions.get(key)
        if session is None:
            return []
        children: dict = {}
        for name, branch in session.branches.items():
            children.setdefault(branch.parent, []).append(name)

        def finished(name: str) -> bool:
            branch = session.branches[name]
            return (branch.in_flight == 0 and not branch.awaiting_tool
                    and all(finished(child) for child in children.get(name, ())))

        closed: list = []

        def forget(name: str) -> None:
            for child in children.get(name, ()):
                forget(child)
            self._forget(key, name)
            closed.append(Closing(*key, name, "subagent"))

        for name in children.get(lead, ()):
            if finished(name):
                forget(name)
        self.counters["subagent_closes"] += len(closed)
        return closed

    def rollback(self, assignment: Assignment, now: float) -> None:
        """The request was refused before it ran: take back what :meth:`assign` recorded (the branch's
        fingerprints as they were, unless a later request has changed them since; a branch or session
        it created, once nothing else uses it)."""
        a, inferred = assignment, assignment.inferred
        self.counters["refused"] += 1
        key = (a.namespace, inferred.session)
        session = self.sessions.get(key)
        branch = session.branches.get(inferred.branch) if session is not None else None
        if branch is None:
            return
        branch.in_flight = max(branch.in_flight - 1, 0)
        if branch.fingerprints is a.recorded:
            if a.previous is None and branch.in_flight == 0:
                self._forget(key, inferred.branch)
            elif a.previous is not None:
                self._set_fingerprints(a.namespace, branch, a.previous)
        if a.new_session and not session.branches:
            self.sessions.pop(key)

    def done(self, namespace: str, session: str, branch: str, now: float, *, called_tool: bool = False) -> None:
        """A request of ``branch`` ended (answered, failed or aborted); ``called_tool``: its reply
        called a tool (the branch waits for the result)."""
        state = self.sessions.get((namespace, session))
        found = state.branches.get(branch) if state is not None else None
        if found is not None:
            found.in_flight = max(found.in_flight - 1, 0)
            found.last_seen = now
            found.awaiting_tool = called_tool

    def bound(self, namespace: str, awaiting_tool: bool) -> float | None:
        """How long a branch of ``namespace`` may wait before :meth:`idle` closes it: the learned tool
        bound for one waiting on its tool (None before one is learned: then only the caller's ``busy``
        and the idle bound apply), else the idle bound (learned, at most ``idle_s``)."""
        learned = self.learned.bound(namespace, "tool" if awaiting_tool else "idle") if self.learned else None
        if awaiting_tool:
            return learned
        return self.idle_s if learned is None else min(learned, self.idle_s)

    def idle(self, now: float, busy: Iterable[tuple[str, str, str]] = ()) -> list[Closing]:
        """Forget and return every branch with no request in flight that waited past its bound
        (:meth:`bound`): one waiting on its tool past its namespace's learned tool bound (reason
        ``"tool_bound"``: even if in ``busy`` -- the learned bound ends the pause), any other past the
        idle bound unless in ``busy`` (paused on a tool within the caller's retention; reason ``"idle"``).
        Parents after their forks. Sessions left without branches are dropped."""
        busy = set(busy)
        closed = []
        for key in list(self.sessions):
            session = self.sessions.get(key)
            idle_bound, tool_bound = self.bound(key[0], False), self.bound(key[0], True)
            while True:  # children first: a parent stays open while a branch forked from it is tracked
                parents = {b.parent for b in session.branches.values()}
                due = []
                for name, branch in session.branches.items():
                    if name in parents or branch.in_flight:
                        continue
                    waited = now - branch.last_seen
                    if branch.awaiting_tool and tool_bound is not None and waited >= tool_bound:
                        due.append(Closing(*key, name, "tool_bound"))
                    elif waited >= idle_bound and (*key, name) not in busy:
                        due.append(Closing(*key, name, "idle"))
                if not due:
                    break
                for item in due:
                    self._forget(key, item.branch)
                    closed.append(item)
                    self.counters["tool_bound_closes" if item.reason == "tool_bound" else "idle_closes"] += 1
            if not session.branches:
                self.sessions.pop(key)
        return closed

    def forget_session(self, namespace: str, session: str) -> None:
        """The session was closed by other means (a route, a purge): drop its state."""
        state = self.sessions.pop((namespace, session))
        if state is not None:
            self._uncount(namespace, state)

    def forget_branch(self, namespace: str, session: str, branch: str) -> None:
        """The branch was closed by other means: forget it (no-op when unknown)."""
        state = self.sessions.get((namespace, session))
        if state is not None and branch in state.branches:
            self._forget((namespace, session), branch)
            if not state.branches:
                self.sessions.pop((namespace, session))

    def forget_namespace(self, namespace: str) -> None:
        if self.learned is not None:
            self.learned.forget_namespace(namespace)
        for _, state in self.sessions.pop_namespace(namespace):
            self._uncount(namespace, state)

    def _uncount(self, namespace: str, state: _Session) -> None:
        for branch in state.branches.values():
            self._set_fingerprints(namespace, branch, ())

    def _forget(self, key: tuple[str, str], name: str) -> None:
        branch = self.sessions.get(key).branches.pop(name)
        self._set_fingerprints(key[0], branch, ())

    def _bound(self, current: tuple[str, str]) -> list[Closing]:
        """Enforce the bounds, forgetting least recently used idle branches first (never one in
        flight, never the current session's newest branch), each in the namespace over its share."""
        forgotten = []
        session = self.sessions.get(current)
        if session is None:  # forgotten by the idle sweep meanwhile
            return forgotten
        while len(session.branches) > self.max_branches:
            name = next((n for n, b in session.branches.items() if b.in_flight == 0), None)
            if name is None:
                break
            self._forget(current, name)
            forgotten.append(Closing(*current, name, "bounds"))
        for key, state in self.sessions.enforce(current):  # the session-count bounds (LRU, per namespace)
            self._uncount(key[0], state)
            forgotten.extend(Closing(*key, n, "bounds") for n in state.branches)
        while self.fingerprints_by_namespace[current[0]] > self.max_fingerprints_per_namespace:
            if not self._forget_oldest(current[0], current, forgotten):
                break
        while self.fingerprint_count > self.max_fingerprints:
            namespace = max(self.fingerprints_by_namespace, key=self.fingerprints_by_namespace.__getitem__)
            if not self._forget_oldest(namespace, current, forgotten):
                break
        self.counters["forgotten_branches"] += len(forgotten)
        return forgotten

    def _forget_oldest(self, namespace: str, keep: tuple[str, str], forgotten: list) -> bool:
        """Forget ``namespace``'s least recently used idle session (not ``keep``); False if none."""
        victim = next((k for k, s in self.sessions.namespace_items(namespace) if k != keep and not s.busy()), None)
        if victim is None:
            return False
        forgotten.extend(Closing(*victim, n, "bounds") for n in self.sessions.get(victim).branches)
        self.forget_session(*victim)
        return True

    def stats(self, namespace: str | None = None) -> dict:
        """Everything, or (``namespace``) only that namespace's own state."""
        if namespace is not None:
            sessions = self.sessions.namespace_items(namespace)
            return {"sessions": len(sessions), "branches": sum(len(s.branches) for _, s in sessions),
                    "fingerprints": self.fingerprints_by_namespace[namespace], "idle_s": self.idle_s,
                    "idle_bound_s": self.bound(namespace, False), "tool_bound_s": self.bound(namespace, True)}
        return {"sessions": len(self.sessions),
                "branches": sum(len(s.branches) for _, s in self.sessions.items()),
                "fingerprints": self.fingerprint_count, "idle_s": self.idle_s, **self.counters}


__all__ = ["Assignment", "ChatInference", "ChatTurn", "Closing", "Inferred", "canonical_message", "tool_names"]
