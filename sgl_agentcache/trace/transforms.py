"""Structure-preserving trace transforms (pure: stdlib and msgspec only)."""

from __future__ import annotations

import json

import msgspec

from sgl_agentcache.trace.schema import Request, Trace, TraceError, TraceHeader, validate

__all__ = ["scale_tokens"]


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
