"""The scheduler side of the control messages: one handler per op, run on every TP rank.

:func:`handle_ctl` is added to each scheduler's request dispatcher by :func:`install` (an AFTER hook on
``Scheduler.init_request_dispatcher``); :mod:`sgl_agentcache.server.control` holds the message types and
the HTTP side's wiring. Each rank applies the same op to its own tree in the same order; handlers never
read a clock, so every rank decides the same.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sgl_agentcache.server.control import AgentCacheCtl, AgentCacheCtlOut, CtlError

logger = logging.getLogger(__name__)


Handler = Callable[[Any, dict], dict]
#: op name -> handler(scheduler, args) -> result. Handlers run on every TP rank.
OPS: dict[str, Handler] = {}


def op(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        OPS[name] = fn
        return fn

    return register


def _agent_cache(scheduler):
    from sgl_agentcache.server.scheduler.cache import AgentRadixCache

    cache = scheduler.tree_cache
    if not isinstance(cache, AgentRadixCache):
        raise CtlError(409, f"this server's tree cache is {type(cache).__name__}, not the agentcache backend "
                            "(start it with --radix-cache-backend agentcache, without --disable-radix-cache)")
    return cache


def _scheduler_idle(scheduler) -> bool:
    return scheduler.is_fully_idle()


@op("stats")
def _stats(scheduler, args: dict) -> dict:
    """Everything (operators, no tenancy), or one namespace's own view (``namespace``: a tenant's)."""
    from sgl_agentcache.server.metrics import paused_tokens_by_priority, queue_by_priority, running_requests

    cache = _agent_cache(scheduler)
    if args.get("namespace"):
        return cache.namespace_stats(args["namespace"])
    by_priority = {f"{cls}/{placement}": n for (cls, placement), n in paused_tokens_by_priority(cache.pauses).items()}
    return cache.agent_stats() | {"queue_by_priority": queue_by_priority(scheduler, cache.settings.starvation_s),
                                  "running_requests": running_requests(scheduler),
                                  "paused_tokens_by_priority": by_priority}


@op("purge")
def _purge(scheduler, args: dict) -> dict:
    """Remove every trace of one cache salt (a tenant) from every tier; locked nodes are reported."""
    return _agent_cache(scheduler).purge_salt(str(args["cache_salt"]))


@op("check")
def _check(scheduler, args: dict) -> dict:
    idle = _scheduler_idle(scheduler)
    cache = _agent_cache(scheduler)
    return cache.check_integrity(idle=idle).to_dict() | {"idle": idle}


@op("branch_close")
def _branch_close(scheduler, args: dict) -> dict:
    from sgl_agentcache.lifecycle import BranchKey

    branch = BranchKey(args["namespace"], args["session"], args["branch"])
    # keep_cached: a close only inferred (chat inference's idle sweep); never from a client's route.
    result = _agent_cache(scheduler).close_branch(branch, keep_cached=bool(args.get("keep_cached")))
    if not result["closed"]:
        raise CtlError(404, f"unknown branch {branch.session}/{branch.branch} (nothing changed)")
    return result | {"branch": branch.to_dict()}


@op("session_close")
def _session_close(scheduler, args: dict) -> dict:
    result = _agent_cache(scheduler).close_session(args["namespace"], args["session"])
    if not result["branches"]:
        raise CtlError(404, f"unknown session {args['session']} (nothing changed)")
    return result


@op("deletions")
def _deletions(scheduler, args: dict) -> dict:
    """The recorded node deletions (needs AGENTCACHE_RECORD_EVICTIONS=1 in the server's env)."""
    core = _agent_cache(scheduler).tree_core
    if core.deletions is None:
        raise CtlError(409, "deletions are not recorded (start the server with AGENTCACHE_RECORD_EVICTIONS=1)")
    return {"deletions": [list(d) for d in core.deletions]}


def _branch(args: dict):
    from sgl_agentcache.lifecycle import BranchKey

    return BranchKey(args["namespace"], args["session"], args["branch"])


@op("pause")
def _pause(scheduler, args: dict) -> dict:
    """Decide and apply a tool pause. ``latency`` is the sender's snapshot of the tool class's model
    (the clock-dependent input, identical on every rank); with ``join_elapsed_s`` (a lead waiting on
    running subagents, their ages) it is their lifetime model, and the pause waits on the join
    (``policy/join.py``); ``force`` applies an action as given."""
    import msgspec

    from sgl_agentcache.policy.join import MAX_CHILDREN, JoinWait
    from sgl_agentcache.policy.latency import LatencyModel, LatencySnapshot
    from sgl_agentcache.policy.pause import PauseAction

    cache = _agent_cache(scheduler)
    branch = _branch(args)
    if branch not in cache.seen and branch not in cache.tree_core.owner_index:
        raise CtlError(404, f"unknown branch {branch.session}/{branch.branch} (nothing changed)")
    latency = None
    if args.get("latency") is not None:
        latency = LatencyModel.from_snapshot(msgspec.convert(args["latency"], LatencySnapshot))
    if args.get("join_elapsed_s") is not None:
        try:
            ages = msgspec.convert(args["join_elapsed_s"], list[float])
        except msgspec.ValidationError as exc:
            raise CtlError(400, f"join_elapsed_s: {exc}") from None
        if latency is None or not 0 < len(ages) <= MAX_CHILDREN:
            raise CtlError(400, f"join_elapsed_s needs a latency model and 1..{MAX_CHILDREN} subagent ages")
        try:
            latency = JoinWait(latency, ages)
        except ValueError as exc:
            raise CtlError(400, str(exc)) from None
    force = PauseAction(args["force"]) if args.get("force") else None
    result = cache.pauses.pause(
        branch, latency, tool_class=args.get("tool_class", "default"), force=force, caps=args.get("caps"),
        **{k: args[k] for k in ("elapsed_s", "deadline_s", "priority", "resume_probability", "prefetch_lead_s")
           if k in args})
    if not result["paused"] and result.get("reason") == "branch is closed":
        raise CtlError(409, f"branch {branch.session}/{branch.branch} is closed (nothing changed)")
    return result


@op("resume")
def _resume(scheduler, args: dict) -> dict:
    return _agent_cache(scheduler).pauses.resume(_branch(args))


@op("prefetch")
def _prefetch(scheduler, args: dict) -> dict:
    return _agent_cache(scheduler).pauses.prefetch_branch(_branch(args), queued=len(scheduler.waiting_queue),
                                                          caps=args.get("caps"))


@op("expire")
def _expire(scheduler, args: dict) -> dict:
    return _agent_cache(scheduler).pauses.expire(_branch(args))


@op("batch")
def _batch(scheduler, args: dict) -> dict:
    """Several ops in one message (the HTTP process's :class:`~sgl_agentcache.server.front.control_channel.
    ControlChannel`), applied in the batch's order on every rank; one ``[status, result]`` per op,
    each as if it had come alone (a failing op does not stop the others)."""
    replies = []
    for item in args.get("ops", ()):
        name, op_args = item
        if name == "batch":
            replies.append([400, {"error": "a batch cannot hold a batch"}])
            continue
        reply = handle_ctl(scheduler, AgentCacheCtl(op=name, args=dict(op_args)))
        replies.append([reply.status, reply.result])
    return {"replies": replies}


def handle_ctl(scheduler, msg: AgentCacheCtl) -> AgentCacheCtlOut:
    """Scheduler-side dispatch. Never raises: a bad message must not take the scheduler down."""
    handler = OPS.get(msg.op)
    if handler is None:
        return AgentCacheCtlOut(status=404, result={"error": f"unknown agentcache op {msg.op!r}"})
    try:
        return AgentCacheCtlOut(status=200, result=handler(scheduler, dict(msg.args)))
    except CtlError as exc:
        return AgentCacheCtlOut(status=exc.status, result={"error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - reported to the caller and logged, scheduler keeps running
        logger.exception("agentcache op %s failed", msg.op)
        return AgentCacheCtlOut(status=500, result={"error": f"{type(exc).__name__}: {exc}"})


def _after_init_request_dispatcher(result, scheduler, *args, **kwargs):
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher([(AgentCacheCtl, lambda msg: handle_ctl(scheduler, msg))])
    return result


def install() -> None:
    """Add :func:`handle_ctl` to every scheduler's request dispatcher: called once by ``plugin.register``
    in every process (the hook fires only where a scheduler starts)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
                          _after_init_request_dispatcher, HookType.AFTER)
