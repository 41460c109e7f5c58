"""Replay an agent trace through the real cache code under a cost model.

The cache is the real one the server runs -- :class:`~sgl_agentcache.server.cache.AgentRadixCache`, or
SGLang's own ``UnifiedRadixCache`` for the stock baseline -- built offline on SGLang's CPU pools and
driven through the scheduler's own calls (:mod:`sgl_agentcache.server.offline`). The replayer owns only
time: a discrete-event loop over the trace's records, where a request is admitted when KV slots can be
found (else it waits, FIFO), holds its slots for ``prefill(uncached) + decode(output)`` seconds of
modelled service, and is then finished (or aborted). No model runs and no KV bytes move.

Policies in this increment:

- ``stock``      B0: SGLang's ``UnifiedRadixCache`` with its LRU strategy; hints and closes are not sent.
- ``agentcache`` our cache with every lifecycle hint the trace implies (session, branch, parent,
                 stable prefix, fork point, context edits, close) and the trace's close/abort events.

Outputs are exact where the trace says so: a call's generated tokens are the tokens its branch's next
prompt carries at those positions, so the next turn can hit them, as on a real server.
"""

from __future__ import annotations

import heapq
import statistics
import time
import zlib
from dataclasses import asdict, dataclass, field

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.sim.cost import Profile
from sgl_agentcache.trace.schema import Event, Request, Trace, block_token_ids

POLICIES = ("stock", "agentcache")


@dataclass
class ReplayResult:
    policy: str
    trace: str
    pool_tokens: int
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    resume_latencies_s: list[float] = field(default_factory=list, repr=False)
    queued_requests: int = 0
    refused_requests: int = 0
    leaked_tokens: int | None = None
    terminated_shared_tokens: int | None = None
    integrity_ok: bool = False
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.input_tokens, 1)

    def resume_quantiles(self) -> dict[str, float]:
        lat = sorted(self.resume_latencies_s)
        if not lat:
            return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
        pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
        return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "resume_latencies_s"}
        return out | {"hit_rate": self.hit_rate, "resume_s": self.resume_quantiles(),
                      "resume_mean_s": statistics.fmean(self.resume_latencies_s or [0.0])}


class _TokenBook:
    """Expands block ids to token ids (cached) and finds each call's exact continuation."""

    def __init__(self, trace: Trace, vocab_size: int):
        self.block = trace.header.block_tokens
        self.vocab = vocab_size
        self._blocks: dict[int, list[int]] = {}
        self.next_call: dict[str, Request] = {}
        last: dict[tuple, Request] = {}
        for record in trace.records:
            if isinstance(record, Request):
                key = (record.tenant, record.session, record.branch)
                if key in last:
                    self.next_call[last[key].id] = record
                last[key] = record

    def prompt(self, request: Request) -> list[int]:
        out: list[int] = []
        for block_id in request.blocks:
            ids = self._blocks.get(block_id)
            if ids is None:
                ids = self._blocks[block_id] = block_token_ids(block_id, self.block, self.vocab)
            out.extend(ids)
        return out[: request.input_tokens]

    def output(self, request: Request) -> list[int]:
        """The tokens the call generates: what the branch's next prompt has there, else filler."""
        n = max(request.output_tokens, 1)
        nxt = self.next_call.get(request.id)
        if nxt is not None and nxt.input_tokens >= request.input_tokens + n:
            return self.prompt(nxt)[request.input_tokens: request.input_tokens + n]
        return block_token_ids(zlib.crc32(request.id.encode()), n, self.vocab)


def _hint(request: Request) -> dict:
    hint = {"session": request.session, "branch": request.branch,
            "stable_prefix_tokens": request.stable_prefix_tokens, "close": request.close}
    if request.parent_branch is not None:
        hint["parent_branch"] = request.parent_branch
        if request.fork_point_tokens is not None:
            hint["fork_point_tokens"] = max(request.fork_point_tokens, request.stable_prefix_tokens)
    if request.edit_from_tokens is not None:
        hint["edit_from_tokens"] = request.edit_from_tokens
    return hint


