"""Tenancy without a server: the tenants file, keys, namespaces, session credentials, ceilings, and the
front-door binding of a request (``auth.bind_generate``) on plain request objects."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache import tenancy as tn
from sgl_agentcache.hints import find_lifecycle_hint, lifecycle_envelope
from sgl_agentcache.tenancy import (Ceilings, CredentialError, Identity, Tenancy, TenancyError, key_digest,
                                    load_config)

ACME, GLOBEX, ADMIN = "acme-key-0123456789abcdef", "globex-key-0123456789abcdef", "admin-key-0123456789abcdef"
SECRET = b"k" * 32
NOW = 1_800_000_000.0


def _write(tmp_path, text: str, name: str = "tenants.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _config(tmp_path, **overrides):
    body = {"admin_keys": [key_digest(ADMIN)], "defaults": {"max_retention_s": 600, "max_priority": 10},
            "tenants": {"acme": {"keys": [key_digest(ACME)], "ceilings": {"max_kept_branches": 1, "max_priority": 3,
                                                                         "max_stable_prefix_tokens": 64}},
                        "globex": {"keys": [GLOBEX]}}} | overrides
    return load_config(_write(tmp_path, json.dumps(body), "tenants.json"))


@pytest.fixture
def tenancy(tmp_path) -> Tenancy:
    return Tenancy(_config(tmp_path), SECRET, tn.binding("/models/qwen"))


def test_toml_and_json_files_load_the_same(tmp_path):
    toml = _write(tmp_path, f'''
admin_keys = ["{key_digest(ADMIN)}"]
[defaults]
max_retention_s = 600
max_priority = 10
[tenants.acme]
keys = ["{key_digest(ACME)}"]
ceilings = {{ max_kept_branches = 1, max_priority = 3, max_stable_prefix_tokens = 64 }}
[tenants.globex]
keys = ["{GLOBEX}"]
''')
    assert load_config(toml) == _config(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"tenants": {"a": {"keys": [ACME]}, "b": {"keys": [key_digest(ACME)]}}}, "both"),
    ({"tenants": {"a": {"keys": ["short"]}}}, "shorter than"),
    ({"tenants": {"a": {"keys": ["sha256:XYZ"]}}}, "64 lowercase hex"),
    ({"tenants": {"a b": {"keys": [ACME]}}}, "tenants"),
    ({"tenants": {}}, "tenants"),
    ({"tenants": {"a": {"keys": [ACME]}}, "surprise": 1}, "surprise"),
    ({"tenants": {"a": {"keys": [ACME], "ceilings": {"max_priority": 1000}}}}, "max_priority"),
    ({"tenants": {"a": {"keys": [ACME]}}, "admin_keys": [ACME]}, "admin"),
])
def test_bad_tenants_files_stop_start_up_with_the_reason(tmp_path, change, message):
    path = _write(tmp_path, json.dumps(change), "bad.json")
    with pytest.raises(TenancyError, match=message):
        load_config(path)


def test_secret_must_be_long_enough():
    with pytest.raises(TenancyError, match=tn.SECRET_ENV):
        tn.load_secret({tn.SECRET_ENV: "short"})
    assert tn.load_secret({tn.SECRET_ENV: "x" * 32}) == b"x" * 32
    assert Tenancy.from_env("/m", environ={}) is None  # no tenants file: tenancy off


def test_keys_authenticate_tenants_and_admins(tenancy):
    assert tenancy.authenticate(ACME) == Identity("acme")
    assert tenancy.authenticate(GLOBEX) == Identity("globex")  # a plain key in the file works too
    assert tenancy.authenticate(ADMIN) == Identity(None, admin=True)
    for wrong in (None, "", ACME + "x", key_digest(ACME)):  # a stored hash is not a key
        assert tenancy.authenticate(wrong) is None


def test_namespaces_bind_tenant_model_and_policy(tenancy, tmp_path):
    assert tenancy.salt("acme") != tenancy.salt("globex")
    other_model = Tenancy(_config(tmp_path), SECRET, tn.binding("/models/llama"))
    assert other_model.salt("acme") != tenancy.salt("acme")
    assert tenancy.tenant_of_salt(tenancy.salt("acme")) == "acme"
    assert tenancy.tenant_of_salt(other_model.salt("acme")) is None
    assert tenancy.tenant_of_salt("acme") is None


def test_session_credentials(tenancy):
    session, expiry, clipped = tenancy.issue_session("acme", NOW, ttl_s=60)
    assert expiry == int(NOW) + 60 and not clipped
    tenancy.verify_session("acme", session, NOW + 59)
    with pytest.raises(CredentialError) as other:
        tenancy.verify_session("globex", session, NOW)  # another tenant's genuine credential
    assert other.value.status == 403 and other.value.reason == "forged_session"
    with pytest.raises(CredentialError) as late:
        tenancy.verify_session("acme", session, NOW + 60)
    assert late.value.status == 401 and late.value.reason == "expired_session"
    sid, exp, mac = session.split(".")
    with pytest.raises(CredentialError, match="not valid"):
        tenancy.verify_session("acme", f"{sid}.{int(exp) + 10}.{mac}", NOW)  # extended life, old MAC
    with pytest.raises(CredentialError) as plain:
        tenancy.verify_session("acme", "my-session", NOW)
    assert plain.value.reason == "unsigned_session"
    tenancy.tombstone("acme", session, NOW)
    with pytest.raises(CredentialError) as replay:
        tenancy.verify_session("acme", session, NOW + 1)
    assert replay.value.status == 403 and replay.value.reason == "closed_session"


def test_a_credential_has_one_spelling(tenancy):
    """An expiry with leading zeros carries the same MAC; it used to verify as another session id, one
    that a close of the real session never retired."""
    session, _, _ = tenancy.issue_session("acme", NOW, ttl_s=60)
    sid, expiry, mac = session.split(".")
    tenancy.tombstone("acme", session, NOW)
    for variant in (f"{sid}.0{expiry}.{mac}", f"{sid}.00{expiry}.{mac}"):
        with pytest.raises(CredentialError) as refused:
            tenancy.verify_session("acme", variant, NOW)
        assert refused.value.status == 403, variant
    with pytest.raises(CredentialError, match="closed"):
        tenancy.verify_session("acme", session, NOW)


def test_session_lifetime_is_clipped_and_ids_fit_the_hint_grammar(tenancy):
    import re

    from sgl_agentcache.hints import ID_REGEX

    session, expiry, clipped = tenancy.issue_session("acme", NOW, ttl_s=10 * 86_400)
    assert clipped and expiry == int(NOW) + tenancy.config.session_ttl_s
    assert re.match(ID_REGEX, session)
    assert find_lifecycle_hint(lifecycle_envelope({"session": session}, message_id="m")).session == session


def test_unsigned_sessions_when_the_operator_allows_them(tmp_path):
    lax = Tenancy(_config(tmp_path, require_signed_sessions=False), SECRET, "b")
    lax.verify_session("acme", "my-session", NOW)  # still namespaced by the tenant
    session, _, _ = lax.issue_session("globex", NOW)
    with pytest.raises(CredentialError):
        lax.verify_session("acme", session, NOW)  # a credential is still checked


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_no_edit_of_a_credential_verifies(data):
    tenancy = Tenancy(TenancyConfigForProperty, SECRET, "b")
    session, _, _ = tenancy.issue_session("acme", NOW, ttl_s=3600)
    i = data.draw(st.integers(0, len(session) - 1))
    c = data.draw(st.sampled_from("0123456789abcdefABCDEF-_."))
    forged = session[:i] + c + session[i + 1:]
    if forged != session:
        with pytest.raises(CredentialError):
            tenancy.verify_session("acme", forged, NOW)


TenancyConfigForProperty = tn.TenancyConfig(tenants={"acme": tn.TenantSpec(keys=[ACME])})


def test_tombstones_are_bounded(tenancy, monkeypatch):
    monkeypatch.setattr(tn, "MAX_TOMBSTONES", 4)
    sessions = [tenancy.issue_session("acme", NOW, ttl_s=100 + i)[0] for i in range(6)]
    for s in sessions:
        tenancy.tombstone("acme", s, NOW)
    assert len(tenancy._tombstones["acme"]) <= 4
    with pytest.raises(CredentialError, match="closed"):
        tenancy.verify_session("acme", sessions[-1], NOW)  # the newest are remembered


def test_one_tenants_closes_never_reopen_another_tenants_closed_session(tenancy, monkeypatch):
    """Issue #38 item 6: the replay-protection table was one for all tenants. After acme's open+close
    pairs filled it, globex's closed credential generated again, and each close rescanned the table.
    Each tenant has its own bound now (its own earliest-expiring go), and a close is O(log n)."""
    monkeypatch.setattr(tn, "MAX_TOMBSTONES", 50)
    theirs = tenancy.issue_session("globex", NOW, ttl_s=60)[0]  # expires first of all
    tenancy.tombstone("globex", theirs, NOW)
    for i in range(500):
        tenancy.tombstone("acme", tenancy.issue_session("acme", NOW, ttl_s=600 + i)[0], NOW)
    with pytest.raises(CredentialError, match="closed"):
        tenancy.verify_session("globex", theirs, NOW)
    assert len(tenancy._tombstones["acme"]) == 50 and len(tenancy._expiries["acme"]) == 50
    # Expired marks go first (a credential past its expiry is refused as expired anyway).
    tenancy.tombstone("globex", tenancy.issue_session("globex", NOW + 100, ttl_s=60)[0], NOW + 100)
    assert theirs not in tenancy._tombstones["globex"]


def test_ceilings_clip_and_merge_with_defaults(tenancy):
    acme = tenancy.ceilings("acme")
    assert acme.max_priority == 3 and acme.max_retention_s == 600  # own value, and the default's
    assert tenancy.ceilings("globex").max_priority == 10
    assert acme.caps() == {"max_kept_branches": 1}
    fields = {"session": "s", "stable_prefix_tokens": 500, "priority": 50, "deadline_ms": 10_000_000}
    clipped = tenancy.clip_hint("acme", fields)
    assert clipped == {"stable_prefix_tokens": (500, 64), "priority": (50, 3), "deadline_ms": (10_000_000, 600_000)}
    assert fields == {"session": "s", "stable_prefix_tokens": 64, "priority": 3, "deadline_ms": 600_000}
    modest = {"stable_prefix_tokens": 10, "priority": -5}
    assert tenancy.clip_hint("acme", modest) == {} and modest == {"stable_prefix_tokens": 10, "priority": -5}
    assert Ceilings().over(Ceilings(max_priority=1)).max_priority == 1


@pytest.mark.parametrize("path, kind", [
    ("/health", "public"), ("/health_generate", "public"), ("/metrics", "public"), ("/v1/models", "open"),
    ("/generate", "tenant"), ("/v1/chat/completions", "tenant"), ("/agentcache/pause", "tenant"),
    ("/agentcache/stats", "any"), ("/agentcache/admin/purge", "admin"), ("/agentcache/check", "admin"),
    ("/flush_cache", "admin"), ("/abort_request", "admin"), ("/v1/responses/abc", "admin"), ("/anything", "admin"),
    ("/v1/messages", "tenant"), ("/v1/realtime", "tenant"), ("/invocations", "tenant"),
])
def test_routes_are_denied_unless_classified(tenancy, path, kind):
    assert tenancy.route_kind(path) == kind


# ---- the front-door binding, on plain request objects ----


@pytest.fixture
def bound(tenancy, monkeypatch):
    from sgl_agentcache.server.front import auth

    monkeypatch.setattr(auth, "tenancy", tenancy)
    monkeypatch.setattr(auth, "trust", auth.Trust())
    return auth


def _request(identity: Identity | None):
    return SimpleNamespace(scope={"agentcache.identity": identity}, url=SimpleNamespace(path="/generate"))


def test_binding_overwrites_the_namespace_and_clips_hints(bound, tenancy):
    session, _, _ = tenancy.issue_session("acme", __import__("time").time(), ttl_s=600)
    envelope = lifecycle_envelope({"session": session, "stable_prefix_tokens": 300, "priority": 99}, message_id="m")
    obj = SimpleNamespace(input_ids=list(range(3, 400)), extra_key="globex", cache_salt=tenancy.salt("globex"),
                          kv_hints=envelope)
    bound.bind_generate(obj, _request(Identity("acme")))
    assert (obj.extra_key, obj.cache_salt) == (None, tenancy.salt("acme"))
    hint = find_lifecycle_hint(obj.kv_hints)
    assert (hint.stable_prefix_tokens, hint.priority, hint.session) == (64, 3, session)
    assert envelope["actions"][0]["payload"]["stable_prefix_tokens"] == 300  # the caller's object is not mutated
    assert bound.trust.clipped == {"stable_prefix_tokens": 1, "priority": 1} and bound.trust.overwritten == 1


def test_binding_refuses_credentials_and_changes_nothing(bound, tenancy):
    import time

    theirs, _, _ = tenancy.issue_session("globex", time.time(), ttl_s=600)
    envelope = lifecycle_envelope({"session": theirs}, message_id="m")
    obj = SimpleNamespace(input_ids=[5, 6], extra_key=None, cache_salt=None, kv_hints=envelope)
    with pytest.raises(CredentialError) as exc:
        bound.bind_generate(obj, _request(Identity("acme")))
    assert exc.value.status_code == 403
    assert obj.cache_salt is None and obj.kv_hints is envelope
    anonymous = SimpleNamespace(input_ids=[5, 6], extra_key=None, cache_salt="mine", kv_hints=None)
    bound.bind_generate(anonymous, _request(None))  # no tenant (warmup, probes): the system namespace
    assert anonymous.cache_salt == tn.SYSTEM_SALT
    with pytest.raises(CredentialError, match="tenant key"):
        bound.bind_generate(SimpleNamespace(input_ids=[5], extra_key=None, cache_salt=None, kv_hints=envelope),
                            _request(None))
    assert bound.trust.rejected == {"forged_session": 1, "no_tenant": 1}


def test_the_tenant_key_header_wins_over_sglangs_bearer():
    """With SGLang's own --api-key the bearer carries SGLang's key; the tenant key rides beside it."""
    from sgl_agentcache.server.front.auth import _presented_key

    both = [(b"authorization", b"Bearer sglang-server-key"), (b"x-agentcache-key", b"tenant-key")]
    assert _presented_key(both) == "tenant-key"
    assert _presented_key([(b"authorization", b"Bearer tenant-key")]) == "tenant-key"
    assert _presented_key([(b"authorization", b"Basic abc")]) is None and _presented_key([]) is None


def test_admin_keys_never_generate_whatever_the_route(bound, tenancy):
    """One rule: a generation with an admin identity is refused where every generation passes, so a
    route missing from the tenant list cannot become an admin's way to generate."""
    obj = SimpleNamespace(input_ids=[5, 6], extra_key=None, cache_salt=None, kv_hints=None)
    request = SimpleNamespace(scope={"agentcache.identity": Identity(None, admin=True)},
                              url=SimpleNamespace(path="/some/new/generation/route"))
    with pytest.raises(CredentialError) as refused:
        bound.bind_generate(obj, request)
    assert refused.value.status_code == 403 and obj.cache_salt is None
    assert bound.trust.rejected == {"admin_on_tenant_route": 1}


