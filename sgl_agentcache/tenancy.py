"""Tenants, API keys, signed session credentials and per-tenant ceilings (pure: no SGLang, no HTTP).

The operator describes tenants in a file named by ``AGENTCACHE_TENANTS`` (JSON or TOML)::

    require_signed_sessions = true          # hints and routes must name server-issued sessions
    admin_keys = ["sha256:9f86d0..."]       # purge, diagnostics, SGLang's own non-generation routes

    [defaults]                              # ceilings of every tenant unless the tenant overrides one
    max_retention_s = 600
    max_kept_branches = 4

    [tenants.acme]
    keys = ["sha256:2c26b4..."]             # sha256 of the API key (plain keys are accepted, discouraged)
    ceilings = { max_kept_tokens = 8192, max_priority = 10 }

Contracts:

- **Keys**: a presented key is hashed (SHA-256) and looked up; configured keys are stored hashed, so
  the file holds no secret. ``sgl-agentcache tenant-key`` prints a fresh key and its hash line.
- **Namespace**: a tenant's cache namespace is ``cache_salt = "agentcache:<tenant>:<binding>"`` where
  ``binding`` hashes the model, tokenizer, revision and :data:`POLICY_VERSION`: two tenants never share
  a tree path, a host copy or a KV-event key, and a change of model or policy starts a fresh namespace.
- **Session credentials** are ``<id>.<expiry>.<mac>``: a random id, a Unix expiry and an HMAC-SHA256
  over (tenant, id, expiry) with the server secret (``AGENTCACHE_SECRET``). They fit the hint id
  grammar, so they go where a session id goes. Verification answers, in this order: not a credential
  or a bad MAC (forged, or another tenant's: indistinguishable by design) -> 403; expired -> 401;
  closed (a credential replayed after its session was closed) -> 403.
- **Ceilings** clip hint and route values to the tenant's limits; a clip is reported, never an error.

Every check here is a pure function of the config, the secret and the ``now`` it is given.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

TENANTS_ENV = "AGENTCACHE_TENANTS"
SECRET_ENV = "AGENTCACHE_SECRET"
#: Bumped when the cache's classification rules change, so old namespaces are never reused.
POLICY_VERSION = "1"
#: The namespace of requests that carry no tenant (public routes such as SGLang's /health_generate).
SYSTEM_SALT = "agentcache:system"
MIN_SECRET_BYTES = 32
MIN_PLAIN_KEY_CHARS = 16
#: Replay protection remembers at most this many closed sessions *per tenant* (that tenant's
#: earliest-expiring go first: one tenant's closes never make another's closed credential usable again).
MAX_TOMBSTONES = 100_000

_TenantName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_HASHED = re.compile(r"^sha256:[0-9a-f]{64}\Z")
#: A credential in its one canonical spelling: the expiry without leading zeros (``0001234`` would carry the
#: same MAC as ``1234`` and verify as another session id, one that ``session/close`` never retired).
_SESSION = re.compile(r"^([0-9a-f]{8,64})\.(0|[1-9][0-9]{0,11})\.([A-Za-z0-9_-]{22})\Z")
_MAC_LABEL = b"sgl-agentcache session v1\x00"
#: Anything shaped like a credential, canonical or not (what logs must never hold in full).
_CREDENTIAL_LIKE = re.compile(r"^([0-9a-f]{8,64})\.[0-9]+\.[A-Za-z0-9_-]+\Z")

#: Routes that need no key at all (SGLang's own probes: it never protects these either).
PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")
DEFAULT_OPEN_PATHS = ("/v1/models", "/get_model_info", "/model_info")
#: Routes that serve a tenant's own traffic (a tenant key, never an admin key). Everything else that is
#: not public or open needs an admin key: deny by default.
#: Every route of SGLang 0.5.23 that runs the model for its caller is listed (one rule: a tenant key
#: generates on all of them, an admin key on none -- ``auth.bind_generate`` refuses an admin's
#: generation whatever the route).
TENANT_PATHS = ("/generate", "/encode", "/classify", "/v1/completions", "/v1/chat/completions",
                "/v1/responses", "/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/tokenize", "/tokenize", "/v1/detokenize", "/detokenize",
                "/v1/audio/transcriptions", "/v1/realtime", "/v1/decisions", "/v1/systemone", "/invocations",
                "/vertex_generate", "/api/chat", "/api/generate")
AGENTCACHE_ADMIN_PATHS = ("/agentcache/admin/", "/agentcache/check", "/agentcache/deletions")


def session_label(session: str) -> str:
    """What logs and error messages may show of a session: the id part of a credential (never its
    expiry and MAC, which together are the secret), any other session id as it is."""
    match = _CREDENTIAL_LIKE.match(session)
    return match.group(1) if match else session


class TenancyError(ValueError):
    """The tenants file or the secret is unusable (raised at start-up, which then stops)."""


class CredentialError(ValueError):
    """A request's key or session credential is refused. ``status`` is 401 or 403; ``reason`` is a
    short label for metrics and the audit log. Subclasses ``ValueError`` so SGLang's handlers turn it
    into an error response carrying ``status_code``."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = self.status_code = status
        self.reason = reason


