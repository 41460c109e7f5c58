"""Program-aware admission on the scheduler: SGLang's waiting queue reordered by program
(``policy/admission_order.py``), opt in with ``AGENTCACHE_ADMISSION``.

SGLang sorts its waiting queue in ``SchedulePolicy.calc_priority`` (by ``--schedule-policy``), then
admits requests in that order until one does not fit. The plugin's hook around ``calc_priority``
(``server/scheduler/admission.py``) calls :meth:`ProgramAdmission.order` after SGLang's own sort, which then
sorts by the strategy's keys (a total order: it replaces SGLang's; ``agent-lpm`` keeps ``lpm``'s
longest-match order within each class). SGLang's cache-aware pass has matched every request by then;
under ``fcfs`` the requests whose match the strategy reads are matched here. The strategy reads only
what every TP rank sees the same: receive order, scheduler passes waited, the tree's matches, tokens
of service counted at admission and answer.

What a request is: its program is its session (``(namespace, session)`` of its lifecycle hint, given
or inferred); its branch and parent come from its hint; its tenant is its cache namespace
(``extra_key`` and ``cache_salt``: with tenancy, the salt bound to the caller's API key). A request
without a hint is a program of its own.

Settings (environment): ``AGENTCACHE_ADMISSION`` = ``off`` (default) or a strategy of
:data:`~sgl_agentcache.policy.admission_order.STRATEGIES`;
``AGENTCACHE_ADMISSION_STARVATION_STEPS`` (scheduler passes a request may be passed over, default
256); ``AGENTCACHE_ADMISSION_TENANT_SLACK`` (default 1.5).
"""

from __future__ import annotations

from sgl_agentcache.policy.admission_order import STRATEGIES, AdmissionSettings, ProgramLedger, order_keys, reads_match
from sgl_agentcache.server.scheduler.request_state import RequestState, state_of
from sgl_agentcache.settings import Settings

#: Requests a pass matches itself to read their residency, at most (SGLang's cache-aware policies stop
#: matching past 128 waiting requests for the same reason: each match walks the prompt); the rest
#: count as not resident.
MATCH_LIMIT = 128


def admission_settings(settings: Settings) -> AdmissionSettings | None:
    """The operator's admission settings (``AGENTCACHE_ADMISSION``, ``..._STARVATION_STEPS``,
    ``..._TENANT_SLACK``), or None when off; ``ValueError`` (the server refuses to start) for a
    strategy it does not know."""
    strategy = settings.admission
    if strategy in ("", "off"):
        return None
    if strategy not in STRATEGIES:
        raise ValueError(f"AGENTCACHE_ADMISSION={strategy!r}: expected off or one of {', '.join(STRATEGIES)}")
    return AdmissionSettings(strategy=strategy, starvation_steps=settings.admission_starvation_steps,
                             tenant_slack=settings.admission_tenant_slack)


def _identity(req, namespace: str) -> tuple:
    """``(tenant, program, branch, parent)`` of a request from its insert plan (hinted) or alone."""
    tenant = namespace
    plan = state_of(req).plan
    owner = plan.own.owner if plan is not None else None
    if owner is None:
        return tenant, None, None, None
    parent = plan.parent.owner if plan.parent is not None else None
    return tenant, (owner.namespace, owner.session), owner, parent


