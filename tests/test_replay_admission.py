"""Admission order in the replay (sim/admission.py): every strategy serves every call and leaks nothing,
the order changes who waits, events keep their places, and no strategy reads the trace's future."""

from __future__ import annotations

import msgspec
import pytest

from sgl_agentcache.lifecycle import BranchKey, namespace_key
from sgl_agentcache.policy.admission_order import STRATEGIES, AdmissionSettings
from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.sim.admission import ReplayAdmission
from sgl_agentcache.sim.replay import replay
from sgl_agentcache.sim.suite import pool_for
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.schema import Event, Request

SEED = PROFILES["seed"]
VOCAB = 2**31 - 1


@pytest.fixture(scope="module")
def branch_heavy():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    return trace, pool_for(trace, "tight")


@pytest.fixture(scope="module")
def runs(branch_heavy):
    trace, pool = branch_heavy
    return {(policy, strategy): replay(trace, policy, pool_tokens=pool, host_tokens=pool, profile=SEED,
                                       vocab_size=VOCAB, admission=strategy, timeline=False)
            for policy in ("sglang-hicache", "agentcache") for strategy in STRATEGIES}


def test_every_strategy_serves_every_call_and_leaks_nothing(branch_heavy, runs):
    trace, _ = branch_heavy
    for (policy, strategy), r in runs.items():
        assert r.admission == strategy
        assert r.requests == len(trace.requests) and r.integrity_ok, (policy, strategy)
        if policy == "agentcache":
            assert r.leaked_tokens == 0, strategy


def test_the_order_decides_who_waits(runs):
    """The strategies are not one order under six names: on this contended trace their calls start at
    different times."""
    starts = {key: {rid: call.start_s for rid, call in r.calls.items()} for key, r in runs.items()}
    for policy in ("sglang-hicache", "agentcache"):
        distinct = {tuple(sorted(starts[(policy, s)].items())) for s in STRATEGIES}
        assert len(distinct) >= 4, policy


def _request(i: int, session: str, tenant: str = "t", tokens: int = 100) -> Request:
    return Request(id=f"r{i}", t=0.0, tenant=tenant, session=session, branch="main", input_tokens=tokens,
                   output_tokens=4, blocks=[])


def _branch(request: Request) -> BranchKey:
    return BranchKey(namespace_key(request.tenant, None), request.session, request.branch)


def test_reorder_sorts_the_calls_ahead_of_the_first_event():
    order = ReplayAdmission(AdmissionSettings(strategy="agent"), resident=lambda request: 90)
    old = _request(0, "old")
    order.received(old, _branch(old), 0.0)
    order.started(old, _branch(old), 100)
    order.answered(old, _branch(old))
    burst = [_request(i, f"new{i}") for i in range(1, 4)]
    turn = _request(4, "old")
    for request in burst + [turn]:
        order.received(request, _branch(request), 0.0)
    abort = Event(t=0.0, kind="abort", tenant="t", session="new3", branch="main")
    late = _request(5, "old")
    order.received(late, _branch(late), 0.0)
    waiting = [(burst[0], 0.0), (burst[1], 0.0), (turn, 0.0), (abort, 0.0), (burst[2], 0.0), (late, 0.0)]
    order.reorder(waiting, _branch, 0.0)
    # The returning turn goes first; the abort is a barrier: nothing behind it moves ahead of it.
    assert [r.id if isinstance(r, Request) else "abort" for r, _ in waiting] == ["r4", "r1", "r2", "abort", "r3", "r5"]
    assert order.waited == {"r1": 1, "r2": 1, "r3": 0, "r4": 1, "r5": 0}


def test_passes_waited_count_the_forward_steps_of_the_wait():
    """The server runs a pass per forward step: a call that waited ``starvation_steps`` steps goes first
    at the next attempt, however few attempts the replay's events made; without a step time only the
    attempts count."""
    settings = AdmissionSettings(strategy="agent", starvation_steps=256)
    step = SEED.forward_step_s()
    assert step == pytest.approx(0.02)
    for step_s, starved_first in ((step, True), (None, False)):
        order = ReplayAdmission(settings, resident=lambda request: 90, step_s=step_s)
        old = _request(0, "old")
        order.received(old, _branch(old), 0.0)
        order.started(old, _branch(old), 100)
        order.answered(old, _branch(old))
        early = _request(1, "new")  # waits from t=0
        order.received(early, _branch(early), 0.0)
        turn = _request(2, "old")  # a returning turn with resident KV: class 0, ahead of the newcomer
        order.received(turn, _branch(turn), 1.0)
        waiting = [(early, 0.0), (turn, 1.0)]
        order.reorder(waiting, _branch, 1.0)
        assert [r.id for r, _ in waiting] == ["r2", "r1"]
        assert order.waited["r1"] == (50 if step_s else 1)
        order.reorder(waiting, _branch, 256 * step + 1e-9)  # the second attempt, 256 steps in
        assert [r.id for r, _ in waiting] == (["r1", "r2"] if starved_first else ["r2", "r1"]), step_s
    with pytest.raises(ValueError, match="step_s"):
        ReplayAdmission(settings, resident=lambda request: 0, step_s=0.0)


