"""Control messages between the HTTP process and the schedulers: our own IPC types, no patch.

The HTTP route sends an :class:`AgentCacheCtl` through the tokenizer manager's scheduler socket. SGLang
broadcasts control messages to every TP rank, so each rank's handler applies the same operation to its
own tree in the same order (deterministic: handlers never read a clock). Only the rank that owns the
reply socket answers, with an :class:`AgentCacheCtlOut`.

Wiring (all through SGLang's plugin points, see ``install``):
- ``io_struct.hook_custom_types`` teaches the msgpack decoder our two types (in every process);
- an AFTER hook on ``Scheduler.init_request_dispatcher`` adds the scheduler handler (registered by
  :mod:`sgl_agentcache.server.scheduler.control_ops`, where the ops live: this module imports neither side);
- an AFTER hook on ``TokenizerControlMixin.init_communicators`` adds a fan-out communicator for replies.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.io_struct import BaseReq


class AgentCacheCtl(BaseReq):
    """A request to every scheduler rank: ``op`` names a handler in
    :data:`sgl_agentcache.server.scheduler.control_ops.OPS`."""

    op: str
    args: dict[str, Any] = {}


class AgentCacheCtlOut(BaseReq):
    """A rank's reply. ``status`` is an HTTP status code; ``result`` is JSON-serialisable."""

    status: int
    result: dict[str, Any] = {}


class CtlError(Exception):
    """A handler's refusal: becomes a reply with this HTTP status and message, nothing changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _after_init_communicators(result, tokenizer_manager, *args, **kwargs):
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.runtime_context import get_parallel
    from sglang.utils import TypeBasedDispatcher

    comm = FanOutCommunicator(tokenizer_manager._dispatch_to_scheduler, get_parallel().num_dp_ranks)
    tokenizer_manager.agentcache_communicator = comm
    tokenizer_manager._result_dispatcher += TypeBasedDispatcher([(AgentCacheCtlOut, comm.handle_recv)])
    return result


async def call_schedulers(tokenizer_manager, op_name: str, args: dict | None = None) -> AgentCacheCtlOut:
    """Send one op to the schedulers and return the (first DP rank's) reply."""
    comm = getattr(tokenizer_manager, "agentcache_communicator", None)
    if comm is None:
        return AgentCacheCtlOut(status=503, result={"error": "agentcache plugin is not loaded in this process"})
    tokenizer_manager.auto_create_handle_loop()
    replies = await comm(AgentCacheCtl(op=op_name, args=args or {}))
    return replies[0]


def engine_call(engine, op_name: str, args: dict | None = None) -> AgentCacheCtlOut:
    """Synchronous :func:`call_schedulers` for an in-process ``sglang.Engine``."""
    return engine.loop.run_until_complete(call_schedulers(engine.tokenizer_manager, op_name, args))


def install() -> None:
    """Register the IPC types and the HTTP side's reply communicator. Idempotent; called by
    ``plugin.register`` in every process (with :func:`~sgl_agentcache.server.scheduler.control_ops.install`)."""
    from sglang.srt.managers import io_struct
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if AgentCacheCtl in io_struct._all_types:
        return
    io_struct.hook_custom_types(AgentCacheCtl, AgentCacheCtlOut)
    HookRegistry.register("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.init_communicators",
                          _after_init_communicators, HookType.AFTER)
