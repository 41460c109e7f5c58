"""Program-aware admission order (policy/admission_order.py): each strategy's order on plain data, the
ledger's accounting, and the settings' validation."""

from __future__ import annotations

import pytest

from sgl_agentcache.policy.admission_order import (PLAS_BASE_TOKENS, AdmissionSettings, ProgramLedger, order_keys,
                                                   over_share, plas_level)
from sgl_agentcache.server.scheduler.program_admission import admission_settings
from sgl_agentcache.settings import Settings
from sgl_agentcache.server.scheduler.request_state import state_of


def _order(waiting, strategy, tenant_service=None, **settings):
    keys = order_keys(waiting, AdmissionSettings(strategy=strategy, **settings), tenant_service)
    return [waiting[i].seq for i in sorted(range(len(waiting)), key=keys.__getitem__)]


def prog(name: str) -> tuple:
    """A program key (its namespace first, as the server's ``(namespace, session)``)."""
    return ("ns", name)


def br(name: str) -> tuple:
    return ("ns", name, "main")


def _scenario():
    """Session A started first and came back from a tool (KV resident); sessions B, C, D are a burst of
    new work received before A's turn; E is an older program whose KV was evicted."""
    ledger = ProgramLedger()
    ledger.receive(prog("A"), br("A"))  # seq 1
    ledger.receive(prog("E"), br("E"))  # seq 2
    ledger.charge("t", prog("A"), br("A"), 3000)
    ledger.charge("t", prog("E"), br("E"), 500)
    ledger.answer(prog("A"))
    ledger.answer(prog("E"))
    burst = [ledger.waiting(ledger.receive(prog(s), br(s)), "t", 4000, program=prog(s), branch=br(s))
             for s in "BCD"]
    a_turn = ledger.waiting(ledger.receive(prog("A"), br("A")), "t", 3100, program=prog("A"), branch=br("A"),
                            resident_tokens=3000)
    e_turn = ledger.waiting(ledger.receive(prog("E"), br("E")), "t", 600, program=prog("E"), branch=br("E"),
                            resident_tokens=0)
    return ledger, burst + [a_turn, e_turn]


def test_fcfs_keeps_receive_order():
    _, waiting = _scenario()
    assert _order(waiting, "fcfs") == [3, 4, 5, 6, 7]


def test_lpm_puts_the_longest_device_match_first():
    _, waiting = _scenario()
    assert _order(waiting, "lpm") == [6, 3, 4, 5, 7]  # A's 3000 resident tokens; the rest 0, in receive order


def test_program_fcfs_puts_older_programs_first():
    _, waiting = _scenario()
    assert _order(waiting, "program-fcfs") == [6, 7, 3, 4, 5]  # A (program seq 1), E (2), then the burst


def test_plas_serves_the_least_attained_program_first():
    _, waiting = _scenario()
    # A has 3000 tokens of service (level 1); E 500 and the new programs 0 (level 0): FCFS within a level.
    assert plas_level(0) == plas_level(PLAS_BASE_TOKENS - 1) == 0 and plas_level(PLAS_BASE_TOKENS) == 1
    assert _order(waiting, "plas") == [3, 4, 5, 7, 6]


def test_atlas_charges_a_subagent_its_leads_path_not_its_siblings():
    ledger = ProgramLedger()
    lead, sub1, sub2, q = ("ns", "P", "lead"), ("ns", "P", "sub1"), ("ns", "P", "sub2"), ("ns", "Q", "main")
    ledger.receive(prog("P"), lead)
    ledger.charge("t", prog("P"), lead, 1000)
    ledger.receive(prog("P"), sub1, parent=lead)
    ledger.receive(prog("P"), sub2, parent=lead)
    ledger.charge("t", prog("P"), sub1, 8000)  # one subagent did much work; its sibling did not
    ledger.receive(prog("Q"), q)
    ledger.charge("t", prog("Q"), q, 3000)
    waiting = [ledger.waiting(ledger.receive(prog("Q"), q), "t", 10, program=prog("Q"), branch=q),
               ledger.waiting(ledger.receive(prog("P"), sub2), "t", 10, program=prog("P"), branch=sub2)]
    assert ledger.path[sub2] == 1000 and waiting[1].attained == 9000
    assert _order(waiting, "plas") == [waiting[0].seq, waiting[1].seq]  # P's whole program is over Q's
    assert _order(waiting, "atlas") == [waiting[1].seq, waiting[0].seq]  # sub2's own path is short


