"""The replayer drives the real cache code (offline) over a trace: every system, same requests, same
device pool, same host tier; nothing but the clairvoyant heuristic reads the future; the LP lower
bound is one."""

from __future__ import annotations

import json
import math
import random

import msgspec
import pytest

from sgl_agentcache.policy.pause import PauseAction
from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.sim.bound import lower_bound
from sgl_agentcache.sim.policies import POLICIES, PauseView, continuum_ttl
from sgl_agentcache.sim.replay import TraceFuture, jain, replay
from sgl_agentcache.sim.suite import PRESSURES, SuiteConfig, compare, mean_ci, pool_for, run_suite, write_report
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.schema import Event, Request, ToolCall, Trace, TraceHeader

SEED = PROFILES["seed"]
VOCAB = 2**31 - 1


@pytest.fixture(scope="module")
def branch_heavy():
    trace = generate("branch_heavy", seed=2, scale=0.1)
    pool = pool_for(trace, "tight")
    return trace, pool, pool  # host tier = 1x pool


@pytest.fixture(scope="module")
def results(branch_heavy):
    trace, pool, host = branch_heavy
    return {name: replay(trace, name, pool_tokens=pool, host_tokens=host, profile=SEED, vocab_size=VOCAB)
            for name in POLICIES}


def test_every_policy_serves_every_request_and_leaks_nothing(branch_heavy, results):
    trace, pool, host = branch_heavy
    for name, r in results.items():
        assert r.requests == len(trace.requests) and r.refused_requests == 0, name
        assert r.integrity_ok, name
        assert r.recomputed_tokens == r.input_tokens - r.cached_tokens, name
        assert 0 < r.hit_rate < 1, name
    for name in ("agentcache", "clairvoyant"):  # lifecycle hints: closed branches are reclaimed, none leaked
        assert results[name].leaked_tokens == 0
        assert results[name].reclaimed_tokens > 0 and results[name].reclaim_latencies_s
    assert results["stock"].leaked_tokens is None and results["stock"].pauses == 0


def test_every_system_gets_the_same_pool_and_host_tier(branch_heavy, results):
    """Equal memory, read back from the run records: the same device pool for all, the same host tier
    for every system that can have one; stock SGLang (the reference) has none."""
    trace, pool, host = branch_heavy
    for name, r in results.items():
        assert r.pool_tokens == pool, name
        assert r.host_tokens == (0 if POLICIES[name].reference else host), name
        if not POLICIES[name].reference and results[name].bytes_d2h:
            assert r.host_tokens_at_end <= host


def test_suite_cells_give_every_compared_system_equal_memory():
    config = SuiteConfig(workloads=("short_tools",), seeds=(1, 2), sweep_hosts=(0.5,), scale=0.05, workers=1)
    report = run_suite(config, SEED)
    cells: dict[tuple, list[dict]] = {}
    for row in report["rows"]:
        cells.setdefault((row["workload"], row["pressure"], row["host_ratio"], row["seed"]), []).append(row)
    assert {k[2] for k in cells} == {0.0, 0.5, 1.0}
    for (_, pressure, host_ratio, _), rows in cells.items():
        pools = {r["pool_tokens"] for r in rows}
        assert len(pools) == 1
        pool = pools.pop()
        for r in rows:
            expected = 0 if POLICIES[r["policy"]].reference else int(round(host_ratio * pool))
            assert r["host_tokens"] == expected, (r["policy"], host_ratio)
        assert {r["policy"] for r in rows} >= {"stock", "agentcache"}
        # the LP bound of the cell is below every run of the cell
        assert all(r["recomputed_tokens"] >= r["lower_bound_tokens"] - 1e-6 for r in rows)
    pools = {p: {r["pool_tokens"] for r in report["rows"] if r["pressure"] == p} for p in PRESSURES}
    assert max(pools["tight"]) < min(pools["moderate"])  # pressure points differ
    # Latency beside tokens: ours against stock and write-back on each latency, seed by seed.
    metrics = {(c["metric"], c["other"]) for c in report["latency_comparisons"] if c["host_ratio"] == 1.0}
    assert metrics >= {(m, o) for m in ("resume_p99_s", "resume_own_wait_p99_s", "session_jct_mean_s")
                       for o in ("stock", "sglang-hicache")}


