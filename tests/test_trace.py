"""Trace format v1: generators (one per workload class), importers, stats, files and validation errors."""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_agentcache.trace.generators import (
    TERMINAL_BENCH_TARGET,
    TERMINAL_BENCH_TOOLS,
    WORKLOADS,
    ToolClass,
    generate,
)
from sgl_agentcache.trace.importers import import_mooncake, import_weka
from sgl_agentcache.trace.schema import (
    MAX_BLOCK_ID,
    Event,
    Request,
    ToolCall,
    Trace,
    TraceError,
    TraceHeader,
    block_token_ids,
    dumps_jsonl,
    dumps_msgpack,
    load,
    loads_jsonl,
    loads_msgpack,
    save,
    validate,
)
from sgl_agentcache.trace.stats import ideal_reuse, quantile, stats_line, trace_stats

NAMES = sorted(WORKLOADS)


@pytest.fixture(scope="module")
def defaults() -> dict[str, tuple[Trace, dict]]:
    """Every workload at its default size, generated once, with its stats."""
    out = {}
    for name in NAMES:
        trace = generate(name)
        out[name] = (trace, trace_stats(trace))
    return out


def _by_branch(trace: Trace) -> dict[tuple[str, str, str], list[Request]]:
    out = defaultdict(list)
    for r in trace.requests:
        out[(r.tenant, r.session, r.branch)].append(r)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- every generator ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_generator_valid_deterministic_and_seeded(name):
    one, again, other = generate(name, seed=3, scale=0.2), generate(name, seed=3, scale=0.2), generate(
        name, seed=4, scale=0.2)
    assert validate(one) is one
    assert dumps_msgpack(one) == dumps_msgpack(again)
    assert dumps_msgpack(one) != dumps_msgpack(other)
    assert one.header.name == name and one.header.block_tokens == 16
    assert json.loads(one.header.source)["seed"] == 3
    blocks = [b for r in one.requests for b in r.blocks]
    assert all(0 <= b <= MAX_BLOCK_ID for b in blocks)


@pytest.mark.parametrize("name", NAMES)
def test_default_sizes_fit_cpu_replay(name, defaults):
    trace, stats = defaults[name]
    assert 300 <= stats["requests"] <= 5000
    assert 100 <= stats["mean_input_tokens"] <= 6000 and stats["max_input_tokens"] <= 12000
    assert stats["duration_s"] > 0 and stats["max_concurrent_sessions"] >= 5
    assert all(r.stable_prefix_tokens <= r.input_tokens for r in trace.requests)
    json.dumps(stats)
    assert name in stats_line(stats)


@pytest.mark.parametrize("name", NAMES)
def test_round_trips(name, tmp_path):
    trace = generate(name, seed=1, scale=0.1)
    assert loads_jsonl(dumps_jsonl(trace)) == trace
    assert loads_msgpack(dumps_msgpack(trace)) == trace
    for suffix in (".jsonl", ".msgpack"):
        save(trace, tmp_path / f"t{suffix}")
        assert load(tmp_path / f"t{suffix}") == trace


@pytest.mark.parametrize("name", ["short_tools", "long_tools", "stable_prompts", "branch_heavy"])
def test_next_prompt_extends_the_previous_one(name, defaults):
    """Without an edit, a branch's next prompt starts with all of its previous prompt's blocks."""
    trace, _ = defaults[name]
    for calls in _by_branch(trace).values():
        for prev, nxt in zip(calls, calls[1:]):
            assert nxt.blocks[:len(prev.blocks)] == prev.blocks
            assert nxt.input_tokens > prev.input_tokens
            assert nxt.t >= prev.t + (prev.tool.duration_s if prev.tool else 0.0) + prev.think_s


def test_generate_registry_and_parameters():
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope")
    assert trace_stats(generate("short_tools", scale=0.1))["sessions"] == 12
    assert trace_stats(generate("short_tools", scale=0.1, sessions=5))["sessions"] == 5
    assert trace_stats(generate("low_reuse", scale=0.1, tenants=1))["tenants"] == 1
    with pytest.raises(ValueError, match="turns"):
        generate("short_tools", turns=(5, 2))
    with pytest.raises(ValueError, match="abort_p"):
        generate("branch_heavy", abort_p=1.5)
    with pytest.raises(ValueError, match="scale"):
        generate("short_tools", scale=0)
    big = generate("stable_prompts", scale=0.05, block_tokens=64)
    assert big.header.block_tokens == 64


# --- the property that defines each class ------------------------------------------------------