def test_logs_show_a_credential_by_its_id_only(tenancy):
    session, expiry, _ = tenancy.issue_session("acme", NOW, ttl_s=60)
    sid, _, mac = session.split(".")
    assert tn.session_label(session) == sid and tn.session_label(f"{sid}.0{expiry}.{mac}") == sid
    assert tn.session_label("task-42") == "task-42"
    with pytest.raises(CredentialError) as refused:
        tenancy.verify_session("acme", f"{sid}.0{expiry}.{mac}", NOW)
    assert mac not in str(refused.value) and str(expiry) not in str(refused.value)


def test_audit_records_keep_a_bounded_piece_of_client_text(tmp_path):
    from sgl_agentcache.server.front import auth

    trust = auth.Trust(str(tmp_path / "audit.jsonl"))
    trust.reject("no_key", tenant=None, path="/" + "p" * 10_000, message="m" * 10_000)
    assert trust.audit.flush(5.0)
    record = json.loads((tmp_path / "audit.jsonl").read_text())
    assert len(record["path"]) < auth.MAX_LOGGED_CHARS + 32 and record["path"].endswith("(+9745 chars)")
    assert len(record["message"]) < auth.MAX_LOGGED_CHARS + 32


# ---- the middleware on every ASGI scope type (in process: this environment's uvicorn has no WebSocket
# implementation installed, so a real server here refuses every upgrade itself) ----


