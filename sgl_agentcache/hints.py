"""The v1 lifecycle hint contract (pure: stdlib and msgspec only; no SGLang, no torch).

A client tells the cache what a request's tokens are for by attaching one *lifecycle hint*. On the
native ``/generate`` path the hint travels inside SGLang's ``kv_hints`` envelope
(``sglang.srt.managers.kv_hints.KvHintsEnvelope``) as one action with
``action_type == ACTION_TYPE`` and ``action_version == ACTION_VERSION`` whose ``payload`` is the hint
object; on OpenAI-compatible endpoints the same object is sent as JSON in the :data:`HINT_HEADER`
header, and through SGLang's router (which forwards neither) as a ``tracestate`` member
(:mod:`sgl_agentcache.gateway`). Other actions in the envelope belong to other consumers and are ignored.

Payload fields (a JSON object of at most :data:`MAX_PAYLOAD_BYTES` bytes; unknown fields are rejected):

``session`` (required)
    Id of the agent trajectory. Ids match :data:`ID_REGEX` (1-128 of ``A-Z a-z 0-9 . _ : -``).
``branch`` (default ``"main"``)
    Id of the branch within the session that issued this request (the lead agent, a subagent...).
``parent_branch`` (default none)
    Set when ``branch`` was forked from another branch of the same session; must differ from ``branch``.
``stable_prefix_tokens`` (default 0)
    Length of the prompt prefix shared by nearly every turn (system prompt, tool schema).
``fork_point_tokens`` (default none; only with ``parent_branch``; ``>= stable_prefix_tokens``)
    Length of the prompt prefix inherited from the parent branch. Without it, the server uses where
    the parent's last finished context (prompt, or prompt plus output) ends, if the fork's prompt
    continues it (``fork_points.py``), else the stable prefix.
``close`` (default false)
    The branch ends after this request: its private KV becomes reclaimable.
``edit_from_tokens`` (default none)
    The agent rewrote its history from this token offset (a summary, a dropped observation, spliced
    memory): the branch's old tokens past it that this prompt no longer shares become reclaimable.
    Reuse stays exact (identical tokens only); everything else is plainly re-prefilled.
``tool_class`` (default none), ``deadline_ms``, ``priority``
    The pause action: this call ends in a tool call of class ``tool_class``. When the call finishes
    normally the branch pauses exactly as with ``POST /agentcache/pause`` (the server decides keep /
    offload / discard; ``deadline_ms`` and ``priority`` as there), before the response is returned.
    Ignored together with ``close``.
``prefetch``
    Reserved: validated, not acted on (use ``POST /agentcache/prefetch`` when a tool is nearly done).
``inferred``
    Set only by the server, on a hint it inferred from a plain chat request (``AGENTCACHE_INFER=chat``,
    see :mod:`sgl_agentcache.chat_infer`); a client sending it gets a 400. An inferred fork whose parent
    the scheduler does not know (any more) runs as a branch of its own instead of being refused.

How the cache uses a hint: prompt tokens ``[0, stable_prefix_tokens)`` are classed STABLE; for a fork,
``[stable_prefix_tokens, fork_point_tokens)`` is the parent's SESSION history and the rest is the
branch's SCRATCH; otherwise the rest is the branch's SESSION history. Hints are advice, never
authority: the server clips token counts to the prompt length, may ignore any hint, and never lets a
hint grant memory beyond the limits it enforces itself. A malformed hint is rejected with
:class:`HintError`, whose message names the offending field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from sgl_agentcache.lifecycle import UNTAGGED_PLAN, BranchKey, InsertPlan, NodeClass, NodeState

__all__ = [
    "ACTION_TYPE",
    "ACTION_VERSION",
    "HINT_HEADER",
    "ID_REGEX",
    "PauseRef",
    "PrefetchRef",
    "MAX_PAYLOAD_BYTES",
    "MAX_TOKENS_FIELD",
    "BranchRef",
    "HintError",
    "LifecycleHint",
    "find_lifecycle_hint",
    "insert_plan",
    "lifecycle_envelope",
    "parse_header",
    "parse_payload",
    "parse_route_body",
    "SessionOpen",
    "SessionRef",
    "TenantRef",
]

#: ``action_type`` of our action inside SGLang's ``kv_hints`` envelope.
ACTION_TYPE = "sgl_agentcache.lifecycle"
#: The only ``action_version`` this module understands.
ACTION_VERSION = "1"
#: HTTP header carrying the same payload as JSON, for OpenAI-compatible endpoints.
HINT_HEADER = "x-sgl-agentcache-hint"

#: Largest accepted payload, in bytes of its compact JSON encoding (or of the raw header value).
MAX_PAYLOAD_BYTES = 4096
#: Largest accepted value of a token-count field.
MAX_TOKENS_FIELD = 1 << 20

#: Session, branch and tool-class ids. ``\\Z`` rather than ``$`` so that a trailing newline is rejected.
ID_REGEX = r"^[A-Za-z0-9._:\-]{1,128}\Z"

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=ID_REGEX)]
_ToolClass = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=ID_REGEX)]
_Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_FIELD)]
_DeadlineMs = Annotated[int, msgspec.Meta(gt=0, le=86_400_000)]
_Priority = Annotated[int, msgspec.Meta(ge=-100, le=100)]


class HintError(ValueError):
    """A lifecycle hint (or the envelope carrying it) is malformed; the message names the field."""


class LifecycleHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One validated lifecycle hint (see the module docstring for the meaning of each field)."""

    session: _Id
    branch: _Id = "main"
    parent_branch: _Id | None = None
    stable_prefix_tokens: _Tokens = 0
    fork_point_tokens: _Tokens | None = None
    close: bool = False
    edit_from_tokens: _Tokens | None = None
    # The pause action (see the module docstring); prefetch is reserved.
    tool_class: _ToolClass | None = None
    deadline_ms: _DeadlineMs | None = None
    priority: _Priority | None = None
    prefetch: bool = False
    # Set by the server only, on a hint it inferred from a chat request (chat_infer.py); refused from clients.
    inferred: bool = False

    def __post_init__(self) -> None:
        """Cross-field rules (msgspec surfaces these as a ValidationError carrying this message)."""
        if self.parent_branch is not None and self.parent_branch == self.branch:
            raise HintError("`parent_branch` must differ from `branch`")
        if self.fork_point_tokens is not None:
            if self.parent_branch is None:
                raise HintError("`fork_point_tokens` is only allowed together with `parent_branch`")
            if self.fork_point_tokens < self.stable_prefix_tokens:
                raise HintError("`fork_point_tokens` must be >= `stable_prefix_tokens`")

    @property
    def is_fork(self) -> bool:
        """True when this request's branch was forked from ``parent_branch``."""
        return self.parent_branch is not None