def test_short_tools_are_short_and_tight(defaults):
    trace, stats = defaults["short_tools"]
    durations = [r.tool.duration_s for r in trace.requests if r.tool]
    assert max(durations) <= 0.2 and 0.005 <= stats["tools"]["all"]["p50_s"] <= 0.05
    assert stats["requests"] >= 5 * stats["sessions"] and stats["ideal_reuse"] > 0.8


def test_terminal_bench_mixture_matches_the_published_shape():
    rng = random.Random(7)
    weights = [t.weight for t in TERMINAL_BENCH_TOOLS]
    draws = sorted(rng.choices(TERMINAL_BENCH_TOOLS, weights)[0].sample(rng) for _ in range(100_000))
    for q, key, tol in ((0.5, "p50", 0.2), (0.9, "p90", 0.15), (0.95, "p95", 0.15), (0.99, "p99", 0.15)):
        assert quantile(draws, q) == pytest.approx(TERMINAL_BENCH_TARGET[key], rel=tol), key
    assert draws[-1] <= TERMINAL_BENCH_TARGET["max"]


def test_tool_class_knots_are_exact_quantiles_and_checked():
    tool = ToolClass("x", 1.0, ((0.0, 0.01), (0.5, 1.0), (1.0, 100.0)))
    rng = random.Random(0)
    draws = sorted(tool.sample(rng) for _ in range(20_000))
    assert quantile(draws, 0.5) == pytest.approx(1.0, rel=0.1)
    assert 0.01 <= draws[0] and draws[-1] <= 100.0
    with pytest.raises(ValueError):
        ToolClass("bad", 1.0, ((0.0, 1.0), (0.9, 2.0)))
    with pytest.raises(ValueError):
        ToolClass("bad", 1.0, ((0.0, 2.0), (1.0, 1.0)))


def test_long_tools_follow_the_terminal_bench_shape(defaults):
    _, stats = defaults["long_tools"]
    tools = stats["tools"]
    assert {"file", "search", "exec"} <= set(tools)
    overall = tools["all"]
    assert 0.004 <= overall["p50_s"] <= 0.05
    assert 2.0 <= overall["p90_s"] <= 20.0
    assert 40.0 <= overall["p99_s"] <= 600.0 and overall["max_s"] <= 600.0
    assert tools["file"]["p50_s"] < 0.005 < tools["exec"]["p50_s"]


def test_branch_heavy_forks_share_the_lead_prefix_and_end(defaults):
    trace, stats = defaults["branch_heavy"]
    assert stats["forks"] >= 100 and stats["forks"] >= 3 * stats["sessions"]
    assert stats["aborts"] >= 5 and stats["close_flags"] + stats["close_branch_events"] >= stats["forks"] // 2
    mains = {key[:2]: calls for key, calls in _by_branch(trace).items() if key[2] == "main"}
    ends = defaultdict(int)
    for r in trace.records:
        if isinstance(r, Event) and r.kind in ("close_branch", "abort"):
            ends[(r.tenant, r.session, r.branch)] += 1
        elif isinstance(r, Request) and r.close and r.branch != "main":
            ends[(r.tenant, r.session, r.branch)] += 1
    for key, calls in _by_branch(trace).items():
        if key[2] == "main":
            continue
        first = calls[0]
        assert all(c.parent_branch == "main" for c in calls)
        lead = [m for m in mains[key[:2]] if m.t < first.t][-1]  # the call that spawned it
        assert first.blocks[:len(lead.blocks)] == lead.blocks and len(first.blocks) > len(lead.blocks)
        assert ends[key] == 1, key


def test_stable_prompts_reuse_is_high_and_tenant_isolated(defaults):
    trace, stats = defaults["stable_prompts"]
    assert stats["ideal_reuse"] >= 0.8 and stats["tenants"] >= 3
    assert all(r.stable_prefix_tokens > 0 and r.stable_prefix_tokens % 16 == 0 for r in trace.requests)
    first_blocks = defaultdict(set)
    for r in trace.requests:
        first_blocks[r.blocks[0]].add(r.tenant)
    assert any(len(tenants) > 1 for tenants in first_blocks.values())  # same template, several tenants
    merged = Trace(header=trace.header, records=[
        msgspec.structs.replace(r, tenant="default") for r in trace.records])
    assert ideal_reuse(merged) > stats["ideal_reuse"]


def test_low_reuse_shares_little(defaults):
    trace, stats = defaults["low_reuse"]
    assert stats["ideal_reuse"] <= 0.15
    owners = defaultdict(set)
    for r in trace.requests:
        for b in r.blocks:
            owners[b].add(r.session)
    assert all(len(sessions) == 1 for sessions in owners.values())


