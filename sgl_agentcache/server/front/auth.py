"""Tenancy at the HTTP front door: who a request is, which namespace it may touch, what it may ask.

Active only when ``AGENTCACHE_TENANTS`` names a tenants file (see :mod:`sgl_agentcache.tenancy`).

- :class:`TenancyMiddleware` (pure ASGI, inside SGLang's own ``--api-key`` middleware) authenticates
  every request, HTTP or WebSocket: the key comes from ``x-agentcache-key``, or from
  ``Authorization: Bearer`` when SGLang's ``--api-key`` is not in use. Public probes pass; tenant
  routes need a tenant key (401 without, 403 with an admin key); everything else needs an admin key.
  The identity is put in the ASGI scope and in a context variable for the hooks below.
- :func:`bind_generate` (called by the ingress hook on ``TokenizerManager.generate_request``) overwrites
  ``extra_key`` / ``cache_salt`` with the tenant's namespace (a client value is counted and audited,
  never used), checks each lifecycle hint's session credential and clips its fields to the ceilings.
- :class:`Trust` counts rejected and clipped hints (``/agentcache/stats``, Prometheus) and writes the
  audit log (``AGENTCACHE_AUDIT_LOG``, JSONL; keys and credentials are never written).
"""

from __future__ import annotations

import contextvars
import logging
import time

import msgspec

from sgl_agentcache.hints import find_lifecycle_hint
from sgl_agentcache.tenancy import SYSTEM_SALT, CredentialError, Identity, Tenancy

logger = logging.getLogger(__name__)
KEY_HEADER = b"x-agentcache-key"
_SCOPE_KEY = "agentcache.identity"

#: The server's tenancy (None: tenancy off). Set once, in the HTTP process, before the app serves.
tenancy: Tenancy | None = None
#: SGLang's start-up warmup calls its own server without a tenant key: ``/model_info``, one generation
#: (``/generate``; ``/encode``, ``/v1/chat/completions`` or ``/v1/systemone`` for other models) and
#: ``/freeze_gc``. While it runs (the server is not "up" yet), a keyless request to one of these paths is
#: admitted only if it comes from this very process -- a TCP connection whose client end is one of our
#: own sockets -- so no other client can pass for the warmup or use up its admission. Path -> whether the
#: warmup's identity there is an operator's (the generations run in the system namespace, without hints).
WARMUP_PATHS = {"/model_info": True, "/freeze_gc": True, "/generate": False, "/encode": False,
                "/v1/chat/completions": False, "/v1/systemone": False}
_warmup_running = False
_current: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("agentcache_identity", default=None)


class Trust:
    """Counters and the audit log of refused and clipped hints (HTTP process)."""

    def __init__(self, audit_path: str | None = None):
        from sgl_agentcache.server.front.event_log import EventLog

        self.audit = EventLog(audit_path, kind_key="event")
        self.rejected: dict[str, int] = {}
        self.clipped: dict[str, int] = {}
        self.overwritten = 0
        self._metrics = None

    def _prom(self):
        if self._metrics is None:
            from sgl_agentcache.server.metrics import TrustMetrics, metrics_enabled

            self._metrics = TrustMetrics() if metrics_enabled() else False
        return self._metrics

    def reject(self, reason: str, *, tenant: str | None, path: str, message: str = "") -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.audit.emit("rejected", {"tenant": tenant}, reason=reason, path=_logged(path),
                        message=_logged(message))
        if self._prom():
            self._metrics.rejected.labels(reason).inc()

    def clip(self, tenant: str, field: str, asked, granted, *, path: str) -> None:
        self.clipped[field] = self.clipped.get(field, 0) + 1
        self.audit.emit("clipped", {"tenant": tenant}, field=field, asked=asked, granted=granted, path=_logged(path))
        if self._prom():
            self._metrics.clipped.labels(field).inc()

    def note_overwrite(self, tenant: str | None, path: str) -> None:
        self.overwritten += 1
        self.audit.emit("namespace_overwritten", {"tenant": tenant}, path=_logged(path))
        if self._prom():
            self._metrics.rejected.labels("namespace_overwritten").inc()

    def record(self, event: str, tenant: str | None, **fields) -> None:
        self.audit.emit(event, {"tenant": tenant}, **fields)

    def stats(self) -> dict:
        return {"rejected": dict(self.rejected), "clipped": dict(self.clipped),
                "namespace_overwritten": self.overwritten, "audit_log": self.audit.path,
                "audit_events": self.audit.written, "audit_dropped": self.audit.dropped + self.audit.failed}


#: Characters of a request path (or message) the audit log keeps: a client chooses them, and a 401
#: costs it nothing, so 8 KiB paths must not become 8 KiB audit lines.
MAX_LOGGED_CHARS = 256


