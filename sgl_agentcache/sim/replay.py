"""Replay an agent trace through the real cache code under a cost model.

The cache is the real one the server runs -- :class:`~sgl_agentcache.server.scheduler.cache.AgentRadixCache`, or
SGLang's own ``UnifiedRadixCache`` for the stock baselines -- built offline on SGLang's CPU pools and
driven through the scheduler's own calls (:mod:`sgl_agentcache.server.scheduler.offline`); tool pauses go through
the same ``PauseBook`` the server uses, and the host tier is SGLang's own HiCache (host pool, cache
controller, ``direct`` io), so backups, offloads and load-backs really copy (tiny) KV tensors. Every
system gets the same device pool and the same host tier (``host_tokens``; stock SGLang without HiCache
runs with none and is the reference). The replayer owns only time: a discrete-event loop over the trace's records, where a request
is admitted when KV slots can be found (else it waits, FIFO), holds its slots for
``restore + prefill(uncached) + decode(output)`` seconds of modelled service, then finishes. When a
call ends in a tool call, the policy (:mod:`sgl_agentcache.sim.policies`) decides what happens to the
branch's KV; the branch's next call is its resume. A branch has at most one call at the server: its
next call carries the previous one's output, so when the trace's clock ran ahead of the replay's
service, that call reaches the server (its hint, the end of the tool pause) only when the previous one
is answered, and is then first in line. Across branches likewise (:mod:`sgl_agentcache.sim.causality`):
a fork's first call is sent once its parent's call is answered, and a lead's call after a pause in
which its subagents ran once their calls are answered.

What a system may know: the trace's future (when a branch's next call arrives, whether it has one)
reaches only a clairvoyant policy, through one :class:`TraceFuture` the replayer holds; every other
policy's rule gets ``None`` in its place, and no other part of the replayer reads ``think_s`` or a
tool's ``duration_s`` (time comes from arrivals alone). ``tests/test_replay.py`` scrambles that future
and checks every other policy's results are unchanged.

Costs come from a :class:`~sgl_agentcache.policy.profiles.Profile` (KV bytes per token, prefill and decode
rates, transfer bandwidths); the cache is told the profile's bytes per token, so its decisions price
the deployment the profile describes, not the tiny offline pool.

Outputs are exact where the trace says so: a call's generated tokens are the tokens its branch's next
prompt carries at those positions, so the next turn can hit them, as on a real server.
"""

from __future__ import annotations

import heapq
import logging
import math
import statistics
import time
import zlib
from array import array
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import msgspec

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.idle import IDLE_CLASS, IdleBranches
from sgl_agentcache.policy.join import Subagents
from sgl_agentcache.policy.latency import LatencyBook
from sgl_agentcache.policy.admission_order import AdmissionSettings
from sgl_agentcache.policy.profiles import Profile
from sgl_agentcache.server.scheduler.branch_walks import movable_suffix
from sgl_agentcache.sim.admission import ReplayAdmission
from sgl_agentcache.sim.causality import cross_branch_prerequisites
from sgl_agentcache.sim.inferred import ReplayInference
from sgl_agentcache.sim.policies import POLICIES, Future, PauseView, ReplayPolicy
from sgl_agentcache.sim.stepgraph import StepGraph
from sgl_agentcache.trace.schema import Event, Request, Trace, block_token_ids

__all__ = ["POLICIES", "CallRecord", "ReplayResult", "TraceFuture", "replay"]

#: KVFlow's ``load_ahead_step`` and ``evict_pri_level`` (hold_step) defaults.
KVFLOW_LOAD_AHEAD_STEPS = 2
KVFLOW_HOLD_STEPS = 4

#: Resident-memory samples kept per run (for the memory-by-class plot).
TIMELINE_SAMPLES = 200
#: SGLang HiCache loggers that narrate, per event, what the replay counts itself (a host pool smaller than
#: the device pool, CPU events without timing, write-back subtrees dropped under host pressure).
_HICACHE_NARRATORS = ("sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.l2_transfer",
                      "sglang.srt.mem_cache.unified_radix_cache")


def _quantiles(values: list[float]) -> dict[str, float]:
    lat = sorted(values)
    if not lat:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


