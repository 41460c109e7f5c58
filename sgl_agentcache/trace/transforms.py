"""Structure-preserving trace transforms (pure: stdlib and msgspec only)."""

from __future__ import annotations

import json
import random

import msgspec

from sgl_agentcache.trace.schema import Request, Trace, TraceError, TraceHeader, validate

__all__ = ["merge_tenants", "offset_sessions", "scale_tokens"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_tokens(trace: Trace, factor: int) -> Trace:
    """The same trace with every token count divided by ``factor`` (rounded up) and blocks of
    ``block_tokens / factor`` tokens.

    Block ids, their number per prompt, times, tools and lineage are unchanged, so every prompt shares
    exactly the blocks it shared before: a replay sees the same reuse structure at ``1/factor`` of the
    tokens (cheaper to replay; prefill is then ``factor`` times cheaper relative to tool and think time,
    which a caller must account for). ``factor`` must divide ``block_tokens``. Lengths inside a prompt
    (stable prefix, fork point, edit point) are scaled the same way and capped at the new prompt length;
    an output of at least one token stays at least one.
    """
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise TraceError(f"token scale factor must be a positive integer, got {factor!r}")
    block = trace.header.block_tokens
    if block % factor:
        raise TraceError(f"token scale factor {factor} does not divide the trace's {block}-token blocks")
    if factor == 1:
        return trace

    def length(value: int | None, cap: int) -> int | None:
        return None if value is None else min(_ceil_div(value, factor), cap)

    records = []
    for record in trace.records:
        if isinstance(record, Request):
            tokens = _ceil_div(record.input_tokens, factor)
            record = msgspec.structs.replace(
                record, input_tokens=tokens, output_tokens=_ceil_div(record.output_tokens, factor),
                stable_prefix_tokens=length(record.stable_prefix_tokens, tokens),
                fork_point_tokens=length(record.fork_point_tokens, tokens),
                edit_from_tokens=length(record.edit_from_tokens, tokens))
        records.append(record)
    source = json.dumps({"token_scale": factor, "of": trace.header.source}, sort_keys=True)
    header = TraceHeader(version=trace.header.version, name=trace.header.name, block_tokens=block // factor,
                         source=source)
    return validate(Trace(header=header, records=records))


def offset_sessions(trace: Trace, seed: int, spread_s: float) -> Trace:
    """The same trace with each session shifted in time by its own seeded offset in ``[0, spread_s)``.

    Within a session nothing moves relative to anything else (call gaps, tool and think times, forks,
    closes), so every agent does exactly what it did; only how sessions overlap changes. This is how a
    fixed real trace yields independent replays for a confidence interval. Seed 0 returns the trace.
    """
    if spread_s < 0 or seed < 0:
        raise TraceError(f"offset_sessions: seed and spread must be non-negative, got {seed}, {spread_s}")
    if seed == 0 or spread_s == 0:
        return trace
    rng = random.Random(seed)
    shift: dict[tuple[str, str], float] = {}
    for record in trace.records:  # first appearance order: the same sessions get the same draws
        key = (record.tenant, record.session)
        if key not in shift:
            shift[key] = round(rng.uniform(0.0, spread_s), 6)
    moved = [(record.t + shift[(record.tenant, record.session)], i, record) for i, record in enumerate(trace.records)]
    moved.sort(key=lambda item: (item[0], item[1]))  # stable: a session's own order is kept
    records = [msgspec.structs.replace(record, t=round(t, 6)) for t, _, record in moved]
    source = json.dumps({"offset_sessions": {"seed": seed, "spread_s": spread_s}, "of": trace.header.source},
                        sort_keys=True)
    header = TraceHeader(version=trace.header.version, name=trace.header.name,
                         block_tokens=trace.header.block_tokens, source=source)
    return validate(Trace(header=header, records=records))


def merge_tenants(traces: dict[str, Trace]) -> Trace:
    """One trace from several, each the traffic of one tenant (its key): every record takes that tenant,
    request ids are prefixed by it (``tenant:id``), and records are merged by arrival (ties keep the
    order of ``traces``, then each trace's own). Block ids stay: a block's tokens are shared only within a
    tenant, whose namespace differs. All traces must have the same block size."""
    if not traces:
        raise TraceError("merge_tenants: no traces")
    sizes = {trace.header.block_tokens for trace in traces.values()}
    if len(sizes) != 1:
        raise TraceError(f"merge_tenants: traces have different block sizes {sorted(sizes)}")
    merged = []
    for order, (tenant, trace) in enumerate(traces.items()):
        for i, record in enumerate(trace.records):
            record = msgspec.structs.replace(record, tenant=tenant)
            if isinstance(record, Request):
                record = msgspec.structs.replace(record, id=f"{tenant}:{record.id}")
            merged.append((record.t, order, i, record))
    merged.sort(key=lambda item: item[:3])
    source = json.dumps({"merge_tenants": {t: tr.header.source for t, tr in traces.items()}}, sort_keys=True)
    header = TraceHeader(name="+".join(f"{t}:{tr.header.name}" for t, tr in traces.items()),
                         block_tokens=sizes.pop(), source=source)
    return validate(Trace(header=header, records=[record for *_, record in merged]))
