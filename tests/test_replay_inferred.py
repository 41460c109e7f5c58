"""Ours with no client hints in the replay: the lifecycle inferred from the calls by the server's own
chat inference (``sim/inferred.py`` drives ``chat_infer.ChatInference`` with block fingerprints), and
the trace format's record of where hints came from."""

from __future__ import annotations

import msgspec
import pytest

from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.sim.inferred import ReplayInference, block_turn
from sgl_agentcache.sim.policies import POLICIES
from sgl_agentcache.sim.replay import _Run, replay
from sgl_agentcache.sim.suite import pool_for
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.schema import (Event, Request, ToolCall, Trace, TraceError, TraceHeader, dumps_jsonl,
                                         loads_jsonl, validate)

SEED = PROFILES["seed"]
VOCAB = 2**31 - 1
BLOCK = 16


def _call(rid, t, blocks, *, session="s", branch="main", parent=None, fork=None, stable=32, tool=None, close=False):
    return Request(id=rid, t=t, session=session, branch=branch, parent_branch=parent, fork_point_tokens=fork,
                   blocks=list(blocks), input_tokens=len(blocks) * BLOCK, output_tokens=BLOCK,
                   stable_prefix_tokens=stable, tool=tool, close=close)


def test_block_turn_fingerprints_all_but_the_last_block_and_names_the_session_by_its_opening():
    a = block_turn(_call("a", 0, [1, 2, 3, 4]), BLOCK)
    b = block_turn(_call("b", 1, [1, 2, 3, 4, 5, 6]), BLOCK)
    other = block_turn(_call("c", 2, [1, 2, 9, 4]), BLOCK)  # same stable prefix, another first user turn
    assert len(a.fingerprints) == 3 and b.fingerprints[:3] == a.fingerprints  # b extends a
    assert a.leading_system == 2 and a.session == b.session != other.session
    assert a.source == "conversation"


def test_inference_continues_a_branch_forks_busy_subagents_and_closes_idle_branches():
    inference = ReplayInference(BLOCK, idle_s=10.0)
    lead, _ = inference.receive(_call("l1", 0.0, [1, 2, 3, 4], tool=ToolCall(tool_class="task", duration_s=5)), 0.0)
    inference.done(lead, 1.0)
    assert lead.hints == "inferred" and lead.parent_branch is None and not lead.close
    # Two subagents extend the lead's history while the lead waits on its tool: neither brings the
    # tool's result, so both are forks (the lead's branch keeps the lead's own history).
    sub1, _ = inference.receive(_call("a1", 1.1, [1, 2, 3, 4, 5, 6], branch="sa-1", parent="main", fork=64), 1.1)
    sub2, _ = inference.receive(_call("b1", 1.1, [1, 2, 3, 4, 7, 8], branch="sa-2", parent="main", fork=64), 1.1)
    # sub2 forks from the branch it shares most with: sub1 (the lead's last, partial block carries no
    # fingerprint, so sub1 shares one block more with sub2 than the lead does).
    assert sub1.parent_branch == lead.branch and sub2.parent_branch == sub1.branch
    assert sub1.branch != sub2.branch != lead.branch
    assert sub2.fork_point_tokens == 4 * BLOCK  # the blocks it shares (past the stable prefix)
    for call in (sub1, sub2):
        inference.done(call, 2.0)
    # The lead's next call brings the tool's result: it continues the lead's branch, and the
    # subagents, answered and waiting for nothing, are done (closed, forks before their parent).
    back, done = inference.receive(_call("l2", 3.0, [1, 2, 3, 4, 9, 10]), 3.0)
    assert back.branch == lead.branch and back.edit_from_tokens is None
    assert [b.branch for b in done] == [sub2.branch, sub1.branch]
    inference.done(back, 4.0)
    paused = {}
    assert inference.idle(5.0, paused) == []  # not idle long enough
    closed = inference.idle(20.0, paused)
    assert [b.branch for b in closed] == [lead.branch]
    assert inference.stats()["sessions"] == 0 and inference.stats()["subagent_closes"] == 2


