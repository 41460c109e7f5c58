"""Tool pauses on the HTTP side: the clocks, the learned latency distributions, deadlines, the event log.

The scheduler must never read a clock (every TP rank has to take the same decision), so everything
time-based lives here, in the one HTTP process, and reaches the schedulers as message fields:

- the tool class's latency distribution (a :class:`~sgl_agentcache.policy.latency.LatencyBook` per
  (namespace, tool class), learned from the observed pause -> resume times) travels as a snapshot with
  each pause, with the class's learned resume rate (how often such a pause ended with its branch
  closed instead: the close likelihood);
- fork/join: a lead that pauses while subagents of its branch run waits for the last of them
  (:class:`~sgl_agentcache.policy.join.Subagents` learns subagents' lifetimes, first call to close);
  its pause then carries the lifetime model and each running subagent's age (``join_elapsed_s``), from
  which the scheduler prices the join (:class:`~sgl_agentcache.policy.join.JoinWait`). A subagent that
  starts while its lead is paused re-prices the lead's pause the same way;
- session idleness: a branch answered without pausing on a tool or closing waits on something unseen
  (:class:`~sgl_agentcache.policy.idle.IdleBranches` learns those gaps per namespace); a sweep every
  ``AGENTCACHE_IDLE_SWEEP_S`` seconds pauses a branch idle past its namespace's usual gap on the implicit tool
  ``@idle``, with its idle time as ``elapsed``: advice only, no deadline (nothing is released for
  being idle);
- deadlines are timers here: when one fires, an ``expire`` message releases the branch on every tier.
  ``deadline_ms`` is clipped to ``AGENTCACHE_MAX_RETENTION_S`` (default 600 s), and a pause with no
  deadline gets that maximum: no tool may hold memory forever;
- a resume is observed either from ``/agentcache/resume`` or from the branch's next request (the
  ingress hook), whichever comes first; the scheduler restores on that request anyway;
- a pause that follows a response (a ``tool_class`` hint, or an inferred chat pause) runs in the
  background (:meth:`PauseCoordinator.pause_soon`): the response's final chunk is never held back for
  the scheduler round trip. Order is kept where it matters: the branch's next request, and every
  pause, resume or prefetch of that branch, waits for it (:meth:`PauseCoordinator.settle`); a control
  route waits for the pending pauses of what it reads or changes (a tenant's stats: its namespace's; a
  close: its branch's or session's; an operator's view: all), so what a client reads after a response
  includes it, and never for another tenant's. A namespace has at most ``AGENTCACHE_MAX_PENDING_PAUSES``
  (default 64) background pauses pending, and ``AGENTCACHE_MAX_PAUSED_BRANCHES`` (default 16,384)
  branches paused; more are shed (counted ``pauses_shed``: the branch is simply not paused, as if the
  hint had no ``tool_class``; the route answers 429), so one tenant's burst cannot queue up work that
  every later call of its own waits for, nor hold timers without bound;
- prefetch lead time (from "nearly done" to the actual resume) is measured here; when its median over
  the last window falls below ``AGENTCACHE_PREFETCH_MIN_LEAD_MS`` prefetch is refused here (the
  scheduler separately turns it off when its precision falls).

Every state change is appended to a JSONL event log when ``AGENTCACHE_EVENT_LOG`` names a file (by a
writer thread: never on the event loop, see :mod:`~sgl_agentcache.server.front.event_log`):
``tool_wait`` (with the decision, retained tokens and bytes), ``restoring``/``decode`` (resume, with the
restored tokens), ``completed`` (closed by the agent, with the route or a ``close`` hint) and
``cancelled`` (deadline, or an aborted subagent), so tool wait is never counted as model latency. A
session credential appears there by its id part only.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import msgspec

from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.idle import IDLE_CLASS, IdleBranches
from sgl_agentcache.policy.join import Subagents
from sgl_agentcache.policy.latency import LatencyBook
from sgl_agentcache.server.front.event_log import EventLog
from sgl_agentcache.settings import Settings
from sgl_agentcache.tenancy import session_label

logger = logging.getLogger(__name__)
#: Prefetch lead times remembered per namespace (the window whose median gates prefetch), and namespaces
#: remembered (the least recently used one's window is forgotten past it: its prefetch is on again).
LEAD_WINDOW = 32
LEAD_NAMESPACES = 4096
_UNBOUNDED = 1 << 62  # a NamespacedLRU only ever filled with bound=False: its caller refuses past its own bound


Send = Callable[[str, dict], Awaitable[tuple[int, dict]]]  # (op, args) -> (status, result)


@dataclass
class _Active:
    tool_class: str
    started: float
    timer: asyncio.Task | None = None
    nearly_done_at: float | None = None
    reprice: dict = field(default_factory=dict)  # what a re-pricing of the pause sends again


@dataclass
class PauseCoordinator:
    """The defaults are :class:`~sgl_agentcache.settings.Settings`'; a server builds its coordinator
    with :meth:`from_settings` (the operator's)."""

    send: Send
    max_retention_s: float = 600.0  # AGENTCACHE_MAX_RETENTION_S
    min_lead_s: float = 0.001  # AGENTCACHE_PREFETCH_MIN_LEAD_MS / 1000
    clock: Callable[[], float] = time.monotonic
    book: LatencyBook = field(default_factory=LatencyBook)  # priors: AGENTCACHE_TOOL_PRIORS
    idle_sweep_s: float = 2.0  # AGENTCACHE_IDLE_SWEEP_S; 0 turns idle pricing off
    max_pending: int = 64  # AGENTCACHE_MAX_PENDING_PAUSES: background pauses pending per namespace
    max_paused: int = 16_384  # AGENTCACHE_MAX_PAUSED_BRANCHES: a pause past it is refused (429)
    events: EventLog = field(default_factory=lambda: EventLog(None))  # AGENTCACHE_EVENT_LOG

    @classmethod
    def from_settings(cls, send: Send, settings: Settings) -> "PauseCoordinator":
        """The server's coordinator, configured by the operator's settings."""
        return cls(send=send, max_retention_s=settings.max_retention_s,
                   min_lead_s=settings.prefetch_min_lead_ms / 1000,
                   book=LatencyBook(priors=dict(settings.tool_priors)), idle_sweep_s=settings.idle_sweep_s,
                   max_pending=settings.max_pending_pauses, max_paused=settings.max_paused_branches,
                   events=EventLog(settings.event_log))

    def __post_init__(self) -> None:
        self._metrics = None  # created on first use, in a server with --enable-metrics
        # Paused branches, by namespace: at most max_paused each (pause refuses more; nothing is evicted,
        # since an entry holds the deadline that releases the branch on every tier).
        self.active: NamespacedLRU[tuple[str, str, str], _Active] = NamespacedLRU(_UNBOUNDED)
        # Each namespace's recent prefetch lead times: one tenant's fast prefetches never turn another's off.
        self.leads: NamespacedLRU[str, deque] = NamespacedLRU(LEAD_NAMESPACES, 1, namespace_of=lambda ns: ns)
        self.pending: dict[tuple[str, str, str], asyncio.Task] = {}  # background pauses not yet applied
        self.pending_by_namespace: Counter = Counter()  # keys of self.pending, by namespace (the bound)
        self.subagents = Subagents(self.book)
        self.idle = IdleBranches(self.book)
        self._sweeper: asyncio.Task | None = None
        self.counters = {"pauses": 0, "resumes": 0, "resumes_by_request": 0, "deadline_expiries": 0,
                         "deadline_clipped": 0, "prefetch_refused_lead": 0, "join_pauses": 0, "join_repriced": 0,
                         "idle_pauses": 0, "idle_repriced": 0, "pauses_shed": 0}

    def _count(self, event: str) -> None:
        self.counters[event] += 1
        if self._metrics is None:
            from sgl_agentcache.server.metrics import CoordinatorMetrics, metrics_enabled

            self._metrics = CoordinatorMetrics() if metrics_enabled() else False
        if self._metrics:
            self._metrics.count(event)

    def _emit(self, state: str, args: dict, **fields) -> None:
        """An event log record; a session credential is logged by its id part only (never in full)."""
        self.events.emit(state, args | {"session": session_label(args["session"])}, **fields)

    @staticmethod
    def _args(namespace: str, session: str, branch: str) -> dict:
        return {"namespace": namespace, "session": session, "branch": branch}

    def pause_soon(self, namespace: str, session: str, branch: str, **kwargs) -> asyncio.Task | None:
        """Start :meth:`pause` in the background and return at once (a response's final chunk does not
        wait for the scheduler round trip). Until it is applied, the branch's next request, pause,
        resume and prefetch wait for it, and so do the control routes that read or change it
        (:meth:`settle`). A failure is logged, never raised: a pause must never fail the call it
        follows. None: the namespace already has :attr:`max_pending` pauses pending, and this one is
        shed (the branch stays unpaused)."""
        key = (namespace, session, branch)
        if key not in self.pending and self.pending_by_namespace[namespace] >= self.max_pending:
            self._count("pauses_shed")
            return None
        return self._in_background(key, self._pause_logged(key, kwargs))

    def _in_background(self, key: tuple[str, str, str], work) -> asyncio.Task:
        """Run ``work`` (a coroutine that changes ``key``'s pause) as ``key``'s pending task: what
        :meth:`settle` waits for; it leaves :attr:`pending` when done (unless replaced meanwhile)."""
        if key not in self.pending:
            self.pending_by_namespace[key[0]] += 1
        task = self.pending[key] = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(lambda done: self._applied(key, done))
        return task

    def _applied(self, key: tuple[str, str, str], task: asyncio.Task) -> None:
        if self.pending.get(key) is not task:  # replaced by a later task of the same key: that one counts
            return
        del self.pending[key]
        self.pending_by_namespace[key[0]] -= 1
        if not self.pending_by_namespace[key[0]]:
            del self.pending_by_namespace[key[0]]

    async def _pause_logged(self, key: tuple[str, str, str], kwargs: dict) -> tuple[int, dict] | None:
        try:
            return await self.pause(*key, **kwargs)
        except Exception:  # noqa: BLE001 - logged: nobody awaits a background pause's result
            logger.warning("agentcache: pause of %s/%s failed (the HTTP server's coordinator is needed; in an "
                           "Engine call the pause op directly)", session_label(key[1]), key[2], exc_info=True)
            return None

    def has_pending(self, keys) -> bool:
        """Some of ``keys`` ((namespace, session, branch)) have a background pause not yet applied."""
        return bool(self.pending) and any(key in self.pending for key in keys)

    async def settle(self, keys=None, *, namespace: str | None = None, session: str | None = None) -> None:
        """Wait until the background pauses of ``keys`` ((namespace, session, branch)), or of one
        ``namespace`` (and ``session``), are applied; all of them when nothing is named (an operator's
        view). Never the caller's own task. Waiting never cancels them (a client that disconnects
        meanwhile does not undo a pause)."""
        current = asyncio.current_task()
        tasks = [task for key, task in list(self.pending.items())
                 if task is not current and (keys is None or key in keys)
                 and (namespace is None or key[0] == namespace) and (session is None or key[1] == session)]
        if tasks:
            await asyncio.wait(tasks)

    async def pause(self, namespace: str, session: str, branch: str, *, tool_class: str, deadline_ms: int | None,
                    priority: int, resume_required: bool, ceilings=None, idle_since: float | None = None
                    ) -> tuple[int, dict]:
        """``ceilings`` (a tenant's :class:`~sgl_agentcache.tenancy.Ceilings`) can only lower the
        maximum retention and the scheduler's caps on kept branches and tokens. ``idle_since``: an
        idle branch's pause on ``@idle`` (the sweep's), idle since then: priced with that much elapsed,
        no deadline."""
        key = (namespace, session, branch)
        await self.settle((key,))  # an earlier background pause of the branch is applied first
        if key not in self.active and self.active.namespace_size(namespace) >= self.max_paused:
            self._count("pauses_shed")
            return 429, {"error": f"this namespace already has {self.max_paused} paused branches "
                                  f"(AGENTCACHE_MAX_PAUSED_BRANCHES); resume or close some first (nothing changed)"}
        max_retention = self.max_retention_s
        if ceilings is not None and ceilings.max_retention_s is not None:
            max_retention = min(max_retention, ceilings.max_retention_s)
        deadline_s = max_retention
        clipped = deadline_ms is not None and deadline_ms / 1000 > max_retention
        if deadline_ms is not None and not clipped:
            deadline_s = deadline_ms / 1000
        # peek, not model: a pause the scheduler refuses must not create (or refresh) a book entry.
        model = self.book.peek(namespace, tool_class)
        # The class's learned resume rate (close likelihood, policy/latency.py); a client that does not
        # require the resume halves it (it can only lower what the server learned).
        kept = {"deadline_s": deadline_s, "priority": priority,
                "resume_probability": model.resume_rate() * (1.0 if resume_required else 0.5)}
        if idle_since is not None:  # advice only: an idle session is never released for being idle
            kept |= {"deadline_s": None, "elapsed_s": max(self.clock() - idle_since, 0.0)}
        if ceilings is not None and ceilings.caps():
            kept["caps"] = ceilings.caps()
        args = self._args(*key) | {"tool_class": tool_class, "latency": msgspec.to_builtins(model.snapshot())} | kept
        joined = self._join_args(key)
        if joined:
            args |= joined
            self._count("join_pauses")
        status, result = await self.send("pause", args)
        if status != 200:
            return status, result
        self.book.model(namespace, tool_class)  # the class is real now: keep its model in the book
        self._cancel(key)
        self._count("pauses")
        if clipped:
            self._count("deadline_clipped")
        if result.get("paused"):
            started = self.clock() if idle_since is None else idle_since  # a resume learns the whole gap
            active = _Active(tool_class, started, reprice=kept)
            self.active.put(key, active, bound=False)
            if idle_since is None:
                active.timer = asyncio.get_running_loop().create_task(self._expire_after(key, deadline_s))
        self._emit("tool_wait", self._args(*key), tool_class=tool_class, action=result.get("action"),
                         retained_tokens=result.get("tokens"), reason=result.get("reason"),
                         deadline_s=kept["deadline_s"])
        return status, result | {"deadline_s": kept["deadline_s"]}

    async def resume(self, namespace: str, session: str, branch: str, *, by_request: bool = False) -> tuple[int, dict]:
        key = (namespace, session, branch)
        await self.settle((key,))
        active = self.active.pop(key)
        if active is not None:
            waited = self.clock() - active.started
            self.book.observe(namespace, active.tool_class, waited)
            if active.nearly_done_at is not None:
                window = self.leads.get(namespace)
                if window is None:
                    window = deque(maxlen=LEAD_WINDOW)
                self.leads.put(namespace, window)
                window.append(self.clock() - active.nearly_done_at)
            if active.timer is not None:
                active.timer.cancel()
            self._count("resumes_by_request" if by_request else "resumes")
        if by_request:  # the scheduler restores as it admits the request; nothing to send
            if active is not None:
                self._emit("restoring", self._args(*key), tool_class=active.tool_class, by="request")
            return 200, {"resumed": active is not None}
        status, result = await self.send("resume", self._args(*key))
        if status == 200 and result.get("resumed"):
            self._emit("decode", self._args(*key), prefetched_tokens=result.get("prefetched_tokens"),
                       placement=result.get("placement"))
        return status, result

    async def prefetch(self, namespace: str, session: str, branch: str,
                       expected_remaining_ms: int | None, ceilings=None) -> tuple[int, dict]:
        key = (namespace, session, branch)
        await self.settle((key,))
        active = self.active.get(key)
        if active is None:
            return 404, {"error": f"branch {session}/{branch} is not paused (nothing changed)"}
        leads = self.leads.get(namespace) or ()
        if len(leads) >= 8 and statistics.median(leads) < self.min_lead_s:
            self._count("prefetch_refused_lead")
            return 200, {"prefetched": False, "reason": f"prefetch lead time {statistics.median(leads):.3g} s "
                                                        f"< {self.min_lead_s:.3g} s: prefetch is off"}
        active.nearly_done_at = self.clock()
        caps = ceilings.caps() if ceilings is not None else {}
        status, result = await self.send("prefetch", self._args(*key) | ({"caps": caps} if caps else {}))
        self._emit("restoring", self._args(*key), speculative=True,
                         restored_tokens=result.get("restored_tokens"), expected_remaining_ms=expected_remaining_ms)
        return status, result

    def _join_args(self, key) -> dict:
        """The pause message's fields for a lead with running subagents: the learned lifetime model as its
        latency and each subagent's age (the scheduler builds the JoinWait); {} when there is no join."""
        join = self.subagents.join(*key, self.clock())
        if join is None:
            return {}
        return {"latency": msgspec.to_builtins(join.lifetime.snapshot()), "join_elapsed_s": list(join.elapsed)}

    def note_fork(self, namespace: str, session: str, branch: str, lead: str) -> None:
        """A request of subagent ``branch`` of ``lead`` arrived (ingress). Its first starts its lifetime;
        if the lead is paused, its pause is re-priced as a join (in the background)."""
        if not self.subagents.started(namespace, session, branch, lead, self.clock()):
            return
        lead_key = (namespace, session, lead)
        if lead_key in self.active and lead_key not in self.pending:
            self._in_background(lead_key, self._reprice(lead_key))

    async def _reprice(self, key) -> None:
        """Send a paused lead's pause again, now as a join on its running subagents (the scheduler
        re-decides against its previous decision, with hysteresis). Its timers and event log are kept."""
        active = self.active.get(key)
        args = self._join_args(key)
        if active is None or not args:
            return
        elapsed = self.clock() - active.started
        message = self._args(*key) | {"tool_class": active.tool_class} | active.reprice | args
        if active.reprice.get("deadline_s") is not None:
            message["deadline_s"] = max(active.reprice["deadline_s"] - elapsed, 0.0)
        try:
            status, _ = await self.send("pause", message)
        except Exception:  # noqa: BLE001 - the pause stands as it was
            logger.warning("agentcache: re-pricing the pause of %s/%s failed", session_label(key[1]), key[2],
                           exc_info=True)
            return
        if status == 200:
            self._count("join_repriced")

    def note_request(self, namespace: str, session: str, branch: str) -> None:
        """The branch's next request arrived (ingress): the tool returned, or its idle spell ended (a
        pause still pending is applied first, then resumed)."""
        key = (namespace, session, branch)
        self.idle.arrived(namespace, session, branch, self.clock())
        if key in self.active or key in self.pending:
            asyncio.get_running_loop().create_task(self.resume(namespace, session, branch, by_request=True))

    def on_tools(self) -> list[tuple[str, str, str]]:
        """Branches paused on a real tool (not idle pauses): what an inferred session's idle close must
        leave open until its deadline."""
        return [key for key, active in self.active.items() if active.tool_class != IDLE_CLASS]

    def note_answered(self, namespace: str, session: str, branch: str) -> None:
        """A call of the branch was answered and it neither paused on a tool nor closed: it is idle
        from now (the sweep prices it once it has been idle past its namespace's usual gap)."""
        if self.idle_sweep_s <= 0:
            return
        self.idle.answered(namespace, session, branch, self.clock())
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        """Every ``idle_sweep_s`` while any branch is idle: pause the ones due on ``@idle``, and price
        again those already paused there whose idle time has grown (``policy/idle.py``)."""
        while self.idle.since:
            await asyncio.sleep(self.idle_sweep_s)
            for (namespace, session, branch), since, _ in self.idle.due(self.clock()):
                key = (namespace, session, branch)
                active = self.active.get(key)
                if key in self.pending or (active is not None and active.tool_class != IDLE_CLASS):
                    continue
                self._count("idle_pauses" if active is None else "idle_repriced")
                self.pause_soon(namespace, session, branch, tool_class=IDLE_CLASS, deadline_ms=None, priority=0,
                                resume_required=True, idle_since=since)

    def forget(self, namespace: str, session: str | None = None, branch: str | None = None) -> None:
        """A branch (or session) closed: its timers go, and each pause it ended counts against its tool
        class's resume rate (the close likelihood). A closed subagent's lifetime is learned."""
        for key in [k for k, _ in self.active.namespace_items(namespace) if k[1] == session
                    and (branch is None or k[2] == branch)]:
            self.book.observe_end(namespace, self.active[key].tool_class)
            self._cancel(key)
        self.idle.ended(namespace, session, branch)
        if branch is None:
            self.subagents.session_ended(namespace, session)
        else:
            self.subagents.ended(namespace, session, branch, self.clock())
            self.subagents.lead_ended(namespace, session, branch)

    def finished(self, namespace: str, session: str, branch: str | None = None, *, state: str = "completed",
                 reason: str = "route") -> None:
        """A trajectory (branch, or every branch of a session) ended: ``completed`` (closed by the agent)
        or ``cancelled`` (aborted); its timers go and the event log gets its final state."""
        self.forget(namespace, session, branch)
        args = {"namespace": namespace, "session": session} | ({"branch": branch} if branch is not None else {})
        self._emit(state, args, reason=reason)

    def purge(self, namespace: str) -> int:
        """A tenant was purged: its timers and its learned tool latencies go. Returns pauses dropped."""
        keys = [k for k, _ in self.active.namespace_items(namespace)]
        for key in keys:
            self._cancel(key)
        self.subagents.namespace_ended(namespace)
        self.idle.namespace_ended(namespace)
        self.leads.pop(namespace)
        self.book.forget_namespace(namespace)
        return len(keys)

    def _cancel(self, key) -> None:
        active = self.active.pop(key)
        if active is not None and active.timer is not None:
            active.timer.cancel()

    async def _expire_after(self, key, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.active.get(key) is None:
            return
        self.active.pop(key)
        status, result = await self.send("expire", self._args(*key))
        self._count("deadline_expiries")
        self._emit("cancelled", self._args(*key), reason="deadline", freed_tokens=result.get("freed_tokens"))
        logger.info("agentcache: deadline of %s/%s passed: %s", session_label(key[1]), key[2], result)

    def stats(self, namespace: str | None = None) -> dict:
        """Everything, or (``namespace``) only what that namespace may see of its own pauses."""
        if namespace is not None:
            leads = self.leads.get(namespace)
            return {"active_pauses": self.active.namespace_size(namespace),
                    "prefetch_lead_median_s": statistics.median(leads) if leads else None,
                    "latency_models": {c: {"observations": m.observations, "p50_s": m.quantile(0.5),
                                           "p99_s": m.quantile(0.99)}
                                       for (_, c), m in self.book.items(namespace)}}
        models = {f"{t}/{c}": {"observations": m.observations, "p50_s": m.quantile(0.5), "p99_s": m.quantile(0.99)}
                  for (t, c), m in self.book.items()[-32:]}
        return {"active_pauses": len(self.active), **self.counters, "latency_models": models,
                "idle_branches": len(self.idle.since), "pending_pauses": len(self.pending),
                "prefetch_lead_namespaces": len(self.leads),
                "max_retention_s": self.max_retention_s, "event_log": self.events.path,
                "events_written": self.events.written, "events_dropped": self.events.dropped + self.events.failed}