def test_a_scaled_profile_keeps_the_deployments_step():
    from sgl_agentcache.sim.suite import scaled_profile

    scaled = scaled_profile(SEED, 64)
    assert scaled.token_scale == 64 and scaled.decode_s_per_token == pytest.approx(1.28)
    assert scaled.forward_step_s() == pytest.approx(SEED.forward_step_s())


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "fcfs"])
def test_no_strategy_reads_the_traces_structure_ahead(branch_heavy, runs, strategy, monkeypatch):
    """With the calls past a cut removed and the close flags after it flipped, every call that started
    by the cut starts as before, with the same hit, under every strategy (nothing reads what a client
    had not sent yet)."""
    from sgl_agentcache.sim.replay import _token_book

    trace, pool = branch_heavy
    cut = sorted(r.t for r in trace.requests)[len(trace.requests) // 2]
    records = [msgspec.structs.replace(r, close=not r.close) if isinstance(r, Request) and r.t > cut else r
               for r in trace.records if not (r.t > cut and (isinstance(r, Event) or r.t > cut + 30.0))]
    changed = msgspec.structs.replace(trace, records=records)
    monkeypatch.setattr(_token_book(changed, VOCAB), "output", _token_book(trace, VOCAB).output)
    for policy in ("sglang-hicache", "agentcache"):
        base = runs[(policy, strategy)]
        other = replay(changed, policy, pool_tokens=pool, host_tokens=pool, profile=SEED, vocab_size=VOCAB,
                       admission=strategy, timeline=False)
        before = {rid: call for rid, call in base.calls.items() if call.start_s <= cut}
        assert len(before) > 10
        diff = [(rid, call, other.calls.get(rid)) for rid, call in before.items() if other.calls.get(rid) != call]
        assert not diff, (policy, strategy, diff[:3])


@pytest.mark.timeout(900)
def test_the_admission_benchmark_runs_every_system_on_equal_memory(tmp_path):
    import json

    from bench_module import load_bench

    from sgl_agentcache.sim.admission_study import SYSTEMS

    bench = load_bench("admission")
    assert bench.main(["--quick", "--out", str(tmp_path), "--workers", "1"]) == 0
    report = json.loads((tmp_path / "admission_quick.json").read_text())
    rows = report["rows"]
    assert {r["policy"] for r in rows} == set(SYSTEMS) and len({r["session"] for r in rows}) == 6
    for group in {r["group"] for r in rows}:
        mine = [r for r in rows if r["group"] == group]
        assert len({r["pool_tokens"] for r in mine}) == 1
        assert {r["host_tokens"] for r in mine if r["policy"] != "stock"} == {round(0.5 * mine[0]["pool_tokens"])}
        assert {r["host_tokens"] for r in mine if r["policy"] == "stock"} == {0}
    assert all(r["integrity_ok"] and not r["leaked_tokens"] for r in rows)
    assert {r["admission"] for r in rows if r["policy"] == "agentcache"} == {"agent"}
    assert all(r["jct_s"] >= r["span_s"] for r in rows)  # no session finishes before its own span
    for ref, floor in report["jct_floor"].items():
        assert floor["sessions"] == 6 and 0 < floor["lowest"] <= floor["median"] <= 1.0 + 1e-9, ref
    others = {c["other"] for c in report["comparisons"] if c["metric"] == "first_ttft_s"}
    assert others == set(SYSTEMS) - {"agentcache"}
    flood = report["flood"]  # two tenants, one flooding: every system on every seed, the same pool
    assert {(r["system"], r["seed"]) for r in flood["rows"]} == {(n, s) for n in SYSTEMS for s in (0, 1)}
    assert all(r["integrity_ok"] and r["calm_slowdown"] > 0 for r in flood["rows"])
    for seed in (0, 1):
        assert len({r["pool_tokens"] for r in flood["rows"] if r["seed"] == seed}) == 1
    assert set(flood["ours_vs"]) == set(SYSTEMS) - {"agentcache"}


def test_the_jct_floor_is_each_sessions_span_over_the_references_jct():
    from sgl_agentcache.sim.admission_study import jct_floor

    rows = [{"policy": "ref", "span_s": span, "jct_s": jct} for span, jct in ((90, 100), (60, 100), (99, 100))]
    rows.append({"policy": "other", "span_s": 1, "jct_s": 100})  # another system's rows are not read
    floor = jct_floor(rows, "ref", target=0.7)
    assert floor["sessions"] == 3 and floor["median"] == pytest.approx(0.9) and floor["lowest"] == pytest.approx(0.6)
    assert floor["mean"] == pytest.approx(0.83) and floor["ci95"][0] < 0.83 < floor["ci95"][1]
    assert floor["below_target"] == 1
    with pytest.raises(ValueError, match="no session"):
        jct_floor(rows, "missing")
