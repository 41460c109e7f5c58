"""Hinted calls through SGLang's router (``sglang-router`` 0.3.x, the ``smg`` gateway): pure helpers.

The router re-serializes every request body through its own request types and forwards only an
allowlist of headers. Checked on 0.3.2 with a worker that records what reaches it: a ``kv_hints``
field of a ``/generate`` body and our ``x-sgl-agentcache-hint`` header are dropped; ``authorization``,
``x-request-id``, ``x-correlation-id``, ``traceparent``, ``tracestate`` and ``x-smg-routing-key``
arrive unchanged (``tools/router_probe.py``). So a call that must reach a worker through the router
carries two headers, both built here:

``x-smg-routing-key: <routing key>``
    The router's ``manual`` policy pins a key to one worker: every call of a session -- the lead and
    every fork -- lands on the worker holding the session's nodes. The key is a hash of the namespace
    and the session (:func:`routing_key`), so no client string reaches the router's logs.
``tracestate: sgl-agentcache=<hint>, <other members>``
    The lifecycle hint as a W3C Trace Context ``tracestate`` member (vendor key :data:`TRACESTATE_KEY`,
    value the hint's compact JSON in unpadded base64url). Trace context is what gateways and proxies
    propagate verbatim, and a tracestate header is a list other vendors' members share, so ours is
    added leftmost and never disturbs theirs (:func:`merge_tracestate`).

The server reads a hint from ``tracestate`` only when the request carries no hint of its own (a
``kv_hints`` envelope, or the ``x-sgl-agentcache-hint`` header), and validates it exactly like the
header: a malformed member of ours is a 400, and the hint grants nothing the header would not.
W3C limits a member's value to 256 characters, i.e. 192 bytes of hint JSON: enough for a hint with
UUID-sized ids; :func:`tracestate_member` refuses a longer one by name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import msgspec

from sgl_agentcache.hints import HintError, LifecycleHint, parse_header, parse_payload

__all__ = [
    "MAX_TRACESTATE_VALUE",
    "ROUTING_HEADER",
    "TRACESTATE_HEADER",
    "TRACESTATE_KEY",
    "gateway_headers",
    "hint_from_tracestate",
    "merge_tracestate",
    "routing_key",
    "tracestate_member",
]

#: The router's session-affinity header (``--policy manual``).
ROUTING_HEADER = "x-smg-routing-key"
#: The W3C Trace Context vendor list header, which the router forwards.
TRACESTATE_HEADER = "tracestate"
#: Our vendor key in ``tracestate`` (W3C simple-key: lowercase letter, then ``a-z 0-9 _ - * /``).
TRACESTATE_KEY = "sgl-agentcache"
#: W3C: a member's value is at most 256 printable characters; a list at most 32 members.
MAX_TRACESTATE_VALUE = 256
MAX_TRACESTATE_MEMBERS = 32


def tracestate_member(hint_fields: dict) -> str:
    """``sgl-agentcache=<base64url(JSON)>`` for a hint (validated first: a bad hint raises HintError)."""
    parse_payload(hint_fields)
    value = base64.urlsafe_b64encode(msgspec.json.encode(hint_fields)).rstrip(b"=").decode("ascii")
    if len(value) > MAX_TRACESTATE_VALUE:
        raise HintError(f"the hint is {len(value)} characters in tracestate, over W3C's {MAX_TRACESTATE_VALUE} "
                        f"per member: shorten the session/branch ids, or send the call to a worker directly "
                        f"with the x-sgl-agentcache-hint header")
    return f"{TRACESTATE_KEY}={value}"


def _members(values: list[str]) -> list[str]:
    """The list members of one or more ``tracestate`` header lines (W3C: lines join with ``,``)."""
    return [m.strip() for line in values for m in line.split(",") if m.strip()]


def merge_tracestate(existing: str | None, member: str) -> str:
    """``existing`` with ``member`` leftmost (W3C: an updated member moves left), any older member of
    ours removed, and the list cut to 32 members from the right."""
    key = member.split("=", 1)[0]
    others = [m for m in _members([existing or ""]) if m.split("=", 1)[0].strip() != key]
    return ",".join([member, *others][:MAX_TRACESTATE_MEMBERS])


def hint_from_tracestate(values: list[str]) -> LifecycleHint | None:
    """The hint carried in ``tracestate`` header line(s), or None when there is no member of ours.

    Other vendors' members are ignored, however they are written, and so is every member past W3C's
    32 (a list has at most 32: ours is read only among them, as :func:`merge_tracestate` places it).
    Raises :class:`HintError` naming the member when ours is sent twice, is not unpadded base64url
    (W3C forbids ``=`` in a value: padding is refused), is too long, or is not a valid hint.
    """
    ours = [m.split("=", 1)[1] if "=" in m else "" for m in _members(values)[:MAX_TRACESTATE_MEMBERS]
            if m.split("=", 1)[0].strip() == TRACESTATE_KEY]
    if not ours:
        return None
    where = f"tracestate member `{TRACESTATE_KEY}`"
    if len(ours) > 1:
        raise HintError(f"{where} sent {len(ours)} times; send one hint")
    value = ours[0].strip()
    if not value or len(value) > MAX_TRACESTATE_VALUE:
        raise HintError(f"{where} must be 1-{MAX_TRACESTATE_VALUE} characters of base64url, got {len(value)}")
    if "=" in value:
        raise HintError(f"{where} is not unpadded base64url (W3C allows no `=` in a value)")
    try:
        raw = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise HintError(f"{where} is not unpadded base64url") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HintError(f"{where} is not UTF-8 JSON: {exc}") from None
    try:
        return parse_header(text)
    except HintError as exc:
        raise HintError(f"{where}: {exc}") from None


def routing_key(session: str, namespace: str = "") -> str:
    """The router's routing key for a session: a hash of namespace and session (32 hex characters).

    ``namespace`` is what the worker binds the call to -- the tenant, or ``extra_key`` / ``cache_salt``
    without tenancy -- so equal session ids of two namespaces are two keys."""
    return hashlib.sha256(f"{namespace}\x00{session}".encode()).hexdigest()[:32]


def gateway_headers(hint_fields: dict, *, namespace: str = "", tracestate: str | None = None) -> dict[str, str]:
    """The headers of a hinted call sent through the router: the session's routing key and the hint
    in ``tracestate`` (merged into the caller's own ``tracestate``, if any)."""
    member = tracestate_member(hint_fields)
    return {ROUTING_HEADER: routing_key(hint_fields["session"], namespace),
            TRACESTATE_HEADER: merge_tracestate(tracestate, member)}