@pytest.fixture
def guarded_app(bound):
    """A Starlette app with an HTTP and two WebSocket routes, behind the real TenancyMiddleware."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.testclient import TestClient

    async def reached(websocket):
        await websocket.accept()
        await websocket.send_text("reached")
        await websocket.close()

    app = Starlette(routes=[Route("/generate", lambda request: PlainTextResponse("ok"), methods=["POST"]),
                            WebSocketRoute("/v1/realtime", reached), WebSocketRoute("/ws/debug", reached)])
    app.add_middleware(bound.TenancyMiddleware)
    return TestClient(app)


@pytest.mark.parametrize("path, key, admitted", [
    ("/v1/realtime", None, False), ("/v1/realtime", "ak-not-a-key-000000000", False),
    ("/v1/realtime", ADMIN, False), ("/v1/realtime", ACME, True),
    ("/ws/debug", None, False), ("/ws/debug", ACME, False), ("/ws/debug", ADMIN, True),  # unclassified: admin
])
def test_websockets_are_authenticated_like_http(guarded_app, bound, path, key, admitted):
    """Issue #22: the middleware passed every non-HTTP scope through, so a WebSocket route reached the
    model with no key at all."""
    from starlette.websockets import WebSocketDisconnect

    headers = {"x-agentcache-key": key} if key else {}
    if admitted:
        with guarded_app.websocket_connect(path, headers=headers) as ws:
            assert ws.receive_text() == "reached"
        return
    with pytest.raises(WebSocketDisconnect) as refused:
        with guarded_app.websocket_connect(path, headers=headers) as ws:
            ws.receive_text()
    assert refused.value.code == 1008
    assert sum(bound.trust.rejected.values()) == 1


def test_unknown_scope_types_are_never_passed_on(bound):
    import asyncio

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    middleware = bound.TenancyMiddleware(app)
    for kind in ("webtransport", "lifespan"):
        asyncio.run(middleware({"type": kind}, None, None))
    assert reached == ["lifespan"]


def test_a_connection_is_recognised_as_this_processs_own_and_no_other():
    """The warmup check: a keyless request is SGLang's warmup only if its TCP client end is one of this
    process's own sockets; a client in another process (any local user) never is."""
    import socket
    import subprocess
    import sys

    from sgl_agentcache.server.front.auth import from_this_process

    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = listener.getsockname()[:2]
        with socket.create_connection(server):  # held open while this process accepts it
            accepted, client = listener.accept()
            with accepted:
                assert from_this_process(client[:2], server)
        other = subprocess.Popen([sys.executable, "-c", "import socket, sys, time; "
                                  f"s = socket.create_connection(('127.0.0.1', {server[1]})); "
                                  "sys.stdout.write('x'); sys.stdout.flush(); time.sleep(30)"],
                                 stdout=subprocess.PIPE)
        try:
            assert other.stdout.read(1) == b"x"
            accepted, client = listener.accept()
            with accepted:
                assert not from_this_process(client[:2], server)
        finally:
            other.kill()
            other.wait()


@pytest.mark.parametrize("backend, dp, attn_dp, workers, tenancy, refused", [
    ("agentcache", 1, 1, 1, True, None), ("agentcache", 2, 1, 1, False, "data parallelism"),
    ("agentcache", 1, 4, 1, False, "data parallelism"), ("agentcache", 1, 1, 2, False, "--tokenizer-worker-num 2"),
    (None, 1, 1, 3, True, "tenancy"), (None, 2, 1, 1, True, None), (None, 2, 1, 4, False, None),
])
def test_unsupported_deployments_are_refused_only_when_they_use_the_plugin(backend, dp, attn_dp, workers, tenancy,
                                                                          refused):
    from sgl_agentcache.server.topology import refusal

    reason = refusal(backend, dp, attn_dp, workers, tenancy)
    assert (reason is None) if refused is None else (refused in reason)
