"""Deployments this plugin does not support refuse to start, with one message that says why.

- **Data parallelism** (``--dp-size`` > 1, or DP attention): every DP rank keeps its own radix tree, but a
  control message's reply (``/agentcache/*``: stats, closes, pauses, purges) is taken from the first DP
  rank only, and a branch's requests may be routed to any rank. Run one server per replica behind a
  router instead.
- **Several tokenizer workers** (``--tokenizer-worker-num`` > 1): the pause coordinator (clocks, learned
  tool latencies, deadlines, the event log) and the tenancy state (the middleware, retired sessions, the
  audit log) live in one HTTP process; the other workers would serve without them.
- **Pipeline parallelism** (``--pp-size`` > 1): every rank keeps its own tree, and control messages
  (closes, pauses, purges) must reach every stage's scheduler in the same order; that is built and
  checked for tensor-parallel ranks only, never across pipeline stages.

Checked by a BEFORE hook on ``Engine._launch_subprocesses``, which both ``sglang serve`` and an
in-process ``sglang.Engine`` go through before any process starts (PP again in the backend factory, for a
scheduler built any other way). Only deployments that use this
plugin are refused: the ``agentcache`` backend, or tenancy (``AGENTCACHE_TENANTS``) for the workers.
The same hook tells chat inference which backend runs (on by default with ours only:
``chat_hooks.bind_backend``).
"""

from __future__ import annotations

import os

from sgl_agentcache import BACKEND_NAME
from sgl_agentcache.tenancy import TENANTS_ENV


class UnsupportedTopology(RuntimeError):
    """This deployment shape would silently break the plugin's guarantees; start-up stops."""


def refusal(radix_cache_backend: str | None, dp_size: int, attn_dp_size: int, tokenizer_workers: int,
            tenancy: bool, *, pp_size: int = 1) -> str | None:
    """Why this deployment must not start, or None (pure)."""
    ours = radix_cache_backend == BACKEND_NAME
    dp_ranks = max(dp_size, 1) * max(attn_dp_size, 1)
    if ours and dp_ranks > 1:
        return (f"sgl_agentcache: --radix-cache-backend {BACKEND_NAME} does not support data parallelism "
                f"({dp_ranks} DP ranks from --dp-size {dp_size} / DP attention): each DP rank keeps its own "
                "tree, but /agentcache/* replies come from the first rank only and a branch's requests may "
                "reach any rank. Run one server per replica behind a router.")
    if (ours or tenancy) and tokenizer_workers > 1:
        what = f"--radix-cache-backend {BACKEND_NAME}" if ours else f"tenancy ({TENANTS_ENV})"
        return (f"sgl_agentcache: {what} does not support --tokenizer-worker-num {tokenizer_workers}: the "
                "pause coordinator (clocks, tool latencies, deadlines, event log) and the tenancy state "
                "(authentication, retired sessions, audit log) live in one HTTP process, and the other "
                "workers would serve without them. Use --tokenizer-worker-num 1.")
    if ours and pp_size > 1:
        return (f"sgl_agentcache: --radix-cache-backend {BACKEND_NAME} does not support pipeline parallelism "
                f"(--pp-size {pp_size}): every rank keeps its own tree and must apply the same control "
                "messages (closes, pauses, purges) in the same order, which is built and checked for "
                "tensor-parallel ranks only, not across pipeline stages. Use --tp-size instead.")
    return None


def check(server_args) -> None:
    """Raise :class:`UnsupportedTopology` for a deployment :func:`refusal` refuses."""
    reason = refusal(getattr(server_args, "radix_cache_backend", None), int(getattr(server_args, "dp_size", 1) or 1),
                     int(getattr(server_args, "attn_dp_size", 1) or 1),
                     int(getattr(server_args, "tokenizer_worker_num", 1) or 1), bool(os.environ.get(TENANTS_ENV)),
                     pp_size=int(getattr(server_args, "pp_size", 1) or 1))
    if reason is not None:
        raise UnsupportedTopology(reason)


def _before_launch_subprocesses(engine_class, *args, **kwargs):
    from sgl_agentcache.server.front import chat_hooks

    server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
    check(server_args)
    chat_hooks.bind_backend(getattr(server_args, "radix_cache_backend", None))
    return None


def install() -> None:
    """Register the start-up check. Call in the main (HTTP/Engine) process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.entrypoints.engine.Engine._launch_subprocesses", _before_launch_subprocesses,
                          HookType.BEFORE)