def replay(trace: Trace, policy: str, *, pool_tokens: int, profile: Profile, vocab_size: int = 512,
           max_live: int = 64) -> ReplayResult:
    """Replay ``trace`` under ``policy`` with a ``pool_tokens`` KV pool; see the module docstring."""
    from sgl_agentcache.lifecycle import BranchKey
    from sgl_agentcache.server.offline import OfflineDriver, OfflineOutOfMemory, OfflineRefused, build_offline_cache

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {POLICIES}")
    started = time.perf_counter()
    longest = max((r.input_tokens + max(r.output_tokens, 1) for r in trace.requests), default=1)
    cache = build_offline_cache(pool_tokens=pool_tokens, max_reqs=max_live, context_len=longest,
                                stock=policy == "stock")
    driver = OfflineDriver(cache)
    hinted = policy == "agentcache"
    book = _TokenBook(trace, vocab_size)
    result = ReplayResult(policy=policy, trace=trace.header.name, pool_tokens=pool_tokens)
    events: list[tuple] = []
    seq = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    for record in trace.records:
        push(record.t, "arrive", record)
    waiting: list[tuple[Request | Event, float]] = []
    deferred: dict[tuple, list[tuple[Request, float]]] = {}
    live: dict[tuple, tuple] = {}  # branch -> (offline req, trace request)
    by_id = {r.id: r for r in trace.requests}
    after_tool = {nxt.id for rid, nxt in book.next_call.items() if by_id[rid].tool is not None}

    def branch_key(r) -> tuple:
        return (r.tenant, r.session, r.branch)

    def try_start(request: Request, arrived: float, now: float) -> bool:
        if branch_key(request) in live:  # its previous call is still running (see "arrive")
            deferred.setdefault(branch_key(request), []).append((request, arrived))
            return True
        # Admission budget, like the scheduler's: the prompt plus the whole output must fit in what is
        # free or evictable, after what live requests will still decode.
        reserved = sum(max(r.output_tokens, 1) for _, r in live.values())
        headroom = driver.free_tokens() + cache.evictable_size() - reserved
        if len(live) >= max_live or headroom < request.input_tokens + max(request.output_tokens, 1):
            return False
        envelope = lifecycle_envelope(_hint(request), message_id=request.id) if hinted else None
        try:
            req = driver.admit(request.id, book.prompt(request), kv_hints=envelope, extra_key=request.tenant)
        except OfflineOutOfMemory:
            return False
        except OfflineRefused:
            result.refused_requests += 1  # e.g. a fork of an already-closed parent: never served
            return True
        result.requests += 1
        result.input_tokens += request.input_tokens
        result.cached_tokens += req.cached_tokens
        result.recomputed_tokens += request.input_tokens - req.cached_tokens
        service = profile.prefill_s(request.input_tokens - req.cached_tokens)
        if request.id in after_tool:
            result.resume_latencies_s.append(now - arrived + service)
        service += profile.decode_s_per_token * max(request.output_tokens, 1)
        live[branch_key(request)] = (req, request)
        push(now + service, "done", request)
        return True

    def close_blocked(event: Event) -> bool:
        if event.kind == "abort":
            return False  # an abort cuts in: it is meant for calls in flight
        if event.kind == "close_session":
            affected = lambda key: key[:2] == (event.tenant, event.session)  # noqa: E731
        else:
            affected = lambda key: key == branch_key(event)  # noqa: E731
        return any(affected(key) for key in live) or any(affected(key) for key in deferred)

    def drain_waiting(now: float) -> None:
        # Events wait behind earlier requests so that a close never overtakes the calls before it.
        while waiting:
            record, arrived = waiting[0]
            if isinstance(record, Event) and close_blocked(record):
                return  # a close waits for the calls of its branch (session) that came before it
            if isinstance(record, Event):
                _apply_event(driver, record, live, hinted, BranchKey)
                if branch_key(record) not in live:  # an abort freed the branch for its deferred calls
                    waiting.extend(deferred.pop(branch_key(record), ()))
            elif not try_start(record, arrived, now):
                return
            waiting.pop(0)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive" and isinstance(payload, Request):
            if branch_key(payload) in live:
                # Causality: the next call of a branch carries its previous output, so it cannot start
                # before that call ends (the trace's own service model may have been faster).
                deferred.setdefault(branch_key(payload), []).append((payload, now))
                result.queued_requests += 1
            elif waiting or not try_start(payload, now, now):
                waiting.append((payload, now))
                result.queued_requests += 1
        elif kind == "arrive":
            waiting.append((payload, now))
            drain_waiting(now)
        elif kind == "done":
            entry = live.get(branch_key(payload))
            if entry is None or entry[1] is not payload:
                continue  # aborted meanwhile
            del live[branch_key(payload)]
            req = entry[0]
            driver.extend(req, book.output(payload))
            driver.finish(req)
            # The branch's next calls are causally next: ahead of anything that waits on them.
            waiting[0:0] = deferred.pop(branch_key(payload), ())
            drain_waiting(now)
        if not events and (waiting or deferred):
            raise RuntimeError(f"{len(waiting) + len(deferred)} requests can never be admitted into a "
                               f"{pool_tokens}-token pool")

    report = driver.check()
    result.integrity_ok = report.ok
    if hinted:
        # Leaked: terminated tokens that nothing holds any more yet are still resident (must be 0).
        # Terminated nodes that other branches' nodes still hang below are shared, not leaked.
        core = cache.tree_core
        result.leaked_tokens = sum(len(n.key) for n in core.terminated if core.is_device_leaf(n))
        result.terminated_shared_tokens = sum(len(n.key) for n in core.terminated) - result.leaked_tokens
    result.wall_s = time.perf_counter() - started
    return result


def _apply_event(driver, event: Event, live: dict, hinted: bool, BranchKey) -> None:
    key = (event.tenant, event.session, event.branch)
    if event.kind == "abort" and key in live:
        req, _ = live.pop(key)
        driver.abort(req)
    if not hinted:
        return
    cache = driver.cache
    namespace = namespace_key(event.tenant, None)
    with driver.activated():
        if event.kind == "close_session":
            cache.close_session(namespace, event.session)
        else:
            cache.close_branch(BranchKey(namespace, event.session, event.branch))