def _logged(text: str) -> str:
    if len(text) <= MAX_LOGGED_CHARS:
        return text
    return f"{text[:MAX_LOGGED_CHARS]}...(+{len(text) - MAX_LOGGED_CHARS} chars)"


trust = Trust()  # its audit log is opened by configure() (AGENTCACHE_AUDIT_LOG)


def configure(server_args, audit_log: str | None = None) -> None:
    """Load the tenants file for this server (BEFORE ``launch_server``; a bad file stops start-up) and
    open the audit log at ``audit_log`` (the operator's ``AGENTCACHE_AUDIT_LOG``)."""
    global tenancy
    from sgl_agentcache.server.front.event_log import EventLog

    trust.audit = EventLog(audit_log, kind_key="event")
    tenancy = Tenancy.from_env(server_args.model_path, getattr(server_args, "tokenizer_path", None),
                               getattr(server_args, "revision", None))
    if tenancy is not None:
        logger.info("agentcache: tenancy on, %d tenants, signed sessions %s", len(tenancy.config.tenants),
                    "required" if tenancy.config.require_signed_sessions else "optional")


def identity_of(request=None) -> Identity | None:
    """The authenticated identity of the current HTTP request (None: tenancy off, or no key)."""
    if request is not None:
        found = getattr(request, "scope", {}).get(_SCOPE_KEY)
        if found is not None:
            return found
    return _current.get()


def _presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    bearer = None
    for name, value in headers:
        if name == KEY_HEADER:
            return value.decode("latin-1")
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token:
                bearer = token.strip()
    return bearer


