"""Admission order in the replay: the same strategies and ledger the server runs
(``policy/admission_order.py``), driven by the replay's queue.

Without a strategy the replay keeps its own order (a branch's next call, released when its previous one
is answered, goes to the head of the queue; other calls join the tail). With one, every time the replay
tries to admit (``_Run.drain``), the waiting calls ahead of the first queued close or abort are sorted
by the strategy's keys (an event is a barrier: no call overtakes an abort of its own branch). As on the
server, admission stops at the first call that does not fit.

What each call is, as the server would know it when it receives the call: its program is its session,
its branch and parent come from its hint, its tenant is its trace tenant; its receive order, the
passes it has waited (one per admission attempt it sat through), the service its program and branch
path attained (prompt tokens computed at admission, output tokens at answer), and for a returning
call the prompt tokens on the device now.
"""

from __future__ import annotations

from typing import Callable

from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.policy.admission_order import AdmissionSettings, ProgramLedger, order_keys, reads_match
from sgl_agentcache.trace.schema import Request

__all__ = ["ReplayAdmission"]


class ReplayAdmission:
    """One replay's admission order. ``resident(request)``: the call's prompt tokens on the device now
    (called only for returning calls, under strategies that read it)."""

    def __init__(self, settings: AdmissionSettings, resident: Callable[[Request], int]):
        self.settings, self.resident = settings, resident
        self.ledger = ProgramLedger()
        self.seq: dict[str, int] = {}  # request id -> receive order
        self.waited: dict[str, int] = {}  # request id -> admission attempts it sat through

    @staticmethod
    def _program(branch: BranchKey) -> tuple:
        return (branch.namespace, branch.session)

    def received(self, request: Request, branch: BranchKey) -> None:
        parent = (BranchKey(branch.namespace, branch.session, request.parent_branch)
                  if request.parent_branch is not None else None)
        self.seq[request.id] = self.ledger.receive(self._program(branch), branch, parent)
        self.waited[request.id] = 0

    def started(self, request: Request, branch: BranchKey, computed_tokens: int) -> None:
        self.seq.pop(request.id, None)
        self.waited.pop(request.id, None)
        self.ledger.charge(request.tenant, self._program(branch), branch, computed_tokens)

    def answered(self, request: Request, branch: BranchKey) -> None:
        program = self._program(branch)
        self.ledger.charge(request.tenant, program, branch, max(request.output_tokens, 1))
        self.ledger.answer(program)

    def reorder(self, waiting: list, branch_of: Callable[[Request], BranchKey]) -> None:
        """Sort the calls in ``waiting`` (``(record, arrived)`` pairs) in place by the strategy's keys;
        a close or an abort is a barrier (the calls before the first one are sorted among themselves; no
        call moves past it, so none overtakes an abort of its own branch). Each call sorted counts one
        more pass waited."""
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
            self.waited[request.id] += 1
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
