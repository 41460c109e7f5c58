"""Prometheus metrics ``sglang:agentcache_*``, in SGLang's multiprocess setup (with ``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) and serves every
process's samples at ``/metrics`` from the HTTP process. We add our own collectors the same way, with a
``tp_rank`` label like SGLang's: the scheduler publishes the cache's state, the HTTP process its pause
coordinator's. The scheduler side is refreshed from the cache's own counters at most once a second
(:meth:`SchedulerMetrics.maybe_publish`, called every step): instrumentation stays out of the hot paths
and out of every decision (the clock here only paces publishing).
"""

from __future__ import annotations

import os
import sys
import time

_METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def metrics_enabled() -> bool:
    """True in a server started with ``--enable-metrics`` (SGLang then sets the multiprocess dir)."""
    if _METRICS_DIR_ENV not in os.environ:
        return False
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # noqa: BLE001 - no published config (offline caches): no metrics
        return False


PRIORITY_CLASSES = ("high", "normal", "low", "default")


def priority_class(value, low_first: bool = False) -> str:
    """``high`` / ``normal`` / ``low`` by the sign of a priority in our orientation (higher = more urgent),
    or ``default`` for a request without one (SGLang's sentinel extremes)."""
    if value is None or abs(value) >= sys.maxsize:
        return "default"
    ours = -value if low_first else value
    return "high" if ours > 0 else "low" if ours < 0 else "normal"


def queue_by_priority(scheduler, threshold: float, now: float | None = None) -> dict[str, dict]:
    """The scheduler's waiting queue per priority class: requests, the oldest wait, and how many wait
    longer than ``threshold`` seconds (``AGENTCACHE_STARVATION_S``). Observability only: nothing decides
    on it."""
    low_first = bool(getattr(scheduler, "schedule_low_priority_values_first", False))
    now = time.perf_counter() if now is None else now  # SGLang stamps queue entry with perf_counter
    out = {c: {"waiting": 0, "oldest_wait_s": 0.0, "starved": 0} for c in PRIORITY_CLASSES}
    for req in list(getattr(scheduler, "waiting_queue", ()) or ()):
        entry = out[priority_class(getattr(req, "priority", None), low_first)]
        entered = getattr(getattr(req, "time_stats", None), "wait_queue_entry_time", 0.0) or 0.0
        waited = now - entered if entered > 0 else 0.0
        entry["waiting"] += 1
        entry["oldest_wait_s"] = max(entry["oldest_wait_s"], waited)
        entry["starved"] += waited > threshold
    return out


def running_requests(scheduler) -> int:
    """Requests the scheduler admitted that have not finished: the decode batch's, and those of a
    prefill batch not merged into it yet (between steps, a request just prefilled sits in
    ``last_batch``). Observability (and tests that wait for a request to start running)."""
    batches = [getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)]
    seen = set()
    for batch in batches:
        for req in getattr(batch, "reqs", None) or ():
            finished = getattr(req, "finished", None)
            if not (callable(finished) and finished()):
                seen.add(id(req))
    return len(seen)


def paused_tokens_by_priority(pauses) -> dict[tuple[str, str], int]:
    """Tokens of paused branches per (priority class, placement): where the eviction pressure lands."""
    out: dict[tuple[str, str], int] = {}
    for record in pauses.records.values():
        priority = record.decision.inputs.priority if record.decision is not None else 0
        key = (priority_class(priority), record.placement.value)
        out[key] = out.get(key, 0) + record.tokens
    return out


