"""Chat inference in the replay: the hints ``AGENTCACHE_INFER=chat`` would give a trace's calls.

The server infers a hint for a plain chat request from its messages (:mod:`sgl_agentcache.chat_infer`).
A trace has no messages, only the prompt's blocks; this module drives the *same* :class:`ChatInference`
with block fingerprints in place of message fingerprints, at the moments the server would see them
(a call received, a call answered, the idle sweep), and rewrites each call into the record the server
would have run (``hints="inferred"``). What carries over, and what it stands for:

- a message fingerprint -> one per block of the prompt except its last (the last block is usually
  partial and changes when the conversation grows, as a message boundary rarely falls on a block's);
- the leading system messages -> the blocks the stable prefix covers (the server renders system +
  tools with the chat template; the trace's ``stable_prefix_tokens`` is that same length);
- the session -> no ``prompt_cache_key`` or ``user`` (the zero-config case): a hash of the
  conversation's opening, here the stable prefix's blocks and the one block after them (the first
  user message); a subagent opening with its own system prompt is a session of its own, as it is on
  the server;
- a fork's ``fork_point_tokens`` -> the shared blocks' tokens (at least the stable prefix);
- a tool pause -> the call's tool (the server pauses on a reply carrying tool calls, class = the
  function's name); a tool result in the next request -> the trace branch's next call after a call
  with a tool (the server sees the ``tool`` message; blocks cannot show it, the branch's continuity
  is what its ``tool_call_id`` says);
- a context edit -> what the server infers: a call that shares history with an idle branch and then
  diverges edits it (``edit_from_tokens`` = the shared blocks' tokens), whether or not the trace marks
  an edit there;
- a conversation rewritten at its start -> a call whose stable prefix is followed by blocks inserted
  before its old opening block (a spliced memory segment) is a new session by its opening, as on the
  server; each of its first ``REOPEN_BLOCKS`` blocks after the opening block stands for a later user
  message that may have opened the old conversation (a message spans many blocks; the server tries
  ``MAX_REOPENINGS`` user messages), and the old session is closed when the next block matches too;
- closes -> none: a client sends no close. A branch resuming from its tool closes its finished forks
  (a Task-style subagent, as on the server). Branches close after their idle bound without a call in
  flight, except while paused on a tool within the server's maximum retention or, once learned, the
  namespace's tool bound (``learn_bounds``: both bounds learned from the gaps seen, as on the server);
  the replay closes them as the server's sweeper does (``keep_cached``: their KV stays untagged cache).
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgspec

from sgl_agentcache.chat_infer import ChatInference, ChatTurn, reopening_candidates
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.gap_bounds import MIN_GAPS
from sgl_agentcache.trace.schema import Request

#: The server's defaults: ``AGENTCACHE_INFER_IDLE_S`` and ``AGENTCACHE_MAX_RETENTION_S``.
IDLE_S = 300.0
MAX_RETENTION_S = 600.0
#: Blocks after a new conversation's opening block that may be the opening block of the conversation
#: it rewrote (a spliced segment of up to this many blocks is recognised).
REOPEN_BLOCKS = 128


def _opening_session(blocks, head: bytes = b"") -> str:
    """The session id of a conversation opening with ``head`` (already encoded blocks) then ``blocks``."""
    data = head + b"".join(b.to_bytes(8, "little") for b in blocks)
    return "c-" + hashlib.blake2b(data, digest_size=12).hexdigest()


def block_turn(request: Request, block_tokens: int) -> ChatTurn:
    """The :class:`ChatTurn` of a call, from its blocks (see the module docstring)."""
    fingerprints, digest = [], b""
    for block in request.blocks[:-1]:
        digest = hashlib.blake2b(digest + block.to_bytes(8, "little"), digest_size=16).digest()
        fingerprints.append(digest)
    leading = min(request.stable_prefix_tokens // block_tokens, len(fingerprints))
    return ChatTurn(tuple(fingerprints), leading, _opening_session(request.blocks[:leading + 1]), "conversation")


def block_reopenings(turn: ChatTurn, request: Request) -> tuple[tuple[str, bytes, bytes], ...]:
    """:attr:`ChatTurn.reopenings` of a call (see the module docstring): each block after the opening
    block, as the first block after the stable prefix of the conversation it may have rewritten."""
    leading, blocks = turn.leading_system, request.blocks
    stop = min(leading + 1 + REOPEN_BLOCKS, len(turn.fingerprints))
    later = range(leading + 1, stop)
    stable = b"".join(b.to_bytes(8, "little") for b in blocks[:leading])  # every candidate's head: encoded once
    return reopening_candidates(turn.fingerprints[leading - 1] if leading else b"",
                                [_opening_session([blocks[i]], stable) for i in later],
                                [(blocks[i].to_bytes(8, "little"), blocks[i + 1].to_bytes(8, "little")) for i in later])


class ReplayInference:
    """The server's inference state for one replay; every method takes the replay's clock."""

    def __init__(self, block_tokens: int, idle_s: float = IDLE_S, max_retention_s: float = MAX_RETENTION_S,
                 infer_edits: bool = True, learn_bounds: bool = True):
        self.block_tokens = block_tokens
        self.state = ChatInference(idle_s=idle_s, name_key=b"replay",  # names: deterministic run to run
                                   infer_edits=infer_edits, learn_after=MIN_GAPS if learn_bounds else 0)
        self.max_retention_s = max_retention_s
        self.called_tool: dict[tuple, bool] = {}  # trace branch -> whether its last call ran a tool
        self.subagents_closed: set[BranchKey] = set()  # inferred branches closed as finished subagents

    def next_sweep_after(self, request: Request) -> float:
        """Seconds after ``request`` is answered that the server's sweep would first find its branch due."""
        bound = self.state.bound(namespace_key(request.tenant, None), request.tool is not None)
        return self.state.idle_s if bound is None else bound

    def receive(self, request: Request, now: float) -> tuple[Request, list[BranchKey]]:
        """The call as the server would run it (inferred session, branch, parent, fork point and
        edit; no close), and the branches it made inference forget (finished subagents, the bounds'
        forgotten), to close."""
        namespace = namespace_key(request.tenant, None)
        turn = block_turn(request, self.block_tokens)
        trace_branch = (request.tenant, request.session, request.branch)
        if self.called_tool.get(trace_branch):  # it carries its branch's tool result, at its end
            turn = dataclasses.replace(turn, last_tool_result=len(turn.fingerprints))
        if self.state.sessions.get((namespace, turn.session)) is None:  # only a new one can be a rewrite
            turn = dataclasses.replace(turn, reopenings=block_reopenings(turn, request))
        self.called_tool[trace_branch] = request.tool is not None
        inferred, assignment = self.state.assign(namespace, turn, now)
        forgotten = self.state.commit(assignment)  # a replayed call is never refused at the front door
        fork_point = edit_from = None
        shared = min(inferred.shared_messages * self.block_tokens, request.input_tokens)
        if inferred.edit:  # its branch goes on: a fork's own call again, if the branch is a fork
            edit_from, shared = shared, 0
        if inferred.parent is not None:
            fork_point = max(shared, request.stable_prefix_tokens)
        rewritten = msgspec.structs.replace(
            request, session=inferred.session, branch=inferred.branch, parent_branch=inferred.parent,
            fork_point_tokens=fork_point, close=False, edit_from_tokens=edit_from, hints="inferred")
        closing = [BranchKey(*item[:3]) for item in forgotten]
        self.subagents_closed.update(b for b, item in zip(closing, forgotten) if item.reason == "subagent")
        return rewritten, closing

    def done(self, request: Request, now: float) -> None:
        """A call received through :meth:`receive` ended."""
        self.state.done(namespace_key(request.tenant, None), request.session, request.branch, now,
                        called_tool=request.tool is not None)

    def forget(self, branch: BranchKey) -> None:
        """``branch`` was closed by other means (attribution: the trace's own close)."""
        self.state.forget_branch(branch.namespace, branch.session, branch.branch)

    def idle(self, now: float, paused: dict[BranchKey, float]) -> list[BranchKey]:
        """Branches the idle sweep closes now; ``paused``: branch -> when its tool pause began (a pause
        holds a branch open until the server's maximum retention, or the learned tool bound)."""
        busy = [(b.namespace, b.session, b.branch) for b, since in paused.items()
                if now - since < self.max_retention_s]
        return [BranchKey(*item[:3]) for item in self.state.idle(now, busy)]

    def stats(self) -> dict:
        return self.state.stats()


__all__ = ["IDLE_S", "MAX_RETENTION_S", "REOPEN_BLOCKS", "ReplayInference", "block_reopenings", "block_turn"]
