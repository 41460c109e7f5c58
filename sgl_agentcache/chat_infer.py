"""Zero-config lifecycle for OpenAI-compatible chat clients (pure: stdlib only; no SGLang, no HTTP).

Most agent harnesses send plain ``/v1/chat/completions`` requests with ``tools`` and ``tool_calls``
and never add our hint header. With ``AGENTCACHE_INFER=chat`` the server infers a hint for each such
request from the chat itself; an explicit hint (the header) always wins and is never mixed with an
inferred one. This module holds the inference state and rules; ``server/chat_hooks.py`` feeds it the
requests and carries out what it decides, and the replay (``sim/inferred.py``) drives the same class
with a trace's block fingerprints for the "ours, inferred" row.

Session identity, in order: OpenAI's ``prompt_cache_key``; ``safety_identifier``; ``user``; else a
hash of the conversation's first messages (its system messages and first user message). Ids are
hashed (``k-``, ``s-``, ``u-``, ``c-`` prefixes), so no client string reaches logs or the tree, and
they live in the caller's namespace (tenant): two tenants sending the same chat never share a session.

Branches: each session tracks the messages of each branch's last request as a chain of fingerprints
(one per message, each covering every message before it). A request whose messages extend a branch's
last request continues that branch (a tool result, the next user turn). One that extends a branch
whose own request is still running, or that shares history with a branch and then diverges, is a
fork of it (a subagent: it shares the parent's exact nodes and its own are its scratch). One that
shares no message past the system messages with any branch is an independent conversation of the
session (a client reusing one ``prompt_cache_key`` for unrelated chats): a new branch without a parent.
Branch names are never reused within a process (``m<n>``, ``f<n>``), so a branch closed when idle
never receives tokens again.

Idle: a branch with no request in flight for ``idle_s`` is closed (its private KV is reclaimed on
every tier), after the branches forked from it (a parent's history stays while a fork may still use
it). The caller never closes a branch paused on a tool (its deadline governs it); the pause's end
makes it idle-countable again.

Bounded: at most ``max_sessions`` sessions per process, ``max_branches`` per session and
``max_fingerprints`` message fingerprints in all; past a bound the least recently used idle session
(or branch) is forgotten and returned for closing. Forgetting only costs cache reuse, never
correctness: the next request of a forgotten session starts a new branch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

#: "chat": infer hints for OpenAI chat requests that carry none; anything else (default ""): off.
INFER_ENV = "AGENTCACHE_INFER"
#: Seconds a branch may sit with no request in flight before it is closed (default 300).
IDLE_ENV = "AGENTCACHE_INFER_IDLE_S"

_DIGEST = 16  # bytes per fingerprint (BLAKE2b): collisions are out of reach for a conversation's life


def infer_mode() -> str:
    """The configured inference mode ("chat" or ""); an unknown value stops start-up."""
    mode = os.environ.get(INFER_ENV, "").strip().lower()
    if mode not in ("", "off", "chat"):
        raise ValueError(f"{INFER_ENV}={mode!r}: expected 'chat' or 'off'")
    return "" if mode == "off" else mode


def idle_seconds() -> float:
    value = os.environ.get(IDLE_ENV, "300")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{IDLE_ENV}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{IDLE_ENV} must be > 0 seconds, got {value!r}")
    return seconds


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

    @classmethod
    def from_messages(cls, messages: Iterable[Mapping], *, prompt_cache_key: str | None = None,
                      safety_identifier: str | None = None, user: str | None = None) -> "ChatTurn":
        fingerprints, digest, opening = [], b"", []
        leading_system, first_user_seen = 0, False
        for i, message in enumerate(messages):
            data = canonical_message(message)
            digest = hashlib.blake2b(digest + data, digest_size=_DIGEST).digest()
            fingerprints.append(digest)
            role = message.get("role")
            if role in ("system", "developer") and leading_system == i:
                leading_system += 1
            if not first_user_seen:
                opening.append(data)
                first_user_seen = role == "user"
        for source, value, prefix in (("prompt_cache_key", prompt_cache_key, "k-"),
                                      ("safety_identifier", safety_identifier, "s-"), ("user", user, "u-")):
            if isinstance(value, str) and value:
                return cls(tuple(fingerprints), leading_system, _hashed(prefix, value.encode()), source)
        return cls(tuple(fingerprints), leading_system, _hashed("c-", b"\x1e".join(opening)), "conversation")


@dataclass(frozen=True)
class Inferred:
    """The hint inferred for one request."""

    session: str
    branch: str
    parent: str | None  # set for a fork
    shared_messages: int  # for a fork: how many leading messages it shares with the parent
    source: str
    continued: bool  # it continues a branch's earlier request (a tool result or the next turn)


@dataclass
class _Branch:
    fingerprints: tuple[bytes, ...]
    parent: str | None
    in_flight: int = 0
    last_seen: float = 0.0


@dataclass
class _Session:
    branches: OrderedDict = field(default_factory=OrderedDict)  # name -> _Branch, least recently used first

    def fingerprints(self) -> int:
        return sum(len(b.fingerprints) for b in self.branches.values())


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
    Every method takes the caller's clock reading ``now``; nothing here reads a clock."""

    def __init__(self, idle_s: float = 300.0, max_sessions: int = 4096, max_branches: int = 32,
                 max_fingerprints: int = 1 << 20):
        self.idle_s = idle_s
        self.max_sessions, self.max_branches, self.max_fingerprints = max_sessions, max_branches, max_fingerprints
        self.sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()  # (namespace, session) -> state
        self.fingerprint_count = 0
        self._next = 0
        self.counters = {"requests": 0, "continued": 0, "forks": 0, "new_branches": 0, "idle_closes": 0,
                         "forgotten_branches": 0}

    def _name(self, kind: str) -> str:
        self._next += 1
        return f"{kind}{self._next}"

    def assign(self, namespace: str, turn: ChatTurn, now: float) -> tuple[Inferred, list[tuple[str, str, str]]]:
        """The branch ``turn`` belongs to (marked in flight until :meth:`done`), and the branches the
        bounds made this forget, as ``(namespace, session, branch)`` for the caller to close."""
        self.counters["requests"] += 1
        key = (namespace, turn.session)
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = _Session()
        self.sessions.move_to_end(key)
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
            if common == longest and session.branches[name].in_flight == 0:
                longest_free = name
        if longest_free is not None:  # a tool result, the next turn: the same branch goes on
            name, parent, shared, continued = longest_free, session.branches[longest_free].parent, 0, True
            self.counters["continued"] += 1
        elif closest is not None and closest_len > turn.leading_system:
            # Shares real history with a branch that is busy, or takes it somewhere else: a subagent.
            name, parent, shared, continued = self._name("f"), closest, closest_len, False
            self.counters["forks"] += 1
        else:
            name, parent, shared, continued = self._name("m"), None, 0, False
            self.counters["new_branches"] += 1
        branch = session.branches.get(name)
        if branch is None:
            branch = session.branches[name] = _Branch((), parent)
        self.fingerprint_count += len(fps) - len(branch.fingerprints)
        branch.fingerprints = fps
        branch.in_flight += 1
        branch.last_seen = now
        session.branches.move_to_end(name)
        forgotten = self._bound(key)
        return Inferred(turn.session, name, parent, shared, turn.source, continued), forgotten

    def done(self, namespace: str, session: str, branch: str, now: float) -> None:
        """A request of ``branch`` ended (answered, failed or aborted)."""
        state = self.sessions.get((namespace, session))
        found = state.branches.get(branch) if state is not None else None
        if found is not None:
            found.in_flight = max(found.in_flight - 1, 0)
            found.last_seen = now

    def idle(self, now: float, busy: Iterable[tuple[str, str, str]] = ()) -> list[tuple[str, str, str]]:
        """Forget and return every branch with no request in flight for ``idle_s`` (except those in
        ``busy``: paused on a tool). Sessions left without branches are dropped."""
        busy = set(busy)
        closed = []
        for key in list(self.sessions):
            session = self.sessions[key]
            while True:  # children first: a parent stays open while a branch forked from it is tracked
                parents = {b.parent for b in session.branches.values()}
                idle = [n for n, b in session.branches.items() if n not in parents and b.in_flight == 0
                        and now - b.last_seen >= self.idle_s and (*key, n) not in busy]
                if not idle:
                    break
                for name in idle:
                    self._forget(key, name)
                    closed.append((*key, name))
                    self.counters["idle_closes"] += 1
            if not session.branches:
                del self.sessions[key]
        return closed

    def forget_session(self, namespace: str, session: str) -> None:
        """The session was closed by other means (a route, a purge): drop its state."""
        state = self.sessions.pop((namespace, session), None)
        if state is not None:
            self.fingerprint_count -= state.fingerprints()

    def forget_namespace(self, namespace: str) -> None:
        for key in [k for k in self.sessions if k[0] == namespace]:
            self.forget_session(*key)

    def _forget(self, key: tuple[str, str], name: str) -> None:
        branch = self.sessions[key].branches.pop(name)
        self.fingerprint_count -= len(branch.fingerprints)

    def _bound(self, current: tuple[str, str]) -> list[tuple[str, str, str]]:
        """Enforce the bounds, forgetting least recently used idle branches first (never one in
        flight, never the current session's newest branch)."""
        forgotten = []
        session = self.sessions[current]
        while len(session.branches) > self.max_branches:
            name = next((n for n, b in session.branches.items() if b.in_flight == 0), None)
            if name is None:
                break
            self._forget(current, name)
            forgotten.append((*current, name))
        while len(self.sessions) > self.max_sessions or self.fingerprint_count > self.max_fingerprints:
            victim = next((k for k, s in self.sessions.items()
                           if k != current and all(b.in_flight == 0 for b in s.branches.values())), None)
            if victim is None:
                break
            forgotten.extend((*victim, n) for n in self.sessions[victim].branches)
            self.forget_session(*victim)
        self.counters["forgotten_branches"] += len(forgotten)
        return forgotten

    def stats(self) -> dict:
        return {"sessions": len(self.sessions), "branches": sum(len(s.branches) for s in self.sessions.values()),
                "fingerprints": self.fingerprint_count, "idle_s": self.idle_s, **self.counters}


__all__ = ["ChatInference", "ChatTurn", "IDLE_ENV", "INFER_ENV", "Inferred", "canonical_message",
           "idle_seconds", "infer_mode", "tool_names"]