def test_context_editing_edits_are_exact(defaults):
    trace, stats = defaults["context_editing"]
    assert stats["edits"] >= 2 * stats["sessions"]
    kinds = set()
    for calls in _by_branch(trace).values():
        for prev, nxt in zip(calls, calls[1:]):
            if nxt.edit_from_tokens is None:
                assert nxt.blocks[:len(prev.blocks)] == prev.blocks
                continue
            edit = nxt.edit_from_tokens
            assert edit <= nxt.input_tokens and edit < prev.input_tokens and edit % 16 == 0
            k = edit // 16
            assert _common(prev.blocks, nxt.blocks) == k
            kinds.add("splice" if edit == nxt.stable_prefix_tokens else "other")
    assert kinds == {"splice", "other"}


# --- stats -------------------------------------------------------------------------------------


def _req(rid, t, blocks, tokens, *, tenant="default", session="s", **kw):
    return Request(id=rid, t=t, tenant=tenant, session=session, blocks=blocks, input_tokens=tokens,
                   output_tokens=1, **kw)


def test_ideal_reuse_counts_partial_blocks_and_tenants():
    trace = validate(Trace(header=TraceHeader(block_tokens=4), records=[
        _req("a", 0.0, [1, 2], 6, tenant="A"),
        _req("b", 1.0, [1, 2, 3], 10, tenant="A"),  # 4 + 2 (only 2 tokens of block 2 were held)
        _req("c", 2.0, [1, 2, 3], 12, tenant="B", session="z"),  # another tenant: nothing
        _req("d", 3.0, [1, 2, 3], 12, tenant="A"),  # 4 + 4 + 2
    ]))
    assert ideal_reuse(trace) == pytest.approx(16 / 40)
    stats = trace_stats(trace)
    assert stats["tenants"] == 2 and stats["sessions"] == 2 and stats["tools"] == {}


def test_stats_counts_and_concurrency():
    trace = validate(Trace(header=TraceHeader(block_tokens=4), records=[
        _req("a", 0.0, [1], 4, tool=ToolCall(tool_class="exec", duration_s=2.0)),
        _req("b", 1.0, [9], 4, session="u", close=True),
        _req("w", 1.5, [1, 5], 8, branch="w", parent_branch="main",
             tool=ToolCall(tool_class="exec", duration_s=4.0)),
        Event(t=2.0, kind="abort", session="s", branch="w"),
        _req("c", 3.0, [1, 2], 8, edit_from_tokens=4),
        Event(t=5.0, kind="close_session", session="s"),
        _req("d", 6.0, [7], 3, session="v", close=True),
    ]))
    stats = trace_stats(trace)
    assert (stats["requests"], stats["sessions"], stats["branches"], stats["forks"]) == (5, 3, 4, 1)
    ends = (stats["aborts"], stats["close_session_events"], stats["close_flags"], stats["edits"])
    assert ends == (1, 1, 2, 1)
    assert stats["tools"]["exec"]["count"] == 2 and stats["tools"]["exec"]["p50_s"] == pytest.approx(3.0)
    assert stats["max_concurrent_sessions"] == 2 and stats["duration_s"] == 6.0
    assert stats["input_tokens"] == 27 and stats["output_tokens"] == 5


# --- importers ---------------------------------------------------------------------------------

OPUS, HAIKU = "claude-opus-4-5-20251101", "claude-haiku-4-5-20251001"


