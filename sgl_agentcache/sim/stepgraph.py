"""KVFlow's agent step graph, built online from what the serving system has seen so far: which branches
run, which stopped on a tool, which subagents a lead's call spawned, which branches ended. No durations
and no future: the graph says what runs before what, the way KVFlow's workflow layer does, from the
structure known at that time (a trace's remaining calls and later forks are the future; an agent
serving system cannot count them).

Steps to execution of a branch: 0 while one of its calls runs; a branch stopped on a plain tool is
next (1); a lead whose call spawned workers waits for them all (an AND join: ``1 +`` the largest steps
of its workers still open); a branch whose first call is waiting runs next (1); a branch that ended
(closed or aborted), or that answered without a tool (it waits on someone the server cannot see: the
user) gets the cap (evicted first), as does one never seen. A lead's workers are the forks of its
branch whose first call arrived after its last call finished (the call that spawned them).
"""

from __future__ import annotations

from sgl_agentcache.trace.schema import Request

Key = tuple  # (tenant, session, branch)


class StepGraph:
    def __init__(self, cap: int):
        self.cap = cap
        self.running: set[Key] = set()
        self.seen: set[Key] = set()  # branches a call of which reached the server
        self.ended: set[Key] = set()
        self.last_done: dict[Key, Request] = {}
        self.waits_on: dict[str, list[Key]] = {}  # lead call id -> worker branches it spawned
        self.lead_of: dict[Key, Key] = {}

    def received(self, request: Request) -> list[Key]:
        """A call reached the server. A fork's first call makes it a worker of its lead's last finished
        call (the one that spawned it). Returns the branches whose steps changed."""
        key = _key(request)
        self.seen.add(key)
        if request.parent_branch is None or key in self.lead_of:
            return []
        lead = (request.tenant, request.session, request.parent_branch)
        spawner = self.last_done.get(lead)
        if spawner is None or lead in self.running:
            return []
        self.waits_on.setdefault(spawner.id, []).append(key)
        self.lead_of[key] = lead
        return [lead]

    def started(self, request: Request) -> list[Key]:
        """A call of ``request``'s branch started; returns the branches whose steps changed."""
        key = _key(request)
        self.running.add(key)
        return [key]

    def finished(self, request: Request) -> list[Key]:
        key = _key(request)
        self.running.discard(key)
        self.last_done[key] = request
        if request.close:
            self.ended.add(key)
        return self._with_lead(key)

    def branch_ended(self, key: Key) -> list[Key]:
        """A close or abort ended ``key`` (a session close ends each of its branches)."""
        self.ended.add(key)
        return self._with_lead(key)

    def steps(self, key: Key) -> int:
        if key in self.running:
            return 0
        last = self.last_done.get(key)
        if key in self.ended or key not in self.seen:
            return self.cap
        if last is None:  # received, not run yet: it runs next
            return 1
        if last.tool is None:
            return self.cap
        workers = [w for w in self.waits_on.get(last.id, ()) if w not in self.ended]
        if not workers:
            return 1
        return min(1 + max(self.steps(w) for w in workers), self.cap)

    def _with_lead(self, key: Key) -> list[Key]:
        lead = self.lead_of.get(key)
        return [key] + ([lead] if lead is not None else [])


def _key(r) -> Key:
    return (r.tenant, r.session, r.branch)


__all__ = ["StepGraph"]