def test_agent_puts_a_resident_returning_turn_ahead_of_a_burst_of_new_sessions():
    _, waiting = _scenario()
    # A's turn (returning, 3000 of 3100 tokens resident) first; E (returning, evicted) next; then the burst.
    assert _order(waiting, "agent") == [6, 7, 3, 4, 5]
    # Were A's KV gone, the older program still goes first among returning turns (program FCFS).
    gone = [w if w.seq != 6 else type(w)(**{**{f: getattr(w, f) for f in w.__slots__}, "resident_tokens": 0})
            for w in waiting]
    assert _order(gone, "agent") == [6, 7, 3, 4, 5]
    # A resident turn of a younger program goes before an evicted turn of an older one.
    younger = [w if w.seq != 7 else type(w)(**{**{f: getattr(w, f) for f in w.__slots__}, "resident_tokens": 600})
               for w in gone]
    assert younger[-1].program_seq > younger[-2].program_seq  # E's program is the younger
    assert _order(younger, "agent") == [7, 6, 3, 4, 5]


def test_a_starved_request_goes_first_after_the_bound():
    _, waiting = _scenario()
    starved = [w if w.seq != 5 else type(w)(**{**{f: getattr(w, f) for f in w.__slots__}, "waited_steps": 8})
               for w in waiting]
    for strategy in ("agent", "plas", "atlas"):
        assert _order(starved, strategy, starvation_steps=8)[0] == 5, strategy
        assert _order(starved, strategy, starvation_steps=9)[0] != 5, strategy


def test_a_flooding_tenant_waits_behind_another_tenants_request():
    ledger = ProgramLedger()
    flood = [ledger.waiting(ledger.receive(("x", i)), "x", 100, program=("x", i)) for i in range(6)]
    for i in range(4):
        ledger.charge("x", ("x", i), None, 500)
    other = ledger.waiting(ledger.receive(("y", 0)), "y", 100, program=("y", 0))
    waiting = flood + [other]
    assert over_share(ledger.tenant_service, {"x", "y"}, 1.5) == {"x"}
    assert _order(waiting, "agent", ledger.tenant_service)[0] == other.seq
    # Alone, a tenant takes what is free: nothing is held back.
    assert over_share(ledger.tenant_service, {"x"}, 1.5) == set()
    assert _order(flood, "agent", ledger.tenant_service) == [w.seq for w in flood]


def test_the_ledger_forgets_tenant_service_outside_its_window_and_stays_bounded():
    ledger = ProgramLedger(limit=4, window=3)
    for i in range(5):
        ledger.receive(("x", i), ("x", i, "main"))
        ledger.charge("x" if i < 2 else "y", ("x", i), ("x", i, "main"), 10)
    assert ledger.tenant_service == {"y": 30}  # x's two charges left the window of three
    assert len(ledger.programs) <= 4 and len(ledger.path) <= 4
    ledger.charge("y", None, None, 0)  # no work: nothing recorded
    assert sum(ledger.tenant_service.values()) == 30


def test_one_namespaces_flood_forgets_only_its_own_programs():
    ledger = ProgramLedger(limit=16, namespace_limit=4)
    other = ("ns-other", "s")
    ledger.receive(other, other + ("main",))
    ledger.answer(other)
    for i in range(200):
        ledger.receive(("ns-flooding", f"s{i}"), ("ns-flooding", f"s{i}", "main"))
    assert ledger.returning(other) and ledger.programs.namespace_size("ns-flooding") <= 4
    assert ledger.path.namespace_size("ns-flooding") <= 4 and other + ("main",) in ledger.path