def _weka() -> dict:
    """A miniature Claude Code trace in the kv-cache-tester schema, two levels of subagents deep.

    Times as the schema has them: a call's ``t`` counts from the start of the agent that holds it; a
    subagent entry's ``t`` is when it finished, in its parent's frame, ``duration_ms`` after its start.
    Absolute (trace) times the importer must produce: main calls at 0, 3, 16, 40 s; m1 (a ``Task`` call,
    ends at 4 s) spawns Explore A and general-purpose C, both starting at 4.5 s (A runs 10 s, C 6 s); A's
    calls at 4.5, 6.5 and 11.5 s, its second (ends at 7 s) spawning B, which starts at 7.5 s (A's frame:
    t 6.0 - 3.0 s), runs 3 s with calls at 7.5 and 9.5 s, and fails."""
    return {
        "id": "cc-7f3a9e", "models": [OPUS, HAIKU], "block_size": 64, "hash_id_scope": "local",
        "system_tokens": 100, "tool_tokens": 28,
        "requests": [
            {"t": 0.0, "type": "s", "model": OPUS, "in": 150, "out": 40, "hash_ids": [1, 2, 3],
             "input_types": ["text"], "output_types": ["tool_use"], "stop": "tool_use", "api_time": 2.0,
             "think_time": 0.0, "ttft": 0.8},
            {"t": 3.0, "type": "n", "model": OPUS, "in": 230, "out": 60, "hash_ids": [1, 2, 4, 5],
             "stop": "tool_use", "api_time": 1.0, "think_time": 1.0},
            {"t": 10.5, "type": "subagent", "agent_id": "agent_003", "subagent_type": "general-purpose",
             "status": "completed", "duration_ms": 6000, "models": [HAIKU], "system_tokens": 32,
             "requests": [
                 {"t": 0.0, "type": "n", "model": HAIKU, "in": 80, "out": 20, "hash_ids": [70, 71],
                  "stop": "end_turn", "api_time": 1.0, "think_time": 0.0}]},
            {"t": 14.5, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
             "status": "completed", "duration_ms": 10000, "total_tokens": 410, "tool_use_count": 2,
             "models": [HAIKU], "system_tokens": 64, "tool_tokens": 0, "requests": [
                 {"t": 0.0, "type": "n", "model": HAIKU, "in": 100, "out": 30, "hash_ids": [50, 51],
                  "stop": "tool_use", "api_time": 1.0, "think_time": 0.0},
                 {"t": 2.0, "type": "n", "model": HAIKU, "in": 180, "out": 50, "hash_ids": [50, 52, 53],
                  "stop": "tool_use", "api_time": 0.5, "think_time": 1.0},
                 {"t": 6.0, "type": "subagent", "agent_id": "agent_002", "subagent_type": "general-purpose",
                  "status": "failed", "duration_ms": 3000, "models": [HAIKU], "requests": [
                      {"t": 0.0, "type": "n", "model": HAIKU, "in": 70, "out": 10, "hash_ids": [60, 61],
                       "stop": "tool_use", "api_time": 1.0},
                      {"t": 2.0, "type": "n", "model": HAIKU, "in": 90, "out": 10, "hash_ids": [60, 62],
                       "stop": "tool_use", "api_time": 0.5}]},
                 {"t": 7.0, "type": "n", "model": HAIKU, "in": 200, "out": 80, "hash_ids": [50, 52, 53, 54],
                  "stop": "end_turn", "api_time": 2.0, "think_time": 4.5},
             ]},
            {"t": 16.0, "type": "n", "model": OPUS, "in": 420, "out": 80, "hash_ids": [1, 2, 4, 6, 7, 8, 9],
             "stop": "end_turn", "api_time": 2.0, "think_time": 12.0},
            {"t": 40.0, "type": "n", "model": OPUS, "input_length": 300, "output_length": 20,
             "hash_ids": [1, 2, 10, 11, 12], "stop": "end_turn", "api_time": 1.0, "think_time": 22.0},
        ],
    }


