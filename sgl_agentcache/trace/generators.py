"""Seeded synthetic agent workloads, one generator per workload class (pure: stdlib and msgspec only).

Every generator is a function ``name(seed=0, **params) -> Trace`` with keyword parameters whose defaults
are sized for CPU replay (a few hundred to a few thousand requests, prompts of hundreds to a few
thousand tokens, 16-token blocks); the result is validated before it is returned, and the same seed and
parameters always give the same trace. :data:`WORKLOADS` maps class names to generators and
:func:`generate` calls one by name, with ``scale`` multiplying its number of sessions.

How traces are built:

- **Prompts** are lists of block-aligned *segments* (system prompt, task, output, tool observation,
  summary, memory...). A segment's block ids are minted once, so two prompts share a block exactly
  where they share content at the same place; a new segment starts a new block, so the previous
  prompt's partial last block reappears, completed with the same id, in the next one (its first tokens
  are exactly what the previous prompt held). A branch's next prompt is its previous prompt plus the
  call's output plus the tool observation, unless the workload edits the context.
- **Block ids** are a bijection of a per-trace counter onto ``[0, 2**63)``: unique per content, never
  colliding within a trace.
- **Times**: sessions start by a Poisson process (``session_rate`` per second); a branch's next call
  arrives after the previous call's modelled service time (``prefill_s_per_token * input_tokens +
  decode_s_per_token * output_tokens``), its tool's duration and a think time.
- **Tools** are :class:`ToolClass` mixtures whose durations are drawn from quantile knots (log-linear
  between knots), which pins the shape of heavy tails exactly: :data:`TERMINAL_BENCH_TOOLS` reproduces
  the published Terminal-Bench shape (:data:`TERMINAL_BENCH_TARGET`).
- **Ends**: a session ends either with ``close=True`` on its last call or with a ``close_session``
  event (``close_event_p``); forked workers end with ``close=True``, a ``close_branch`` event, or an
  ``abort`` event mid-tool.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import zlib
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_agentcache.trace.schema import MAX_BLOCK_ID, Event, Request, ToolCall, Trace, TraceHeader, validate

__all__ = [
    "SHORT_TOOLS",
    "TERMINAL_BENCH_TARGET",
    "TERMINAL_BENCH_TOOLS",
    "WORKLOADS",
    "ToolClass",
    "branch_heavy",
    "context_editing",
    "generate",
    "long_tools",
    "low_reuse",
    "short_tools",
    "stable_prompts",
]

_M63 = MAX_BLOCK_ID  # 2**63 - 1
Range = tuple[int, int]  # inclusive (lo, hi) of a uniform integer draw


# ---- tools ----

@dataclass(frozen=True, slots=True)
class ToolClass:
    """A tool: its share of calls, its latency as quantile knots, and the size of what it returns."""

    name: str
    weight: float
    #: ``(cumulative probability, seconds)`` knots from ``(0, min)`` to ``(1, max)``; durations are
    #: interpolated log-linearly between knots, so every knot is an exact quantile of the draws.
    quantiles: tuple[tuple[float, float], ...]
    observation_tokens: tuple[int, int] = (40, 240)

    def __post_init__(self) -> None:
        probs = [p for p, _ in self.quantiles]
        secs = [s for _, s in self.quantiles]
        if probs[0] != 0.0 or probs[-1] != 1.0 or any(a >= b for a, b in zip(probs, probs[1:])):
            raise ValueError(f"tool {self.name}: quantile probabilities must rise from 0 to 1")
        if secs[0] <= 0 or any(a > b for a, b in zip(secs, secs[1:])):
            raise ValueError(f"tool {self.name}: quantile durations must be positive and non-decreasing")

    def sample(self, rng: random.Random) -> float:
        u = rng.random()
        i = min(bisect_right([p for p, _ in self.quantiles], u), len(self.quantiles) - 1)
        (p0, s0), (p1, s1) = self.quantiles[i - 1], self.quantiles[i]
        return math.exp(math.log(s0) + (u - p0) / (p1 - p0) * (math.log(s1) - math.log(s0)))


#: Short deterministic tools: tens of milliseconds, tight.
SHORT_TOOLS: tuple[ToolClass, ...] = (
    ToolClass("kv_lookup", 0.4, ((0.0, 0.004), (0.5, 0.008), (1.0, 0.02)), (20, 120)),
    ToolClass("calculator", 0.2, ((0.0, 0.001), (0.5, 0.002), (1.0, 0.006)), (10, 40)),
    ToolClass("http_get", 0.4, ((0.0, 0.02), (0.5, 0.045), (0.9, 0.07), (1.0, 0.12)), (80, 400)),
)

#: Terminal-Bench tool latencies (agent-sched-bench, 3,115 calls): the overall shape to reproduce.
TERMINAL_BENCH_TARGET = {"p50": 0.0128, "p90": 6.2, "p95": 20.6, "p99": 180.0, "max": 600.0}

#: File ops ~1.3 ms, search ~8 ms, and ``exec`` with its published quantiles (p50 147 ms, p90 15.4 s,
#: p99 228 s, max 600 s); the mixture weights put the overall quantiles on TERMINAL_BENCH_TARGET.
TERMINAL_BENCH_TOOLS: tuple[ToolClass, ...] = (
    ToolClass("file", 0.385, ((0.0, 0.0003), (0.5, 0.0013), (0.9, 0.004), (0.99, 0.02), (1.0, 0.1)),
              (60, 400)),
    ToolClass("search", 0.06, ((0.0, 0.002), (0.5, 0.008), (0.9, 0.04), (1.0, 0.5)), (40, 200)),
    ToolClass("exec", 0.555, ((0.0, 0.004), (0.5, 0.147), (0.9, 15.4), (0.99, 228.0), (1.0, 600.0)),
              (40, 500)),
)


Tools = Sequence[ToolClass]


def _pick_tool(rng: random.Random, tools: Tools) -> ToolClass:
    return rng.choices(tools, weights=[t.weight for t in tools])[0]


# ---- blocks and prompts ----

def _perm63(x: int) -> int:
    """A bijection of ``[0, 2**63)`` (splitmix64's steps, each invertible modulo 2**63)."""
    x = (x + 0x1E3779B97F4A7C15) & _M63
    x = ((x ^ (x >> 30)) * 0x3F58476D1CE4E5B9) & _M63
    x = ((x ^ (x >> 27)) * 0x14D049BB133111EB) & _M63
    return x ^ (x >> 31)


class _BlockIds:
    """Mints block ids: distinct counters map to distinct ids, and the stream depends on seed and name."""

    def __init__(self, seed: int, name: str):
        self._base = _perm63((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & _M63)
        self._next = 0

    def take(self, n: int) -> tuple[int, ...]:
        start, self._next = self._next, self._next + n
        return tuple(_perm63((self._base + i) & _M63) for i in range(start, start + n))


class _Context:
    """A prompt as block-aligned segments ``(kind, block ids, tokens)``; only its last block is partial."""

    __slots__ = ("block_tokens", "segments")

    def __init__(self, block_tokens: int, segments: list[tuple[str, tuple[int, ...], int]] | None = None):
        self.block_tokens = block_tokens
        self.segments = list(segments or [])

    def append(self, kind: str, tokens: int, ids: _BlockIds) -> None:
        if tokens > 0:
            self.segments.append((kind, ids.take(-(-tokens // self.block_tokens)), tokens))

    def splice(self, index: int, kind: str, tokens: int, ids: _BlockIds) -> None:
        self.segments.insert(index, (kind, ids.take(-(-tokens // self.block_tokens)), tokens))

    def copy(self) -> _Context:
        return _Context(self.block_tokens, self.segments)

    def prompt(self) -> tuple[list[int], int]:
        blocks = [b for _, seg, _ in self.segments for b in seg]
        if not blocks:
            return [], 0
        _, last, tokens = self.segments[-1]
        return blocks, (len(blocks) - len(last)) * self.block_tokens + tokens

    def tokens(self) -> int:
        return self.prompt()[1]


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- the builder ----

class _Builder:
    """Collects records with their times; ``trace()`` sorts them (causal order on ties) and validates."""

    def __init__(self, name: str, seed: int, params: dict):
        _check(params)
        self.name = name
        self.p = params
        self.block_tokens = params["block_tokens"]
        self.prefill_s = params["prefill_s_per_token"]
        self.decode_s = params["decode_s_per_token"]
        self.think_mean_s = params["think_mean_s"]
        self.rng = random.Random(f"{name}/{seed}")
        self.ids = _BlockIds(seed, name)
        self._source = _describe(name, seed, params)
        self._records: list[tuple[float, int, Request | Event]] = []
        self._calls: dict[tuple[str, str], int] = {}

    def context(self) -> _Context:
        return _Context(self.block_tokens)

    def service_s(self, ctx: _Context, output_tokens: int) -> float:
        return self.prefill_s * ctx.tokens() + self.decode_s * output_tokens

    def think_s(self) -> float:
        return round(self.rng.expovariate(1.0 / self.think_mean_s), 6) if self.think_mean_s > 0 else 0.0

    def call(self, t: float, ctx: _Context, output_tokens: int, *, tenant: str, session: str,
             branch: str = "main", parent: str | None = None, stable: int = 0, tool: ToolCall | None = None,
             think_s: float = 0.0, edit_from: int | None = None, close: bool = False) -> float:
        """Record one model call whose prompt is ``ctx`` now; return when its service ends."""
        blocks, tokens = ctx.prompt()
        n = self._calls.get((session, branch), 0)
        self._calls[(session, branch)] = n + 1
        t = round(t, 6)
        self._records.append((t, len(self._records), Request(
            id=f"{session}.{branch}.{n}", t=t, tenant=tenant, session=session, branch=branch,
            parent_branch=parent, blocks=blocks, input_tokens=tokens, output_tokens=output_tokens,
            stable_prefix_tokens=min(stable, tokens), tool=tool, think_s=think_s,
            edit_from_tokens=None if edit_from is None else min(edit_from, tokens), close=close)))
        return t + self.service_s(ctx, output_tokens)

    def event(self, t: float, kind: str, *, tenant: str, session: str, branch: str = "main") -> None:
        t = round(t, 6)
        self._records.append((t, len(self._records), Event(t=t, kind=kind, tenant=tenant, session=session,
                                                           branch=branch)))

    def tool_call(self, tools: Tools) -> tuple[ToolClass, ToolCall]:
        cls = _pick_tool(self.rng, tools)
        return cls, ToolCall(tool_class=cls.name, duration_s=round(cls.sample(self.rng), 6))

    def trace(self) -> Trace:
        self._records.sort(key=lambda item: (item[0], item[1]))
        header = TraceHeader(name=self.name, block_tokens=self.block_tokens, source=self._source)
        return validate(Trace(header=header, records=[r for _, _, r in self._records]))


def _describe(name: str, seed: int, params: dict) -> str:
    shown = {k: [t.name for t in v] if k == "tools" else v for k, v in params.items() if k != "seed"}
    return json.dumps({"generator": f"sgl_agentcache.trace.generators.{name}", "seed": seed, **shown},
                      sort_keys=True, default=str)


def _arrivals(rng: random.Random, sessions: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(sessions):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _tenant(rng: random.Random, tenants: int, skew: float = 0.0) -> str:
    if tenants <= 1:
        return "default"
    return f"t{rng.choices(range(tenants), weights=[1.0 / (i + 1) ** skew for i in range(tenants)])[0]}"


def _aligned(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens) * block_tokens


def _check(params: dict) -> None:
    for key, value in params.items():
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
            if not 0 <= value[0] <= value[1]:
                raise ValueError(f"{key}={value}: expected a range (lo, hi) with 0 <= lo <= hi")
        elif key.endswith("_p") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{key}={value}: a probability must be in [0, 1]")
    if params["sessions"] < 1 or params["session_rate"] <= 0:
        raise ValueError("sessions must be >= 1 and session_rate > 0")
    if not 1 <= params["block_tokens"] <= 4096:
        raise ValueError(f"block_tokens={params['block_tokens']} is outside [1, 4096]")
    if not params["tools"]:
        raise ValueError("tools must name at least one ToolClass")


# ---- sessions ----

def _run_session(b: _Builder, t: float, ctx: _Context, *, tenant: str, session: str, turns: int,
                 stable: int, edit: Callable[[_Context], bool] | None = None) -> float:
    """One branch ("main") of ``turns`` calls; return when its last call's service ends.

    After each call the context grows by the call's output and its tool's observation; then ``edit``
    may rewrite it, returning True when the harness announces the edit (``edit_from_tokens`` on the
    next call: the tokens the new prompt still shares with the previous one).
    """
    rng, p, who = b.rng, b.p, {"tenant": tenant, "session": session}
    close_event = rng.random() < p["close_event_p"]
    edit_from = None
    for k in range(turns):
        out = rng.randint(*p["output_tokens"])
        if k == turns - 1:
            end = b.call(t, ctx, out, **who, stable=stable, edit_from=edit_from, close=not close_event)
            if close_event:
                b.event(end, "close_session", **who)
            return end
        cls, tool = b.tool_call(p["tools"])
        think = b.think_s()
        end = b.call(t, ctx, out, **who, stable=stable, tool=tool, think_s=think, edit_from=edit_from)
        before = ctx.prompt()[0]
        ctx.append("output", out, b.ids)
        ctx.append("observation", rng.randint(*cls.observation_tokens), b.ids)
        edit_from = None
        if edit is not None and edit(ctx):
            kept = _common_blocks(before, ctx.prompt()[0])
            edit_from = kept * b.block_tokens if kept < len(before) else None
        t = end + tool.duration_s + think
    raise ValueError("a session needs at least one turn")


def _system(b: _Builder, tokens: int, kind: str = "system") -> _Context:
    ctx = b.context()
    ctx.append(kind, _aligned(tokens, b.block_tokens), b.ids)
    return ctx


def _tool_sessions(b: _Builder) -> Trace:
    """Sessions of one agent: a shared system prompt, a task, then tool rounds (short_tools, long_tools)."""
    rng, p = b.rng, b.p
    system = _system(b, p["system_tokens"])
    for i, t0 in enumerate(_arrivals(rng, p["sessions"], p["session_rate"])):
        ctx = system.copy()
        ctx.append("task", rng.randint(*p["task_tokens"]), b.ids)
        _run_session(b, t0, ctx, tenant=_tenant(rng, p["tenants"]), session=f"s{i:05d}",
                     turns=rng.randint(*p["turns"]), stable=system.tokens())
    return b.trace()


# ---- the workload classes ----

def short_tools(seed: int = 0, *, sessions: int = 120, session_rate: float = 2.0, turns: Range = (6, 14),
                tenants: int = 1, system_tokens: int = 800, task_tokens: Range = (40, 200),
                output_tokens: Range = (20, 120), tools: Tools = SHORT_TOOLS, think_mean_s: float = 0.3,
                close_event_p: float = 0.5, block_tokens: int = 16, prefill_s_per_token: float = 1e-4,
                decode_s_per_token: float = 0.02) -> Trace:
    """Multi-turn sessions with short deterministic tools (tens of milliseconds, tight)."""
    return _tool_sessions(_Builder("short_tools", seed, locals()))


def long_tools(seed: int = 0, *, sessions: int = 100, session_rate: float = 0.5, turns: Range = (6, 14),
               tenants: int = 1, system_tokens: int = 1200, task_tokens: Range = (80, 400),
               output_tokens: Range = (30, 200), tools: Tools = TERMINAL_BENCH_TOOLS,
               think_mean_s: float = 0.5, close_event_p: float = 0.5, block_tokens: int = 16,
               prefill_s_per_token: float = 1e-4, decode_s_per_token: float = 0.02) -> Trace:
    """Multi-turn sessions with long heavy-tailed tools (the Terminal-Bench mixture by default)."""
    return _tool_sessions(_Builder("long_tools", seed, locals()))


def branch_heavy(seed: int = 0, *, sessions: int = 40, session_rate: float = 0.5, lead_turns: Range = (4, 8),
                 spawn_p: float = 0.6, workers: Range = (2, 6), worker_turns: Range = (1, 4),
                 tenants: int = 1, system_tokens: int = 1200, task_tokens: Range = (100, 400),
                 output_tokens: Range = (30, 200), worker_task_tokens: Range = (40, 160),
                 result_tokens: Range = (50, 300), abort_p: float = 0.15, tools: Tools = SHORT_TOOLS,
                 think_mean_s: float = 0.2, close_event_p: float = 0.4, block_tokens: int = 16,
                 prefill_s_per_token: float = 1e-4, decode_s_per_token: float = 0.02) -> Trace:
    """A lead agent per session that forks many short-lived workers.

    At a lead turn (after the first; probability ``spawn_p``) the lead's output is the fork point: each
    worker's prompt is the lead's prompt and output blocks plus its own task, and every worker call
    carries ``parent_branch="main"``. Workers run short tools and end with ``close=True``, a
    ``close_branch`` event (``close_event_p``) or, with ``abort_p``, an ``abort`` event during a tool.
    The lead waits (tool class ``subagents``) for all of them and reads their results.
    """
    b = _Builder("branch_heavy", seed, locals())
    rng = b.rng
    system = _system(b, system_tokens)
    for i, t0 in enumerate(_arrivals(rng, sessions, session_rate)):
        ctx = system.copy()
        ctx.append("task", rng.randint(*task_tokens), b.ids)
        who = {"tenant": _tenant(rng, tenants), "session": f"s{i:05d}"}
        _lead(b, t0, ctx, who, rng.randint(*lead_turns), system.tokens())
    return b.trace()


def _lead(b: _Builder, t: float, ctx: _Context, who: dict, turns: int, stable: int) -> None:
    rng, p = b.rng, b.p
    close_event = rng.random() < p["close_event_p"]
    for k in range(turns):
        out = rng.randint(*p["output_tokens"])
        if k == turns - 1:
            end = b.call(t, ctx, out, **who, stable=stable, close=not close_event)
            if close_event:
                b.event(end, "close_session", **who)
            return
        end, think, prompt = t + b.service_s(ctx, out), b.think_s(), ctx.copy()
        ctx.append("output", out, b.ids)
        if k > 0 and rng.random() < p["spawn_p"]:
            done = [_worker(b, end + 0.001 * (w + 1), ctx.copy(), who, f"w{k}-{w}", stable)
                    for w in range(rng.randint(*p["workers"]))]
            tool = ToolCall(tool_class="subagents", duration_s=round(max(e for _, e in done) - end, 6))
            for result_tokens, _ in done:
                ctx.append("observation", result_tokens, b.ids)
        else:
            cls, tool = b.tool_call(p["tools"])
            ctx.append("observation", rng.randint(*cls.observation_tokens), b.ids)
        b.call(t, prompt, out, **who, stable=stable, tool=tool, think_s=think)
        t = end + tool.duration_s + think


def _worker(b: _Builder, t: float, ctx: _Context, who: dict, branch: str, stable: int) -> tuple[int, float]:
    """Run one forked worker; return (tokens of what it reports to the lead, when it ended)."""
    rng, p = b.rng, b.p
    ctx.append("task", rng.randint(*p["worker_task_tokens"]), b.ids)
    turns = rng.randint(*p["worker_turns"])
    abort_at = rng.randrange(turns) if rng.random() < p["abort_p"] else -1
    close_event = rng.random() < p["close_event_p"]
    mine = {**who, "branch": branch, "parent": "main", "stable": stable}
    for k in range(turns):
        out = rng.randint(*p["output_tokens"])
        if k == turns - 1 and k != abort_at:
            end = b.call(t, ctx, out, **mine, close=not close_event)
            if close_event:
                b.event(end, "close_branch", **who, branch=branch)
            return rng.randint(*p["result_tokens"]), end
        cls, tool = b.tool_call(p["tools"])
        think = b.think_s()
        end = b.call(t, ctx, out, **mine, tool=tool, think_s=think)
        if k == abort_at:  # cancelled while its tool runs: the lead gets a short error note
            aborted = end + rng.random() * tool.duration_s
            b.event(aborted, "abort", **who, branch=branch)
            return rng.randint(10, 40), aborted
        ctx.append("output", out, b.ids)
        ctx.append("observation", rng.randint(*cls.observation_tokens), b.ids)
        t = end + tool.duration_s + think
    raise ValueError("a worker needs at least one turn")


def stable_prompts(seed: int = 0, *, sessions: int = 400, session_rate: float = 4.0, tenants: int = 4,
                   tenant_skew: float = 1.0, templates: int = 3, system_tokens: Range = (800, 1600),
                   tool_schema_tokens: Range = (400, 1200), shared_across_tenants: bool = True,
                   turns: Range = (1, 4), task_tokens: Range = (30, 300), output_tokens: Range = (30, 250),
                   tools: Tools = SHORT_TOOLS, think_mean_s: float = 0.5, close_event_p: float = 0.5,
                   block_tokens: int = 16, prefill_s_per_token: float = 1e-4,
                   decode_s_per_token: float = 0.02) -> Trace:
    """Many short sessions over a few stable templates (system prompt + tool schema) and several tenants.

    Each session's tenant is drawn with Zipf weights ``1/(i+1)**tenant_skew`` and its template uniformly;
    ``stable_prefix_tokens`` is the template's length (whole blocks). With ``shared_across_tenants`` the
    tenants run the same templates (identical block ids), which a tenant-isolating cache must not share.
    """
    b = _Builder("stable_prompts", seed, locals())
    rng = b.rng

    def make_templates() -> list[_Context]:
        out = []
        for _ in range(templates):
            ctx = _system(b, rng.randint(*system_tokens))
            ctx.append("tool_schema", _aligned(rng.randint(*tool_schema_tokens), block_tokens), b.ids)
            out.append(ctx)
        return out

    names = ["default"] if tenants <= 1 else [f"t{i}" for i in range(tenants)]
    shared = make_templates() if shared_across_tenants else None
    by_tenant = {name: shared or make_templates() for name in names}
    for i, t0 in enumerate(_arrivals(rng, sessions, session_rate)):
        tenant = _tenant(rng, tenants, tenant_skew)
        template = rng.choice(by_tenant[tenant])
        ctx = template.copy()
        ctx.append("task", rng.randint(*task_tokens), b.ids)
        _run_session(b, t0, ctx, tenant=tenant, session=f"s{i:05d}", turns=rng.randint(*turns),
                     stable=template.tokens())
    return b.trace()


def context_editing(seed: int = 0, *, sessions: int = 60, session_rate: float = 0.5, turns: Range = (12, 24),
                    tenants: int = 1, system_tokens: int = 1000, task_tokens: Range = (100, 400),
                    output_tokens: Range = (30, 200), compact_at_tokens: int = 3000, keep_segments: int = 2,
                    summary_tokens: Range = (200, 600), drop_p: float = 0.25, splice_p: float = 0.1,
                    memory_tokens: Range = (100, 400), tools: Tools = SHORT_TOOLS, think_mean_s: float = 0.3,
                    close_event_p: float = 0.5, block_tokens: int = 16, prefill_s_per_token: float = 1e-4,
                    decode_s_per_token: float = 0.02) -> Trace:
    """Sessions whose harness rewrites history, announcing each edit with ``edit_from_tokens``.

    Before each next call: past ``compact_at_tokens`` the context is summarised (the first
    ``keep_segments`` segments, system prompt and task, plus a new summary); otherwise an older tool
    observation is dropped (``drop_p``) or a memory segment is spliced in after the system prompt
    (``splice_p``). Blocks after a dropped observation keep their ids (same text) at new positions, so
    exact prefix reuse ends at the edit, as it would with real tokens.
    """
    b = _Builder("context_editing", seed, locals())
    rng = b.rng

    def edit(ctx: _Context) -> bool:
        if ctx.tokens() > compact_at_tokens:
            del ctx.segments[keep_segments:]
            ctx.append("summary", rng.randint(*summary_tokens), b.ids)
            return True
        older = [i for i, seg in enumerate(ctx.segments[:-1]) if seg[0] == "observation"]
        draw = rng.random()
        if draw < drop_p and older:
            del ctx.segments[rng.choice(older)]
            return True
        if draw < drop_p + splice_p:
            ctx.splice(1, "memory", rng.randint(*memory_tokens), b.ids)
            return True
        return False

    system = _system(b, system_tokens)
    for i, t0 in enumerate(_arrivals(rng, sessions, session_rate)):
        ctx = system.copy()
        ctx.append("task", rng.randint(*task_tokens), b.ids)
        _run_session(b, t0, ctx, tenant=_tenant(rng, tenants), session=f"s{i:05d}",
                     turns=rng.randint(*turns), stable=system.tokens(), edit=edit)
    return b.trace()


def low_reuse(seed: int = 0, *, sessions: int = 300, session_rate: float = 3.0, turns: Range = (1, 3),
              tenants: int = 2, instruction_tokens: Range = (16, 64), context_tokens: Range = (400, 2400),
              output_tokens: Range = (20, 200), rebuild_p: float = 0.9, tools: Tools = SHORT_TOOLS,
              think_mean_s: float = 0.3, close_event_p: float = 0.5, block_tokens: int = 16,
              prefill_s_per_token: float = 1e-4, decode_s_per_token: float = 0.02) -> Trace:
    """Retrieval-style sessions with little prefix sharing: nothing is shared across sessions, and each
    next call rebuilds its prompt (``rebuild_p``: the session's short instruction plus freshly retrieved
    context) instead of extending the previous one. No edit is announced."""
    b = _Builder("low_reuse", seed, locals())
    rng = b.rng

    def rebuild(ctx: _Context) -> bool:
        if rng.random() < rebuild_p:
            del ctx.segments[1:]
            ctx.append("context", rng.randint(*context_tokens), b.ids)
        return False

    for i, t0 in enumerate(_arrivals(rng, sessions, session_rate)):
        ctx = b.context()
        ctx.append("instruction", rng.randint(*instruction_tokens), b.ids)
        ctx.append("context", rng.randint(*context_tokens), b.ids)
        _run_session(b, t0, ctx, tenant=_tenant(rng, tenants), session=f"s{i:05d}",
                     turns=rng.randint(*turns), stable=0, edit=rebuild)
    return b.trace()


WORKLOADS: dict[str, Callable[..., Trace]] = {
    fn.__name__: fn
    for fn in (short_tools, long_tools, branch_heavy, stable_prompts, context_editing, low_reuse)
}


def generate(name: str, seed: int = 0, scale: float = 1.0, **params) -> Trace:
    """Generate workload ``name``; ``scale`` multiplies its default number of sessions (unless given)."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if "sessions" not in params:
        params["sessions"] = max(1, round(inspect.signature(fn).parameters["sessions"].default * scale))
    return fn(seed, **params)