def _scrambled_durations(trace: Trace, seed: int) -> Trace:
    """The same arrivals with every call's think time and tool duration shuffled among the calls."""
    rng = random.Random(seed)
    requests = [r for r in trace.records if isinstance(r, Request)]
    thinks = [r.think_s for r in requests]
    tools = [r.tool.duration_s for r in requests if r.tool is not None]
    rng.shuffle(thinks)
    rng.shuffle(tools)
    records, t, k = [], iter(thinks), iter(tools)
    for record in trace.records:
        if isinstance(record, Request):
            tool = record.tool and ToolCall(tool_class=record.tool.tool_class, duration_s=next(k) + 7.0)
            record = msgspec.structs.replace(record, think_s=next(t) + 3.0, tool=tool)
        records.append(record)
    return Trace(header=trace.header, records=records)


class _WrongFuture(TraceFuture):
    """Every branch returns at a random time (or never)."""

    def __init__(self, trace, tokens, seed):
        super().__init__(trace, tokens)
        self.rng = random.Random(seed)

    def after(self, request, now):
        from sgl_agentcache.sim.policies import Future

        return Future(wait_s=self.rng.uniform(0.0, 100.0), resumes=self.rng.random() < 0.5)


def test_only_the_clairvoyant_heuristic_reads_the_future(branch_heavy, results):
    """The trace's future times reach only the clairvoyant policy: with every think time and tool
    duration scrambled (arrivals unchanged), and with a wrong future handed to the replayer, every
    other system's results are identical; the clairvoyant one's are not."""
    from sgl_agentcache.sim.replay import _token_book

    trace, pool, host = branch_heavy
    scrambled = _scrambled_durations(trace, seed=4)
    wrong = _WrongFuture(trace, _token_book(trace, VOCAB), seed=5)
    changed = set()
    for name, base in results.items():
        a = replay(scrambled, name, pool_tokens=pool, host_tokens=host, profile=SEED, vocab_size=VOCAB)
        b = replay(trace, name, pool_tokens=pool, host_tokens=host, profile=SEED, vocab_size=VOCAB, future=wrong)
        want = {k: v for k, v in base.to_dict().items() if k != "wall_s"}
        same = all({k: v for k, v in x.to_dict().items() if k != "wall_s"} == want for x in (a, b))
        if not POLICIES[name].clairvoyant:
            assert same, name
        elif not same:
            changed.add(name)
    assert changed == {"clairvoyant"}  # the test has teeth: the future does drive that one


def _future_changed(trace: Trace, cut: float, how: str) -> Trace:
    """``trace`` with its future past ``cut`` changed, its present kept: every call arriving by ``cut``
    and its tokens are the same. ``closes``: calls past the cut flip their close flag and events past
    it go; ``tools``: calls past the cut gain or lose their tool stop; ``calls``: nothing past the cut
    (no branch has a call left); ``times``: every record past the cut arrives 50 s later."""
    records = []
    for record in trace.records:
        late = record.t > cut
        if late and (how == "calls" or (how == "closes" and isinstance(record, Event))):
            continue
        if late and how == "closes":
            record = msgspec.structs.replace(record, close=not record.close)
        elif late and how == "tools" and isinstance(record, Request):
            record = msgspec.structs.replace(
                record, tool=None if record.tool is not None else ToolCall(tool_class="grep", duration_s=1.0))
        elif late and how == "times":
            record = msgspec.structs.replace(record, t=record.t + 50.0)
        records.append(record)
    return Trace(header=trace.header, records=records)