def test_import_weka_nested_subagent_times_are_absolute(tmp_path):
    """Acceptance test of issue 18: nested subagent times (two levels), lineage, tool and think time,
    ends. Before the fix every subagent ran at t=0 and every tool lasted 0 s."""
    path = tmp_path / "cc.json"
    path.write_text(json.dumps(_weka()))
    trace = import_weka(path)
    assert trace.header.block_tokens == 64 and trace.header.name == "cc-7f3a9e"
    calls = _by_branch(trace)
    branch = {name: calls[("default", "cc-7f3a9e", name)] for name in ("main", "sa-agent_001", "sa-agent_002",
                                                                        "sa-agent_003")}
    main, explore, nested, parallel = branch.values()
    assert {name: [r.t for r in rs] for name, rs in branch.items()} == {
        "main": [0.0, 3.0, 16.0, 40.0], "sa-agent_001": [4.5, 6.5, 11.5], "sa-agent_002": [7.5, 9.5],
        "sa-agent_003": [4.5]}
    assert {name: {r.parent_branch for r in rs} for name, rs in branch.items()} == {
        "main": {None}, "sa-agent_001": {"main"}, "sa-agent_002": {"sa-agent_001"}, "sa-agent_003": {"main"}}
    tools = {r.id: (r.tool and (r.tool.tool_class, r.tool.duration_s), r.think_s) for r in trace.requests}
    assert tools == {
        "cc-7f3a9e.main.0": (("tool", 1.0), 0.0),  # ends at 2 s, next call at 3 s
        "cc-7f3a9e.main.1": (("subagent", 12.0), 0.0),  # the Task call: ends at 4 s, main resumes at 16 s
        "cc-7f3a9e.main.2": (None, 22.0),  # end_turn: the user's turn, 18 -> 40 s
        "cc-7f3a9e.main.3": (None, 0.0),
        "cc-7f3a9e.sa-agent_001.0": (("tool", 1.0), 0.0),
        "cc-7f3a9e.sa-agent_001.1": (("subagent", 4.5), 0.0),  # spawns agent_002: 7 -> 11.5 s
        "cc-7f3a9e.sa-agent_001.2": (None, 0.0),
        "cc-7f3a9e.sa-agent_002.0": (("tool", 1.0), 0.0),
        # Its last call stopped for a tool: a tool the client knows it runs, of unknown duration (the
        # subagent was aborted during it); no next call is read to decide that.
        "cc-7f3a9e.sa-agent_002.1": (("tool", None), 0.0),
        "cc-7f3a9e.sa-agent_003.0": (None, 0.0)}
    events = {(r.kind, r.branch): r.t for r in trace.records if isinstance(r, Event)}
    # A subagent's end is the harness's to know; the session's is not (no close_session unless asked).
    assert events == {("abort", "sa-agent_002"): 10.5, ("close_branch", "sa-agent_003"): 10.5,
                      ("close_branch", "sa-agent_001"): 14.5}
    closed = import_weka(path, close_sessions=True)
    assert [(r.kind, r.t) for r in closed.records if isinstance(r, Event) and r.kind == "close_session"] == [
        ("close_session", 41.0)]
    assert [r.t for r in trace.records] == sorted(r.t for r in trace.records)
    assert main[1].blocks[:2] == main[0].blocks[:2] and main[1].blocks[2] != main[0].blocks[2]
    assert main[2].blocks[:3] == main[1].blocks[:3] and main[2].edit_from_tokens is None
    assert main[3].edit_from_tokens == 128  # compaction kept 2 of 6 full blocks
    assert [c[0].stable_prefix_tokens for c in (main, explore, nested, parallel)] == [128, 64, 0, 32]
    stats = trace_stats(trace)
    assert stats["forks"] == 3 and stats["aborts"] == 1 and stats["close_branch_events"] == 2
    assert stats["tools"]["tool"]["count"] == 3 and stats["tools"]["tool"]["p50_s"] == 1.0
    assert stats["tools"]["subagent"]["count"] == 2 and stats["tools"]["subagent"]["max_s"] == 12.0
    assert load_round_trip(trace, tmp_path) == trace


def load_round_trip(trace: Trace, tmp_path) -> Trace:
    save(trace, tmp_path / "rt.msgpack")
    return load(tmp_path / "rt.msgpack")


def test_import_weka_reblocks_and_scopes(tmp_path):
    trace = import_weka(_weka(), block_tokens=32)
    main = _by_branch(trace)[("default", "cc-7f3a9e", "main")]
    assert [len(r.blocks) for r in main] == [5, 8, 14, 10]
    assert main[1].blocks[:4] == main[0].blocks[:4] and main[1].blocks[4] != main[0].blocks[4]
    assert main[3].edit_from_tokens == 128 and _common(main[2].blocks, main[3].blocks) == 4
    other = dict(_weka(), id="cc-other")
    local = import_weka([_weka(), other], stagger_s=100.0)
    firsts = {r.session: r for r in local.requests if r.branch == "main" and r.id.endswith(".0")}
    assert firsts["cc-other"].t == 100.0 and firsts["cc-other"].blocks != firsts["cc-7f3a9e"].blocks
    shared = import_weka([dict(_weka(), hash_id_scope="global"), dict(other, hash_id_scope="global")])
    firsts = {r.session: r for r in shared.requests if r.branch == "main" and r.id.endswith(".0")}
    assert firsts["cc-other"].blocks == firsts["cc-7f3a9e"].blocks
    lines = tmp_path / "cc.jsonl"
    lines.write_text(json.dumps(_weka()) + "\n" + json.dumps(other) + "\n")
    assert trace_stats(import_weka(lines))["sessions"] == 2


