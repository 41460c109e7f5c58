"""The ``/agentcache/*`` routes, added to SGLang's own FastAPI app in the HTTP server process.

Handlers only translate HTTP to a control message (``control.call_schedulers``) and back; all cache
logic runs in the scheduler. SGLang's ``--api-key`` middleware covers these routes too.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sgl_agentcache import BACKEND_NAME, __version__
from sgl_agentcache.hints import BranchRef, HintError, SessionRef, parse_route_body
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.server.control import call_schedulers

router = APIRouter(prefix="/agentcache", tags=["agentcache"])


async def _forward(op_name: str, args: dict | None = None, extra: dict | None = None) -> JSONResponse:
    from sglang.srt.entrypoints.http_server import get_global_state

    reply = await call_schedulers(get_global_state().tokenizer_manager, op_name, args)
    body = reply.result | extra if reply.status == 200 and extra else reply.result
    return JSONResponse(body, status_code=reply.status)


@router.get("/stats")
async def stats() -> JSONResponse:
    """Backend identity, resident tokens per lifecycle class, size counters (scheduler rank 0's tree)."""
    return await _forward("stats", extra={"backend": BACKEND_NAME, "version": __version__})


@router.get("/check")
async def check() -> JSONResponse:
    """Run the tree-integrity check (conservation checks apply only when the scheduler is idle)."""
    return await _forward("check")


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
    return await _forward("branch_close", {"namespace": namespace_key(ref.extra_key, ref.cache_salt),
                                           "session": ref.session, "branch": ref.branch})


@router.post("/session/close")
async def session_close(request: Request) -> JSONResponse:
    """Terminate every branch of a session (same body as branch close, without ``branch``)."""
    try:
        ref = parse_route_body(await request.body(), SessionRef)
    except HintError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    return await _forward("session_close", {"namespace": namespace_key(ref.extra_key, ref.cache_salt),
                                            "session": ref.session})


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
