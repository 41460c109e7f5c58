"""Forks and joins in the replay: a subagent's first call is sent only after the parent call it forks from
is answered, and the lead's call after a subagents pause only after its subagents' calls are answered
(sim/causality.py). Pure replay code, no server."""

from __future__ import annotations

import pytest

from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.sim.causality import cross_branch_prerequisites
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.suite import REPLAY_VOCAB, pool_for
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.schema import Event, Request, ToolCall, Trace, TraceHeader

BLOCK = 16


def _call(rid, t, blocks, *, branch="main", parent=None, tool=None, close=False):
    return Request(id=rid, t=t, session="s", branch=branch, parent_branch=parent, blocks=list(blocks),
                   input_tokens=len(blocks) * BLOCK, output_tokens=BLOCK, stable_prefix_tokens=32, tool=tool,
                   close=close)


def _fan_out_trace() -> Trace:
    """A lead call, two subagents forked from its answer (one with two calls), the lead's closing call.
    The trace's clock puts every subagent call *before* the lead could have been answered in the replay
    (0.001 s apart), which is what a replay slower than the trace's own service model sees."""
    wait = ToolCall(tool_class="subagents", duration_s=0.004)
    grep = ToolCall(tool_class="grep", duration_s=0.0005)
    return Trace(header=TraceHeader(block_tokens=BLOCK), records=[
        _call("lead0", 0.0, range(1, 41), tool=wait),
        _call("a0", 0.001, [*range(1, 42), 100], branch="a", parent="main", tool=grep),
        _call("b0", 0.002, [*range(1, 42), 200], branch="b", parent="main", close=True),
        _call("a1", 0.003, [*range(1, 42), 100, 101], branch="a", parent="main", close=True),
        _call("lead1", 0.005, [*range(1, 42), 300, 301], close=True),
        Event(t=0.006, kind="close_session", session="s"),
    ])


def test_prerequisites_are_the_fork_parent_and_the_joined_children():
    needs = cross_branch_prerequisites(_fan_out_trace())
    assert needs == {"a0": ("lead0",), "b0": ("lead0",), "lead1": ("a0", "b0", "a1")}


def test_a_branch_without_forks_has_no_prerequisites():
    trace = generate("short_tools", seed=1, scale=0.05)
    assert cross_branch_prerequisites(trace) == {}


def _order(result) -> tuple[dict, dict]:
    admitted = {rid: i for i, (kind, rid) in enumerate(result.access_log) if kind == "a"}
    finished = {rid: i for i, (kind, rid) in enumerate(result.access_log) if kind == "f"}
    return admitted, finished


@pytest.mark.parametrize("policy", ["stock", "sglang-hicache", "agentcache", "agentcache-inferred"])
def test_subagents_run_after_their_fork_and_the_lead_resumes_after_them(policy):
    result = replay(_fan_out_trace(), policy, pool_tokens=4096, host_tokens=4096, profile=PROFILES["seed"],
                    vocab_size=REPLAY_VOCAB, timeline=False)
    admitted, finished = _order(result)
    assert result.requests == 5 and result.refused_requests == 0
    assert admitted["a0"] > finished["lead0"] and admitted["b0"] > finished["lead0"]
    assert admitted["lead1"] > max(finished["a0"], finished["a1"], finished["b0"])
    assert admitted["a1"] > finished["a0"]
    # The subagents found the lead's context cached: only their own tokens were computed.
    if policy != "agentcache-inferred":
        assert result.recomputed_tokens < 40 * BLOCK + 5 * 3 * BLOCK


def test_every_fork_and_join_of_a_generated_workload_keeps_its_order():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    pool = pool_for(trace, "tight")
    result = replay(trace, "agentcache", pool_tokens=pool, host_tokens=pool, profile=PROFILES["seed"],
                    vocab_size=REPLAY_VOCAB, timeline=False)
    admitted, finished = _order(result)
    needs = cross_branch_prerequisites(trace)
    assert len(needs) > 40
    checked = 0
    for rid, prerequisites in needs.items():
        for p in prerequisites:
            if rid in admitted and p in finished:  # aborted or refused calls have no answer
                assert admitted[rid] > finished[p], (rid, p)
                checked += 1
    assert checked > 60
    assert result.leaked_tokens == 0 and result.integrity_ok
