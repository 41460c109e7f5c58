"""KVFlow's agent step graph, built from the trace's structure: which calls each branch has left and
which worker branches a lead's call waits on. No durations: the graph says what runs before what,
the way KVFlow's workflow layer does, never when.

Steps to execution of a branch: 0 while one of its calls runs; a branch stopped on a plain tool is
next (1); a lead whose call spawned workers waits for them all (an AND join: ``1 + max`` over the
workers of the calls each has left); a branch with no call left gets the cap (evicted first). A
lead's workers are the forks of its branch whose first call arrives after that call and before the
lead's next one.
"""

from __future__ import annotations

from sgl_agentcache.trace.schema import Request, Trace

Key = tuple  # (tenant, session, branch)


class StepGraph:
    def __init__(self, trace: Trace, cap: int):
        self.cap = cap
        self.left: dict[Key, int] = {}  # calls not finished yet, per branch
        self.running: set[Key] = set()
        self.last_done: dict[Key, Request] = {}
        self.waits_on: dict[str, list[Key]] = {}  # lead call id -> worker branches
        self.lead_of: dict[Key, Key] = {}
        calls: dict[Key, list[Request]] = {}
        for r in trace.requests:
            calls.setdefault(_key(r), []).append(r)
        for key, rs in calls.items():
            self.left[key] = len(rs)
        for key, rs in calls.items():
            first = rs[0]
            if first.parent_branch is None:
                continue
            lead = (first.tenant, first.session, first.parent_branch)
            lead_calls = calls.get(lead, [])
            for i, call in enumerate(lead_calls):
                after = lead_calls[i + 1].t if i + 1 < len(lead_calls) else float("inf")
                if call.t <= first.t < after:
                    self.waits_on.setdefault(call.id, []).append(key)
                    self.lead_of[key] = lead
                    break

    def started(self, request: Request) -> list[Key]:
        """A call of ``request``'s branch started; returns the branches whose steps changed."""
        key = _key(request)
        self.running.add(key)
        return [key]

    def finished(self, request: Request) -> list[Key]:
        key = _key(request)
        self.running.discard(key)
        self.left[key] -= 1
        self.last_done[key] = request
        lead = self.lead_of.get(key)
        return [key] + ([lead] if lead is not None else [])

    def steps(self, key: Key) -> int:
        if key in self.running:
            return 0
        if self.left.get(key, 0) <= 0:
            return self.cap
        last = self.last_done.get(key)
        workers = self.waits_on.get(last.id, ()) if last is not None else ()
        pending = [self.left[w] for w in workers if self.left[w] > 0]
        return min(1 + max(pending), self.cap) if pending else 1


def _key(r) -> Key:
    return (r.tenant, r.session, r.branch)


__all__ = ["StepGraph"]