class Ceilings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-tenant upper bounds; ``None`` leaves the server-wide setting in force."""

    max_retention_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] | None = None
    max_kept_branches: _Count | None = None
    max_kept_tokens: _Count | None = None
    prefetch_budget_tokens: _Count | None = None
    max_priority: Annotated[int, msgspec.Meta(ge=-100, le=100)] | None = None
    max_stable_prefix_tokens: _Count | None = None
    max_session_ttl_s: Annotated[int, msgspec.Meta(gt=0, le=30 * 86_400)] | None = None

    def over(self, base: "Ceilings") -> "Ceilings":
        """These ceilings, with ``base``'s value wherever this one is unset."""
        return Ceilings(**{f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
                           for f in self.__struct_fields__})

    def caps(self) -> dict:
        """The scheduler-side caps (kept pins, speculative tokens) that are set, for a control message."""
        return {f: getattr(self, f) for f in ("max_kept_branches", "max_kept_tokens", "prefetch_budget_tokens")
                if getattr(self, f) is not None}


class TenantSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    keys: Annotated[list[str], msgspec.Meta(min_length=1)]
    ceilings: Ceilings = Ceilings()


class TenancyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    tenants: Annotated[dict[_TenantName, TenantSpec], msgspec.Meta(min_length=1)]
    admin_keys: list[str] = []
    defaults: Ceilings = Ceilings()
    require_signed_sessions: bool = True
    session_ttl_s: Annotated[int, msgspec.Meta(gt=0, le=30 * 86_400)] = 86_400
    open_paths: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_OPEN_PATHS))
    tenant_paths: list[str] = []


@dataclass(frozen=True)
class Identity:
    """Who a request is: a tenant, or an operator (``admin``), never both."""

    tenant: str | None
    admin: bool = False


def key_digest(key: str) -> str:
    """The ``sha256:<hex>`` form of an API key (how the tenants file stores keys)."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random API key and the line that goes into the tenants file."""
    key = "ak-" + secrets.token_urlsafe(32)
    return key, key_digest(key)


