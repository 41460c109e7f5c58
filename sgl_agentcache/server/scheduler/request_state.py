"""What the backend keeps about one scheduler request: one typed record on SGLang's ``Req``.

SGLang's ``Req`` has no slot for a backend's own state, so ours rides on it as a single attribute,
``req.agentcache``, created on first use by :func:`state_of`. Everything the scheduler side reads
about a request between its creation and its release is a field here, with its default, instead
of loose ``req.agentcache_*`` attributes read through ``getattr`` with defaults scattered over the
files that read them.

Scheduler side only (cache, admission, program admission, the offline driver); rank-local, never
sent over IPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_agentcache.hints import LifecycleHint
from sgl_agentcache.lifecycle import InsertPlan


@dataclass(slots=True)
class RequestState:
    # ---- the lifecycle (server/scheduler/cache.py) ----
    hint: LifecycleHint | None = None  # the request's lifecycle hint, read at its first plan (None: untagged)
    plan: InsertPlan | None = None  # who owns what it inserts; rebuilt only when a branch it names closes
    closed_version: int | None = None  # the closed-branch set's version ``plan`` was checked against
    refused: bool = False  # refused at admission (quota, closed parent): its release changes nothing
    edited: bool = False  # its edit hint freed the old suffix already (once per request)
    adopted: bool = False  # its first insert ran (a fork adopts the parent's nodes there)
    # ---- admission (server/scheduler/admission.py) ----
    prefill_waits: int = 0  # steps it waited for a batch-mate computing its stable prefix
    # ---- program-aware admission (server/scheduler/program_admission.py) ----
    program: tuple | None = None  # (tenant, program, branch) it is charged to; None: not received
    seq: int | None = None  # its receive order in the ledger
    passes: int = 0  # admission passes it has waited since it was received (or retracted)
    output_charged: int = 0  # output tokens charged to its program so far


def state_of(req) -> RequestState:
    """``req``'s state, created (all defaults) on first use."""
    state = getattr(req, "agentcache", None)
    if state is None:
        state = req.agentcache = RequestState()
    return state
