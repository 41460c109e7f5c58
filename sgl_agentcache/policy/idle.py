"""Session idleness: a branch whose call was answered and that neither paused on a tool nor closed is
waiting on something the server cannot see (the user, the harness). Its KV is priced like a tool pause
on an implicit tool, :data:`IDLE_CLASS`, once it has been idle for a while (pure: the caller passes
the time, so the HTTP side's clock and the replay's model clock drive the same code).

The gaps between a branch's answered call and its next call are learned per namespace in the same
:class:`~sgl_agentcache.policy.latency.LatencyBook` as tool latencies (pseudo tool class
:data:`IDLE_CLASS`; clients cannot name a tool class like it). A branch idle past
:meth:`IdleBranches.after_s` -- the learned gaps' :data:`PRICE_QUANTILE` quantile once
:data:`MIN_GAPS` are known, :data:`DEFAULT_AFTER_S` before -- is *due*: the caller pauses it on
:data:`IDLE_CLASS` with ``elapsed`` = its idle time, and the pause decision conditions the learned gap
distribution on that (the longer a session has been idle, the longer it is expected to stay idle: its
KV is worth less per byte, and its advice moves toward offload or discard). It is due again, priced
anew with its longer idle time, each time that time has grown :data:`REPRICE_FACTOR`-fold since it was
last priced: advice given at the usual gap must not stand for hours (on the real Claude Code sessions,
sessions idle for 40 and 50 minutes still held the OFFLOAD advice of their first minute). On HiCache
an idle pause's advice never lifts a host copy over others' (``AgentRadixCache.hicache_host_key``);
DISCARD advice puts its copies first to go. Such a pause is advice only:
it never releases anything on a deadline (an idle session that returns finds whatever memory pressure
left of it). Its next call resumes it, which teaches the book that gap; a gap that ends before the
branch is due is learned at its next call.
"""

from __future__ import annotations

from sgl_agentcache.namespaced_lru import NamespacedLRU

__all__ = ["DEFAULT_AFTER_S", "IDLE_CLASS", "MIN_GAPS", "PRICE_QUANTILE", "REPRICE_FACTOR", "IdleBranches"]

#: The pseudo tool class of idle gaps in a LatencyBook (hints validate tool classes against
#: ``[A-Za-z0-9._:-]``, so no client can name it).
IDLE_CLASS = "@idle"
#: Gaps a namespace must have shown before its own quantile sets when a branch is due.
MIN_GAPS = 8
#: A branch is due once idle longer than this quantile of its namespace's gaps...
PRICE_QUANTILE = 0.9
#: ...or, before that, than this many seconds.
DEFAULT_AFTER_S = 60.0
#: A priced branch is due again once its idle time is this many times what it was when last priced.
REPRICE_FACTOR = 2.0
#: Idle branches tracked at once, in all and per namespace (the least recently answered of the
#: namespace over its share are forgotten past it: another namespace's never are).
LIMIT = 65_536
NAMESPACE_LIMIT = 16_384

Key = tuple  # (namespace, session, branch)


class IdleBranches:
    """Branches answered and waiting for their next call, and the gaps learned from them."""

    def __init__(self, book, limit: int = LIMIT, namespace_limit: int = NAMESPACE_LIMIT):
        self.book = book
        # idle branch -> when its call was answered, least recently answered first in each namespace
        self.since: NamespacedLRU[Key, float] = NamespacedLRU(limit, namespace_limit)
        self.priced: dict[Key, float] = {}  # due ones handed out (paused on IDLE_CLASS) -> idle s then

    def answered(self, namespace: str, session: str, branch: str, now: float) -> None:
        """A call of the branch was answered and it did not pause on a tool or close: idle from now."""
        key = (namespace, session, branch)
        self.since.pop(key)
        self.priced.pop(key, None)
        for old, _ in self.since.put(key, now):
            self.priced.pop(old, None)

    def arrived(self, namespace: str, session: str, branch: str, now: float) -> float | None:
        """The branch's next call arrived: returns the gap, learned here unless the branch was due and
        paused (then the pause's resume learns it), or None when it was not idle."""
        key = (namespace, session, branch)
        started = self.since.pop(key)
        if started is None:
            return None
        gap = max(now - started, 0.0)
        if key in self.priced:
            del self.priced[key]
        else:
            self.book.observe(namespace, IDLE_CLASS, gap)
        return gap

    def after_s(self, namespace: str) -> float:
        """How long a branch of ``namespace`` is idle before it is due."""
        if (namespace, IDLE_CLASS) in self.book:
            model = self.book.peek(namespace, IDLE_CLASS)
            if model.observations >= MIN_GAPS:
                return model.quantile(PRICE_QUANTILE)
        return DEFAULT_AFTER_S

    def due(self, now: float) -> list[tuple[Key, float, float]]:
        """Branches due, as ``(key, answered at, idle s)``: idle past :meth:`after_s` and not handed out
        yet, or handed out when idle for t and idle for :data:`REPRICE_FACTOR` x t now (to be priced
        again: the caller re-pauses a branch still paused on :data:`IDLE_CLASS`)."""
        out = []
        for key, started in self.since.items():  # a snapshot
            idle, last = now - started, self.priced.get(key)
            if idle >= (self.after_s(key[0]) if last is None else REPRICE_FACTOR * last):
                self.priced[key] = max(idle, 1e-3)  # never 0: a zero would make it due at every sweep
                out.append((key, started, idle))
        return out

    def model(self, namespace: str):
        """The namespace's learned gap distribution (its prior until gaps are seen)."""
        return self.book.peek(namespace, IDLE_CLASS)

    def ended(self, namespace: str, session: str, branch: str | None = None) -> None:
        """A branch (or, with ``branch`` None, every branch of a session) closed."""
        if branch is not None:
            keys = [(namespace, session, branch)]
        else:
            keys = [k for k, _ in self.since.namespace_items(namespace) if k[1] == session]
        for key in keys:
            self.since.pop(key)
            self.priced.pop(key, None)

    def namespace_ended(self, namespace: str) -> None:
        for key, _ in self.since.pop_namespace(namespace):
            self.priced.pop(key, None)