@pytest.fixture(scope="module")
def long_tools():
    trace = generate("long_tools", seed=1, scale=0.1)
    pool = pool_for(trace, "tight")
    return trace, pool, {name: replay(trace, name, pool_tokens=pool, host_tokens=pool, profile=SEED,
                                      vocab_size=VOCAB) for name in POLICIES}


@pytest.mark.parametrize("how", ["closes", "tools", "calls", "times", "calls-long_tools"])
def test_no_policy_reads_the_traces_structure_ahead(branch_heavy, results, long_tools, how, monkeypatch):
    """Issue #39 item 5: the future is more than durations. With the close flags, the tool stops, the
    calls a branch has left and the arrival times past a cut changed, every call that started by the
    cut is served exactly as before (same start, same hit) by every system but the clairvoyant one:
    none reads what a client had not sent yet (KVFlow's step graph counted each branch's remaining calls
    and read later forks' arrivals). The clairvoyant heuristic must see which calls are left."""
    trace, pool, host = branch_heavy
    if how == "calls-long_tools":  # where KVFlow's old step graph served a call differently (its teeth)
        (trace, pool, results), how, host = long_tools, "calls", long_tools[1]
    cut = sorted(r.t for r in trace.requests)[len(trace.requests) // 2]
    changed = _future_changed(trace, cut, how)
    assert changed.records != trace.records
    # What a call generated is recorded data, not a signal (the replay reads it from the branch's next
    # prompt): the changed trace's calls generate what they did, whatever was cut after them.
    from sgl_agentcache.sim.replay import _token_book

    monkeypatch.setattr(_token_book(changed, VOCAB), "output", _token_book(trace, VOCAB).output)
    moved = set()
    for name, base in results.items():
        other = replay(changed, name, pool_tokens=pool, host_tokens=host, profile=SEED, vocab_size=VOCAB)
        before = {rid: call for rid, call in base.calls.items() if call[0] <= cut}
        assert len(before) > 10
        same = all(other.calls.get(rid) == call for rid, call in before.items())
        if not POLICIES[name].clairvoyant:
            diff = [(rid, call, other.calls.get(rid)) for rid, call in before.items() if other.calls.get(rid) != call]
            assert same, (name, diff[:5])
        elif not same:
            moved.add(name)
    if how == "calls" and trace is branch_heavy[0]:
        assert moved == {"clairvoyant"}  # the test has teeth: which calls are left does drive that one


def test_policies_use_the_mechanisms_they_claim(results):
    hicache = results["sglang-hicache"]  # SGLang's own HiCache: write-back and load-backs, no pauses
    assert hicache.restored_tokens > 0 and hicache.bytes_d2h > 0 and hicache.pauses == 0
    infercept = results["infercept"]
    assert infercept.pauses > 0 and infercept.decisions["offload"] > 0
    # Every pause is a decision, or refused: its branch was closed (an aborted call closes its branch).
    kinds = ("keep", "offload", "discard", "release", "refused_closed", "too_small")
    assert sum(infercept.decisions[a] for a in kinds) == infercept.pauses
    continuum = results["continuum"].decisions  # TTL pinning: it never moves or drops a paused branch
    assert continuum["offload"] == continuum["discard"] == continuum["release"] == 0
    assert results["kvflow"].restored_tokens > 0
    ours = results["agentcache"]
    assert sum(ours.decisions[a] for a in ("keep", "offload", "discard", "release")) > 0
    assert ours.restored_tokens > 0 and ours.bytes_h2d > 0
    assert all(0.0 <= x <= 1.0 for x in ours.tenant_hit_rates.values())
    assert ours.timeline and set(ours.timeline[-1][1]) >= {"stable", "session", "scratch"}


def test_every_run_recomputes_at_least_its_lower_bound(branch_heavy, results):
    trace, pool, host = branch_heavy
    for name, r in results.items():
        bound = lower_bound(trace, r.access_log, pool + r.host_tokens)
        assert bound.compulsory_tokens <= bound.recompute_tokens <= r.recomputed_tokens, name
        assert bound.access_tokens == r.input_tokens
    # More capacity never raises the bound.
    log = results["stock"].access_log
    values = [lower_bound(trace, log, c).recompute_tokens for c in (pool // 2, pool, 2 * pool, 100 * pool)]
    assert values == sorted(values, reverse=True)


def test_lower_bound_is_the_offline_optimum_on_a_small_case():
    """Two prompts of 100 tokens, a (u, v, u, v) access order: with room for 100 tokens the best
    offline cache keeps one of them across (keeping both needs 200), so it recomputes 300 of 400."""
    block = 10
    u = Request(id="u1", t=0.0, session="a", blocks=list(range(10)), input_tokens=100, output_tokens=1)
    v = Request(id="v1", t=0.1, session="b", blocks=list(range(100, 110)), input_tokens=100, output_tokens=1)
    u2 = msgspec.structs.replace(u, id="u2", t=1.0)
    v2 = msgspec.structs.replace(v, id="v2", t=1.1)
    trace = Trace(header=TraceHeader(block_tokens=block), records=[u, v, u2, v2])
    log = [("a", "u1"), ("f", "u1"), ("a", "v1"), ("f", "v1"), ("a", "u2"), ("f", "u2"), ("a", "v2"), ("f", "v2")]
    assert math.isclose(lower_bound(trace, log, 100).recompute_tokens, 300, abs_tol=2)
    assert math.isclose(lower_bound(trace, log, 200).recompute_tokens, 200, abs_tol=2)
    assert math.isclose(lower_bound(trace, log, 0).recompute_tokens, 400, abs_tol=2)


def test_replay_is_deterministic():
    trace = generate("context_editing", seed=5, scale=0.1)
    pool = pool_for(trace, "tight")
    first = replay(trace, "agentcache", pool_tokens=pool, host_tokens=pool, profile=SEED).to_dict()
    second = replay(trace, "agentcache", pool_tokens=pool, host_tokens=pool, profile=SEED).to_dict()
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second


def test_unknown_policy_and_bad_sizes_are_clear_errors():
    trace = generate("low_reuse", seed=1, scale=0.05)
    with pytest.raises(ValueError, match="unknown policy 'lru2'.*agentcache"):
        replay(trace, "lru2", pool_tokens=8192, host_tokens=0, profile=SEED)
    with pytest.raises(ValueError, match="host_tokens non-negative"):
        replay(trace, "stock", pool_tokens=8192, host_tokens=-1, profile=SEED)


def test_continuum_ttl_formula():
    # Cold start: Exp(1) durations give ln(benefit) when the benefit exceeds 1 s, else no pin.
    assert continuum_ttl([], 0.5, lambda t: 0.0) == 0.0
    assert math.isclose(continuum_ttl([], math.e ** 2, lambda t: 0.0), 2.0)
    obs = [0.1, 0.2, 5.0]
    cdf = lambda t: sum(o <= t for o in obs) / len(obs)  # noqa: E731
    # F(0.2) * 3 - 0.2 = 1.8 beats F(5) * 3 - 5 < 0 and F(0.1) * 3 - 0.1 = 0.9.
    assert continuum_ttl(obs, 3.0, cdf) == 0.2


class _Mean:
    def __init__(self, m):
        self.m = m

    def mean(self):
        return self.m

    def quantile(self, q):
        return self.m


def _view(**over) -> PauseView:
    base = dict(now=0.0, tokens=1000, latency=_Mean(1.0), observations=[], all_observations=[], prefill_s=0.05,
                transfer_s=0.004, tokens_per_s_link=100_000.0, running_tokens=2000, queue_s=0.0, memoryfulness=1.0,
                host_tokens=10_000)
    return PauseView(**(base | over))


def test_infercept_swaps_within_its_budget_then_picks_the_minimum_waste():
    rule = POLICIES["infercept"].pause_rule()
    assert rule(_view(now=1.0), None).action is PauseAction.OFFLOAD  # the budget has refilled
    # Budget spent at the same instant: preserve (1 s x 1000) vs discard (1000 x 2500 / 20,000/s = 125).
    assert rule(_view(now=1.0, tokens=100_000, latency=_Mean(30.0), prefill_s=5.0), None).action is PauseAction.DISCARD
    assert rule(_view(now=1.0, tokens=100_000, latency=_Mean(0.001), prefill_s=5.0), None).action is PauseAction.KEEP
    assert rule(_view(now=2.0, host_tokens=0), None).action is not PauseAction.OFFLOAD  # nowhere to swap to


def test_continuum_uses_its_cdf_only_past_100_samples():
    rule = POLICIES["continuum"].pause_rule()
    cold = rule(_view(observations=[0.5] * 50, transfer_s=5.0), None)  # cold start: tau = ln(5 s)
    assert math.isclose(cold.unpin_after_s, math.log(5.0))
    warm = rule(_view(observations=[0.5] * 101, transfer_s=5.0), None)  # F(0.5) = 1: pin 0.5 s
    assert warm.unpin_after_s == 0.5 and warm.action is PauseAction.KEEP


def test_mean_ci_and_verdicts():
    mean, lo, hi = mean_ci([1.0, 1.0, 1.0])
    assert mean == lo == hi == 1.0
    rows = [{"workload": "w", "pressure": "tight", "host_ratio": 1.0, "seed": s, "policy": p, "recomputed_tokens": v}
            for s, (a, b) in enumerate([(80, 100), (82, 100), (79, 100)]) for p, v in (("agentcache", a), ("x", b))]
    (verdict,) = compare(rows, "agentcache")
    assert verdict["verdict"] == "better" and verdict["ci95"][1] < 1.0
    rows = [r | {"recomputed_tokens": 100 if r["policy"] == "x" else (90 if r["seed"] % 2 else 110)} for r in rows]
    assert compare(rows, "agentcache")[0]["verdict"] == "tie"


def test_jain_index():
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert math.isclose(jain([1.0, 0.0]), 0.5)


def test_suite_writes_json_and_plots(tmp_path):
    config = SuiteConfig(workloads=("short_tools",), policies=("stock", "sglang-hicache", "agentcache"), seeds=(1, 2),
                         pressures=("tight",), sweep_hosts=(0.5,), scale=0.05, workers=1)
    report = run_suite(config, SEED)
    files = write_report(report, tmp_path, "test")
    names = {f.name for f in files}
    assert {"results.json", "recompute_tight_host0x.png", "recompute_tight_host1x.png", "resume_cdf_tight.png",
            "host_sweep.png", "memory_by_class.png"} <= names
    assert all(f.stat().st_size > 0 for f in files)
    body = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["policy"], r["host_ratio"]): r for r in body["summary"]}
    assert rows[("stock", 0.0)]["recompute_vs_stock"] == 1.0
    assert {("agentcache", 0.5), ("sglang-hicache", 0.5), ("agentcache", 0.0), ("sglang-hicache", 1.0)} <= set(rows)
    assert all(r["integrity_ok"] and r["lower_bound_vs_stock"] <= r["recompute_vs_stock"] + 1e-9 for r in rows.values())
    assert all(len(r["recompute_ci95"]) == 2 for r in rows.values())
    assert body["comparisons"] and all(c["verdict"] in ("better", "worse", "tie") for c in body["comparisons"])
    assert body["command"] == "test" and body["environment"]["versions"]["sglang"] == "0.5.23"


def test_kvflow_steps_come_from_what_has_been_seen():
    """KVFlow's step graph, online: a running branch is at 0, one stopped on a tool at 1, a lead that
    spawned workers 1 + the workers' steps, an ended or idle (answered, no tool) branch at the cap; a
    worker is known from its first call, never from the trace's later records."""
    from sgl_agentcache.sim.stepgraph import StepGraph

    def call(rid, branch, tool=True, parent=None, close=False):
        return Request(id=rid, t=0.0, session="s", branch=branch, parent_branch=parent, blocks=[1], input_tokens=1,
                       output_tokens=1, tool=ToolCall(tool_class="t", duration_s=None) if tool else None, close=close)

    g, lead, worker = StepGraph(cap=5), ("default", "s", "main"), ("default", "s", "w")
    assert g.steps(lead) == 5  # never seen
    g.received(call("m0", "main"))
    assert g.steps(lead) == 1  # waiting to run
    g.started(call("m0", "main"))
    assert g.steps(lead) == 0
    g.finished(call("m0", "main"))
    assert g.steps(lead) == 1  # on its tool
    assert g.received(call("w0", "w", parent="main")) == [lead]
    assert g.steps(lead) == 2 and g.steps(worker) == 1
    g.started(call("w0", "w", parent="main"))
    assert g.steps(lead) == 1
    g.finished(call("w0", "w", tool=False, parent="main", close=True))
    assert g.steps(worker) == 5 and g.steps(lead) == 1  # the worker ended: the lead is next
    g.received(call("m1", "main"))
    g.started(call("m1", "main"))
    g.finished(call("m1", "main", tool=False))
    assert g.steps(lead) == 5  # answered without a tool: waits on someone unseen


def test_a_calls_own_wait_is_counted_from_when_the_server_received_it(results):
    """Issue #39 item 1: a resumed call's latency from its trace arrival carries the lag its branch's
    earlier calls left; its own wait counts from when the server received it (the previous call
    answered), never more. Every call has one; a session's JCT is at least its trace's own span."""
    for name, r in results.items():
        assert len(r.own_waits_s) == r.requests and min(r.own_waits_s) >= 0.0, name
        assert len(r.resume_own_waits_s) == len(r.resume_queue_s) > 0, name
        assert all(own <= queued + 1e-9 for own, queued in zip(r.resume_own_waits_s, r.resume_queue_s)), name
        assert all(jct >= span - 1e-9 for jct, span in zip(r.session_jct_s, r.session_span_s)), name
        d = r.to_dict()
        assert d["own_wait_s"]["total"] == pytest.approx(sum(r.own_waits_s)) and r.admission_refusals >= 0
    # Causality holds calls back on every system: some resumes waited on their branch's earlier calls.
    assert any(q > own for r in results.values() for own, q in zip(r.resume_own_waits_s, r.resume_queue_s))


@pytest.mark.parametrize("arrival_s", [0.01, 0.5])
def test_a_running_calls_reservation_is_its_remaining_output_plus_what_it_has_decoded(arrival_s):
    """SGLang's ``PrefillAdder`` (with ``ignore_eos``, as every server benchmark sends) reserves a running
    request's *remaining* output, while the tokens it already decoded hold slots; the replay reserves the
    whole output and allocates none of it until the call ends. The sum is the same at every instant, so
    a second call fits exactly when ``a.in + a.out + b.in + b.out < pool`` however far the first has
    decoded (it decodes 50 tokens over 1 s; ``b`` arrives early in it or half way through)."""
    a = Request(id="a", t=0.0, session="a", blocks=list(range(10)), input_tokens=100, output_tokens=50)
    b = Request(id="b", t=arrival_s, session="b", blocks=list(range(100, 110)), input_tokens=100, output_tokens=50)
    trace = Trace(header=TraceHeader(block_tokens=10), records=[a, b])
    assert SEED.decode_s_per_token * a.output_tokens > arrival_s  # b arrives while a decodes
    tight = replay(trace, "stock", pool_tokens=300, host_tokens=0, profile=SEED, vocab_size=VOCAB)
    assert tight.admission_refusals == 1 and tight.calls["b"].start_s > SEED.decode_s_per_token * a.output_tokens
    roomy = replay(trace, "stock", pool_tokens=301, host_tokens=0, profile=SEED, vocab_size=VOCAB)
    assert roomy.admission_refusals == 0 and roomy.calls["b"].start_s == arrival_s
