"""Scheduler-side admission of hinted requests (every TP rank, same message order, same outcome).

An AROUND hook on ``Scheduler._create_generation_req`` (SGLang's documented extension point for
request-local state) runs as each request is created:

- requests built by ``session_params`` sessions lose ``kv_hints`` in SGLang 0.5.23 (``Session.create_req``
  does not pass them); the hook copies them back from the tokenized input;
- the request's insert plan is built once, here, so a branch is known from its first admitted request;
- a fork whose parent branch the server has never seen, or that was closed, is refused with HTTP 400
  before it allocates anything (the request is finished with an abort that our release path does not
  treat as the branch's own abort, so the refusal changes nothing in the tree).

An AROUND hook on ``SchedulePolicy.calc_priority`` marks the matches it makes as ranking only
(``AgentRadixCache.ranking_matches``). With a cache-aware ``--schedule-policy`` (``lpm``, ``dfs-weight``,
...) the scheduler matches every waiting request there at every step, to sort the queue; a request's
host copies must come back only at the match that admits it (``Req.init_next_round_input`` in
``Scheduler.get_new_batch_prefill``, right before ``PrefillAdder.add_one_req``), not once per step
for every request that keeps waiting.

An AROUND hook on ``PrefillAdder.add_one_req`` loads a request's host copies back only once it
passes the prefill budget counting them as new tokens (SGLang's rule for a HiCache host hit): the
admission match only notes them, and a refused request moves and evicts nothing. It also skips, for
one step, a request whose spilled KV is being loaded back by a worker thread
(``server/async_load.py``), or that continues into what another request's load is bringing back: it
returns ``CONTINUE`` without adding it, so the scheduler goes on with the rest of the queue and
matches it again next step. It also skips a hinted request whose
declared stable prefix (a system prompt and tool schema the harness says every session shares) is
not cached yet while a request admitted in the same step computes it: sessions that start together
would otherwise each prefill the same prompt in one batch; one computes it, the others hit it at the
next step (at least :data:`MIN_SHARED_PREFILL_TOKENS` of it missing, at most
:data:`~sgl_agentcache.server.async_load.MAX_WAIT_STEPS` steps; ``shared_prefill_waits`` in the stats).
Unhinted traffic is scheduled as stock SGLang schedules it.

An AFTER hook on ``Scheduler.on_idle`` lands eager offloads and prefetches whose copy a worker made
(``server/host_copies.py``, ``server/async_load.py``): with no batch there is no
``flush_pending_backups`` to land them, and an idle server would otherwise keep an offloaded suffix on
the device (or a prefetch's slots unfilled) until the next request. It also lands requests' load-backs
still in flight (``AsyncLoads.land_stranded``): an owner behind a request that does not fit is never
matched, and its load's slots could keep that request from ever fitting. Every TP
rank is idle at the same loop iteration (same messages, same batches), so they land at the same point.
"""

from __future__ import annotations

from sgl_agentcache.server.async_load import MAX_WAIT_STEPS
from sgl_agentcache.server.request_state import state_of

#: Tokens of a request's declared stable prefix that must be missing from the cache, and being computed
#: by a request admitted in the same step, before it waits a step to hit them instead.
MIN_SHARED_PREFILL_TOKENS = 64


def _around_create_generation_req(original, scheduler, recv_req, *args, **kwargs):
    req = original(scheduler, recv_req, *args, **kwargs)
    if getattr(req, "kv_hints", None) is None and getattr(recv_req, "kv_hints", None) is not None:
        req.kv_hints = recv_req.kv_hints
    from sgl_agentcache.server.cache import AgentRadixCache, namespace_of

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
    cache = getattr(policy, "tree_cache", None)
    ranking = getattr(cache, "ranking_matches", None)
    if ranking is None:  # another backend
        return original(policy, *args, **kwargs)
    with ranking():
        result = original(policy, *args, **kwargs)
    admission = cache.admission
    if admission is not None:  # program-aware order over SGLang's (server/program_admission.py)
        queue = args[0] if args else kwargs["waiting_queue"]
        admission.order(queue, cache, matched=policy.waiting_queue_prefix_matched(queue),
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


def _passes_budget_recomputing(adder, req) -> bool:
    """Whether ``req`` passes ``PrefillAdder.add_one_req``'s prefill budget with everything past its
    device match counted as new tokens -- SGLang's condition for loading a HiCache host hit, whose
    tokens need device slots as a recompute does (``_select_prefill_admission`` under ``_lock_node``,
    then ``init_load_back``). Nothing is allocated or evicted here."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    if (limit := adder.prefill_max_requests) is not None and len(adder.can_run_list) >= limit:
        return False
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    total = (len(req.full_untruncated_fill_ids) - req.prefix_len + max_new + adder.per_req_token_overhead
             + adder._mamba_gap_budget_for_req(req, include_host_hit=True) + adder._request_slot_reserve_for_req(req))
    with adder._lock_node(req.last_node):
        return total < adder.rem_total_tokens


def load_host_copies_if_admissible(adder, req, cache) -> None:
    """The admission match found host copies for ``req`` (``state_of(req).host_pending``): load them
    only if the request passes the budget counting them as new (then its admission match runs again,
    and they come back); else it is refused below as it stands, having moved and evicted nothing."""
    if _passes_budget_recomputing(adder, req):
        with cache.host_loads_cleared(req):
            req.init_next_round_input(cache)
    else:
        state_of(req).host_pending = False
        cache.host_loads_refused += 1


def around_add_one_req(original, adder, req, *args, **kwargs):
    cache = getattr(adder, "tree_cache", None)
    loads = getattr(cache, "loads", None)
    state = state_of(req)
    if loads is not None and state.host_pending:
        load_host_copies_if_admissible(adder, req, cache)
    if loads is not None and loads.waiting and req.rid in loads.waiting:
        # It continues into what another request's load is bringing back (server/async_load.py): it
        # holds no slots; skipped this step, it hits those tokens at its next match.
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    if loads is not None and loads.pending(req.rid):  # its load was issued by this step's match
        if adder.rem_total_tokens >= 0 and adder.cur_rem_tokens >= 0:
            # Its load-back is being copied (server/async_load.py): skipped this step, admitted at the
            # next (where the load is finished), while the rest of the queue goes on.
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.CONTINUE
        # The load's slots came out of memory the requests already in this batch were admitted
        # against (their budget is free + evictable memory at admission): give them back, and the
        # request is added (or not) as it is, recomputing what it lacks, as a load-back without room does.
        loads.cancel(req.rid, "no_room")
    elif loads is not None and state.prefill_waits < MAX_WAIT_STEPS \
            and _computes_my_stable_prefix(adder, req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        state.prefill_waits += 1
        cache.shared_prefill_waits += 1
        return AddReqResult.CONTINUE
    result = original(adder, req, *args, **kwargs)
    admission = getattr(cache, "admission", None)
    if admission is not None and adder.can_run_list and adder.can_run_list[-1] is req:
        admission.admitted(req)
    return result


def after_on_idle(result, scheduler, *args, **kwargs):
    cache = scheduler.tree_cache
    copies = getattr(cache, "copies", None)
    if copies is not None and (copies.offloading or cache.loads.prefetches):  # a few reads per idle poll otherwise
        cache.pauses.land_copies()
    loads = getattr(cache, "loads", None)
    if loads is not None and loads.by_rid:  # loads whose owners the step never reached
        loads.land_stranded()
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
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", after_on_idle, HookType.AFTER)
