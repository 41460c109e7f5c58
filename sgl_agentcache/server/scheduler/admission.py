"""Scheduler-side admission of hinted requests (every TP rank, same message order, same outcome).

An AROUND hook on ``Scheduler._create_generation_req`` (SGLang's documented extension point for
request-local state) runs as each request is created:

- requests built by ``session_params`` sessions lose ``kv_hints`` in SGLang 0.5.23 (``Session.create_req``
  does not pass them); the hook copies them back from the tokenized input;
- the request's insert plan is built once, here, so a branch is known from its first admitted request;
- a fork whose parent branch the server has never seen, or that was closed, is refused with HTTP 400
  before it allocates anything (the request is finished with an abort that our release path does not
  treat as the branch's own abort, so the refusal changes nothing in the tree).

An AROUND hook on ``SchedulePolicy.calc_priority`` reorders the waiting queue after SGLang's own
policy when program-aware admission is on (``server/scheduler/program_admission.py``).

An AROUND hook on ``PrefillAdder.add_one_req`` skips a hinted request whose declared stable prefix (a
system prompt and tool schema the harness says every session shares) is not cached yet while a
request admitted in the same step computes it: sessions that start together would otherwise each
prefill the same prompt in one batch; one computes it, the others hit it at the next step (at least
:data:`MIN_SHARED_PREFILL_TOKENS` of it missing, at most :data:`MAX_WAIT_STEPS` steps;
``shared_prefill_waits`` in the stats). It returns ``CONTINUE`` without adding it, so the scheduler
goes on with the rest of the queue and matches it again next step. Unhinted traffic is scheduled as
stock SGLang schedules it. What HiCache holds of a request is loaded back by SGLang's own admission
(``PrefillAdder`` after its budget check, ``init_load_back``).
"""

from __future__ import annotations

from sgl_agentcache.server.scheduler.request_state import state_of

#: Tokens of a request's declared stable prefix that must be missing from the cache, and being computed
#: by a request admitted in the same step, before it waits a step to hit them instead.
MIN_SHARED_PREFILL_TOKENS = 64
#: Scheduler steps a request waits at most for a batch-mate computing its stable prefix.
MAX_WAIT_STEPS = 4


def _around_create_generation_req(original, scheduler, recv_req, *args, **kwargs):
    req = original(scheduler, recv_req, *args, **kwargs)
    if getattr(req, "kv_hints", None) is None and getattr(recv_req, "kv_hints", None) is not None:
        req.kv_hints = recv_req.kv_hints
    from sgl_agentcache.server.scheduler.cache import AgentRadixCache, namespace_of

    cache = scheduler.tree_cache
    if isinstance(cache, AgentRadixCache) and cache.scheduler is None:
        cache.scheduler = scheduler  # read-only use: queue metrics per priority class
    if isinstance(cache, AgentRadixCache) and req.kv_hints is not None:
        refusal = cache.admit(req)
        if refusal is not None:
            state_of(req).refused = True
            req.skip_radix_cache_insert = True  # the placeholder token an abort leaves is not cached
            req.set_finish_with_abort(refusal)
    if isinstance(cache, AgentRadixCache) and cache.admission is not None:
        cache.admission.received(req, namespace_of(req))
    return req


def around_calc_priority(original, policy, *args, **kwargs):
    result = original(policy, *args, **kwargs)
    admission = getattr(getattr(policy, "tree_cache", None), "admission", None)
    if admission is not None:  # program-aware order over SGLang's (server/scheduler/program_admission.py)
        queue = args[0] if args else kwargs["waiting_queue"]
        admission.order(queue, policy.tree_cache, matched=policy.waiting_queue_prefix_matched(queue),
                        priority_sign=policy.priority_sign if policy.enable_priority_scheduling else None)
    return result


def _computes_my_stable_prefix(adder, req) -> bool:
    """A request admitted in this step (``adder.can_run_list``) computes the stable prefix ``req``
    declared and lacks (at least :data:`MIN_SHARED_PREFILL_TOKENS` of it): the same tokens, in the
    same namespace, not cached for it either."""
    plan = state_of(req).plan
    if plan is None or plan.stable_end < MIN_SHARED_PREFILL_TOKENS or not adder.can_run_list:
        return False
    stable = plan.stable_end
    if stable - req.prefix_len < MIN_SHARED_PREFILL_TOKENS:
        return False
    mine = None
    for other in adder.can_run_list:
        if (other.prefix_len >= stable or len(other.origin_input_ids) < stable or other.extra_key != req.extra_key
                or other.cache_salt != req.cache_salt):
            continue
        mine = list(req.origin_input_ids[:stable]) if mine is None else mine
        if list(other.origin_input_ids[:stable]) == mine:
            return True
    return False


def around_add_one_req(original, adder, req, *args, **kwargs):
    cache = getattr(adder, "tree_cache", None)
    waits = getattr(cache, "shared_prefill_waits", None)  # None: another backend
    if waits is not None:
        state = state_of(req)
        if state.prefill_waits < MAX_WAIT_STEPS and _computes_my_stable_prefix(adder, req):
            from sglang.srt.managers.schedule_policy import AddReqResult

            state.prefill_waits += 1
            cache.shared_prefill_waits += 1
            return AddReqResult.CONTINUE
    result = original(adder, req, *args, **kwargs)
    admission = getattr(cache, "admission", None)
    if admission is not None and adder.can_run_list and adder.can_run_list[-1] is req:
        admission.admitted(req)
    return result


def install() -> None:
    """Register the scheduler hooks (every process; they only resolve inside schedulers' use)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._create_generation_req",
                          _around_create_generation_req, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
                          around_calc_priority, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
                          around_add_one_req, HookType.AROUND)
