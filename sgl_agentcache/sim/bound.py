"""A provable lower bound on recomputed prefill tokens: the LP relaxation of offline caching.

For one replay run -- its trace, the order in which its calls started and finished (the run's
``access_log``) and a capacity ``C = device pool + host tier`` in tokens -- no cache that holds at
most ``C`` tokens on its two tiers together can recompute fewer tokens than :func:`lower_bound`.

Why it is a bound. Identify every prompt token by its namespace (tenant), the chain of block ids up to
its block, and its offset in the block: the replay expands each block id into the same tokens every
time, so equal chains are equal prompts, which is what a prefix cache can reuse. (Two different blocks
expand to tokens that start alike only by coincidence of the expansion; the suite replays with a
2**31-token vocabulary, which makes that a 1-in-2**31 event per point where prompts diverge, and checks
every run's recompute against its bound.) A call's start
*accesses* its prompt tokens (a token is a hit only if it was kept since its last *touch*); a call's
finish *inserts* the output tokens its branch's next prompt carries (decoded, never prefilled: a free
touch). Between two consecutive touches of a token, keeping it occupies one token of capacity at every
point in between. So for any real schedule, the tokens it hits are a selection of such touch intervals
(each ending in an access) whose overlap at every point between two events is at most ``C``. Relax:
drop the prefix constraint (a real hit needs every earlier token too), let tokens held by running
requests and duplicates held on both tiers cost nothing extra, allow fractions, and let a call hit what
another call started just before it (a real one only after the other's prefill). Each relaxation only
enlarges the feasible set, so the LP's maximum of kept tokens is at least any real schedule's hits,
and ``total prompt tokens - LP maximum`` is at most any real schedule's recompute.

Tokens whose touch intervals coincide are one LP variable (their sum): per token the objective and the
capacity use are both 1, so merging them loses nothing. The LP is solved with HiGHS
(``scipy.optimize.linprog``); it has a variable per distinct interval and a row per event.

The bound holds for the run's own order of events, which depends on the system (a system that
recomputes less serves faster, and calls interleave differently). The suite reports, per cell, the
smallest bound over the systems it ran: a lower bound for each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_agentcache.trace.schema import Request, Trace


@dataclass(frozen=True)
class Bound:
    recompute_tokens: float  # no cache of this capacity recomputes fewer (on this order)
    access_tokens: int  # prompt tokens of the calls that ran
    compulsory_tokens: int  # touched for the first time: recomputed by every cache, however large
    capacity_tokens: int
    variables: int


class _Touches:
    """The event that last touched each token range of each block chain, for one run.

    A block whose touched range is one run from offset 0 (nearly every block) lives in two arrays
    (``end``, ``event``), so a call's access is a few array operations; any other shape (a partial
    block whose tail an output insert touched later) in ``special`` as ``[(start, end, event)]``."""

    def __init__(self, chains: int):
        import numpy as np

        self.np = np
        self.event = np.full(chains, -1, dtype=np.int64)
        self.end = np.zeros(chains, dtype=np.int64)
        self.is_special = np.zeros(chains, dtype=bool)
        self.special: dict[int, list[tuple[int, int, int]]] = {}

    def access(self, ix, lens, event: int, intervals: dict) -> int:
        """Call start: ``[0, lens[k])`` of each chain ``ix[k]``. Adds each earlier-touched range to
        ``intervals[(previous event, event)]``; returns the tokens never touched before."""
        np = self.np
        fresh = 0
        spec = self.is_special[ix]
        if spec.any():
            for i, n in zip(ix[spec].tolist(), lens[spec].tolist()):
                fresh += self.touch_one(i, 0, n, event, intervals)
            keep = ~spec
            ix, lens = ix[keep], lens[keep]
        before, end = self.event[ix], self.end[ix]
        overlap = np.where(before >= 0, np.minimum(end, lens), 0)
        fresh += int(lens.sum() - overlap.sum())
        hit = overlap > 0
        if hit.any():
            events, inverse = np.unique(before[hit], return_inverse=True)
            sums = np.bincount(inverse, weights=overlap[hit])
            for ev, size in zip(events.tolist(), sums.tolist()):
                intervals[(ev, event)] = intervals.get((ev, event), 0) + int(size)
        shorter = (before >= 0) & (lens < end)  # a shorter prefix than before: two runs now
        if shorter.any():
            for i, n, e_end, ev in zip(ix[shorter].tolist(), lens[shorter].tolist(), end[shorter].tolist(),
                                       before[shorter].tolist()):
                self.special[i] = [(0, n, event), (n, e_end, ev)]
                self.is_special[i] = True
        self.event[ix] = event
        self.end[ix] = lens  # the shorter ones are special now: these entries are not read for them
        return fresh

    def touch_one(self, i: int, lo: int, hi: int, event: int, intervals: dict | None) -> int:
        """The general case for one chain: mark ``[lo, hi)`` touched at ``event`` (an access when
        ``intervals`` is given); returns the tokens never touched before."""
        if self.is_special[i]:
            ranges = self.special[i]
        elif self.event[i] >= 0:
            ranges = [(0, int(self.end[i]), int(self.event[i]))]
        else:
            ranges = []
        kept, fresh = [], hi - lo
        for start, end, ev in ranges:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                fresh -= b - a
                if intervals is not None:
                    intervals[(ev, event)] = intervals.get((ev, event), 0) + (b - a)
            if start < lo:
                kept.append((start, min(end, lo), ev))
            if end > hi:
                kept.append((max(start, hi), end, ev))
        kept.append((lo, hi, event))
        kept.sort()
        if len(kept) == 1 and kept[0][0] == 0:
            self.is_special[i] = False
            self.special.pop(i, None)
            self.end[i], self.event[i] = kept[0][1], kept[0][2]
        else:
            self.is_special[i] = True
            self.special[i] = kept
        return fresh


def _chains(request: Request, block_tokens: int) -> list[tuple[int, int]]:
    """``(chain id, tokens of that block the prompt holds)`` for each block of ``request``'s prompt."""
    out, h, left = [], hash(("tenant", request.tenant)), request.input_tokens
    for block in request.blocks:
        if left <= 0:
            break
        h = hash((h, block))
        out.append((h, min(block_tokens, left)))
        left -= block_tokens
    return out


