"""The HTTP process's shared state: one control channel to the schedulers and one pause coordinator.

Every part of the HTTP front (routes in ``routes.py``, the generate and chat hooks in ``ingress.py`` and
``chat_hooks.py``) sends control ops and pauses through these two, so their batching, per-namespace
lanes, clocks and latency book are one per process. Read them as ``front.coordinator`` (not bound
by name at import) so a test can swap them.
"""

from __future__ import annotations

from sgl_agentcache.server.control import call_schedulers
from sgl_agentcache.server.front.control_channel import ControlChannel
from sgl_agentcache.server.front.coordinator import PauseCoordinator
from sgl_agentcache.settings import Settings

#: The HTTP process's settings (``AGENTCACHE_*``), parsed once as the plugin loads; a bad value stops it.
settings = Settings.from_env()


async def _send_batch(ops: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    from sglang.srt.entrypoints.http_server import get_global_state

    reply = await call_schedulers(get_global_state().tokenizer_manager, "batch",
                                  {"ops": [[op_name, args] for op_name, args in ops]})
    if reply.status != 200:  # the batch itself was refused (no agentcache backend...): so is each op
        return [(reply.status, reply.result)] * len(ops)
    return [(status, result) for status, result in reply.result["replies"]]


#: Every control op of this process goes through one channel: batched, each namespace served in turn.
channel = ControlChannel(_send_batch)


async def send_to_scheduler(op_name: str, args: dict) -> tuple[int, dict]:
    """One control op, in the lane of the namespace it concerns (operator ops share the lane ``""``)."""
    return await channel.call(str(args.get("namespace") or ""), op_name, args)


#: The HTTP process's pause coordinator (clocks, latency book, deadlines); see coordinator.py.
coordinator = PauseCoordinator.from_settings(send_to_scheduler, settings)