async def _refuse(send, status: int, message: str) -> None:
    body = msgspec.json.encode({"error": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="sgl-agentcache"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _refuse_websocket(receive, send, message: str) -> None:
    """Refuse a WebSocket before it is accepted: the server answers the handshake with HTTP 403."""
    await receive()  # the websocket.connect message, always the first
    reason = message.encode()[:120].decode(errors="ignore")  # a close reason is at most 123 bytes
    await send({"type": "websocket.close", "code": 1008, "reason": reason})


class TenancyMiddleware:
    """Authenticate and authorise every request against :data:`tenancy` (see module docstring): HTTP and
    WebSocket scopes alike (``/v1/realtime`` is a WebSocket). ``lifespan`` is the server's own; any other
    scope type is never passed on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        kind_of_scope = scope["type"]
        if tenancy is None or kind_of_scope == "lifespan" or (kind_of_scope == "http"
                                                               and scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        if kind_of_scope not in ("http", "websocket"):
            logger.warning("agentcache: refused an ASGI scope of unknown type %r", kind_of_scope)
            return None
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # a server behind --fastapi-root-path: classify the route itself
            path = path[len(root):] or "/"
        kind = tenancy.route_kind(path)
        identity = None
        if kind not in ("public", "open"):
            key = _presented_key(scope.get("headers", []))
            identity = tenancy.authenticate(key)
            refusal = None
            if identity is None and kind_of_scope == "http" and _is_warmup(scope, path):
                identity = Identity(None, admin=WARMUP_PATHS[path])
            elif identity is None:
                refusal = (401, "no_key" if key is None else "bad_key",
                           "a valid API key is required (x-agentcache-key or Authorization: Bearer)")
            elif kind == "tenant" and identity.admin:
                refusal = (403, "admin_on_tenant_route", f"{path} serves tenants; use a tenant key")
            elif kind == "admin" and not identity.admin:
                refusal = (403, "not_admin", f"{path} needs an admin key")
            if refusal is not None:
                status, reason, message = refusal
                trust.reject(reason, tenant=identity.tenant if identity else None, path=path)
                if kind_of_scope == "websocket":
                    return await _refuse_websocket(receive, send, message)
                return await _refuse(send, status, message)
        scope[_SCOPE_KEY] = identity
        token = _current.set(identity)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)


def _is_warmup(scope, path: str) -> bool:
    """Whether this keyless request is SGLang's own warmup (see :data:`WARMUP_PATHS`)."""
    if not _warmup_running or path not in WARMUP_PATHS:
        return False
    client, server = scope.get("client"), scope.get("server")
    return bool(client and server) and from_this_process(tuple(client[:2]), tuple(server[:2]))


def from_this_process(client: tuple, server: tuple) -> bool:
    """Whether the TCP connection ``client`` -> ``server`` was opened by this process: one of our own
    sockets has ``client`` as its local and ``server`` as its remote address. (A connection's address
    pair is unique, and no other process can own our socket.)"""
    import psutil

    try:
        connections = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.raddr and (c.laddr.ip, c.laddr.port) == client and (c.raddr.ip, c.raddr.port) == server
               for c in connections)


def around_warmup(original, *args, **kwargs):
    """AROUND hook on SGLang's ``_wait_and_warmup``: its keyless self-requests are admitted while it runs."""
    global _warmup_running
    _warmup_running = tenancy is not None
    try:
        return original(*args, **kwargs)
    finally:
        _warmup_running = False


# ---- generation requests ----


def bound_salt(identity: Identity | None) -> str:
    return tenancy.salt(identity.tenant) if identity is not None and identity.tenant else SYSTEM_SALT


def check_session(identity: Identity | None, session: str, path: str) -> None:
    """Raise :class:`CredentialError` (audited, counted) unless ``identity`` may use ``session``."""
    if identity is None or identity.tenant is None:
        trust.reject("no_tenant", tenant=None, path=path)
        raise CredentialError(403, "no_tenant", "lifecycle hints need a tenant key")
    try:
        tenancy.verify_session(identity.tenant, session, time.time())
    except CredentialError as exc:
        trust.reject(exc.reason, tenant=identity.tenant, path=path, message=str(exc))
        raise


def bind_generate(obj, request=None, inferred: bool = False) -> None:
    """Bind a generation request to its tenant's namespace, check and clip its lifecycle hints.

    Runs after hint validation (a malformed hint is a 400 first). Raises :class:`CredentialError`
    (401/403 through SGLang's error response) and changes nothing when a credential is refused. A hint
    the server ``inferred`` from a chat request needs no session credential: the server named the
    session, inside the caller's namespace.
    """
    if tenancy is None:
        return
    identity = identity_of(request)
    path = getattr(getattr(request, "url", None), "path", "/generate")
    refuse_admin_generation(identity, path)
    salt = bound_salt(identity)
    tenant = identity.tenant if identity is not None else None
    if hasattr(obj, "cache_salt"):
        given = [v for v in _values(getattr(obj, "extra_key", None)) + _values(obj.cache_salt) if v and v != salt]
        if given:
            trust.note_overwrite(tenant, path)
    hints = getattr(obj, "kv_hints", None)
    if hints:
        envelopes = hints if isinstance(hints, list) else [hints]
        parsed = [(e, find_lifecycle_hint(e)) for e in envelopes]
        for _, hint in parsed:  # check every credential before changing anything
            if hint is not None and not inferred:
                check_session(identity, hint.session, path)
        rewritten = [_clip_envelope(e, hint, identity, path) if hint is not None else e for e, hint in parsed]
        obj.kv_hints = rewritten if isinstance(hints, list) else rewritten[0]
    if hasattr(obj, "cache_salt"):
        obj.extra_key = None
        obj.cache_salt = salt


def refuse_admin_generation(identity: Identity | None, path: str) -> None:
    """One rule for every route that runs the model: a tenant key generates (in its namespace), an admin
    key never does. Raise :class:`CredentialError` (403, audited) for an admin's generation."""
    if tenancy is not None and identity is not None and identity.admin:
        trust.reject("admin_on_tenant_route", tenant=None, path=path)
        raise CredentialError(403, "admin_on_tenant_route", f"{_logged(path)} runs the model for a tenant; "
                              "admin keys do not generate (use a tenant key)")


def _values(value) -> list:
    return value if isinstance(value, list) else [value]


def clip(identity: Identity | None, fields: dict, path: str) -> dict:
    """Clip ``fields`` in place to the identity's tenant ceilings; each clip is counted and audited."""
    if tenancy is None or identity is None or identity.tenant is None:
        return {}
    clipped = tenancy.clip_hint(identity.tenant, fields)
    for name, (asked, granted) in clipped.items():
        trust.clip(identity.tenant, name, asked, granted, path=path)
    return clipped


def _clip_envelope(envelope, hint, identity: Identity, path: str):
    fields = {f: getattr(hint, f) for f in hint.__struct_fields__ if getattr(hint, f) is not None}
    clipped = clip(identity, fields, path)
    if not clipped:
        return envelope
    from sgl_agentcache.hints import ACTION_TYPE

    plain = msgspec.to_builtins(envelope) if not isinstance(envelope, dict) else envelope
    actions = [dict(a, payload={**a["payload"], **{k: fields[k] for k in clipped}})
               if a.get("action_type") == ACTION_TYPE else a for a in plain["actions"]]
    return {**plain, "actions": actions}


def ceilings_for(identity: Identity | None):
    """The tenant's ceilings, or None (tenancy off or no tenant)."""
    if tenancy is None or identity is None or identity.tenant is None:
        return None
    return tenancy.ceilings(identity.tenant)


__all__ = ["TenancyMiddleware", "Trust", "bind_generate", "bound_salt", "ceilings_for", "check_session", "clip",
           "configure", "identity_of", "trust"]