def test_import_weka_edge_cases():
    """An empty subagent passes its nested children to the enclosing agent; an async subagent without
    telemetry (no ``duration_ms``) starts at its ``t`` and closes after its last call; a subagent that
    starts before its parent's first call is imported as an independent branch."""
    leaf = {"type": "n", "model": OPUS, "in": 64, "out": 1, "hash_ids": [1], "api_time": 0.5}
    obj = {"id": "edge", "block_size": 64, "requests": [
        {"t": 0.6, "type": "subagent", "agent_id": "early", "subagent_type": "x", "status": "cancelled",
         "duration_ms": 500, "models": [], "requests": [{**leaf, "t": 0.0, "hash_ids": [8]}]},
        {**leaf, "t": 1.0},
        {"t": 2.0, "type": "subagent", "agent_id": "empty", "subagent_type": "x", "status": "completed",
         "models": [], "requests": [
             {"t": 2.0, "type": "subagent", "agent_id": "inner", "subagent_type": "x",
              "status": "async_launched", "duration_ms": None, "models": [],
              "requests": [{**leaf, "t": 3.0, "hash_ids": [7]}]}]},
    ]}
    trace = import_weka(obj)
    parents = {r.branch: r.parent_branch for r in trace.requests}
    assert parents == {"main": None, "sa-inner": "main", "sa-early": None}
    assert {r.branch: r.t for r in trace.requests} == {"sa-early": 0.1, "main": 1.0, "sa-inner": 7.0}
    events = {(r.kind, r.branch): r.t for r in trace.records if isinstance(r, Event)}
    assert events == {("abort", "sa-early"): 0.6, ("close_branch", "sa-inner"): 7.5}


def test_import_weka_reads_gzip(tmp_path):
    import gzip

    path = tmp_path / "cc.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_weka()).encode()))
    assert import_weka(path).records == import_weka(_weka()).records
    lines = tmp_path / "cc.jsonl.gz"
    lines.write_bytes(gzip.compress((json.dumps(_weka()) + "\n" + json.dumps(dict(_weka(), id="b"))).encode()))
    assert trace_stats(import_weka(lines))["sessions"] == 2
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="bad.json.gz: not a readable gzip file"):
        import_weka(tmp_path / "bad.json.gz")


def test_import_weka_pads_short_hash_lists():
    obj = _weka()
    obj["requests"][0]["hash_ids"] = [1, 2]  # 150 tokens need 3 blocks
    trace = import_weka(obj)
    assert json.loads(trace.header.source)["hash_fixups"] == 1
    assert len(trace.requests[0].blocks) == 3


@pytest.mark.parametrize("mutate, where", [
    (lambda o: o["requests"][1].pop("in"), "requests[1]"),
    (lambda o: o["requests"][0].__setitem__("t", -1.0), "requests[0]"),
    (lambda o: o["requests"][3]["requests"][0].__setitem__("out", "30"), "requests[3].requests[0]"),
    (lambda o: o["requests"][3]["requests"][2]["requests"][0].__setitem__("hash_ids", [1, -2]),
     "requests[3].requests[2].requests[0]"),
    (lambda o: o["requests"][3]["requests"][2].__setitem__("duration_ms", -1), "requests[3].requests[2]"),
    (lambda o: o["requests"][1].__setitem__("think_time", "1"), "requests[1]"),
    (lambda o: o["requests"][4].__setitem__("type", "x"), "requests[4]"),
    (lambda o: o["requests"][2].pop("agent_id"), "requests[2]"),
    (lambda o: o.__setitem__("block_size", "64"), "block_size"),
    (lambda o: o.__setitem__("hash_id_scope", "galaxy"), "hash_id_scope"),
])
def test_import_weka_malformed_names_the_entry(mutate, where):
    obj = _weka()
    mutate(obj)
    with pytest.raises(TraceError, match=re.escape(where)):
        import_weka(obj)


MOONCAKE = [  # rows 2 and 5 continue row 0, row 3 continues row 1, row 4 only shares row 0's first blocks
    {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 30, "hash_ids": [3, 4]},
    {"timestamp": 4000, "input_length": 1700, "output_length": 40, "hash_ids": [0, 1, 5, 6]},
    {"timestamp": 5000, "input_length": 1300, "output_length": 20, "hash_ids": [3, 7, 8]},
    {"timestamp": 6000, "input_length": 1200, "output_length": 25, "hash_ids": [0, 1, 9]},
    {"timestamp": 9000, "input_length": 2300, "output_length": 60, "hash_ids": [0, 1, 5, 6, 10]},
]