def jain(values: list[float]) -> float:
    """Jain's fairness index of non-negative values (1 = perfectly even)."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class CallRecord(NamedTuple):
    """One call as a system served it."""

    start_s: float  # when it was admitted
    cached_tokens: int  # its prompt's tokens it did not compute
    ttft_s: float  # from its trace arrival to its first token (restore and prefill included)
    own_wait_s: float  # from when the server received it to its admission
    resumed: bool  # its branch's previous call stopped for a tool
    first_token_s: float  # when its first token came (admission, restore and prefill)


@dataclass
class ReplayResult:
    policy: str
    trace: str
    pool_tokens: int
    host_tokens: int = 0  # host tier capacity this system had
    label: str = ""
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0  # device hits, including what a restore brought back before the match
    restored_tokens: int = 0  # of which came from the host tier
    recomputed_tokens: int = 0
    # A resumed call's latency counts from its trace arrival: it carries the lag its branch's earlier
    # calls left (the user-facing figure); its own wait counts from when the server received it (the
    # previous call answered, its tool returned): what this call's admission cost, nothing inherited.
    resume_latencies_s: list[float] = field(default_factory=list, repr=False)
    resume_queue_s: list[float] = field(default_factory=list, repr=False)
    own_waits_s: list[float] = field(default_factory=list, repr=False)  # every call: start - received
    resume_own_waits_s: list[float] = field(default_factory=list, repr=False)
    admission_refusals: int = 0  # admission attempts refused for room (the call waits and tries again)
    admission: str | None = None  # the admission order's strategy (None: the replay's own order)
    # (tenant, session) -> (its JCT here: last answer - first call's trace arrival, its trace's own span:
    # last arrival - first, the JCT a system with no wait at all comes closest to).
    sessions: dict = field(default_factory=dict, repr=False)
    # From a close (or abort) event to the moment the branch's KV is reclaimed, for the policies that
    # reclaim on close; a close waits for the branch's calls that came before it.
    reclaim_latencies_s: list[float] = field(default_factory=list, repr=False)
    reclaimed_tokens: int = 0
    queued_requests: int = 0
    refused_requests: int = 0
    pauses: int = 0
    decisions: dict = field(default_factory=dict)
    idle_kv_token_s: float = 0.0  # device KV of paused branches x time paused
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    prefetch: dict = field(default_factory=dict)
    tenant_hit_rates: dict = field(default_factory=dict)
    leaked_tokens: int | None = None
    terminated_shared_tokens: int | None = None
    host_tokens_at_end: int = 0
    integrity_ok: bool = False
    timeline: list = field(default_factory=list, repr=False)  # (t, {class: tokens})
    # The order the cache saw calls start ("a") and finish ("f"), by request id: what the LP lower
    # bound is computed on (sim/bound.py).
    access_log: list = field(default_factory=list, repr=False)
    # Each call as the cache served it: request id -> :class:`CallRecord`. What the non-clairvoyance
    # test compares call by call (tests/test_replay.py) and the real-session study reads per session.
    calls: dict = field(default_factory=dict, repr=False)
    completion_s: float = 0.0  # when the last call finished (the trace's makespan under this system)
    inference: dict = field(default_factory=dict)  # ours, inferred: what the chat inference decided
    # ours, inferred: request id -> where its reading departs from the trace's labels ("" where it does not;
    # _Run.audit_inferred), for the attribution study
    inference_flags: dict = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def session_jct_s(self) -> list[float]:
        return [jct for jct, _ in self.sessions.values()]

    @property
    def session_span_s(self) -> list[float]:
        return [span for _, span in self.sessions.values()]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.input_tokens, 1)

    def resume_quantiles(self) -> dict[str, float]:
        return _quantiles(self.resume_latencies_s)

    def to_dict(self) -> dict:
        skip = ("resume_latencies_s", "resume_queue_s", "reclaim_latencies_s", "access_log", "timeline", "calls",
                "own_waits_s", "resume_own_waits_s", "sessions")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["timeline"] = list(self.timeline)
        return out | {"hit_rate": self.hit_rate, "resume_s": self.resume_quantiles(),
                      "resume_mean_s": statistics.fmean(self.resume_latencies_s or [0.0]),
                      "resume_queue_s": _quantiles(self.resume_queue_s),
                      "own_wait_s": _quantiles(self.own_waits_s) | {"total": sum(self.own_waits_s)},
                      "resume_own_wait_s": _quantiles(self.resume_own_waits_s),
                      "session_jct_s": _quantiles(self.session_jct_s) | {
                          "mean": statistics.fmean(self.session_jct_s or [0.0])},
                      "reclaim_latency_s": _quantiles(self.reclaim_latencies_s),
                      "fairness_jain": jain(list(self.tenant_hit_rates.values())),
                      "resume_latencies_s": [round(x, 6) for x in self.resume_latencies_s]}


class _TokenBook:
    """Expands block ids to token ids (cached) and finds each call's exact continuation. One book
    serves every replay of the same trace and vocabulary (:func:`_token_book`)."""

    def __init__(self, trace: Trace, vocab_size: int):
        self.block = trace.header.block_tokens
        self.vocab = vocab_size
        self._blocks: dict[int, list[int]] = {}
        self._prompts: dict[str, array] = {}
        self.next_call: dict[str, Request] = {}
        last: dict[tuple, Request] = {}
        for record in trace.records:
            if isinstance(record, Request):
                key = (record.tenant, record.session, record.branch)
                if key in last:
                    self.next_call[last[key].id] = record
                last[key] = record

    def prompt(self, request: Request) -> list[int]:
        """The call's prompt tokens (a fresh list: callers may keep or extend it)."""
        cached = self._prompts.get(request.id)
        if cached is None:
            out: list[int] = []
            for block_id in request.blocks:
                ids = self._blocks.get(block_id)
                if ids is None:
                    ids = self._blocks[block_id] = block_token_ids(block_id, self.block, self.vocab)
                out.extend(ids)
            del out[request.input_tokens:]
            cached = self._prompts[request.id] = array("q", out)
        return cached.tolist()

    def output(self, request: Request) -> list[int]:
        """The tokens the call generates: what the branch's next prompt has there, else filler."""
        n = max(request.output_tokens, 1)
        nxt = self.next_call.get(request.id)
        if nxt is not None and nxt.input_tokens >= request.input_tokens + n:
            return self.prompt(nxt)[request.input_tokens: request.input_tokens + n]
        return block_token_ids(zlib.crc32(request.id.encode()), n, self.vocab)


_BOOKS: dict[tuple[int, int], tuple[Trace, _TokenBook]] = {}


def _token_book(trace: Trace, vocab_size: int) -> _TokenBook:
    """The book of ``trace`` (kept for the last few traces: a suite replays each many times)."""
    key = (id(trace), vocab_size)
    hit = _BOOKS.get(key)
    if hit is not None and hit[0] is trace:
        return hit[1]
    if len(_BOOKS) >= 4:
        _BOOKS.pop(next(iter(_BOOKS)))
    book = _TokenBook(trace, vocab_size)
    _BOOKS[key] = (trace, book)
    return book


class TraceFuture:
    """The trace's future, as only a clairvoyant policy may see it: when each branch's next call
    arrives after a call ends. The one place the replayer reads times other than arrivals."""

    def __init__(self, trace: Trace, tokens: "_TokenBook"):
        self.next_call = tokens.next_call

    def after(self, request: Request, now: float) -> Future:
        nxt = self.next_call.get(request.id)
        if nxt is None:
            return Future(wait_s=math.inf, resumes=False)
        return Future(wait_s=max(nxt.t - now, 0.0), resumes=True)


def _hint(request: Request, full: bool) -> dict:
    """The lifecycle hint the harness sends; baselines on our cache get ownership only (no stable
    prefix, no fork classes, no close), which is what they need to find a paused branch's KV."""
    hint = {"session": request.session, "branch": request.branch}
    if request.parent_branch is not None:
        hint["parent_branch"] = request.parent_branch
    if not full:
        return hint
    hint |= {"stable_prefix_tokens": request.stable_prefix_tokens, "close": request.close}
    if request.hints == "inferred":
        hint["inferred"] = True
    if request.parent_branch is not None and request.fork_point_tokens is not None:
        hint["fork_point_tokens"] = max(request.fork_point_tokens, request.stable_prefix_tokens)
    if request.edit_from_tokens is not None:
        hint["edit_from_tokens"] = request.edit_from_tokens
    return hint