def settings_from_env(environ: dict):
    return admission_settings(Settings.from_env(environ))


def test_settings_are_validated_and_read_from_the_environment():
    assert settings_from_env({}) is None and settings_from_env({"AGENTCACHE_ADMISSION": "off"}) is None
    s = settings_from_env({"AGENTCACHE_ADMISSION": "Agent", "AGENTCACHE_ADMISSION_STARVATION_STEPS": "32"})
    assert (s.strategy, s.starvation_steps) == ("agent", 32)
    with pytest.raises(ValueError, match="expected off or one of"):
        settings_from_env({"AGENTCACHE_ADMISSION": "sjf"})
    with pytest.raises(ValueError, match="AGENTCACHE_ADMISSION_STARVATION_STEPS='0'"):
        settings_from_env({"AGENTCACHE_ADMISSION": "plas", "AGENTCACHE_ADMISSION_STARVATION_STEPS": "0"})
    with pytest.raises(ValueError, match="tenant_slack"):
        AdmissionSettings(tenant_slack=0.5)


def test_agent_lpm_orders_each_class_by_device_match():
    _, waiting = _scenario()
    # Classes as agent's (A resident, E returning, the burst new); within the burst, longest match first.
    matched = [w if w.seq != 5 else type(w)(**{**{f: getattr(w, f) for f in w.__slots__}, "resident_tokens": 64})
               for w in waiting]
    assert _order(matched, "agent-lpm") == [6, 7, 5, 3, 4]
    assert _order(matched, "agent") == [6, 7, 3, 4, 5]


def _driver(strategy: str | None):
    from sgl_agentcache.server.scheduler.offline import OfflineDriver, build_offline_cache
    from sgl_agentcache.server.scheduler.program_admission import ProgramAdmission

    cache = build_offline_cache(pool_tokens=4096)
    cache.admission = ProgramAdmission(AdmissionSettings(strategy=strategy)) if strategy else None
    return OfflineDriver(cache)


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("strategy", [None, "agent"])
def test_the_scheduler_hook_puts_a_resident_returning_turn_first(strategy):
    """Through the plugin's real hook on SGLang's ``SchedulePolicy.calc_priority`` (offline, SGLang's
    CPU pools; no timing): a lead answered a call, four new sessions arrive, then the lead's next turn.
    SGLang's FCFS keeps the turn last; ``agent`` puts it first (its KV is resident), and charges it."""
    from sgl_agentcache.hints import lifecycle_envelope

    driver = _driver(strategy)
    hint = lambda session: lifecycle_envelope({"session": session}, message_id=f"m-{session}")  # noqa: E731
    first = _tokens(1, 300)
    lead = driver.admit("lead-1", first, hint("lead"))
    driver.extend(lead, _tokens(2, 8))
    driver.finish(lead)
    burst = [driver.queue(f"new{i}", _tokens(10 + i, 200), hint(f"new{i}")) for i in range(4)]
    turn = driver.queue("lead-2", first + _tokens(2, 8) + _tokens(3, 20), hint("lead"))
    ranked = [req.rid for req in driver.rank(burst + [turn], policy="fcfs")]
    if strategy is None:
        assert ranked == ["new0", "new1", "new2", "new3", "lead-2"]
        return
    assert ranked == ["lead-2", "new0", "new1", "new2", "new3"]
    stats = driver.cache.admission.stats()
    assert stats["reordered_passes"] == 1 and stats["moved_ahead"] == 1  # one request jumped the queue
    ledger = driver.cache.admission.ledger
    assert ledger.returning(state_of(turn).program[1]) and not ledger.returning(state_of(burst[0]).program[1])
    # Its answer charged the lead's output (8 tokens) to its program and tenant.
    assert ledger.programs[state_of(turn).program[1]].attained == 8