def load_config(path: str | os.PathLike) -> TenancyConfig:
    """Parse and check a tenants file (``.toml`` or JSON); every problem raises :class:`TenancyError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TenancyError(f"{TENANTS_ENV}: cannot read {path}: {exc}") from None
    try:
        if path.suffix == ".toml":
            config = msgspec.toml.decode(raw, type=TenancyConfig)
        else:
            config = msgspec.json.decode(raw, type=TenancyConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TenancyError(f"{TENANTS_ENV}: {path} is not a valid tenants file: {exc}") from None
    seen: dict[str, str] = {}
    owners = [(f"tenant {name!r}", spec.keys) for name, spec in config.tenants.items()] + [("admin", config.admin_keys)]
    for owner, keys in owners:
        for key in keys:
            digest = _stored_digest(key, owner)
            if digest in seen:
                raise TenancyError(f"{TENANTS_ENV}: one key is listed for both {seen[digest]} and {owner}")
            seen[digest] = owner
    return config


def _stored_digest(key: str, owner: str) -> str:
    if key.startswith("sha256:"):
        if not _HASHED.match(key):
            raise TenancyError(f"{TENANTS_ENV}: a key of {owner} starts with 'sha256:' but is not 64 lowercase hex")
        return key
    if len(key) < MIN_PLAIN_KEY_CHARS:
        raise TenancyError(f"{TENANTS_ENV}: a plain key of {owner} is shorter than {MIN_PLAIN_KEY_CHARS} "
                           "characters (store keys as sha256:<hex>; `sgl-agentcache tenant-key` makes one)")
    return key_digest(key)


def load_secret(environ=os.environ) -> bytes:
    secret = environ.get(SECRET_ENV, "")
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise TenancyError(f"{SECRET_ENV} must be set to at least {MIN_SECRET_BYTES} bytes of secret (it signs "
                           "session credentials; the same value on every HTTP worker)")
    return secret.encode()


def binding(model_path: str, tokenizer_path: str | None = None, revision: str | None = None) -> str:
    """Short digest of what a namespace must bind besides the tenant: model, tokenizer, policy version."""
    text = "\x00".join([model_path, tokenizer_path or model_path, revision or "", POLICY_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


class Tenancy:
    """The loaded tenants, their keys and ceilings, and the session signer (one per HTTP process)."""

    def __init__(self, config: TenancyConfig, secret: bytes, bind: str):
        self.config = config
        self._secret = secret
        self.bind = bind
        self._keys: dict[str, Identity] = {}
        for name, spec in config.tenants.items():
            for key in spec.keys:
                self._keys[_stored_digest(key, name)] = Identity(name)
        for key in config.admin_keys:
            self._keys[_stored_digest(key, "admin")] = Identity(None, admin=True)
        self._ceilings = {name: spec.ceilings.over(config.defaults) for name, spec in config.tenants.items()}
        # tenant -> {closed session: its credential's expiry}, and the same as a heap by expiry (O(log n)
        # per close, however full the table: a full table used to be rescanned at every close).
        self._tombstones: dict[str, dict[str, int]] = {}
        self._expiries: dict[str, list[tuple[int, str]]] = {}

    @classmethod
    def from_env(cls, model_path: str, tokenizer_path: str | None = None, revision: str | None = None,
                 environ=os.environ) -> "Tenancy | None":
        """The tenancy of this server, or None when ``AGENTCACHE_TENANTS`` is unset (no tenancy)."""
        path = environ.get(TENANTS_ENV)
        if not path:
            return None
        return cls(load_config(path), load_secret(environ), binding(model_path, tokenizer_path, revision))

    # ---- identity ----

    def authenticate(self, key: str | None) -> Identity | None:
        """The identity a presented API key proves, or None."""
        if not key:
            return None
        return self._keys.get(key_digest(key))

    def salt(self, tenant: str) -> str:
        """The ``cache_salt`` every request and route of ``tenant`` is bound to."""
        return f"agentcache:{tenant}:{self.bind}"

    def tenant_of_salt(self, salt: str | None) -> str | None:
        if not salt or not salt.startswith("agentcache:") or not salt.endswith(":" + self.bind):
            return None
        name = salt[len("agentcache:"):-len(self.bind) - 1]
        return name if name in self.config.tenants else None

    def ceilings(self, tenant: str) -> Ceilings:
        return self._ceilings[tenant]

    def route_kind(self, path: str) -> str:
        """``public``, ``open``, ``tenant``, ``any`` (a tenant or an admin key: ``/agentcache/stats``, whose
        answer depends on who asks) or ``admin`` (the default for anything unlisted)."""
        if path.startswith(PUBLIC_PREFIXES):
            return "public"
        if path in self.config.open_paths:
            return "open"
        if path == "/agentcache/stats":
            return "any"
        if path.startswith("/agentcache/"):
            return "admin" if path.startswith(AGENTCACHE_ADMIN_PATHS) else "tenant"
        if path in TENANT_PATHS or path in self.config.tenant_paths:
            return "tenant"
        return "admin"

    # ---- session credentials ----

    def _mac(self, tenant: str, sid: str, expiry: int) -> str:
        msg = _MAC_LABEL + f"{tenant}\x00{sid}\x00{expiry}".encode()
        return _b64(hmac.new(self._secret, msg, hashlib.sha256).digest())[:22]

    def issue_session(self, tenant: str, now: float, ttl_s: int | None = None) -> tuple[str, int, bool]:
        """A new session credential for ``tenant``: (credential, expiry, whether ``ttl_s`` was clipped)."""
        limit = self.ceilings(tenant).max_session_ttl_s or self.config.session_ttl_s
        ttl = limit if ttl_s is None else min(ttl_s, limit)
        expiry = int(now) + ttl
        sid = secrets.token_hex(12)
        return f"{sid}.{expiry}.{self._mac(tenant, sid, expiry)}", expiry, ttl_s is not None and ttl_s > limit

    def verify_session(self, tenant: str, session: str, now: float) -> None:
        """Raise :class:`CredentialError` unless ``session`` is a live credential of ``tenant``.

        With ``require_signed_sessions`` off any well-formed id is accepted (it is still namespaced by
        the tenant, so it cannot name another tenant's session).
        """
        match = _SESSION.match(session)
        if match is None:
            if not self.config.require_signed_sessions:
                return
            raise CredentialError(403, "unsigned_session", f"session {session_label(session)[:40]!r} is not a "
                                  "credential issued by this server (POST /agentcache/session/open)")
        sid, expiry = match.group(1), int(match.group(2))
        if not hmac.compare_digest(match.group(3), self._mac(tenant, sid, expiry)):
            raise CredentialError(403, "forged_session", "session credential is not valid for this tenant")
        if now >= expiry:
            raise CredentialError(401, "expired_session", "session credential expired; open a new session")
        if session in self._tombstones.get(tenant, ()):
            raise CredentialError(403, "closed_session", "session was closed; its credential cannot be reused")

    def tombstone(self, tenant: str, session: str, now: float) -> None:
        """Remember a closed session until its credential expires (replay protection, bounded)."""
        match = _SESSION.match(session)
        marks = self._tombstones.setdefault(tenant, {})
        if match is None or session in marks:
            return
        heap = self._expiries.setdefault(tenant, [])
        while heap and (heap[0][0] <= now or len(marks) >= MAX_TOMBSTONES):  # expired ones, then the earliest
            _, gone = heapq.heappop(heap)
            del marks[gone]
        expiry = int(match.group(2))
        marks[session] = expiry
        heapq.heappush(heap, (expiry, session))

    # ---- ceilings ----

    def clip_hint(self, tenant: str, hint_fields: dict) -> dict[str, tuple]:
        """Clip a lifecycle hint's fields in place to ``tenant``'s ceilings; returns
        ``{field: (asked, granted)}`` for each clipped field."""
        c, clipped = self.ceilings(tenant), {}
        limits = {"stable_prefix_tokens": c.max_stable_prefix_tokens, "priority": c.max_priority,
                  "deadline_ms": None if c.max_retention_s is None else int(c.max_retention_s * 1000)}
        for name, limit in limits.items():
            value = hint_fields.get(name)
            if limit is not None and value is not None and value > limit:
                hint_fields[name] = limit
                clipped[name] = (value, limit)
        return clipped
