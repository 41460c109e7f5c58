"""Program-aware admission: the order in which the scheduler tries its waiting requests (pure).

SGLang admits waiting requests in queue order and stops at the first one that does not fit
(``Scheduler.get_new_batch_prefill``), so the order is a scheduling policy. Stock orders requests, not
programs: a returning agent turn whose KV is still resident waits behind a burst of newer sessions, and
can lose that KV to eviction while it waits. Each strategy here maps the waiting requests, described as
plain data (:class:`Waiting`), to sort keys; the caller sorts stably (requests with equal keys keep
the order they had), so a strategy refines the order it is given.

- ``fcfs``: receive order (SGLang's ``--schedule-policy fcfs``).
- ``lpm``: longest device match first, then receive order (SGLang's ``--schedule-policy lpm`` order,
  without its in-batch prefix deprioritization); for the replay, where SGLang's sort does not run.
- ``program-fcfs``: the scheduling side of Continuum (Li et al., 2025): requests ordered by their
  program's arrival, so an older program's next turn goes before a newer program's first.
- ``plas``: Autellix's program-level attained service (Luo et al., 2025): a multi-level queue by the
  program's attained service (:data:`PLAS_LEVELS`, doubling thresholds), FCFS within a level; a
  request that waited :attr:`AdmissionSettings.starvation_steps` scheduler passes goes first.
  Autellix promotes by the ratio of waiting to service time; we count scheduler passes instead, so
  every tensor-parallel rank orders alike (no rank's wall clock decides).
- ``atlas``: Autellix's ATLAS for programs with subagents: as ``plas``, with the service attained
  along the request's branch path (its lead's service up to the fork, plus its own) instead of the
  whole program's: parallel subagents do not push one another back.
- ``agent`` (ours): anti-starvation first (as ``plas``); then tenant fairness (a tenant over
  :attr:`AdmissionSettings.tenant_slack` times its equal share of recent service waits behind the
  others' requests, only while another tenant waits); then returning turns whose KV is resident now
  (waiting risks evicting what would make them cheap), then other returning turns, then new
  programs; program FCFS within each class.
- ``agent-lpm``: as ``agent``, longest device match first within each class (``lpm``'s order).

Every key ends in the receive order, so a strategy's order is total: it replaces the order the
caller had (on the server, ``--schedule-policy``'s), it does not refine it.

A request without a session (no hint and no inferred one) is a program of its own: never returning.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Hashable, Iterable

from sgl_agentcache.namespaced_lru import NamespacedLRU

__all__ = ["READS_EVERY_MATCH", "STRATEGIES", "AdmissionSettings", "ProgramLedger", "Waiting", "order_keys",
           "plas_level", "reads_match"]

STRATEGIES = ("fcfs", "lpm", "program-fcfs", "plas", "atlas", "agent", "agent-lpm")
#: Strategies that read every waiting request's device match (``agent`` reads returning ones' only).
READS_EVERY_MATCH = ("lpm", "agent-lpm")


def reads_match(strategy: str, returning: bool) -> bool:
    """Whether ``strategy`` reads the device match of a waiting request (``returning`` or not)."""
    return strategy in READS_EVERY_MATCH or (strategy == "agent" and returning)

#: Attained-service thresholds (tokens of work: prefill plus decode) of PLAS/ATLAS's queue levels: a
#: program with less than the first is at level 0, then one level per doubling.
PLAS_BASE_TOKENS = 2048
PLAS_LEVELS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Waiting:
    """One waiting request as the admission order sees it (every field is the same on every TP rank).

    ``seq``: receive order. ``program``: its session, or None (a program of its own). ``program_seq``:
    the receive order of its program's first request. ``returning``: its program had a call answered
    before it. ``resident_tokens``: prompt tokens on the device now (its match; read for every request
    by :data:`READS_EVERY_MATCH` strategies, for returning ones by ``agent``). ``attained``,
    ``path_attained``: service (tokens) attained by its program, and along its branch path.
    ``waited_steps``: scheduler passes it has waited.
    """

    seq: int
    tenant: str
    prompt_tokens: int
    program: Hashable | None = None
    program_seq: int | None = None
    returning: bool = False
    resident_tokens: int = 0
    attained: int = 0
    path_attained: int = 0
    waited_steps: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """``strategy``: one of :data:`STRATEGIES`. ``starvation_steps``: scheduler passes after which a
    request goes first whatever its class (``plas``, ``atlas``, ``agent``). ``resident_fraction``: the
    share of its prompt a returning turn must find on the device to count as resident.
    ``tenant_slack``: how far over its equal share of recent service a tenant may be before its
    requests wait behind other tenants'."""

    strategy: str = "agent"
    starvation_steps: int = 256
    resident_fraction: float = 0.5
    tenant_slack: float = 1.5

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown admission strategy {self.strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if self.starvation_steps < 1:
            raise ValueError(f"starvation_steps must be >= 1, got {self.starvation_steps}")
        if not 0.0 <= self.resident_fraction <= 1.0:
            raise ValueError(f"resident_fraction must be in [0, 1], got {self.resident_fraction}")
        if self.tenant_slack < 1.0:
            raise ValueError(f"tenant_slack must be >= 1, got {self.tenant_slack}")


def plas_level(attained: int) -> int:
    """The PLAS queue level of ``attained`` tokens of service (0 = least served)."""
    level, threshold = 0, PLAS_BASE_TOKENS
    while attained >= threshold and level < PLAS_LEVELS - 1:
        level, threshold = level + 1, threshold * 2
    return level


def over_share(tenant_service: dict[str, int], waiting_tenants: Iterable[str], slack: float) -> set[str]:
    """Tenants whose recent service exceeds ``slack`` times an equal share of the waiting tenants'
    total (none while fewer than two tenants wait: a tenant alone takes what is free)."""
    tenants = set(waiting_tenants)
    if len(tenants) < 2:
        return set()
    total = sum(tenant_service.get(t, 0) for t in tenants)
    share = total / len(tenants)
    return {t for t in tenants if tenant_service.get(t, 0) > slack * share}


def order_keys(waiting: list[Waiting], settings: AdmissionSettings,
               tenant_service: dict[str, int] | None = None) -> list[tuple]:
    """One sort key per waiting request (lower goes first), under ``settings.strategy``."""
    strategy = settings.strategy
    if strategy == "fcfs":
        return [(w.seq,) for w in waiting]
    if strategy == "lpm":
        return [(-w.resident_tokens, w.seq) for w in waiting]
    program_seq = [w.seq if w.program_seq is None else w.program_seq for w in waiting]
    if strategy == "program-fcfs":
        return [(p, w.seq) for w, p in zip(waiting, program_seq)]
    starved = [0 if w.waited_steps >= settings.starvation_steps else 1 for w in waiting]
    if strategy in ("plas", "atlas"):
        service = (lambda w: w.attained) if strategy == "plas" else (lambda w: w.path_attained)
        return [(s, plas_level(service(w)), w.seq) for w, s in zip(waiting, starved)]
    heavy = over_share(tenant_service or {}, (w.tenant for w in waiting), settings.tenant_slack)
    keys = []
    for w, s, p in zip(waiting, starved, program_seq):
        resident = w.returning and w.resident_tokens >= settings.resident_fraction * max(w.prompt_tokens, 1)
        cls = 0 if resident else 1 if w.returning else 2
        within = (-w.resident_tokens, w.seq) if strategy == "agent-lpm" else (p, w.seq)
        keys.append((s, 1 if w.tenant in heavy else 0, cls) + within)
    return keys


class _Program:
    """What the ledger keeps of one program."""

    __slots__ = ("first_seq", "answered", "attained")

    def __init__(self, first_seq: int):
        self.first_seq, self.answered, self.attained = first_seq, False, 0


class ProgramLedger:
    """What the admission order knows of programs, fed by the server (or the replay) as requests are
    received, admitted and answered. Plain data, bounded per namespace: program and branch keys are
    tuples whose first item is their namespace (``(namespace, session)``, a
    :class:`~sgl_agentcache.lifecycle.BranchKey`), kept in :class:`NamespacedLRU` maps, so one tenant's
    flood forgets only its own programs (a forgotten program's next request counts as a new one's).

    Service is counted in tokens of work: the prompt tokens a request computes when admitted, its
    output tokens when answered. Tenants' recent service is over the last ``window`` charges (a
    window every tenant shares on purpose: it measures each one's share of what the server did).
    """

    def __init__(self, limit: int = 65_536, namespace_limit: int = 16_384, window: int = 512):
        self.seq = 0
        self.programs: NamespacedLRU[tuple, _Program] = NamespacedLRU(limit, namespace_limit)
        self.path: NamespacedLRU[tuple, int] = NamespacedLRU(limit, namespace_limit)  # branch -> ATLAS service
        self.recent: deque[tuple[str, int]] = deque(maxlen=window)
        self.tenant_service: dict[str, int] = {}  # at most ``window`` tenants: those in ``recent``

    def receive(self, program: tuple | None, branch: tuple | None = None, parent: tuple | None = None) -> int:
        """A request is received: its receive order. A branch first seen with a ``parent`` starts its
        path at the parent's service so far (a subagent inherits its lead's critical path)."""
        self.seq += 1
        if program is not None:
            if program in self.programs:
                self.programs.touch(program)
            else:
                self.programs.put(program, _Program(self.seq))
        if branch is not None and branch not in self.path:
            self.path.put(branch, self.path.get(parent, 0) if parent is not None else 0)
        return self.seq

    def charge(self, tenant: str, program: tuple | None, branch: tuple | None, tokens: int) -> None:
        """``tokens`` of work done for a request of ``program`` / ``branch`` (admitted or answered)."""
        if tokens <= 0:
            return
        record = self.programs.get(program) if program is not None else None
        if record is not None:
            record.attained += tokens
        if branch is not None and branch in self.path:
            self.path.put(branch, self.path[branch] + tokens)
        if len(self.recent) == self.recent.maxlen:
            old_tenant, old = self.recent[0]
            left = self.tenant_service[old_tenant] - old
            if left > 0:
                self.tenant_service[old_tenant] = left
            else:
                del self.tenant_service[old_tenant]
        self.recent.append((tenant, tokens))
        self.tenant_service[tenant] = self.tenant_service.get(tenant, 0) + tokens

    def answer(self, program: tuple | None) -> None:
        """A call of ``program`` was answered: its later requests are returning turns."""
        record = self.programs.get(program) if program is not None else None
        if record is not None:
            record.answered = True

    def returning(self, program: tuple | None) -> bool:
        record = self.programs.get(program) if program is not None else None
        return record is not None and record.answered

    def waiting(self, seq: int, tenant: str, prompt_tokens: int, *, program: tuple | None = None,
                branch: tuple | None = None, resident_tokens: int = 0, waited_steps: int = 0) -> Waiting:
        """A waiting request as :func:`order_keys` reads it."""
        record = self.programs.get(program) if program is not None else None
        return Waiting(seq=seq, tenant=tenant, prompt_tokens=prompt_tokens, program=program,
                       program_seq=record.first_seq if record is not None else None,
                       returning=record is not None and record.answered, resident_tokens=resident_tokens,
                       attained=record.attained if record is not None else 0,
                       path_attained=self.path.get(branch, 0) if branch is not None else 0,
                       waited_steps=waited_steps)