def test_a_conversation_spliced_after_its_stable_prefix_closes_the_session_it_rewrote():
    """Blocks inserted between the stable prefix and the opening block (a memory segment) make a new
    session by the opening, as on the server; the old session, idle, is closed as rewritten."""
    inference = ReplayInference(BLOCK)
    old, _ = inference.receive(_call("o1", 0.0, [1, 2, 3, 4, 5]), 0.0)
    inference.done(old, 1.0)
    new, closed = inference.receive(_call("o2", 2.0, [1, 2, 70, 71, 72, 3, 4, 5, 6]), 2.0)
    assert new.session != old.session and closed == [BranchKey(namespace_key("default", None), old.session, old.branch)]
    assert inference.stats()["rewritten_closes"] == 1 and inference.stats()["sessions"] == 1
    # Every splice of the generated context_editing trace is found, and nothing else is closed so.
    trace = generate("context_editing", seed=1, scale=0.1)
    inference = ReplayInference(trace.header.block_tokens)
    splices = 0
    for request in sorted(trace.requests, key=lambda r: r.t):
        splices += request.edit_from_tokens is not None and request.edit_from_tokens <= request.stable_prefix_tokens
        inferred, _ = inference.receive(request, request.t)
        inference.done(inferred, request.t + 1.0)
    assert splices > 0 and inference.stats()["rewritten_closes"] == splices
    assert inference.stats()["sessions"] == len({r.session for r in trace.requests})


def test_a_paused_branch_is_not_closed_when_idle_until_the_maximum_retention():
    inference = ReplayInference(BLOCK, idle_s=10.0, max_retention_s=100.0)
    call, _ = inference.receive(_call("l1", 0.0, [1, 2, 3]), 0.0)
    inference.done(call, 1.0)
    branch = BranchKey(namespace_key("default", None), call.session, call.branch)
    assert inference.idle(50.0, {branch: 1.0}) == []
    assert inference.idle(150.0, {branch: 1.0}) == [branch]


def test_trace_format_records_inferred_hints_and_refuses_inferred_closes():
    call = msgspec.structs.replace(_call("x", 0.0, [1, 2]), hints="inferred", session="c-1", branch="m1")
    trace = Trace(header=TraceHeader(block_tokens=BLOCK), records=[call])
    assert loads_jsonl(dumps_jsonl(trace)).records[0].hints == "inferred"
    assert _call("y", 0.0, [1]).hints == "explicit"
    with pytest.raises(TraceError, match="inferred record carries no close"):
        validate(Trace(header=trace.header, records=[msgspec.structs.replace(call, close=True)]))


def test_inferred_replay_serves_every_call_with_no_client_hint_and_leaks_nothing():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    pool = pool_for(trace, "tight")
    r = replay(trace, "agentcache-inferred", pool_tokens=pool, host_tokens=pool, profile=SEED, vocab_size=VOCAB)
    assert POLICIES["agentcache-inferred"].infer and r.label.startswith("ours, inferred")
    assert r.requests == len(trace.requests) and r.refused_requests == 0
    assert r.integrity_ok and r.leaked_tokens == 0
    inferred = r.inference
    assert inferred["requests"] == len(trace.requests)
    assert inferred["forks"] > 0 and inferred["continued"] > 0  # subagents found without a hint
    # Idle closes end the branches but keep their KV as untagged cache (a close is only a guess).
    assert inferred["idle_closes"] > 0 and inferred["kept_on_close_tokens"] > 0
    v1 = replay(trace, "agentcache-inferred-v1", pool_tokens=pool, host_tokens=pool, profile=SEED, vocab_size=VOCAB)
    assert v1.integrity_ok and v1.leaked_tokens == 0
    assert v1.reclaimed_tokens > 0 and v1.inference["kept_on_close_tokens"] == 0  # as first shipped: freed
    assert sum(r.decisions[k] for k in ("keep", "offload", "discard", "release")) > 0  # tool pauses decided


