"""Summary statistics of a trace (pure: stdlib only): what a workload is, in one JSON-serialisable dict.

The *ideal prefix reuse* is the fraction of input tokens an infinite, tenant-isolated prefix cache
would serve from earlier prompts: requests are replayed in trace order against one block trie per
tenant, and a request is served the longest prefix of its blocks already in the trie. A block counts
only as many tokens as an earlier prompt held of it (a prompt's last block may be partial), and the match
stops inside a block held only partly. Outputs are not counted: a replay cannot make the model emit the
tokens a trace's next prompt contains, so only prompt tokens can be reused.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from sgl_agentcache.trace.schema import Event, Request, Trace

__all__ = ["ideal_reuse", "quantile", "stats_line", "trace_stats"]


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile of already sorted values, interpolating linearly between ranks."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def _durations(values: list[float]) -> dict:
    values = sorted(values)
    return {"count": len(values), "mean_s": sum(values) / len(values), "p50_s": quantile(values, 0.5),
            "p90_s": quantile(values, 0.9), "p95_s": quantile(values, 0.95), "p99_s": quantile(values, 0.99),
            "max_s": values[-1]}


def _reused_tokens(requests: list[Request], block_tokens: int) -> list[int]:
    """Per request, the input tokens an infinite per-tenant prefix cache would hold (see module doc)."""
    roots: dict[str, dict] = defaultdict(dict)  # tenant -> {block: [tokens held, children]}
    out = []
    for req in requests:
        children, hit, matching = roots[req.tenant], 0, True
        last = len(req.blocks) - 1
        for index, block in enumerate(req.blocks):
            tokens = req.input_tokens - last * block_tokens if index == last else block_tokens
            node = children.get(block)
            if node is None:
                node = children[block] = [0, {}]
            if matching:
                hit += min(tokens, node[0])
                matching = node[0] >= tokens
            node[0] = max(node[0], tokens)
            children = node[1]
        out.append(hit)
    return out


def ideal_reuse(trace: Trace) -> float:
    """Fraction of input tokens an infinite, tenant-isolated prefix cache would serve (0 for no input)."""
    requests = trace.requests
    total = sum(r.input_tokens for r in requests)
    return sum(_reused_tokens(requests, trace.header.block_tokens)) / total if total else 0.0


def _max_concurrent_sessions(trace: Trace) -> int:
    """Sessions live from their first to their last record (a one-record session counts at its instant)."""
    span: dict[tuple[str, str], list[float]] = {}
    for record in trace.records:
        key = (record.tenant, record.session)
        span.setdefault(key, [record.t, record.t])[1] = record.t
    edges = sorted([(a, 0) for a, _ in span.values()] + [(b, 1) for _, b in span.values()])
    live = best = 0
    for _, kind in edges:
        live += 1 if kind == 0 else -1
        best = max(best, live)
    return best


def trace_stats(trace: Trace) -> dict:
    """Counts, token totals, tool-duration quantiles by class, ideal reuse, concurrency and duration."""
    requests = trace.requests
    events = Counter(r.kind for r in trace.records if isinstance(r, Event))
    tools: dict[str, list[float]] = defaultdict(list)
    for r in requests:
        if r.tool is not None and r.tool.duration_s is not None:  # None: the trace ended during the tool
            tools[r.tool.tool_class].append(r.tool.duration_s)
    input_tokens = sum(r.input_tokens for r in requests)
    reused = sum(_reused_tokens(requests, trace.header.block_tokens))
    times = [r.t for r in trace.records]
    return {
        "name": trace.header.name,
        "block_tokens": trace.header.block_tokens,
        "records": len(trace.records),
        "requests": len(requests),
        "sessions": len({(r.tenant, r.session) for r in trace.records}),
        "branches": len({(r.tenant, r.session, r.branch) for r in requests}),
        "forks": len({(r.tenant, r.session, r.branch) for r in requests if r.parent_branch is not None}),
        "tenants": len({r.tenant for r in trace.records}),
        "close_flags": sum(r.close for r in requests),
        "close_branch_events": events["close_branch"],
        "close_session_events": events["close_session"],
        "aborts": events["abort"],
        "edits": sum(r.edit_from_tokens is not None for r in requests),
        "tool_calls": sum(r.tool is not None for r in requests),  # with or without a known duration
        "tools": {"all": _durations([d for v in tools.values() for d in v])} | {
            name: _durations(v) for name, v in sorted(tools.items())} if tools else {},
        "think_s_total": sum(r.think_s for r in requests),
        "input_tokens": input_tokens,
        "output_tokens": sum(r.output_tokens for r in requests),
        "stable_prefix_tokens": sum(r.stable_prefix_tokens for r in requests),
        "mean_input_tokens": input_tokens / len(requests) if requests else 0.0,
        "max_input_tokens": max((r.input_tokens for r in requests), default=0),
        "ideal_reuse": reused / input_tokens if input_tokens else 0.0,
        "max_concurrent_sessions": _max_concurrent_sessions(trace),
        "duration_s": (max(times) - min(times)) if times else 0.0,
    }


def stats_line(stats: dict) -> str:
    """One line for logs and reports."""
    tools = "tools 0"
    if tool := stats["tools"].get("all"):
        quantiles = "/".join(f"{tool[k]:.3g}" for k in ("p50_s", "p95_s", "p99_s"))
        tools = f"tools {stats['tool_calls']} p50/p95/p99 {quantiles}s"
    return (f"{stats['name']}: {stats['requests']} req, {stats['sessions']} sess, {stats['branches']} br "
            f"({stats['forks']} forks), {stats['tenants']} tenants, closes {stats['close_flags']}+"
            f"{stats['close_branch_events']}+{stats['close_session_events']}, aborts {stats['aborts']}, "
            f"edits {stats['edits']}, {tools}, in {stats['input_tokens']} "
            f"(mean {stats['mean_input_tokens']:.0f}, max {stats['max_input_tokens']}), "
            f"out {stats['output_tokens']}, reuse {stats['ideal_reuse']:.3f}, "
            f"max conc {stats['max_concurrent_sessions']}, {stats['duration_s']:.0f}s")
