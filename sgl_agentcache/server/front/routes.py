"""The ``/agentcache/*`` routes, added to SGLang's own FastAPI app in the HTTP server process.

Handlers only translate HTTP to a control message (sent through ``control_channel.ControlChannel``)
and back; all cache logic runs in the scheduler. SGLang's ``--api-key`` middleware covers these routes
too; with tenancy on (``AGENTCACHE_TENANTS``) every call is bound to the caller's tenant namespace (see
``auth.py``).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sgl_agentcache import BACKEND_NAME, __version__
from sgl_agentcache.hints import (BranchRef, HintError, PauseRef, PrefetchRef, SessionOpen, SessionRef, TenantRef,
                                  parse_route_body)
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.server.front import auth, chat_hooks, shared
from sgl_agentcache.tenancy import Ceilings, CredentialError, Identity

router = APIRouter(prefix="/agentcache", tags=["agentcache"])


async def _body(request: Request, kind: type):
    try:
        return parse_route_body(await request.body(), kind), None
    except HintError as exc:
        return None, JSONResponse({"error": str(exc)}, status_code=400)


async def _forward(op_name: str, args: dict | None = None, extra: dict | None = None) -> JSONResponse:
    """Run a control op and answer with its result. The caller first settles the background pauses
    of what the op reads or changes (what a client reads or changes after a response includes the
    pause that response started; never another tenant's)."""
    status, result = await shared.send_to_scheduler(op_name, args or {})
    return JSONResponse(result | extra if status == 200 and extra else result, status_code=status)


class _Scope(NamedTuple):
    """What a route call may touch: its parsed body, its namespace, the caller and their ceilings."""

    ref: object
    namespace: str
    identity: Identity | None
    ceilings: Ceilings | None


async def _scoped(request: Request, kind: type) -> _Scope | JSONResponse:
    """Parse the body and bind the call to a namespace: with tenancy, the authenticated tenant's (a
    body ``extra_key`` / ``cache_salt`` is ignored, counted and audited) after its session credential
    is checked (401/403, nothing changed); without, the body's own."""
    ref, error = await _body(request, kind)
    if error is not None:
        return error
    if auth.tenancy is None:
        return _Scope(ref, namespace_key(ref.extra_key, ref.cache_salt), None, None)
    identity, path = auth.identity_of(request), request.url.path
    try:
        auth.check_session(identity, ref.session, path)
    except CredentialError as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    if ref.extra_key or ref.cache_salt:
        auth.trust.note_overwrite(identity.tenant, path)
    return _Scope(ref, namespace_key(None, auth.bound_salt(identity)), identity, auth.ceilings_for(identity))


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    """Operators (and every caller without tenancy): backend identity, resident tokens per lifecycle
    class, size counters (scheduler rank 0's tree). A tenant: its own namespace only (and it waits
    only for its own namespace's pending pauses)."""
    identity = auth.identity_of(request)
    if auth.tenancy is not None and identity is not None and identity.tenant is not None:
        namespace = namespace_key(None, auth.bound_salt(identity))
        await shared.coordinator.settle(namespace=namespace)
        return await _forward("stats", {"namespace": namespace}, extra={
            "tenant": identity.tenant, "ceilings": msgspec.to_builtins(auth.ceilings_for(identity)),
            "coordinator": shared.coordinator.stats(namespace), "chat_inference": chat_hooks.stats(namespace)})
    await shared.coordinator.settle()
    extra = {"backend": BACKEND_NAME, "version": __version__, "coordinator": shared.coordinator.stats(),
             "chat_inference": chat_hooks.stats(), "control_channel": shared.channel.stats()}
    if auth.tenancy is not None:
        extra["trust"] = auth.trust.stats()
    return await _forward("stats", extra=extra)


@router.get("/check")
async def check() -> JSONResponse:
    """Run the tree-integrity check (conservation checks apply only when the scheduler is idle)."""
    await shared.coordinator.settle()
    return await _forward("check")


@router.get("/deletions")
async def deletions() -> JSONResponse:
    """Every node deletion so far, in order (diagnostics; needs AGENTCACHE_RECORD_EVICTIONS=1)."""
    await shared.coordinator.settle()
    return await _forward("deletions")


@router.post("/session/open")
async def session_open(request: Request) -> JSONResponse:
    """Issue a session credential to the calling tenant (tenancy on). Body: ``{"ttl_s"?: int}``, clipped
    to the tenant's ``max_session_ttl_s``. The credential is the session id to use in hints and routes."""
    if auth.tenancy is None:
        return JSONResponse({"error": "tenancy is off on this server: any session id works"}, status_code=409)
    ref, error = await _body(request, SessionOpen)
    if error is not None:
        return error
    identity, now = auth.identity_of(request), time.time()
    session, expiry, clipped = auth.tenancy.issue_session(identity.tenant, now, ref.ttl_s)
    reply = {"session": session, "expires_at": expiry, "tenant": identity.tenant}
    if clipped:
        granted = expiry - int(now)
        auth.trust.clip(identity.tenant, "ttl_s", ref.ttl_s, granted, path=request.url.path)
        reply["clipped"] = {"ttl_s": {"asked": ref.ttl_s, "granted": granted}}
    auth.trust.record("session_opened", identity.tenant, expires_at=expiry)
    return JSONResponse(reply)


@router.post("/branch/close")
async def branch_close(request: Request) -> JSONResponse:
    """Terminate a branch: its private nodes are freed now (locked ones when their request ends).

    Body: ``{"session": ..., "branch": ...}`` (and, without tenancy, ``extra_key`` / ``cache_salt``).
    404 for a branch the server has never seen; closing an already-closed branch is idempotent.
    """
    scope = await _scoped(request, BranchRef)
    if isinstance(scope, JSONResponse):
        return scope
    ref = scope.ref
    # A pause still being applied is closed with the branch, not after it.
    await shared.coordinator.settle([(scope.namespace, ref.session, ref.branch)])
    shared.coordinator.forget(scope.namespace, ref.session, ref.branch)
    response = await _forward("branch_close", {"namespace": scope.namespace, "session": ref.session,
                                               "branch": ref.branch})
    if response.status_code == 200:
        shared.coordinator.finished(scope.namespace, ref.session, ref.branch)
    return response


@router.post("/session/close")
async def session_close(request: Request) -> JSONResponse:
    """Terminate every branch of a session (same body as branch close, without ``branch``). With
    tenancy the session's credential is retired: using it again is a 403."""
    scope = await _scoped(request, SessionRef)
    if isinstance(scope, JSONResponse):
        return scope
    ref = scope.ref
    await shared.coordinator.settle(namespace=scope.namespace, session=ref.session)
    shared.coordinator.forget(scope.namespace, ref.session)
    if scope.identity is not None:
        auth.tenancy.tombstone(scope.identity.tenant, ref.session, time.time())
    response = await _forward("session_close", {"namespace": scope.namespace, "session": ref.session})
    if response.status_code == 200:
        shared.coordinator.finished(scope.namespace, ref.session)
    return response


@router.post("/pause")
async def pause(request: Request) -> JSONResponse:
    """The branch stops on a tool call: keep, offload or discard its KV (the server decides).

    Body: :class:`~sgl_agentcache.hints.PauseRef`. The reply carries the decision, the tokens it
    concerned, the expected cost of each option and the (clipped) deadline. 404 for an unknown branch.
    """
    scope = await _scoped(request, PauseRef)
    if isinstance(scope, JSONResponse):
        return scope
    ref = scope.ref
    asked = {"deadline_ms": ref.deadline_ms, "priority": ref.priority}
    clipped = auth.clip(scope.identity, asked, request.url.path)
    status, result = await shared.coordinator.pause(
        scope.namespace, ref.session, ref.branch, tool_class=ref.tool_class, deadline_ms=asked["deadline_ms"],
        priority=asked["priority"], resume_required=ref.resume_required, ceilings=scope.ceilings)
    if clipped and status == 200:
        result = result | {"clipped": {k: {"asked": a, "granted": g} for k, (a, g) in clipped.items()}}
    return JSONResponse(result, status_code=status)


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    """The tool returned: restore (or unpin) now. The branch's next request does the same by itself."""
    scope = await _scoped(request, BranchRef)
    if isinstance(scope, JSONResponse):
        return scope
    status, result = await shared.coordinator.resume(scope.namespace, scope.ref.session, scope.ref.branch)
    return JSONResponse(result, status_code=status)


@router.post("/prefetch")
async def prefetch(request: Request) -> JSONResponse:
    """The tool is nearly done: restore from host ahead of the request, within the speculative budget."""
    scope = await _scoped(request, PrefetchRef)
    if isinstance(scope, JSONResponse):
        return scope
    ref = scope.ref
    status, result = await shared.coordinator.prefetch(scope.namespace, ref.session, ref.branch, ref.expected_remaining_ms,
                                                ceilings=scope.ceilings)
    return JSONResponse(result, status_code=status)


@router.post("/admin/purge")
async def purge(request: Request) -> JSONResponse:
    """Operators: remove a whole tenant's state from every tier (device tree, host tier, pins, prefetch,
    timers, learned tool latencies). Body ``{"tenant": ...}``; 404 for an unknown tenant."""
    if auth.tenancy is None:
        return JSONResponse({"error": "tenancy is off on this server: there are no tenants"}, status_code=409)
    ref, error = await _body(request, TenantRef)
    if error is not None:
        return error
    if ref.tenant not in auth.tenancy.config.tenants:
        return JSONResponse({"error": f"unknown tenant {ref.tenant!r} (nothing changed)"}, status_code=404)
    salt = auth.tenancy.salt(ref.tenant)
    await shared.coordinator.settle(namespace=namespace_key(None, salt))
    dropped = shared.coordinator.purge(namespace_key(None, salt))
    chat_hooks.forget_namespace(namespace_key(None, salt))
    response = await _forward("purge", {"cache_salt": salt}, extra={"tenant": ref.tenant, "pauses_dropped": dropped})
    auth.trust.record("purged", ref.tenant, status=response.status_code)
    return response


_installed = False


def _before_launch_server(server_args=None, *args, **kwargs):
    """BEFORE hook on ``http_server.launch_server``: attach the router once, in the HTTP process, and
    with ``AGENTCACHE_TENANTS`` load the tenants (a bad file or secret stops start-up here) and add the
    tenancy middleware (inside SGLang's own ``--api-key`` middleware, which is added later)."""
    global _installed
    if not _installed:
        from sglang.srt.entrypoints.http_server import app

        if server_args is not None:
            auth.configure(server_args, shared.settings.audit_log)
        if auth.tenancy is not None:
            app.add_middleware(auth.TenancyMiddleware)
        app.include_router(router)
        _installed = True
    return None


def install() -> None:
    """Register the route installer. Call only in the main (HTTP) process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _before_launch_server, HookType.BEFORE)
    HookRegistry.register("sglang.srt.entrypoints.http_server._wait_and_warmup", auth.around_warmup, HookType.AROUND)