class _TraceIndex:
    """Per trace: each call's block chains (dense indexes and token counts) and its branch's next call,
    shared by every run's bound."""

    def __init__(self, trace: Trace):
        import numpy as np

        block = trace.header.block_tokens
        self.requests = {r.id: r for r in trace.requests}
        dense: dict[int, int] = {}
        self.chains: dict[str, tuple] = {}
        for r in trace.requests:
            pairs = _chains(r, block)
            ix = [dense.setdefault(h, len(dense)) for h, _ in pairs]
            self.chains[r.id] = (np.array(ix, dtype=np.int64), np.array([n for _, n in pairs], dtype=np.int64))
        self.size = len(dense)
        self.next_call: dict[str, Request] = {}
        last: dict[tuple, Request] = {}
        for r in trace.requests:
            key = (r.tenant, r.session, r.branch)
            if key in last:
                self.next_call[last[key].id] = r
            last[key] = r


_INDEXES: dict[int, tuple[Trace, _TraceIndex]] = {}


def _index(trace: Trace) -> _TraceIndex:
    hit = _INDEXES.get(id(trace))
    if hit is not None and hit[0] is trace:
        return hit[1]
    if len(_INDEXES) >= 4:
        _INDEXES.pop(next(iter(_INDEXES)))
    index = _TraceIndex(trace)
    _INDEXES[id(trace)] = (trace, index)
    return index


def lower_bound(trace: Trace, access_log: list[tuple[str, str]], capacity_tokens: int) -> Bound:
    """The LP lower bound on recomputed prompt tokens for ``trace`` run in ``access_log``'s order with
    ``capacity_tokens`` of device + host (see the module docstring)."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix

    block = trace.header.block_tokens
    index = _index(trace)
    requests, next_call, chains = index.requests, index.next_call, index.chains
    touches = _Touches(index.size)
    intervals: dict[tuple[int, int], int] = {}
    access = compulsory = 0
    for event, (kind, rid) in enumerate(access_log):
        r = requests[rid]
        if kind == "a":
            ix, lens = chains[rid]
            compulsory += touches.access(ix, lens, event, intervals)
            access += r.input_tokens
        else:  # the finish inserts the output its branch's next prompt carries at [input, input + out)
            nxt = next_call.get(rid)
            out = max(r.output_tokens, 1)
            if nxt is None or nxt.input_tokens < r.input_tokens + out:
                continue
            lo, hi = r.input_tokens, r.input_tokens + out
            ix, lens = chains[nxt.id]
            for j in range(lo // block, min((hi - 1) // block + 1, len(ix))):
                a, b = max(lo, j * block), min(hi, j * block + int(lens[j]))
                if a < b:
                    touches.touch_one(int(ix[j]), a - j * block, b - j * block, event, None)
    pairs = [(a, b, size) for (a, b), size in intervals.items()]
    if not pairs:
        return Bound(float(access), access, compulsory, capacity_tokens, 0)
    events = len(access_log)
    # Row g: the capacity between events g and g + 1; interval (a, b) occupies rows a .. b-1.
    rows, cols = [], []
    for k, (a, b, _) in enumerate(pairs):
        rows.extend(range(a, b))
        cols.extend([k] * (b - a))
    matrix = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(max(events - 1, 1), len(pairs)))
    sizes = np.array([size for _, _, size in pairs], dtype=float)
    solved = linprog(-np.ones(len(pairs)), A_ub=matrix, b_ub=np.full(matrix.shape[0], float(capacity_tokens)),
                     bounds=np.stack([np.zeros(len(pairs)), sizes], axis=1), method="highs")
    if not solved.success:
        raise RuntimeError(f"lower bound LP failed: {solved.message}")
    kept = -solved.fun
    # HiGHS's optimum is exact up to its tolerance; round the kept tokens up so the bound stays below.
    # Tokens touched for the first time are recomputed by any cache: the bound is never below them.
    bound = max(access - kept - 1e-6 * access - 1.0, float(compulsory))
    return Bound(bound, access, compulsory, capacity_tokens, len(pairs))


__all__ = ["Bound", "lower_bound"]
