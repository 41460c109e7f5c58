"""Which calls of a trace must be answered before another call can be sent, across branches.

A client sends a branch's next call only when the previous one was answered (its prompt carries that
output); the replayer enforces that per branch. Forks add two more orderings the trace's clock alone
does not keep once the replay runs slower than the trace's own service model:

- **fork**: a branch's first call carries its parent's context up to the fork, so it is sent only
  after the parent's latest earlier call was answered (the harness spawns subagents from that answer);
- **join**: a call of a branch that follows a tool pause during which its child branches ran is sent
  only after every one of those child calls was answered (the lead reads its subagents' results).

Without them a replay could run a lead's closing turn before its subagents, close the lead, and then
make the subagents recompute the lead's history -- an order no client produces. The orderings are read
from the trace's structure (parents, arrival order), never from its tool durations or think times.
"""

from __future__ import annotations

from sgl_agentcache.trace.schema import Request, Trace

__all__ = ["cross_branch_prerequisites"]


def cross_branch_prerequisites(trace: Trace) -> dict[str, tuple[str, ...]]:
    """Request id -> ids of calls of *other* branches that must be answered before it is sent.

    Only requests with at least one prerequisite appear. Every prerequisite arrives earlier in the
    trace than its dependent, so the orderings never form a cycle.
    """
    last_call: dict[tuple, Request] = {}  # branch -> its latest call so far (trace order)
    since_last: dict[tuple, list[str]] = {}  # branch -> its children's calls since its latest call
    needs: dict[str, tuple[str, ...]] = {}
    for request in trace.requests:  # arrival order
        key = (request.tenant, request.session, request.branch)
        wanted: list[str] = []
        if key in last_call:
            wanted.extend(since_last.get(key, ()))  # join: the children that ran during the pause
        elif request.parent_branch is not None:
            parent = last_call.get((request.tenant, request.session, request.parent_branch))
            if parent is not None:  # fork: the parent's call it was spawned from
                wanted.append(parent.id)
        if request.parent_branch is not None:
            since_last.setdefault((request.tenant, request.session, request.parent_branch), []).append(request.id)
        last_call[key] = request
        since_last[key] = []
        if wanted:
            needs[request.id] = tuple(wanted)
    return needs