def parse_payload(payload: object) -> LifecycleHint:
    """Validate a decoded hint payload (a JSON object) and return it as a :class:`LifecycleHint`.

    Raises :class:`HintError` (and nothing else) for any input that is not a valid v1 hint.
    """
    if not isinstance(payload, dict):
        raise HintError(f"lifecycle hint payload must be a JSON object, got {type(payload).__name__}")
    # A payload that converts is well under the size limit (every field is bounded and unknown fields
    # are refused: see test_largest_valid_payload_is_under_the_limit), so the common case converts
    # first and pays for nothing else; the scheduler decodes one hint per request.
    try:
        return msgspec.convert(payload, LifecycleHint)
    except Exception:  # noqa: BLE001 - whatever it is, the careful path below names it
        pass
    # Invalid: report the size (or encodability) first, then what is wrong with a field.
    try:
        size = len(msgspec.json.encode(payload))
    except Exception as e:  # unencodable values, lone surrogates, nesting too deep, ...
        raise HintError(f"lifecycle hint payload is not JSON-encodable: {type(e).__name__}: {e}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise HintError(f"lifecycle hint payload is {size} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit")
    try:
        return msgspec.convert(payload, LifecycleHint)
    except msgspec.ValidationError as e:
        raise HintError(f"invalid lifecycle hint: {e}") from None


def parse_header(value: str) -> LifecycleHint:
    """Parse the JSON text of the :data:`HINT_HEADER` header into a :class:`LifecycleHint`."""
    if not isinstance(value, str):
        raise HintError(f"{HINT_HEADER} header must be a string, got {type(value).__name__}")
    # Characters never outnumber UTF-8 bytes, so this cheap check already rejects huge values.
    if len(value) > MAX_PAYLOAD_BYTES:
        raise HintError(f"{HINT_HEADER} header is over the {MAX_PAYLOAD_BYTES}-byte limit")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HintError(f"{HINT_HEADER} header is not valid UTF-8 text: {e}") from None
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise HintError(f"{HINT_HEADER} header is {len(raw)} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit")
    try:
        payload = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise HintError(f"{HINT_HEADER} header is not valid JSON: {e}") from None
    return parse_payload(payload)


def _field(obj: Any, name: str) -> Any:
    """Read ``name`` from a dict-shaped or attribute-shaped object (None when absent)."""
    # The two common cases first, without the ABC isinstance check (it runs per request): a dict, or
    # SGLang's KvHintsEnvelope / KvHintAction (msgspec structs).
    if type(obj) is dict:
        return obj.get(name)
    if isinstance(obj, msgspec.Struct):
        return getattr(obj, name, None)
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def find_lifecycle_hint(envelope: Any) -> LifecycleHint | None:
    """Return the lifecycle hint carried by a ``kv_hints`` envelope, or None when it carries none.

    ``envelope`` is SGLang's ``KvHintsEnvelope``, a dict with the same keys, or None. Actions of other
    types are ignored; more than one lifecycle action, or one of another version, is a :class:`HintError`.
    """
    if envelope is None:
        return None
    actions = _field(envelope, "actions")
    if actions is None:
        return None
    if not isinstance(actions, (list, tuple)):
        raise HintError(f"kv_hints `actions` must be a list, got {type(actions).__name__}")
    action = None
    for candidate in actions:
        if _field(candidate, "action_type") == ACTION_TYPE:
            if action is not None:
                count = sum(_field(a, "action_type") == ACTION_TYPE for a in actions)
                raise HintError(f"kv_hints carries {count} `{ACTION_TYPE}` actions; at most one is allowed")
            action = candidate
    if action is None:
        return None
    version = _field(action, "action_version")
    if version != ACTION_VERSION:
        raise HintError(
            f"unsupported action_version {version!r} for `{ACTION_TYPE}` (supported: {ACTION_VERSION!r})"
        )
    return parse_payload(_field(action, "payload"))


def lifecycle_envelope(hint_fields: dict, *, message_id: str, action_id: str = "lifecycle") -> dict:
    """Build a JSON-ready ``kv_hints`` envelope carrying one lifecycle action (for clients).

    ``hint_fields`` is validated with :func:`parse_payload` first; a bad hint raises :class:`HintError`.
    """
    parse_payload(hint_fields)
    for name, value in (("message_id", message_id), ("action_id", action_id)):
        if not isinstance(value, str) or not value:
            raise HintError(f"`{name}` must be a non-empty string")
    return {
        "protocol_version": "1",
        "message_id": message_id,
        "actions": [
            {
                "action_id": action_id,
                "action_type": ACTION_TYPE,
                "action_version": ACTION_VERSION,
                "payload": dict(hint_fields),
            }
        ],
    }


_Namespace = Annotated[str, msgspec.Meta(max_length=256)]


class BranchRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/branch/close``: which branch, in which cache namespace."""

    session: _Id
    branch: _Id = "main"
    extra_key: _Namespace | None = None
    cache_salt: _Namespace | None = None


class SessionRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/session/close``: every branch of a session."""

    session: _Id
    extra_key: _Namespace | None = None
    cache_salt: _Namespace | None = None


class PauseRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/pause``: the branch stops on a tool call.

    The server computes the retained tokens and bytes itself; ``deadline_ms`` is clipped to the
    server's maximum retention; ``priority`` prices resume latency, it never grants memory.
    ``resume_required: false`` says the agent may never come back (the branch's state is worth less).
    """

    session: _Id
    branch: _Id = "main"
    tool_class: _ToolClass = "default"
    deadline_ms: _DeadlineMs | None = None
    priority: _Priority = 0
    resume_required: bool = True
    extra_key: _Namespace | None = None
    cache_salt: _Namespace | None = None


class PrefetchRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/prefetch``: the tool is nearly done (``expected_remaining_ms`` left)."""

    session: _Id
    branch: _Id = "main"
    expected_remaining_ms: _DeadlineMs | None = None
    extra_key: _Namespace | None = None
    cache_salt: _Namespace | None = None


class SessionOpen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/session/open`` (tenancy): the wanted lifetime, clipped server-side."""

    ttl_s: Annotated[int, msgspec.Meta(gt=0, le=30 * 86_400)] | None = None


class TenantRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /agentcache/admin/purge``: the tenant whose state goes from every tier."""

    tenant: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


def parse_route_body(body: bytes, kind: type):
    """Decode a route's JSON body into ``kind`` (size-limited); malformed input raises :class:`HintError`."""
    if len(body) > MAX_PAYLOAD_BYTES:
        raise HintError(f"request body is {len(body)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise HintError(f"invalid request body: {exc}") from None
    except UnicodeDecodeError as exc:  # invalid UTF-8 inside a JSON string
        raise HintError(f"invalid request body: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def insert_plan(hint: LifecycleHint | None, namespace: str, closed) -> InsertPlan:
    """How a request carrying ``hint`` classifies the tokens its insert creates (pure).

    ``closed`` is a container of closed :class:`~sgl_agentcache.lifecycle.BranchKey`; tokens of a
    closed branch are born terminated (a late request cannot resurrect its branch).
    """
    if hint is None:
        return UNTAGGED_PLAN
    own_key = BranchKey(namespace, hint.session, hint.branch)
    own = NodeState(NodeClass.SCRATCH if hint.is_fork else NodeClass.SESSION, own_key, own_key in closed)
    if not hint.is_fork:
        return InsertPlan(own=own, stable_end=hint.stable_prefix_tokens, fork_point=hint.stable_prefix_tokens)
    parent_key = BranchKey(namespace, hint.session, hint.parent_branch)
    parent = NodeState(NodeClass.SESSION, parent_key, parent_key in closed)
    fork_point = max(hint.stable_prefix_tokens, hint.fork_point_tokens or 0)
    return InsertPlan(own=own, stable_end=hint.stable_prefix_tokens, fork_point=fork_point, parent=parent)
