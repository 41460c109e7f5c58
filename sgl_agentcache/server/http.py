"""The ``/agentcache/*`` routes, added to SGLang's own FastAPI app in the HTTP server process.

Handlers only translate HTTP to a control message (``control.call_schedulers``) and back; all cache
logic runs in the scheduler. SGLang's ``--api-key`` middleware covers these routes too.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sgl_agentcache import BACKEND_NAME, __version__
from sgl_agentcache.hints import BranchRef, HintError, PauseRef, PrefetchRef, SessionRef, parse_route_body
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.server.control import call_schedulers
from sgl_agentcache.server.coordinator import PauseCoordinator

router = APIRouter(prefix="/agentcache", tags=["agentcache"])


async def _send(op_name: str, args: dict) -> tuple[int, dict]:
    from sglang.srt.entrypoints.http_server import get_global_state

    reply = await call_schedulers(get_global_state().tokenizer_manager, op_name, args)
    return reply.status, reply.result


#: The HTTP process's pause coordinator (clocks, latency book, deadlines); see coordinator.py.
coordinator = PauseCoordinator(send=_send)


async def _body(request: Request, kind: type):
    try:
        return parse_route_body(await request.body(), kind), None
    except HintError as exc:
        return None, JSONResponse({"error": str(exc)}, status_code=400)


async def _forward(op_name: str, args: dict | None = None, extra: dict | None = None) -> JSONResponse:
    from sglang.srt.entrypoints.http_server import get_global_state

    reply = await call_schedulers(get_global_state().tokenizer_manager, op_name, args)
    body = reply.result | extra if reply.status == 200 and extra else reply.result
    return JSONResponse(body, status_code=reply.status)


@router.get("/stats")
async def stats() -> JSONResponse:
    """Backend identity, resident tokens per lifecycle class, size counters (scheduler rank 0's tree)."""
    return await _forward("stats", extra={"backend": BACKEND_NAME, "version": __version__,
                                          "coordinator": coordinator.stats()})


@router.get("/check")
async def check() -> JSONResponse:
    """Run the tree-integrity check (conservation checks apply only when the scheduler is idle)."""
    return await _forward("check")


@router.get("/deletions")
async def deletions() -> JSONResponse:
    """Every node deletion so far, in order (diagnostics; needs AGENTCACHE_RECORD_EVICTIONS=1)."""
    return await _forward("deletions")


@router.post("/branch/close")
async def branch_close(request: Request) -> JSONResponse:
    """Terminate a branch: its private nodes are freed now (locked ones when their request ends).

    Body: ``{"session": ..., "branch": ..., "extra_key"?: ..., "cache_salt"?: ...}``. 404 for a branch
    the server has never seen; closing an already-closed branch is idempotent.
    """
    try:
        ref = parse_route_body(await request.body(), BranchRef)
    except HintError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    namespace = namespace_key(ref.extra_key, ref.cache_salt)
    coordinator.forget(namespace, ref.session, ref.branch)
    return await _forward("branch_close", {"namespace": namespace, "session": ref.session, "branch": ref.branch})


@router.post("/session/close")
async def session_close(request: Request) -> JSONResponse:
    """Terminate every branch of a session (same body as branch close, without ``branch``)."""
    try:
        ref = parse_route_body(await request.body(), SessionRef)
    except HintError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    namespace = namespace_key(ref.extra_key, ref.cache_salt)
    coordinator.forget(namespace, ref.session)
    return await _forward("session_close", {"namespace": namespace, "session": ref.session})


@router.post("/pause")
async def pause(request: Request) -> JSONResponse:
    """The branch stops on a tool call: keep, offload or discard its KV (the server decides).

    Body: :class:`~sgl_agentcache.hints.PauseRef`. The reply carries the decision, the tokens it
    concerned, the expected cost of each option and the (clipped) deadline. 404 for an unknown branch.
    """
    ref, error = await _body(request, PauseRef)
    if error is not None:
        return error
    status, result = await coordinator.pause(
        namespace_key(ref.extra_key, ref.cache_salt), ref.session, ref.branch, tool_class=ref.tool_class,
        deadline_ms=ref.deadline_ms, priority=ref.priority, resume_required=ref.resume_required)
    return JSONResponse(result, status_code=status)


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    """The tool returned: restore (or unpin) now. The branch's next request does the same by itself."""
    ref, error = await _body(request, BranchRef)
    if error is not None:
        return error
    status, result = await coordinator.resume(namespace_key(ref.extra_key, ref.cache_salt), ref.session, ref.branch)
    return JSONResponse(result, status_code=status)


@router.post("/prefetch")
async def prefetch(request: Request) -> JSONResponse:
    """The tool is nearly done: restore from host ahead of the request, within the speculative budget."""
    ref, error = await _body(request, PrefetchRef)
    if error is not None:
        return error
    status, result = await coordinator.prefetch(namespace_key(ref.extra_key, ref.cache_salt), ref.session,
                                                ref.branch, ref.expected_remaining_ms)
    return JSONResponse(result, status_code=status)


@router.post("/fault")
async def fault(request: Request) -> JSONResponse:
    """Test-only: make the next host-tier transfers fail (403 unless AGENTCACHE_FAULT_INJECTION=1)."""
    import os

    if os.environ.get("AGENTCACHE_FAULT_INJECTION") != "1":
        return JSONResponse({"error": "fault injection is disabled"}, status_code=403)
    try:
        body = msgspec.json.decode(await request.body(), type=dict[str, str | int])
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        return JSONResponse({"error": f"invalid body: {exc}"}, status_code=400)
    return await _forward("fault", body)


_installed = False


def _before_launch_server(*args, **kwargs):
    """BEFORE hook on ``http_server.launch_server``: attach the router once, in the HTTP process."""
    global _installed
    if not _installed:
        from sglang.srt.entrypoints.http_server import app

        app.include_router(router)
        _installed = True
    return None


def install() -> None:
    """Register the route installer. Call only in the main (HTTP) process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _before_launch_server, HookType.BEFORE)
