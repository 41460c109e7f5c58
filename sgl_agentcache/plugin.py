"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] agentcache``).

SGLang calls :func:`register` with no arguments in every process it starts (HTTP/main, each scheduler
rank, detokenizer, DP controller). It must be idempotent and cheap, and it may not raise for a reason
that is not ours: SGLang only logs plugin errors, so real start-up failures (a changed SGLang) are raised
later, inside the backend factory, where they stop the server.
"""

from __future__ import annotations

import logging
import multiprocessing

from sgl_agentcache import BACKEND_NAME

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Register the ``agentcache`` radix-cache backend, tree core, IPC types, hooks and routes."""
    global _registered
    if _registered:
        return
    from sgl_agentcache.server import control
    from sgl_agentcache.server.scheduler import admission, control_ops
    from sgl_agentcache.server.scheduler.cache import register_backends

    register_backends()
    control.install()
    control_ops.install()
    admission.install()
    if multiprocessing.parent_process() is None:
        from sgl_agentcache.server import topology
        from sgl_agentcache.server.front import chat_hooks, ingress, routes

        topology.install()
        routes.install()
        ingress.install()
        chat_hooks.install()
    _registered = True
    logger.info("sgl_agentcache: registered radix-cache backend %r", BACKEND_NAME)