class SchedulerMetrics:
    """The cache's state and counters as Prometheus series (one instance per scheduler rank)."""

    def __init__(self, tp_rank: int = 0, interval_s: float = 1.0):
        from prometheus_client import Counter, Gauge

        self.rank = str(tp_rank)
        self.interval_s = interval_s
        self._last = 0.0
        self._seen: dict[tuple, float] = {}
        gauge = lambda name, doc, labels=(): Gauge(  # noqa: E731
            f"sglang:agentcache_{name}", doc, labelnames=("tp_rank", *labels), multiprocess_mode="mostrecent")
        counter = lambda name, doc, labels=(): Counter(  # noqa: E731
            f"sglang:agentcache_{name}", doc, labelnames=("tp_rank", *labels))
        self.resident = gauge("resident_tokens", "KV tokens resident per lifecycle class and tier", ("cls", "tier"))
        self.pressure = gauge("eviction_pressure", "1 - device headroom (free + evictable/2) / pool")
        self.paused = gauge("paused_branches", "Branches paused on a tool call, by where their KV is", ("placement",))
        self.decisions = counter("pause_decisions", "Pause decisions applied, by kind", ("action",))
        self.moved = counter("bytes_moved", "KV bytes moved between tiers", ("direction",))
        self.prefetch = counter("prefetch", "Prefetch outcomes", ("outcome",))
        self.deadline = counter("deadline_releases", "Pauses released at their deadline (every tier)")
        self.quota = counter("quota_trims", "Tokens of over-quota branches eviction took first", ("kind",))
        self.faults = counter("transfer_fallbacks", "Offloads that fell back to a discard", ("reason",))
        self.reclaimed = counter("reclaimed_tokens", "Tokens freed because their branch ended")
        self.waiting = gauge("waiting_requests", "Requests waiting for admission, by priority class",
                             ("priority_class",))
        self.queue_age = gauge("queue_age_seconds", "Oldest wait in the admission queue, by priority class",
                               ("priority_class",))
        self.starved = gauge("starved_requests", "Requests waiting longer than AGENTCACHE_STARVATION_S, by priority class",
                             ("priority_class",))
        self.paused_tokens = gauge("paused_tokens", "Tokens of paused branches by priority class and placement "
                                   "(where eviction pressure lands)", ("priority_class", "placement"))

    def _inc(self, metric, labels: tuple, total: float) -> None:
        """Counters are fed from cumulative totals: add what is new since the last publish."""
        key = (id(metric), labels)
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            metric.labels(self.rank, *labels).inc(delta)
            self._seen[key] = total

    def maybe_publish(self, cache) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self.publish(cache)

    def publish(self, cache) -> None:
        pauses = cache.pauses
        for cls, tokens in cache.resident_tokens_by_class().items():
            self.resident.labels(self.rank, cls, "device").set(tokens)
        hicache = cache.hicache_stats()
        for cls, tokens in hicache.get("host_tokens_by_class", {}).items():  # HiCache's host pool, when attached
            self.resident.labels(self.rank, cls, "host").set(tokens)
        allocator = cache.token_to_kv_pool_allocator
        headroom = (allocator.available_size() + 0.5 * cache.evictable_size()) / max(allocator.size, 1)
        self.pressure.labels(self.rank).set(1.0 - min(headroom, 1.0))
        placements: dict[str, int] = {"device": 0, "host": 0, "none": 0}
        for record in pauses.records.values():
            placements[record.placement.value] += 1
        for placement, n in placements.items():
            self.paused.labels(self.rank, placement).set(n)
        for action, n in pauses.counters["decisions"].items():
            self._inc(self.decisions, (action,), n)
        bpt = pauses.settings.bytes_per_token
        # HiCache's load-backs (what a match or a prefetch brought back from its host pool).
        self._inc(self.moved, ("host_to_device",), cache.tree_core.host_loaded_tokens * bpt)
        for outcome in ("issued", "used", "wasted", "refused_budget", "refused_room", "refused_no_gain", "refused_queue",
                        "refused_disabled"):
            self._inc(self.prefetch, (outcome,), pauses.prefetch[outcome])
        self._inc(self.deadline, (), pauses.counters["deadline_releases"])
        self._inc(self.quota, ("trimmed_tokens",), cache.quota_trimmed_tokens)
        for reason, n in pauses.counters["offload_fallbacks"].items():
            self._inc(self.faults, (f"offload_{reason}",), n)
        self._inc(self.reclaimed, (), cache.freed_on_close_tokens)
        if cache.scheduler is not None:
            for cls, q in queue_by_priority(cache.scheduler, cache.settings.starvation_s).items():
                self.waiting.labels(self.rank, cls).set(q["waiting"])
                self.queue_age.labels(self.rank, cls).set(q["oldest_wait_s"])
                self.starved.labels(self.rank, cls).set(q["starved"])
        by_priority = paused_tokens_by_priority(pauses)
        for cls in PRIORITY_CLASSES:
            for placement in ("device", "host", "none"):
                self.paused_tokens.labels(self.rank, cls, placement).set(by_priority.get((cls, placement), 0))


class CoordinatorMetrics:
    """The HTTP process's pause coordinator as Prometheus series."""

    def __init__(self):
        from prometheus_client import Counter

        self.events = Counter("sglang:agentcache_pause_events", "Pause lifecycle events seen by the HTTP process",
                              labelnames=("event",))

    def count(self, event: str) -> None:
        self.events.labels(event).inc()


class TrustMetrics:
    """Refused and clipped hints and credentials (HTTP process, with tenancy on)."""

    def __init__(self):
        from prometheus_client import Counter

        self.rejected = Counter("sglang:agentcache_hints_rejected", "Requests, hints and credentials refused "
                                "by tenancy checks, by reason", labelnames=("reason",))
        self.clipped = Counter("sglang:agentcache_hints_clipped", "Hint and route values clipped to a "
                               "tenant's ceilings, by field", labelnames=("field",))