def test_import_mooncake_groups_sessions(tmp_path):
    path = tmp_path / "toolagent.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in MOONCAKE) + "\n")
    trace = import_mooncake(path)
    assert trace.header.block_tokens == 512
    groups = {key[1]: [r.id for r in calls] for key, calls in _by_branch(trace).items()}
    assert sorted(groups.values()) == [["r0", "r2", "r5"], ["r1", "r3"], ["r4"]]
    first = trace.requests[0]
    # No row knows whether its session goes on: no tool pauses, no closes (issue #39 item 5).
    assert first.t == 0.0 and all(r.tool is None and not r.close for r in trace.requests)
    assert not [r for r in trace.records if isinstance(r, Event)]
    assert [r.t for r in trace.requests] == [0.0, 0.5, 4.0, 5.0, 6.0, 9.0]
    assert trace_stats(trace)["ideal_reuse"] > 0.3
    assert len(import_mooncake(MOONCAKE, max_gap_s=1.0).requests) == 6
    assert trace_stats(import_mooncake(MOONCAKE, max_gap_s=1.0))["sessions"] == 6
    explicit = import_mooncake([dict(row, session_id=f"u{i % 2}") for i, row in enumerate(MOONCAKE)])
    assert trace_stats(explicit)["sessions"] == 2
    fine = import_mooncake(MOONCAKE, block_tokens=128)
    assert [len(r.blocks) for r in fine.requests][:2] == [9, 6]


@pytest.mark.parametrize("bad, match", [
    ({"input_length": 10, "output_length": 1, "hash_ids": [0]}, "row 3: missing field 'timestamp'"),
    ({"timestamp": "9", "input_length": 10, "output_length": 1, "hash_ids": [0]}, "row 3: field 'timestamp'"),
    ({"timestamp": 9, "input_length": 10.5, "output_length": 1, "hash_ids": [0]},
     "row 3: field 'input_length'"),
    ({"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": "0"}, "row 3: field 'hash_ids'"),
    ([1, 2], "row 3: expected a JSON object"),
])
def test_import_mooncake_malformed_names_the_row(bad, match):
    with pytest.raises(TraceError, match=match):
        import_mooncake(MOONCAKE[:3] + [bad])


def test_import_mooncake_bad_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + "\n{oops\n")
    with pytest.raises(TraceError, match="row 1"):
        import_mooncake(path)


# --- malformed v1 traces ------------------------------------------------------------------------


def _tiny() -> Trace:
    return validate(Trace(header=TraceHeader(name="tiny", block_tokens=4), records=[
        _req("a0", 0.0, [1, 2], 7, tool=ToolCall(tool_class="exec", duration_s=0.5)),
        _req("w0", 1.0, [1, 2, 3], 10, branch="w", parent_branch="main", close=True),
        _req("a1", 2.0, [1, 2, 4], 12, stable_prefix_tokens=4, edit_from_tokens=8),
        Event(t=3.0, kind="close_session", session="s"),
    ]))


def _lines(**edits) -> bytes:
    """The tiny trace as JSONL, with ``line<N>={field: value}`` edits (``None`` deletes a field)."""
    lines = dumps_jsonl(_tiny()).splitlines()
    for key, changes in edits.items():
        n = int(key.removeprefix("line")) - 1
        obj = json.loads(lines[n])
        for field, value in changes.items():
            obj.pop(field) if value is None else obj.__setitem__(field, value)
        lines[n] = json.dumps(obj).encode()
    return b"\n".join(lines) + b"\n"


def test_tiny_trace_loads():
    assert loads_jsonl(_lines()) == _tiny()


@pytest.mark.parametrize("edits, match", [
    ({"line2": {"input_tokens": "7"}}, r"line 2: Expected `int`"),
    ({"line3": {"colour": "red"}}, r"line 3: .*unknown field `colour`"),
    ({"line2": {"tool": {"tool_class": "exec", "duration_s": -0.5}}}, r"line 2: .*>= 0"),
    ({"line4": {"think_s": -1.0}}, r"line 4: .*>= 0"),
    ({"line2": {"blocks": [MAX_BLOCK_ID + 1, 2]}}, r"line 2: .*blocks\[0\]"),
    ({"line2": {"blocks": [-1, 2]}}, r"line 2: .*blocks\[0\]"),
    ({"line2": {"session": None}}, r"line 2: Object missing required field `session`"),
    ({"line4": {"t": 0.5}}, r"record 2 \(a1\): time goes backwards"),
    ({"line3": {"parent_branch": "lead"}}, r"record 1 \(w0\): unknown parent branch lead"),
    ({"line4": {"input_tokens": 20}}, r"record 2 \(a1\): 3 blocks for 20 input tokens"),
    ({"line4": {"edit_from_tokens": 13}}, r"record 2 \(a1\): edit_from_tokens=13 is past"),
    ({"line4": {"id": "a0"}}, r"record 2 \(a0\): duplicate request id"),
    ({"line4": {"branch": "w"}}, r"record 2 \(a1\): branch s/w was already closed"),
    ({"line5": {"kind": "close_branch", "branch": "x"}},
     r"record 3 \(close_branch s/x\): close_branch of unknown"),
    ({"line1": {"version": 2}}, r"trace version 2 is not supported"),
])
def test_malformed_trace_names_the_record(edits, match):
    with pytest.raises(TraceError, match=match):
        loads_jsonl(_lines(**edits))


