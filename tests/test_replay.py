"""The replayer drives the real cache code (offline) over a trace: same requests, both policies."""

from __future__ import annotations

from sgl_agentcache.sim.cost import PROFILES
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.trace.generators import generate


def test_replay_serves_every_request_under_both_policies_and_leaks_nothing():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    stock = replay(trace, "stock", pool_tokens=8192, profile=PROFILES["seed"])
    ours = replay(trace, "agentcache", pool_tokens=8192, profile=PROFILES["seed"])
    assert stock.requests == len(trace.requests) and stock.refused_requests == 0
    # agentcache refuses calls of subagents whose lead already closed (a fork of a closed parent):
    # they are counted, never silently dropped.
    assert ours.requests + ours.refused_requests == len(trace.requests)
    assert stock.integrity_ok and ours.integrity_ok
    assert ours.leaked_tokens == 0
    assert 0 < stock.hit_rate < 1 and 0 < ours.hit_rate < 1
    assert ours.recomputed_tokens == ours.input_tokens - ours.cached_tokens


def test_replay_is_deterministic():
    trace = generate("context_editing", seed=5, scale=0.1)
    first = replay(trace, "agentcache", pool_tokens=8192, profile=PROFILES["seed"]).to_dict()
    second = replay(trace, "agentcache", pool_tokens=8192, profile=PROFILES["seed"]).to_dict()
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