def test_a_call_sent_before_its_predecessor_is_answered_reaches_the_server_after_the_answer():
    """The trace's clock can be faster than the replay's service: the next call of a branch is received
    (its hint, the end of its tool pause) only once the previous call is answered, as from a client.
    Inferred: it continues the branch instead of looking like a fork of a busy branch."""
    calls = [_call("c0", 0.0, range(1, 41), tool=ToolCall(tool_class="grep", duration_s=0.001)),
             _call("c1", 0.002, range(1, 43), tool=ToolCall(tool_class="grep", duration_s=0.001)),
             _call("c2", 0.004, range(1, 45), close=True)]
    trace = Trace(header=TraceHeader(block_tokens=BLOCK), records=calls)
    for policy in ("agentcache", "agentcache-inferred"):
        run = _Run(trace, POLICIES[policy], 4096, 4096, SEED, VOCAB, 8, None, False)
        result = run.run()
        assert result.requests == 3 and not run.paused  # every pause ended at its resume
        assert all(x < 0.5 for x in run.observed_all["default"])  # tool time seen by the server, not service
        if policy == "agentcache-inferred":
            assert result.inference["continued"] == 2 and result.inference["forks"] == 0


def test_inferred_replay_ignores_the_trace_closes_and_edits():
    calls = [_call("c0", 0.0, [1, 2, 3, 4]), _call("c1", 5.0, [1, 2, 3, 4, 5, 6], close=True)]
    trace = Trace(header=TraceHeader(block_tokens=BLOCK),
                  records=[*calls, Event(t=6.0, kind="close_session", session="s")])
    run = _Run(trace, POLICIES["agentcache-inferred"], 4096, 0, SEED, VOCAB, 8, None, False)
    result = run.run()
    assert result.requests == 2 and result.inference["continued"] == 1
    # Closed by the idle sweep (idle_s after the last answer), not by the trace's close.
    assert result.inference["idle_closes"] == 1 and result.reclaim_latencies_s == []


def test_a_divergence_from_an_idle_branch_is_its_edit_and_from_a_busy_one_a_fork():
    inference = ReplayInference(BLOCK, idle_s=10.0)
    lead, _ = inference.receive(_call("l1", 0.0, [1, 2, 3, 4, 5, 6]), 0.0)
    inference.done(lead, 1.0)
    compacted, _ = inference.receive(_call("l2", 2.0, [1, 2, 3, 9, 10]), 2.0)
    assert compacted.branch == lead.branch and compacted.parent_branch is None
    assert compacted.edit_from_tokens == 3 * BLOCK  # the blocks it still shares
    # While the branch's own call runs, a divergent call is a fork, not an edit.
    forked, _ = inference.receive(_call("f1", 2.1, [1, 2, 3, 9, 11, 12]), 2.1)
    assert forked.parent_branch == lead.branch and forked.edit_from_tokens is None
    assert inference.stats()["edits"] == 1 and inference.stats()["forks"] == 1
    as_shipped = ReplayInference(BLOCK, idle_s=10.0, infer_edits=False)
    first, _ = as_shipped.receive(_call("l1", 0.0, [1, 2, 3, 4, 5, 6]), 0.0)
    as_shipped.done(first, 1.0)
    again, _ = as_shipped.receive(_call("l2", 2.0, [1, 2, 3, 9, 10]), 2.0)
    assert again.parent_branch == first.branch and again.edit_from_tokens is None


def test_a_subagent_started_by_its_leads_tool_is_a_fork_and_the_leads_own_rewrite_an_edit():
    inference = ReplayInference(BLOCK, idle_s=10.0)
    task = ToolCall(tool_class="task", duration_s=5)
    lead, _ = inference.receive(_call("l1", 0.0, [1, 2, 3, 4, 5, 6], tool=task), 0.0)
    inference.done(lead, 1.0)
    sub, _ = inference.receive(_call("s1", 1.1, [1, 2, 3, 9, 10], branch="sub", parent="main"), 1.1)
    assert sub.parent_branch == lead.branch and sub.edit_from_tokens is None  # no tool result: a fork
    inference.done(sub, 2.0)
    back, _ = inference.receive(_call("l2", 6.0, [1, 2, 3, 11, 12]), 6.0)  # the lead's next call: its result
    assert back.branch == lead.branch and back.edit_from_tokens == 3 * BLOCK