class _Run:
    """One replay: the event loop's state (see :func:`replay`)."""

    def __init__(self, trace: Trace, policy: ReplayPolicy, pool_tokens: int, host_tokens: int, profile: Profile,
                 vocab_size: int, max_live: int, future: TraceFuture | None, timeline: bool,
                 admission: AdmissionSettings | None = None):
        from sgl_agentcache.server.scheduler.offline import OfflineDriver, OfflineHiCache, build_offline_cache

        self.trace, self.policy, self.profile, self.max_live = trace, policy, profile, max_live
        host_tokens = 0 if policy.reference else host_tokens  # stock SGLang has no host tier
        longest = max((r.input_tokens + max(r.output_tokens, 1) for r in trace.requests), default=1)
        hicache = OfflineHiCache(host_tokens, policy.hicache) if policy.hicache and host_tokens > 0 else None
        self.cache = build_offline_cache(pool_tokens=pool_tokens, max_reqs=max_live, context_len=longest,
                                         stock=policy.stock, enable_session_radix_cache=policy.session_radix,
                                         hicache=hicache)
        self.driver = OfflineDriver(self.cache)
        self.agent = not policy.stock
        self.ranking = None
        if self.agent:
            cache = self.cache
            if policy.ranking is not None:
                self.ranking = (policy.ranking(cache, hold_step=KVFLOW_HOLD_STEPS) if policy.steps
                                else policy.ranking(cache))
                cache.set_eviction_key(self.ranking.key)
            s = cache.pauses.settings
            s.bytes_per_token = profile.kv_bytes_per_token
            s.h2d_bytes_per_s, s.d2h_bytes_per_s = profile.h2d_bytes_per_s, profile.d2h_bytes_per_s
            s.prefill_tokens_per_s = profile.prefill_tokens_per_s
            if not policy.quotas:  # quotas are ours; baselines run without them
                cache.branch_quota_tokens = cache.session_quota_tokens = 1 << 40
                s.max_kept_branches = s.max_kept_tokens = 1 << 40
        self.rule = policy.pause_rule() if policy.pause_rule is not None else None
        self.book = LatencyBook()
        self.subagents = Subagents(self.book)  # subagents' lifetimes, for a lead's join (policy/join.py)
        self.prices_joins = getattr(self.rule, "prices_joins", False)
        # Session idleness (policy/idle.py): a branch answered without a tool or a close is paused on
        # the implicit tool ``@idle`` once idle past its namespace's usual gap, as the server's sweep does.
        self.idle = IdleBranches(self.book) if getattr(self.rule, "prices_idle", False) else None
        self.observed: dict[tuple[str, str], list[float]] = {}
        self.observed_all: dict[str, list[float]] = {}
        self.tokens = _token_book(trace, vocab_size)
        # The future, for a clairvoyant policy only (tests hand in a scrambled one).
        self.future = (future or TraceFuture(trace, self.tokens)) if policy.clairvoyant else None
        self.graph = StepGraph(KVFLOW_HOLD_STEPS + 1) if policy.steps else None
        self.by_id = by_id = {r.id: r for r in trace.requests}
        self.after_tool = {nxt.id: by_id[rid] for rid, nxt in self.tokens.next_call.items()
                           if by_id[rid].tool is not None}
        self.result = ReplayResult(policy=policy.name, label=policy.label, trace=trace.header.name,
                                   pool_tokens=pool_tokens, host_tokens=host_tokens,
                                   admission=admission.strategy if admission is not None else None)
        # The admission order (sim/admission.py); None: the replay's own (a branch's next call first).
        self.order = (ReplayAdmission(admission, self.resident, step_s=profile.forward_step_s())
                      if admission is not None else None)
        self.events: list[tuple] = []
        self.seq = 0
        self.waiting: list[tuple[Request | Event, float]] = []
        self.deferred: dict[tuple, list[tuple[Request, float]]] = {}
        self.live: dict[tuple, tuple] = {}  # branch -> (offline req, trace request)
        self.paused: dict[BranchKey, tuple[float, str, int]] = {}  # -> (since, tool class, device tokens)
        self.last_call: dict[BranchKey, Request] = {}  # each branch's latest finished call
        self.sessions: set[tuple[str, str]] = set()
        self.session_calls: dict[tuple[str, str], int] = {}
        self.finished_programs: list[int] = []  # calls per finished session (Continuum's eta)
        self.memoryfulness = 1.0
        self.lost_queue: deque = deque(maxlen=50)  # queueing of returning calls that lost KV (Continuum's T)
        self.tenant_tokens: dict[str, list[int]] = {}
        self.done_count = 0
        self.timeline = timeline
        # Ours, inferred: the server's chat inference names each call's branch when it is received
        # (sim/inferred.py); causality (a branch's next call waits for its previous one) stays on the
        # trace's own branches, whose names the rewritten calls keep here, by request id.
        self.inference = (ReplayInference(trace.header.block_tokens, infer_edits=policy.infer_edits,
                                          learn_bounds=policy.infer_learn_bounds)
                          if policy.infer else None)
        self.trace_keys: dict[str, tuple] = {}
        self.inferred_of: dict[tuple, BranchKey] = {}  # trace branch -> the inferred branch of its last call
        self.inferred_closed: set[BranchKey] = set()  # inferred branches the idle sweep or the bounds closed
        self.trace_closes: list[tuple] = []  # attribution: trace closes waiting for their branch's calls
        self.trace_closed: set[tuple] = set()
        self.inference_flags: dict[str, str] = {}
        self.audit = {"calls": 0, "trace_edits": 0, "trace_edits_inferred": 0, "trace_edits_as_forks": 0,
                      "trace_edits_continued": 0,
                      "edits_not_in_trace": 0, "subagent_starts": 0, "subagents_forked": 0,
                      "returns_after_close": 0, "returns_after_subagent_close": 0, "branch_changes": 0,
                      "trace_closes_applied": 0}
        self.received: dict[tuple, int] = {}  # trace branch -> its calls the server received, not yet done
        self.inferred_orphans = 0
        self.restore_marks: dict[str, int] = {}  # request id -> tokens its failed attempts loaded back
        self.received_at: dict[str, float] = {}  # request id -> when the server received it
        # (tenant, session) -> [first call's trace arrival, last call's trace arrival, last answer]
        self.session_times: dict[tuple[str, str], list[float]] = {}
        for r in trace.requests:
            times = self.session_times.setdefault((r.tenant, r.session), [r.t, r.t, r.t])
            times[0], times[1] = min(times[0], r.t), max(times[1], r.t)
        # Forks and joins (sim/causality.py): a call waits, unsent, for other branches' calls.
        self.blocked_by = {rid: set(ids) for rid, ids in cross_branch_prerequisites(trace).items()}
        self.unblocks: dict[str, list[str]] = {}
        for rid, ids in self.blocked_by.items():
            for prerequisite in ids:
                self.unblocks.setdefault(prerequisite, []).append(rid)
        self.blocked_closes: list[tuple[Event, float]] = []  # closes waiting for their branch's calls

    # ---- plumbing ----

    def push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, payload))
        self.seq += 1

    def key(self, r) -> tuple:
        """The trace branch of a record (a call rewritten by inference keeps its trace branch here)."""
        if isinstance(r, Request) and r.id in self.trace_keys:
            return self.trace_keys[r.id]
        return (r.tenant, r.session, r.branch)

    @staticmethod
    def branch(r) -> BranchKey:
        return BranchKey(namespace_key(r.tenant, None), r.session, r.branch)

    def owned_on_device(self, branch: BranchKey) -> int:
        return self.cache.tree_core.resident_owned_tokens(branch)

    def resident(self, request: Request) -> int:
        """Prompt tokens of ``request`` on the device now (a stock match: nothing loads back)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        key = RadixKey(array("q", self.tokens.prompt(request)), extra_key=request.tenant)
        with self.driver.activated():
            return UnifiedRadixCache.match_prefix(self.cache, MatchPrefixParams(key=key)).device_prefix_len

    def restored_so_far(self) -> int:
        """Tokens HiCache's admission load-backs brought back from its host pool so far."""
        return self.driver.hicache_loaded_tokens if self.driver.hicache else 0

    # ---- requests ----

    def try_start(self, request: Request, arrived: float, now: float) -> bool:
        from sgl_agentcache.server.scheduler.offline import OfflineOutOfMemory, OfflineRefused

        if len(self.live) >= self.max_live:
            return False
        # Admission budget, the scheduler's: with its match locked, the prompt's new tokens plus its
        # whole output must fit in what is free or evictable, after what live requests will still
        # decode (a prefix already on the device costs nothing, as in PrefillAdder).
        budget = max(request.output_tokens, 1) + sum(max(r.output_tokens, 1) for _, r in self.live.values())
        envelope = (lifecycle_envelope(_hint(request, self.policy.hints), message_id=request.id)
                    if self.agent else None)
        session_id = None
        if self.policy.session_radix:
            session_id = f"{request.tenant}/{request.session}"
            if (request.tenant, request.session) not in self.sessions:
                self.driver.open_session(session_id)
                self.sessions.add((request.tenant, request.session))
        restored_before = self.restored_so_far()
        try:
            req = self.driver.admit(request.id, self.tokens.prompt(request), kv_hints=envelope,
                                    extra_key=request.tenant, session_id=session_id, budget=budget)
        except OfflineOutOfMemory:
            self.result.admission_refusals += 1
            # Its match may already have loaded host copies back (as the scheduler's does at every
            # attempt): they count toward the call when it runs.
            self.restore_marks[request.id] = (self.restore_marks.get(request.id, 0)
                                              + self.restored_so_far() - restored_before)
            return False
        except OfflineRefused:
            if self.order is not None:
                self.order.started(request, self.branch(request), 0)
            self.result.refused_requests += 1  # a new fork of an already-closed parent: never served
            self.answered(request, now)
            self.waiting.extend(self.release_next(self.key(request), now))
            return True
        restored = self.restored_so_far() - restored_before + self.restore_marks.pop(request.id, 0)
        r = self.result
        r.access_log.append(("a", request.id))
        r.requests += 1
        r.input_tokens += request.input_tokens
        r.cached_tokens += req.cached_tokens
        r.restored_tokens += restored
        r.recomputed_tokens += request.input_tokens - req.cached_tokens
        if self.order is not None:
            self.order.started(request, self.branch(request), request.input_tokens - req.cached_tokens)
        tenant = self.tenant_tokens.setdefault(request.tenant, [0, 0])
        tenant[0] += req.cached_tokens
        tenant[1] += request.input_tokens
        # A restore at admission sits on the critical path (a prefetched one already happened).
        service = restored * self.profile.kv_bytes_per_token / self.profile.h2d_bytes_per_s
        service += self.profile.prefill_s(request.input_tokens - req.cached_tokens)
        own = now - self.received_at.pop(request.id, arrived)
        r.own_waits_s.append(own)
        previous = self.after_tool.get(request.id)
        r.calls[request.id] = CallRecord(now, req.cached_tokens, now - arrived + service, own, previous is not None,
                                         now + service)
        if previous is not None:
            r.resume_latencies_s.append(now - arrived + service)
            r.resume_queue_s.append(now - arrived)
            r.resume_own_waits_s.append(own)
            if req.cached_tokens < previous.input_tokens:
                self.lost_queue.append(now - arrived)
        service += self.profile.decode_s_per_token * max(request.output_tokens, 1)
        if self.graph is not None:
            self.update_steps(self.graph.started(request))
        elif self.future is not None:
            self.ranking.next_use[self.branch(request)] = now
        self.live[self.key(request)] = (req, request)
        self.push(now + service, "done", request)
        return True

    def receive(self, request: Request, now: float) -> Request | None:
        """The server receives a call: the call as it runs (inferred, for ours-inferred), or None when
        refused. The server's admission hook runs when a request is *received* (not when it is
        scheduled): a new fork of a closed or unknown parent is refused then (an inferred one runs as a
        branch of its own, as the cache's admission does); any other branch becomes known."""
        from sgl_agentcache.lifecycle import parent_refusal

        trace_key = self.key(request)
        if self.inference is not None:
            original = request
            request, forgotten = self.inference.receive(request, now)
            self.trace_keys[request.id] = trace_key
            self.audit_inferred(original, request, trace_key)
            self.close_inferred(forgotten)
        if self.agent:
            cache, own = self.cache, self.branch(request)
            if request.parent_branch is not None and own not in cache.seen:
                parent = BranchKey(own.namespace, own.session, request.parent_branch)
                if parent_refusal(parent, cache.seen, cache.closed) is not None:
                    if request.hints != "inferred":
                        self.result.refused_requests += 1
                        self.resolve(request, now)
                        return None
                    request = msgspec.structs.replace(request, parent_branch=None, fork_point_tokens=None)
                    self.inferred_orphans += 1
            cache.seen.add(own)
            if self.idle is not None:
                self.idle.arrived(request.tenant, request.session, request.branch, now)
            if request.parent_branch is not None and self.subagents.started(
                    request.tenant, request.session, request.branch, request.parent_branch, now):
                lead = BranchKey(own.namespace, own.session, request.parent_branch)
                if self.prices_joins and lead in self.paused:
                    self.reprice(lead, request.tenant, now)
        self.received[trace_key] = self.received.get(trace_key, 0) + 1
        self.received_at[request.id] = now
        if self.order is not None:
            self.order.received(request, self.branch(request), now)
        if self.graph is not None:
            self.update_steps(self.graph.received(request))
        return request

    def audit_inferred(self, original: Request, inferred: Request, trace_key: tuple) -> None:
        """Count where the inference's reading of a call departs from the trace's own labels (what the
        attribution study reports): edits missed or invented, subagents not linked to their parent,
        calls of a branch that was closed as idle, continuations moved to another branch."""
        a, own = self.audit, self.branch(inferred)
        before = self.inferred_of.get(trace_key)
        a["calls"] += 1
        flags = []
        if original.edit_from_tokens is not None:
            a["trace_edits"] += 1
            a["trace_edits_inferred"] += inferred.edit_from_tokens is not None
            a["trace_edits_as_forks"] += inferred.parent_branch is not None and own != before
            a["trace_edits_continued"] += inferred.edit_from_tokens is None and own == before
            flags.append("trace_edit")
        elif inferred.edit_from_tokens is not None:
            a["edits_not_in_trace"] += 1
            flags.append("edit_not_in_trace")
        if before is None and original.parent_branch is not None:
            a["subagent_starts"] += 1
            a["subagents_forked"] += inferred.parent_branch is not None
            flags.append("subagent_start")
        if before is not None and before != own:
            if before in self.inferred_closed:
                a["returns_after_close"] += 1
                a["returns_after_subagent_close"] += before in self.inference.subagents_closed  # a wrong guess
                flags.insert(0, "return_after_close")
            elif original.edit_from_tokens is None:
                a["branch_changes"] += 1
                flags.append("branch_change")
        self.inferred_of[trace_key] = own
        self.inference_flags[original.id] = flags[0] if flags else ""

    def resumed(self, request: Request, now: float) -> None:
        """A received call of a paused branch ends its pause: learn the tool's duration, account the
        memory the pause held."""
        branch = self.branch(request)
        if branch in self.paused:  # the tool returned: learn its duration, account idle memory
            since, tool_class, held = self.paused.pop(branch)
            waited = now - since
            self.book.observe(request.tenant, tool_class, waited)
            self.observed.setdefault((request.tenant, tool_class), []).append(waited)
            self.observed_all.setdefault(request.tenant, []).append(waited)
            held_now = self.owned_on_device(branch)
            self.result.idle_kv_token_s += (held + held_now) / 2 * waited

    def on_arrive(self, request: Request, now: float) -> None:
        key = self.key(request)
        if self.received.get(key) or key in self.deferred or request.id in self.blocked_by:
            # Causality: the next call of a branch carries its previous output, so the client sends it
            # when that call is answered (the trace's own service model may have been faster); only
            # then does the server receive it -- its hint, the end of the branch's tool pause. A fork's
            # first call and a lead's call after its subagents also wait for those other branches'
            # calls (``blocked_by``, sim/causality.py).
            self.deferred.setdefault(key, []).append((request, now))
            self.result.queued_requests += 1
            return
        request = self.receive(request, now)
        if request is None:
            return
        self.resumed(request, now)
        if self.waiting or not self.try_start(request, now, now):
            self.waiting.append((request, now))
            self.result.queued_requests += 1

    def on_done(self, request: Request, now: float) -> None:
        entry = self.live.get(self.key(request))
        if entry is None or entry[1] is not request:
            return  # aborted meanwhile
        del self.live[self.key(request)]
        self.driver.extend(entry[0], self.tokens.output(request), batched_decode=True)
        self.driver.finish(entry[0])
        self.result.access_log.append(("f", request.id))
        self.result.completion_s = now
        times = self.session_times[self.key(request)[:2]]  # the trace's session (inference renames it)
        times[2] = max(times[2], now)
        self.answered(request, now)
        branch = self.branch(request)
        if self.order is not None:
            self.order.answered(request, branch)
        self.last_call[branch] = request
        if request.close:
            self.branch_ended(request.tenant, request.session, request.branch, now)
        elif request.tool is None and self.idle is not None:
            self.idle.answered(request.tenant, request.session, request.branch, now)
            self.push(now + self.idle.after_s(request.tenant), "idle_check", None)
        session = (request.tenant, request.session)
        self.session_calls[session] = self.session_calls.get(session, 0) + 1
        if self.agent and request.tool is not None and self.rule is not None:
            self.pause(request, now)
        elif self.future is not None:  # clairvoyant: Belady knows when the branch runs next
            future = self.future.after(request, now)
            self.ranking.next_use[branch] = now + future.wait_s if future.resumes else math.inf
        if self.graph is not None:
            self.update_steps(self.graph.finished(request))
        self.done_count += 1
        if self.timeline and self.done_count % max(len(self.trace.requests) // TIMELINE_SAMPLES, 1) == 0:
            self.sample(now)
        # The branch's next calls are causally next: ahead of anything that waits on them.
        self.waiting[0:0] = self.release_next(self.key(request), now)
        self.drain(now)

    def release_next(self, key: tuple, now: float) -> list:
        """The first call held behind trace branch ``key``'s previous one reaches the server now (as
        ``[(call, arrived)]``, or ``[]``); the rest wait for its answer in turn (one unanswered call per
        trace branch, as from a client)."""
        queue = self.deferred.get(key)
        while queue and not self.received.get(key):
            record, arrived = queue[0]
            if record.id in self.blocked_by:
                return []  # a fork or a join: sent when the calls it reads are answered (resolve)
            queue.pop(0)
            if not queue:
                del self.deferred[key]
            received = self.receive(record, now)
            if received is not None:
                self.resumed(received, now)
                return [(received, arrived)]
        return []

    def update_steps(self, keys) -> None:
        """KVFlow: refresh the steps to execution of ``keys``; a waiting branch whose next step comes
        within ``load_ahead_step`` has its evicted KV loaded back now (may evict, as KVFlow's does)."""
        for tenant, session, name in keys:
            branch = BranchKey(namespace_key(tenant, None), session, name)
            before = self.ranking.steps.get(branch, KVFLOW_HOLD_STEPS + 1)
            steps = self.graph.steps((tenant, session, name))
            self.ranking.steps[branch] = steps
            if steps != before and 0 < steps <= KVFLOW_LOAD_AHEAD_STEPS:
                self.load_branch(branch, evict=True)

    # ---- tool pauses ----

    def pause(self, request: Request, now: float) -> None:
        branch, tool = self.branch(request), request.tool
        pauses = self.cache.pauses
        tokens = sum(len(n.key) for n in movable_suffix(self.cache.tree_core, branch))
        p = self.profile
        join = self.subagents.join(request.tenant, request.session, request.branch, now) \
            if self.prices_joins else None
        view = PauseView(
            now=now, tokens=tokens, latency=self.book.model(request.tenant, tool.tool_class), join=join,
            observations=self.observed.get((request.tenant, tool.tool_class), []),
            all_observations=self.observed_all.get(request.tenant, []),
            prefill_s=p.prefill_s(tokens), transfer_s=tokens * p.kv_bytes_per_token / p.h2d_bytes_per_s,
            tokens_per_s_link=p.d2h_bytes_per_s / p.kv_bytes_per_token,
            running_tokens=sum(r.input_tokens + r.output_tokens for _, r in self.live.values()),
            queue_s=statistics.fmean(self.lost_queue) if self.lost_queue else 0.0,
            memoryfulness=self.memoryfulness, host_tokens=self.cache.host_tier_tokens)
        order = self.rule(view, self.future.after(request, now) if self.future is not None else None)
        self.result.pauses += 1
        if order.next_use_in_s is not None:
            self.ranking.next_use[branch] = now + order.next_use_in_s
        if order.action is not None or order.latency is not None:
            with self.driver.activated():
                pauses.pause(branch, order.latency, tool_class=tool.tool_class, force=order.action,
                             resume_probability=order.resume_probability)
        self.paused[branch] = (now, tool.tool_class, self.owned_on_device(branch))
        if order.unpin_after_s is not None:
            self.push(now + order.unpin_after_s, "unpin", branch)
        if order.prefetch_after_s is not None:
            self.push(now + order.prefetch_after_s, "prefetch", (branch, order.prefetch_evicts))

    def price_idle(self, now: float) -> None:
        """The server's idle sweep: branches idle past their namespace's usual gap are paused on
        ``@idle`` with their idle time as elapsed (advice only: no deadline), and priced again as that
        time grows (``policy/idle.py``)."""
        for (tenant, session, name), since, idle_s in self.idle.due(now):
            branch = BranchKey(namespace_key(tenant, None), session, name)
            paused = self.paused.get(branch)
            if (paused is not None and paused[1] != IDLE_CLASS) or branch in self.cache.closed:
                continue
            model = self.idle.model(tenant)
            with self.driver.activated():
                result = self.cache.pauses.pause(branch, model, tool_class=IDLE_CLASS, elapsed_s=idle_s,
                                                 resume_probability=model.resume_rate())
            if result.get("paused") and paused is None:  # priced again: still paused since it went idle
                self.paused[branch] = (since, IDLE_CLASS, self.owned_on_device(branch))

    def reprice(self, lead: BranchKey, tenant: str, now: float) -> None:
        """A subagent of paused ``lead`` started: the lead's pause is decided again as a join on its
        running subagents, as the server's coordinator re-prices it (a rule that prices joins only)."""
        join = self.subagents.join(tenant, lead.session, lead.branch, now)
        if join is None or lead not in self.cache.pauses.records:
            return
        tool_class = self.paused[lead][1]
        with self.driver.activated():
            self.cache.pauses.pause(lead, join, tool_class=tool_class,
                                    resume_probability=self.book.peek(tenant, tool_class).resume_rate())

    def branch_ended(self, tenant: str, session: str, branch: str, now: float) -> None:
        """A branch closed or was aborted: as a subagent its lifetime is learned; as a lead, nothing
        waits on its subagents any more."""
        self.subagents.ended(tenant, session, branch, now)
        self.subagents.lead_ended(tenant, session, branch)

    def on_unpin(self, branch: BranchKey) -> None:
        record = self.cache.pauses.records.get(branch)
        if record is not None and branch in self.cache.pauses.kept:
            with self.driver.activated():
                self.cache.pauses.resume(branch)  # TTL over: back to plain eviction order

    def on_prefetch(self, branch: BranchKey, evict: bool) -> None:
        if branch in self.paused:  # not resumed, closed or released since
            self.load_branch(branch, evict=evict)

    def load_branch(self, branch: BranchKey, *, evict: bool) -> None:
        """Bring what HiCache's host pool holds of ``branch``'s last call's path back ahead of its next
        call (``evict``: into memory eviction frees too, else only into free memory)."""
        with self.driver.activated():
            last = self.last_call.get(branch)
            if last is None or not self.cache.on_hicache:
                return
            from sglang.srt.mem_cache.radix_cache import RadixKey

            tokens = self.tokens.prompt(last) + self.tokens.output(last)
            self.cache.load_from_host(RadixKey(array("q", tokens), last.tenant), evict=evict)
            self.driver.idle_poll()  # the copy is acknowledged at the scheduler's next loop

    # ---- closes ----

    def close_blocked(self, event: Event) -> bool:
        if event.kind == "abort":
            return False  # an abort cuts in: it is meant for calls in flight
        if event.kind == "close_session":
            affected = lambda key: key[:2] == (event.tenant, event.session)  # noqa: E731
        else:
            affected = lambda key: key == self.key(event)  # noqa: E731
        return (any(affected(key) for key in self.live) or any(affected(key) for key in self.deferred)
                or any(affected(self.key(r)) for r, _ in self.waiting if isinstance(r, Request)))

    def abort_live(self, event: Event, now: float) -> None:
        """An abort event ends the branch's running call (a client gone mid-call), if it has one."""
        key = self.key(event)
        if event.kind == "abort" and key in self.live:
            req, request = self.live.pop(key)
            self.driver.abort(req)
            self.answered(request, now)

    def apply_event(self, event: Event, now: float) -> None:
        self.abort_live(event, now)
        if self.graph is not None:
            ended = (sorted(key for key in self.graph.seen if key[:2] == (event.tenant, event.session))
                     if event.kind == "close_session" else [self.key(event)])
            for key in ended:
                self.update_steps(self.graph.branch_ended(key))
        if event.kind == "close_session":
            calls = self.session_calls.pop((event.tenant, event.session), 0)
            if calls:
                self.finished_programs.append(calls)
                self.memoryfulness = _memoryfulness(self.finished_programs)
        if self.policy.session_radix and event.kind == "close_session" \
                and (event.tenant, event.session) in self.sessions:
            self.driver.close_session(f"{event.tenant}/{event.session}")
            self.sessions.discard((event.tenant, event.session))
        if not self.agent:
            return
        cache = self.cache
        namespace = namespace_key(event.tenant, None)
        if event.kind == "close_session":
            branches = [b for b in set(cache.tree_core.owner_index) | set(cache.pauses.records)
                        if b.namespace == namespace and b.session == event.session]
        else:
            branches = [self.branch(event)]
        with self.driver.activated():
            if self.policy.hints:
                if event.kind == "close_session":
                    cache.close_session(namespace, event.session)
                else:
                    cache.close_branch(branches[0])
            else:  # the baselines never close anything on device; a paused copy is dropped
                for b in branches:
                    cache.pauses.forget(b)
        if event.kind == "close_session":
            self.subagents.session_ended(event.tenant, event.session)
        else:
            self.branch_ended(event.tenant, event.session, event.branch, now)
        if self.idle is not None:
            self.idle.ended(event.tenant, event.session, None if event.kind == "close_session" else event.branch)
        for b in branches:
            paused = self.paused.pop(b, None)
            if paused is not None:  # ended while it waited on its tool: counts against its resume rate
                self.book.observe_end(event.tenant, paused[1])
            if self.future is not None:
                self.ranking.next_use[b] = math.inf

    def on_event_inferred(self, event: Event, now: float) -> None:
        """Inferred: a client sends no closes; an abort ends the call only. With ``infer_trace_closes``
        (attribution), the trace's close of a branch with no call left closes the inferred branch its
        last call ran on, as an explicit close would."""
        self.abort_live(event, now)
        if self.policy.infer_trace_closes and event.kind != "abort":
            keys = ([k for k in self.inferred_of if k[:2] == (event.tenant, event.session)]
                    if event.kind == "close_session" else [self.key(event)])
            self.trace_closes.extend(keys)
            self.apply_trace_closes()
        if not self.received.get(self.key(event)):  # an abort freed the branch for its next call
            self.waiting.extend(self.release_next(self.key(event), now))

    def apply_trace_closes(self) -> None:
        """Attribution (``infer_trace_closes``): close, as an explicit close would, the inferred branch
        of each trace branch the trace closed, once that branch has no call left to run."""
        waiting = []
        for key in self.trace_closes:
            if self.received.get(key) or key in self.deferred:
                waiting.append(key)
                continue
            self.trace_closed.add(key)
            branch = self.inferred_of.get(key)
            if branch is None or branch in self.inferred_closed or any(
                    other == branch and k not in self.trace_closed for k, other in self.inferred_of.items()):
                continue  # another trace branch's calls run on it too (a subagent that continued its lead)
            self.inference.forget(branch)
            self.inferred_closed.add(branch)
            self.audit["trace_closes_applied"] += 1
            with self.driver.activated():
                self.cache.close_branch(branch)
            self.paused.pop(branch, None)
        self.trace_closes = waiting

    def answered(self, request: Request, now: float) -> None:
        """A received call ended (answered, refused at admission or aborted)."""
        self.received[self.key(request)] -= 1
        self.resolve(request, now)
        if self.inference is not None:
            self.inference.done(request, now)
            self.push(now + self.inference.next_sweep_after(request), "idle", None)
            if self.trace_closes:
                self.apply_trace_closes()

    def resolve(self, request: Request, now: float) -> None:
        """``request`` ended or was refused: a call held for it that waits for nothing else any more
        is sent now, after the current event (the answer, and its pause, come first)."""
        for rid in self.unblocks.pop(request.id, ()):
            waiting_for = self.blocked_by[rid]
            waiting_for.discard(request.id)
            if not waiting_for:
                del self.blocked_by[rid]
                self.push(now, "release", self.key(self.by_id[rid]))

    def on_idle(self, now: float) -> None:
        """The server's idle sweep (inferred): close what has waited past its bound."""
        self.close_inferred(self.inference.idle(now, {b: since for b, (since, tool, _) in self.paused.items()
                                                      if tool != IDLE_CLASS}))  # an idle pause holds nothing open

    def close_inferred(self, branches: list[BranchKey]) -> None:
        """Close branches the inference forgot (idle or over its bounds), as the server's sweeper does."""
        for branch in branches:
            self.inferred_closed.add(branch)
            if branch in self.cache.seen:  # else the server never saw it: nothing to close (its 404)
                with self.driver.activated():
                    self.cache.close_branch(branch, keep_cached=self.policy.infer_keep_on_close)
            self.paused.pop(branch, None)

    def drain(self, now: float) -> None:
        # Events wait behind earlier requests so that a close never overtakes the calls before it; a
        # close whose branch (session) still has calls to run steps aside until they are done, without
        # holding back other branches' calls (it may be what one of them waits for).
        ready = [item for item in self.blocked_closes if not self.close_blocked(item[0])]
        if ready:
            self.blocked_closes = [item for item in self.blocked_closes if item not in ready]
            for event, arrived in ready:
                self.end_with(event, arrived, now)
        if self.order is not None and len(self.waiting) > 1:
            self.order.reorder(self.waiting, self.branch, now)
        while self.waiting:
            record, arrived = self.waiting[0]
            if isinstance(record, Event):
                self.waiting.pop(0)
                if self.close_blocked(record):
                    self.blocked_closes.append((record, arrived))
                else:
                    self.end_with(record, arrived, now)
            elif self.try_start(record, arrived, now):
                self.waiting.pop(0)
            else:
                return

    def end_with(self, event: Event, arrived: float, now: float) -> None:
        """Apply a close or an abort that nothing holds back any more."""
        self.apply_event(event, now)
        if self.policy.hints and event.kind != "abort":
            self.result.reclaim_latencies_s.append(now - arrived)
        if not self.received.get(self.key(event)):  # an abort freed the branch for its next call
            self.waiting.extend(self.release_next(self.key(event), now))

    def sample(self, now: float) -> None:
        if self.agent:
            counts = self.cache.resident_tokens_by_class()
        else:
            counts = {"untagged": self.driver.pool_tokens - self.driver.free_tokens()}
        self.result.timeline.append((round(now, 6), counts))

    # ---- the loop ----

    def run(self) -> ReplayResult:
        for record in self.trace.records:
            self.push(record.t, "arrive", record)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive" and isinstance(payload, Request):
                self.on_arrive(payload, now)
            elif kind == "release":  # a fork or a join whose prerequisites were answered
                self.waiting[0:0] = self.release_next(payload, now)
                self.drain(now)
            elif kind == "arrive" and self.inference is not None:
                self.on_event_inferred(payload, now)
                self.drain(now)
            elif kind == "arrive":
                self.waiting.append((payload, now))
                self.drain(now)
            elif kind == "idle":
                self.on_idle(now)
            elif kind == "idle_check":
                self.price_idle(now)
            elif kind == "done":
                self.on_done(payload, now)
            elif kind == "unpin":
                self.on_unpin(payload)
            elif kind == "prefetch":
                self.on_prefetch(*payload)
            stuck = len(self.waiting) + len(self.deferred) + len(self.blocked_closes)
            if not self.events and stuck:
                raise RuntimeError(f"{stuck} requests or closes can never be admitted into a "
                                   f"{self.result.pool_tokens}-token pool")
        return self.finish()

    def finish(self) -> ReplayResult:
        r = self.result
        r.sessions = {key: (answered - first, last - first)
                      for key, (first, last, answered) in self.session_times.items()}
        report = self.driver.check()
        r.integrity_ok = report.ok
        if self.driver.hicache:  # HiCache's own copies (ours on HiCache and SGLang's cache alike)
            moved = self.driver.hicache_moved
            r.bytes_d2h = moved["d2h_tokens"] * self.profile.kv_bytes_per_token
            r.bytes_h2d = moved["h2d_tokens"] * self.profile.kv_bytes_per_token
            host = self.cache.cache_controller.mem_pool_host
            r.host_tokens_at_end = int(host.size) - int(host.available_size())
        r.tenant_hit_rates = {t: c / max(n, 1) for t, (c, n) in sorted(self.tenant_tokens.items())}
        if self.agent:
            pauses = self.cache.pauses
            r.decisions = dict(pauses.counters["decisions"]) | {
                "refused_closed": pauses.counters["refused_closed"], "too_small": pauses.counters["too_small"]}
            pf = pauses.prefetch
            judged = pf["used"] + pf["wasted"]
            r.prefetch = {"issued": pf["issued"], "used": pf["used"], "wasted": pf["wasted"],
                          "precision": pf["used"] / judged if judged else None}
        if self.inference is not None:
            r.inference = self.inference.stats() | {"orphans": self.inferred_orphans, "audit": dict(self.audit),
                                                    "kept_on_close_tokens": self.cache.kept_on_close_tokens}
            r.inference_flags = self.inference_flags
        if self.policy.hints:
            # Leaked: terminated tokens that nothing holds any more yet are still resident, on any tier
            # (must be 0): what a reclaim could free now (``awaits_reclaim``, as the integrity check asks).
            # Terminated nodes that other branches' nodes still hang below, on the device or in HiCache's
            # host pool, are shared, not leaked.
            core, cache = self.cache.tree_core, self.cache
            r.reclaimed_tokens = cache.freed_on_close_tokens
            r.leaked_tokens = sum(len(n.key) for n in core.terminated if core.awaits_reclaim(n))
            r.terminated_shared_tokens = sum(len(n.key) for n in core.terminated) - r.leaked_tokens
        if self.timeline:
            self.sample(max(r.completion_s, max((e.t for e in self.trace.records), default=0.0)))
        return r


def _memoryfulness(program_lengths: list[int]) -> float:
    """Continuum's eta = -Corr(k, N - k) over the calls k = 1..N of finished programs (1 when fewer
    than two distinct samples)."""
    ks = [k for n in program_lengths for k in range(1, n + 1)]
    rest = [n - k for n in program_lengths for k in range(1, n + 1)]
    if len(set(ks)) < 2 or len(set(rest)) < 2:
        return 1.0
    return -statistics.correlation(ks, rest)


def replay(trace: Trace, policy: str | ReplayPolicy, *, pool_tokens: int, host_tokens: int, profile: Profile,
           vocab_size: int = 512, max_live: int = 64, future: TraceFuture | None = None,
           timeline: bool = True, admission: str | AdmissionSettings | None = None) -> ReplayResult:
    """Replay ``trace`` under ``policy`` (a name in :data:`POLICIES` or a :class:`ReplayPolicy`) with a
    ``pool_tokens`` device KV pool and ``host_tokens`` of host tier (a reference policy -- stock SGLang
    -- runs without one). ``future`` replaces the trace's future a clairvoyant policy reads (tests);
    ``timeline``: sample resident tokens by class over time (for plots). ``admission``: the order in
    which waiting calls are tried (a strategy of ``policy/admission_order.py``, or its settings; None:
    the replay's own order, see ``sim/admission.py``)."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        policy = POLICIES[policy]
    if host_tokens < 0 or pool_tokens <= 0:
        raise ValueError(f"pool_tokens must be positive and host_tokens non-negative, got {pool_tokens}, {host_tokens}")
    started = time.perf_counter()
    if isinstance(admission, str):
        admission = AdmissionSettings(strategy=admission)
    with _quiet(_HICACHE_NARRATORS if policy.hicache else ()):
        result = _Run(trace, policy, pool_tokens, host_tokens, profile, vocab_size, max_live, future, timeline,
                      admission).run()
    result.wall_s = time.perf_counter() - started
    return result


@contextmanager
def _quiet(names: tuple[str, ...]):
    """Raise the loggers ``names`` to ERROR for the block, then restore their levels."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