def test_record_after_session_close_and_header_placement():
    after = _lines() + json.dumps({"type": "request", "id": "a2", "t": 4.0, "session": "s", "blocks": [1],
                                   "input_tokens": 4, "output_tokens": 1}).encode() + b"\n"
    with pytest.raises(TraceError, match=r"record 4 \(a2\): branch s/main was already closed"):
        loads_jsonl(after)
    lines = _lines().splitlines()
    with pytest.raises(TraceError, match="line 1: the first line must be the trace header"):
        loads_jsonl(b"\n".join([lines[1], lines[0], *lines[2:]]))
    with pytest.raises(TraceError, match="exactly one header"):
        loads_jsonl(b"\n".join([*lines, lines[0]]))
    with pytest.raises(TraceError, match="empty trace"):
        loads_jsonl(b"\n\n")
    with pytest.raises(TraceError, match="invalid msgpack trace"):
        loads_msgpack(b"\x93garbage")


def test_save_refuses_an_invalid_trace(tmp_path):
    bad = Trace(header=TraceHeader(block_tokens=4), records=[_req("x", 0.0, [1], 9)])
    with pytest.raises(TraceError, match=r"record 0 \(x\): 1 blocks for 9 input tokens"):
        save(bad, tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()


# --- token expansion ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(block_id=st.integers(0, MAX_BLOCK_ID), block_tokens=st.integers(1, 64), vocab=st.integers(4, 300_000))
def test_block_token_ids_stay_inside_the_vocabulary(block_id, block_tokens, vocab):
    ids = block_token_ids(block_id, block_tokens, vocab)
    assert len(ids) == block_tokens and all(3 <= x < vocab for x in ids)
    assert ids == block_token_ids(block_id, block_tokens, vocab)


def test_generated_blocks_expand_inside_a_small_vocabulary():
    trace = generate("branch_heavy", scale=0.05)
    for r in trace.requests[:50]:
        for b in r.blocks:
            assert all(3 <= x < 256 for x in block_token_ids(b, trace.header.block_tokens, 256))
    with pytest.raises(ValueError):
        block_token_ids(1, 4, 3)


def test_traces_built_in_code_get_the_same_range_checks_as_files():
    from sgl_agentcache.trace.schema import Request, Trace, TraceError, TraceHeader, ToolCall, validate

    bad = Trace(header=TraceHeader(), records=[Request(id="r0", t=0.0, session="s", blocks=[1], input_tokens=4,
                                                       output_tokens=1, tool=ToolCall("bash", -1.0))])
    with pytest.raises(TraceError, match="duration_s"):
        validate(bad)


def test_a_branch_keeps_its_parent():
    from sgl_agentcache.trace.schema import Request, Trace, TraceError, TraceHeader, validate

    def call(i, parent):
        return Request(id=f"r{i}", t=float(i), session="s", branch="b" if parent else "main",
                       parent_branch=parent, blocks=[1], input_tokens=4, output_tokens=1)

    records = [call(0, None), Request(id="x", t=0.5, session="s", branch="other", blocks=[1], input_tokens=4,
                                      output_tokens=1), call(1, "main"), call(2, "other")]
    with pytest.raises(TraceError, match="parent_branch changed"):
        validate(Trace(header=TraceHeader(), records=records))


def test_merge_tenants_retags_every_record_and_merges_by_arrival():
    from sgl_agentcache.trace.transforms import merge_tenants

    calm = generate("branch_heavy", seed=0, sessions=2)
    flood = generate("short_tools", seed=1, sessions=3)
    merged = merge_tenants({"calm": calm, "flood": flood})
    assert len(merged.records) == len(calm.records) + len(flood.records)
    times = [r.t for r in merged.records]
    assert times == sorted(times)
    assert {r.tenant for r in merged.records} == {"calm", "flood"}
    ids = [r.id for r in merged.requests]
    assert len(set(ids)) == len(ids) and all(i.split(":", 1)[0] in ("calm", "flood") for i in ids)
    # Each tenant's own records keep their order and content (but the tenant and the id's prefix).
    mine = [r for r in merged.records if r.tenant == "calm"]
    assert [r.t for r in mine] == [r.t for r in calm.records]
    with pytest.raises(TraceError, match="block sizes"):
        merge_tenants({"a": calm, "b": generate("short_tools", seed=1, sessions=1, block_tokens=32)})