def test_an_inferred_edit_frees_the_old_suffix_and_the_audit_counts_it():
    history = list(range(1, 41))
    calls = [_call("c0", 0.0, history), _call("c1", 50.0, history[:10] + list(range(100, 110)))]
    trace = Trace(header=TraceHeader(block_tokens=BLOCK), records=calls)
    run = _Run(trace, POLICIES["agentcache-inferred"], 4096, 0, SEED, VOCAB, 8, None, False)
    result = run.run()
    assert result.inference["edits"] == 1 and run.cache.context_edit_freed_tokens > 0
    assert result.inference["audit"]["edits_not_in_trace"] == 1  # the trace did not label it
    assert result.integrity_ok and result.leaked_tokens == 0


def test_a_conversation_back_after_a_long_pause_finds_its_history_unless_idle_closes_free_it():
    """A human away for longer than the idle time: the idle close was wrong. Kept as untagged cache,
    the history is still resident when the next turn comes (nothing else wanted the room)."""
    history = list(range(1, 41))
    calls = [_call("c0", 0.0, history), _call("c1", 2000.0, history + [41, 42])]
    trace = Trace(header=TraceHeader(block_tokens=BLOCK), records=calls)
    cached = {}
    for policy in ("agentcache-inferred", "agentcache-inferred-v1"):
        result = _Run(trace, POLICIES[policy], 4096, 0, SEED, VOCAB, 8, None, False).run()
        assert result.inference["idle_closes"] >= 1 and result.inference["audit"]["returns_after_close"] == 1
        assert result.integrity_ok and result.leaked_tokens == 0
        cached[policy] = result.calls["c1"].cached_tokens
    assert cached["agentcache-inferred"] >= 39 * BLOCK
    assert cached["agentcache-inferred-v1"] == 32  # the stable prefix (unowned) only: the history was freed


def test_the_attribution_policy_applies_the_traces_own_closes_to_inferred_branches():
    calls = [_call("c0", 0.0, [1, 2, 3, 4]),
             _call("s0", 0.0, [1, 2, 5, 6, 7], branch="sub", parent="main", fork=32)]
    trace = Trace(header=TraceHeader(block_tokens=BLOCK),
                  records=[*calls, Event(t=5.0, kind="close_branch", session="s", branch="sub")])
    closes = _Run(trace, POLICIES["agentcache-inferred+closes"], 4096, 0, SEED, VOCAB, 8, None, False).run()
    plain = _Run(trace, POLICIES["agentcache-inferred"], 4096, 0, SEED, VOCAB, 8, None, False).run()
    assert closes.reclaimed_tokens > 0 and plain.reclaimed_tokens == 0  # freed at the trace's close
    assert closes.integrity_ok and closes.leaked_tokens == 0


def test_a_branch_abandoned_on_its_tool_is_closed_at_the_learned_bound_not_the_retention():
    """A conversation rewritten from its first user message leaves its old branch waiting on a tool
    whose result never comes. Once the namespace has seen MIN_GAPS tool results, the replay closes it
    at the learned tool bound, as the server's sweeper does; with fixed bounds it is still held
    (paused within the maximum retention) when the trace ends."""
    from sgl_agentcache.policy.gap_bounds import MIN_GAPS

    grep = ToolCall(tool_class="grep", duration_s=1.0)
    loop = [_call(f"c{i}", 3.0 * i, range(1, 5 + 2 * i), tool=grep) for i in range(MIN_GAPS + 1)]
    loop.append(_call("end", 3.0 * (MIN_GAPS + 1), range(1, 7 + 2 * MIN_GAPS)))
    abandoned = _call("x0", 200.0, [1, 2, 900, 901, 902], session="s2", tool=grep)
    trace = Trace(header=TraceHeader(block_tokens=BLOCK), records=[*loop, abandoned])
    learned = _Run(trace, POLICIES["agentcache-inferred"], 4096, 0, SEED, VOCAB, 8, None, False).run()
    fixed = _Run(trace, POLICIES["agentcache-inferred-fixed-bounds"], 4096, 0, SEED, VOCAB, 8, None, False).run()
    assert learned.inference["tool_bound_closes"] == 1 and fixed.inference["tool_bound_closes"] == 0
    assert fixed.inference["idle_closes"] == learned.inference["idle_closes"]  # the loop's own branch
    for result in (learned, fixed):
        assert result.requests == len(trace.records) and result.integrity_ok and result.leaked_tokens == 0
