"""Admission order in the replay: the same strategies and ledger the server runs
(``policy/admission_order.py``), driven by the replay's queue.

Without a strategy the replay keeps its own order (a branch's next call, released when its previous one
is answered, goes to the head of the queue; other calls join the tail). With one, every time the replay
tries to admit (``_Run.drain``), the waiting calls ahead of the first queued close or abort are sorted
by the strategy's keys (an event is a barrier: no call overtakes an abort of its own branch). As on the
server, admission stops at the first call that does not fit.

What each call is, as the server would know it when it receives the call: its program is its session,
its branch and parent come from its hint, its tenant is its trace tenant; its receive order, the
scheduler passes it has waited, the service its program and branch path attained (prompt tokens
computed at admission, output tokens at answer), and for a returning call the prompt tokens on the
device now.

Passes waited: SGLang's scheduler runs one pass over its waiting queue per forward step, so a call that
waits 5 s behind 20 ms decode steps has sat through some 250 passes (and meets the starvation bound,
256 by default). The replay models no steps: it tries to admit at its events (an arrival, an answer).
A call's passes waited are therefore the forward steps that fit in its wait (``step_s``: the profile's
unscaled decode step, :meth:`~sgl_agentcache.policy.profiles.Profile.forward_step_s`), and at least one
per admission attempt it sat through. Counting attempts alone let a call sit 222 s through 20 of them,
far from the bound the server would have applied after a few seconds.
"""

from __future__ import annotations

from typing import Callable

from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.policy.admission_order import AdmissionSettings, ProgramLedger, order_keys, reads_match
from sgl_agentcache.trace.schema import Request

__all__ = ["ReplayAdmission"]


class ReplayAdmission:
    """One replay's admission order. ``resident(request)``: the call's prompt tokens on the device now
    (called only for returning calls, under strategies that read it). ``step_s``: seconds per
    scheduler pass (a forward step); None counts one pass per admission attempt only."""

    def __init__(self, settings: AdmissionSettings, resident: Callable[[Request], int],
                 step_s: float | None = None):
        if step_s is not None and not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.settings, self.resident, self.step_s = settings, resident, step_s
        self.ledger = ProgramLedger()
        self.seq: dict[str, int] = {}  # request id -> receive order
        self.received_s: dict[str, float] = {}  # request id -> when the server received it
        self.attempts: dict[str, int] = {}  # request id -> admission attempts it sat through
        self.waited: dict[str, int] = {}  # request id -> scheduler passes it has waited (at the last sort)

    @staticmethod
    def _program(branch: BranchKey) -> tuple:
        return (branch.namespace, branch.session)

    def received(self, request: Request, branch: BranchKey, now: float) -> None:
        parent = (BranchKey(branch.namespace, branch.session, request.parent_branch)
                  if request.parent_branch is not None else None)
        self.seq[request.id] = self.ledger.receive(self._program(branch), branch, parent)
        self.received_s[request.id] = now
        self.attempts[request.id] = self.waited[request.id] = 0

    def started(self, request: Request, branch: BranchKey, computed_tokens: int) -> None:
        for book in (self.seq, self.received_s, self.attempts, self.waited):
            book.pop(request.id, None)
        self.ledger.charge(request.tenant, self._program(branch), branch, computed_tokens)

    def answered(self, request: Request, branch: BranchKey) -> None:
        program = self._program(branch)
        self.ledger.charge(request.tenant, program, branch, max(request.output_tokens, 1))
        self.ledger.answer(program)

    def _passes(self, request_id: str, now: float) -> int:
        attempts = self.attempts[request_id]
        if self.step_s is None:
            return attempts
        return max(attempts, int((now - self.received_s[request_id]) / self.step_s))

    def reorder(self, waiting: list, branch_of: Callable[[Request], BranchKey], now: float) -> None:
        """Sort the calls in ``waiting`` (``(record, arrived)`` pairs) in place by the strategy's keys;
        a close or an abort is a barrier (the calls before the first one are sorted among themselves; no
        call moves past it, so none overtakes an abort of its own branch). Each call sorted counts one
        more admission attempt; its passes waited are the larger of its attempts and the forward steps
        since the server received it."""
        slots = []
        for i, (record, _) in enumerate(waiting):
            if not isinstance(record, Request):
                break
            if record.id in self.seq:
                slots.append(i)
        if not slots:
            return
        ledger, items = self.ledger, []
        for i in slots:
            request = waiting[i][0]
            self.attempts[request.id] += 1
            self.waited[request.id] = self._passes(request.id, now)
            branch = branch_of(request)
            program = self._program(branch)
            resident = 0
            if reads_match(self.settings.strategy, ledger.returning(program)):
                resident = self.resident(request)
            items.append(ledger.waiting(self.seq[request.id], request.tenant, request.input_tokens, program=program,
                                        branch=branch, resident_tokens=resident,
                                        waited_steps=self.waited[request.id]))
        keys = order_keys(items, self.settings, ledger.tenant_service)
        ranked = sorted(range(len(slots)), key=keys.__getitem__)
        if ranked != list(range(len(slots))):
            entries = [waiting[i] for i in slots]
            for slot, r in zip(slots, ranked):
                waiting[slot] = entries[r]