class ProgramAdmission:
    """The scheduler side of program-aware admission (one per TP rank; every rank sees the same
    requests, passes and matches, so every rank orders alike)."""

    def __init__(self, settings: AdmissionSettings):
        self.settings = settings
        self.ledger = ProgramLedger()
        self.counters = {"passes": 0, "reordered_passes": 0, "moved_ahead": 0, "starved_first": 0,
                         "tenant_held_back": 0}

    def received(self, req, namespace: str) -> None:
        """A request was created (after its plan): note its program and receive order."""
        tenant, program, branch, parent = _identity(req, namespace)
        state = state_of(req)
        state.program = (tenant, program, branch)
        state.seq = self.ledger.receive(program, branch, parent)
        state.passes = 0

    def order(self, waiting_queue: list, cache, matched: bool, priority_sign: int | None = None) -> None:
        """Reorder ``waiting_queue`` in place by the strategy's keys. ``matched``: SGLang's pass matched
        every waiting request already (a cache-aware policy); else the requests whose residency the
        strategy reads are matched here (at most :data:`MATCH_LIMIT`; a stock match, as a cache-aware
        policy's ranking makes: nothing moves). ``priority_sign``: with SGLang's priority scheduling on, its
        request priority (times this sign, as SGLang sorts) stays the first key: priority preemption
        acts on it, and our order refines it rather than overriding it."""
        if len(waiting_queue) < 2:
            for req in waiting_queue:
                self._tick(req)
            return
        self.counters["passes"] += 1
        settings, ledger = self.settings, self.ledger
        items, budget = [], MATCH_LIMIT
        for req in waiting_queue:
            state = self._tick(req)
            tenant, program, branch = state.program
            resident = 0
            if reads_match(settings.strategy, ledger.returning(program)):
                if matched:
                    resident = req.prefix_len
                elif budget > 0:
                    from sglang.srt.mem_cache.common import match_kv_cache

                    budget -= 1
                    match_kv_cache(req, cache)
                    resident = req.prefix_len
            items.append(ledger.waiting(state.seq, tenant, len(req.origin_input_ids), program=program,
                                        branch=branch, resident_tokens=resident, waited_steps=state.passes))
        keys = order_keys(items, settings, ledger.tenant_service)
        if priority_sign is not None:
            keys = [((req.priority or 0) * priority_sign,) + key for req, key in zip(waiting_queue, keys)]
        ranked = sorted(range(len(waiting_queue)), key=keys.__getitem__)
        if ranked != list(range(len(ranked))):
            self.counters["reordered_passes"] += 1
            self.counters["moved_ahead"] += sum(1 for pos, i in enumerate(ranked) if i > pos)
            if settings.strategy not in ("fcfs", "lpm", "program-fcfs"):
                skip = 0 if priority_sign is None else 1  # the priority key goes first
                first = keys[ranked[0]]
                self.counters["starved_first"] += first[skip] == 0
                if settings.strategy in ("agent", "agent-lpm"):
                    self.counters["tenant_held_back"] += sum(1 for k in keys if k[skip + 1] == 1)
            waiting_queue[:] = [waiting_queue[i] for i in ranked]

    @staticmethod
    def _tick(req) -> RequestState:
        """One more pass waited; returns the request's state."""
        state = state_of(req)
        if state.program is None:  # created before the backend saw it (cannot happen in 0.5.23)
            state.program, state.seq, state.passes = ("", None, None), 0, 0
        state.passes += 1
        return state

    def admitted(self, req) -> None:
        """``req`` was added to a prefill batch: charge the prompt tokens it computes."""
        state = state_of(req)
        tenant, program, branch = state.program
        self.ledger.charge(tenant, program, branch, len(req.origin_input_ids) - req.prefix_len)
        state.passes = 0  # a retracted request waits anew

    def released(self, req, answered: bool) -> None:
        """``req`` left the scheduler (finished, aborted, or retracted to wait again): charge the output
        not charged yet (a retracted request keeps its output); an answered call makes its program's
        later requests returning turns."""
        state = state_of(req)
        if state.program is None:
            return
        tenant, program, branch = state.program
        charged, state.output_charged = state.output_charged, len(req.output_ids)
        self.ledger.charge(tenant, program, branch, len(req.output_ids) - charged)
        if answered:
            self.ledger.answer(program)

    def stats(self) -> dict:
        return {"strategy": self.settings.strategy, "starvation_steps": self.settings.starvation_steps,
                "tenant_slack": self.settings.tenant_slack, **self.counters,
                "programs": len(self.ledger.programs),
                "tenant_recent_service": dict(sorted(self.ledger.tenant_service.items()))}
