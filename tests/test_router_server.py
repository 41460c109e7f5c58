"""Two agentcache workers behind SGLang's own router (``sglang-router`` 0.3.2, from the test extra).

Both workers run tenancy with one tenants file and one secret; the router runs ``--policy manual
--assignment-mode min_group`` and forwards the client's ``Authorization``. Calls go through the router
with :func:`sgl_agentcache.gateway.gateway_headers` (routing key + hint in ``tracestate``); our routes
go to the workers through :class:`sgl_agentcache.cluster.Cluster`. What is checked: every call of a
session lands on one worker with its hint intact, cache hits equal a single worker's, forks are
reclaimed where they live, a credential from one worker works on the other, and a killed worker's
sessions move cold to the survivor while the survivor's own sessions keep their cache (that test runs
last: it kills a worker).
"""

from __future__ import annotations

import random

import pytest

from sgl_agentcache.cluster import Cluster
from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.gateway import gateway_headers
from sgl_agentcache.router_process import RouterProcess, router_available
from sgl_agentcache.tenancy import key_digest

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

ACME_KEY = "ak-acme-router-test-0123456789"
GLOBEX_KEY = "ak-globex-router-test-0123456789"
ADMIN_KEY = "ak-admin-router-test-0123456789"
TENANTS_TOML = f"""
require_signed_sessions = true
admin_keys = ["{key_digest(ADMIN_KEY)}"]
[tenants.acme]
keys = ["{key_digest(ACME_KEY)}"]
[tenants.globex]
keys = ["{key_digest(GLOBEX_KEY)}"]
"""
STABLE = 16  # hinted stable prefix of every session
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    if not router_available():
        pytest.fail("sglang_router is not importable: install the test extra (it pins sglang-router==0.3.2)")
    root = tmp_path_factory.mktemp("router")
    (root / "tenants.toml").write_text(TENANTS_TOML)
    env = {"AGENTCACHE_TENANTS": str(root / "tenants.toml"), "AGENTCACHE_SECRET": "r" * 48,
           "AGENTCACHE_INFER": "chat"}  # hint-less chat clients: sessions inferred on each worker
    workers = [CpuServer(str(tiny_model.path), log_path=root / f"worker{i}.log", max_total_tokens=2048, env=env,
                         extra_args=("--enable-cache-report",)) for i in range(2)]
    router = RouterProcess([w.url for w in workers], log_path=root / "router.log")
    try:
        for worker in workers:
            worker.start()
        router.start()
        yield workers, router
    finally:
        router.stop()
        for worker in workers:
            worker.stop()


def _open(worker: CpuServer, key: str) -> str:
    status, reply = worker.request("POST", "/agentcache/session/open", {}, headers=_bearer(key))
    assert status == 200, reply
    return reply["session"]


def _generate(target, key: str, ids: list[int], hint: dict, *, direct: bool = False) -> dict:
    """/generate through the router (gateway headers), or straight to a worker (kv_hints in the body)."""
    body = {"input_ids": ids, "sampling_params": GREEDY}
    if direct:
        from sgl_agentcache.hints import lifecycle_envelope

        body["kv_hints"] = lifecycle_envelope(hint, message_id="direct")
        status, out = target.request("POST", "/generate", body, headers=_bearer(key))
    else:
        status, out = target.request("POST", "/generate", body, headers=gateway_headers(hint) | _bearer(key))
    assert status == 200, out
    return out


def _holders(workers, session: str) -> dict[int, dict[str, int]]:
    """Per worker index: the session's branches and their owned tokens (operator view)."""
    found = {}
    for i, worker in enumerate(workers):
        status, stats = worker.request("GET", "/agentcache/stats", headers=_bearer(ADMIN_KEY))
        assert status == 200, stats
        owned = {b["branch"]: b["owned_tokens"] for b in stats["branches"] if b["session"] == session}
        if owned:
            found[i] = owned
    return found


def _integrity(workers) -> None:
    for worker in workers:
        status, report = worker.request("GET", "/agentcache/check", headers=_bearer(ADMIN_KEY))
        assert status == 200 and report["ok"], report


class _Agent:
    """One session's growing prompt: turns append the output and a tool observation."""

    def __init__(self, session: str, rng: random.Random, vocab: int):
        self.session, self.rng, self.vocab = session, rng, vocab
        self.prompt = self._ids(64)
        self.cached: list[int] = []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def turn(self, target, key: str, *, direct: bool = False) -> None:
        out = _generate(target, key, self.prompt, {"session": self.session, "stable_prefix_tokens": STABLE},
                        direct=direct)
        self.cached.append(out["meta_info"]["cached_tokens"])
        self.prompt = self.prompt + out["output_ids"] + self._ids(20)


def test_a_session_stays_on_one_worker_with_its_hints_and_hits_as_on_one_worker(cluster, tiny_model):
    workers, router = cluster
    acme = [_Agent(_open(workers[0], ACME_KEY), random.Random(i), tiny_model.vocab_size) for i in range(4)]
    # The same traffic, by another tenant (no cross-tenant hits), straight to one worker: the reference.
    alone = [_Agent(_open(workers[0], GLOBEX_KEY), random.Random(i), tiny_model.vocab_size) for i in range(4)]
    for _ in range(3):
        for agent in acme:
            agent.turn(router, ACME_KEY)
        for agent in alone:
            agent.turn(workers[0], GLOBEX_KEY, direct=True)
    assert [a.cached for a in acme] == [a.cached for a in alone]
    assert all(a.cached[0] == 0 and a.cached[1] > 64 for a in acme), [a.cached for a in acme]
    for agent in acme:
        holders = _holders(workers, agent.session)
        assert len(holders) == 1, holders  # every call of the session on one worker
        (owned,) = holders.values()
        # Tagged as the hint said (the hint reached the worker in tracestate): the lead owns its history.
        assert owned["main"] == len(agent.prompt) - 20 - 1 - STABLE, owned
    _integrity(workers)


def test_a_fork_lives_and_is_reclaimed_on_its_sessions_worker(cluster, tiny_model):
    workers, router = cluster
    rng = random.Random(7)
    agent = _Agent(_open(workers[1], ACME_KEY), rng, tiny_model.vocab_size)
    for _ in range(2):
        agent.turn(router, ACME_KEY)
    fork_point = len(agent.prompt)
    hint = {"session": agent.session, "branch": "sub-1", "parent_branch": "main", "stable_prefix_tokens": STABLE,
            "fork_point_tokens": fork_point}
    out = _generate(router, ACME_KEY, agent.prompt + agent._ids(30), hint)
    assert out["meta_info"]["cached_tokens"] >= fork_point - 24  # the lead's last turn, less its fresh tail
    (index, owned), = _holders(workers, agent.session).items()
    assert owned["sub-1"] > 0 and owned["main"] > 0  # the fork next to its parent, charged its own tokens
    tenant = Cluster.from_router(router.url, headers=_bearer(ACME_KEY))
    status, reply = tenant.call("/agentcache/branch/close", {"session": agent.session, "branch": "sub-1"})
    assert status == 200 and reply["freed_tokens"] == owned["sub-1"], reply
    assert reply["worker"] == workers[index].url and reply["statuses"][workers[1 - index].url] == 404
    assert _holders(workers, agent.session) == {index: {"main": owned["main"]}}
    again = tenant.call("/agentcache/branch/close", {"session": agent.session, "branch": "sub-1"})
    assert again[0] == 200 and again[1]["already_closed"]
    # In-band: a fork whose last call says close is gone when the call returns.
    _generate(router, ACME_KEY, agent.prompt + agent._ids(30), hint | {"branch": "sub-2", "close": True})
    assert "sub-2" not in _holders(workers, agent.session)[index]
    # Pause through the fan-out reaches the holder; an unknown branch is a 404 from every worker.
    status, reply = tenant.call("/agentcache/pause", {"session": agent.session, "branch": "main", "tool_class": "grep"})
    assert status == 200 and reply["worker"] == workers[index].url, reply
    assert reply["action"] in ("keep", "offload", "discard"), reply
    assert tenant.call("/agentcache/resume", {"session": agent.session, "branch": "main"})[0] == 200
    status, reply = tenant.call("/agentcache/pause", {"session": agent.session, "branch": "nope", "tool_class": "grep"})
    assert status == 404 and set(reply["statuses"].values()) == {404}
    _integrity(workers)


def test_cluster_stats_are_the_sum_of_the_workers(cluster, tiny_model):
    workers, router = cluster
    # A branch on each worker, sent straight to it: the sum must not hang on where the router placed
    # the earlier tests' sessions (min_group may put them all on one worker, or their state may be gone).
    for i, worker in enumerate(workers):
        ids = [random.Random(50 + i).randrange(3, tiny_model.vocab_size) for _ in range(40)]
        _generate(worker, ACME_KEY, ids, {"session": _open(worker, ACME_KEY)}, direct=True)
    operator = Cluster.from_router(router.url, headers=_bearer(ADMIN_KEY))
    stats = operator.stats()
    assert set(stats["workers"]) == {w.url for w in workers} and not stats["unreachable"]
    for cls, tokens in stats["total"]["resident_tokens"].items():
        assert tokens == sum(s["resident_tokens"][cls] for s in stats["workers"].values())
    assert len(stats["total"]["branches"]) == sum(len(s["branches"]) for s in stats["workers"].values())
    assert {b["worker"] for b in stats["total"]["branches"]} == {w.url for w in workers}


def test_a_credential_from_one_worker_works_on_the_other_and_a_close_retires_it_everywhere(cluster, tiny_model):
    workers, router = cluster
    session = _open(workers[0], GLOBEX_KEY)
    ids = [random.Random(3).randrange(3, tiny_model.vocab_size) for _ in range(40)]
    _generate(workers[1], GLOBEX_KEY, ids, {"session": session}, direct=True)  # issued by 0, accepted by 1
    status, _ = workers[1].request("POST", "/generate", {"input_ids": ids, "sampling_params": GREEDY},
                                   headers=gateway_headers({"session": session}) | _bearer(ACME_KEY))
    assert status == 403  # another tenant's credential: refused on any worker
    tenant = Cluster([w.url for w in workers], headers=_bearer(GLOBEX_KEY))
    assert tenant.call("/agentcache/session/close", {"session": session})[0] == 200
    for worker in workers:  # retired on both, including the worker that never held it
        status, _ = worker.request("POST", "/generate", {"input_ids": ids, "sampling_params": GREEDY},
                                   headers=gateway_headers({"session": session}) | _bearer(GLOBEX_KEY))
        assert status == 403


def test_hintless_chat_behind_cache_aware_routing_continues_its_inferred_sessions(cluster):
    """A client that sends no hint and no routing key: the router's cache_aware policy (prefix
    affinity) brings each later turn to the worker holding the conversation, where the worker's chat
    inference continues the session it inferred (a turn elsewhere would start a new branch there)."""
    workers, _ = cluster
    by_prefix = RouterProcess([w.url for w in workers], policy="cache_aware")
    before = [_inference(w) for w in workers]
    with by_prefix:
        for c in range(3):
            messages = [{"role": "system", "content": f"You are agent {c}. Use the tools."},
                        {"role": "user", "content": f"task {c}: fix the failing test in module {c}"}]
            for turn in range(3):
                status, reply = by_prefix.request("POST", "/v1/chat/completions", {
                    "model": "default", "messages": messages, "max_tokens": 4, "temperature": 0},
                    headers=_bearer(GLOBEX_KEY))
                assert status == 200, reply
                messages = messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": f"observation {turn}: 3 tests still fail"}]
    after = [_inference(w) for w in workers]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in ("requests", "continued")}
    assert delta == {"requests": 9, "continued": 6}, (before, after)  # every later turn continued


def _inference(worker: CpuServer) -> dict:
    status, stats = worker.request("GET", "/agentcache/stats", headers=_bearer(ADMIN_KEY))
    assert status == 200 and stats["chat_inference"]["mode"] == "chat", stats
    return stats["chat_inference"]


def test_a_killed_workers_sessions_move_cold_and_the_survivors_keep_theirs(cluster, tiny_model):
    workers, router = cluster
    agents, placed = [], {}
    while min(list(placed.values()).count(i) for i in (0, 1)) < 2:  # two sessions or more on each worker
        assert len(agents) < 16, placed  # min_group gives new keys to the worker holding fewer
        agent = _Agent(_open(workers[0], ACME_KEY), random.Random(100 + len(agents)), tiny_model.vocab_size)
        agent.turn(router, ACME_KEY)
        agents.append(agent)
        placed[agent.session] = next(iter(_holders(workers, agent.session)))
    idle = next(a for a in agents if placed[a.session] == 1)  # its tool is still running: no call after
    workers[1].stop()  # dies with its sessions
    for agent in agents:  # no request fails: the router re-pins the dead worker's keys
        if agent is not idle:
            agent.turn(router, ACME_KEY)
    for agent in agents:
        if agent is idle:
            continue
        if placed[agent.session] == 0:
            assert agent.cached[-1] > 64, agent.cached  # the survivor's sessions kept their cache
        else:
            assert agent.cached[-1] < 64, agent.cached  # moved: cold (recomputed) on the survivor
        assert set(_holders(workers[:1], agent.session)) == {0}
    gone = Cluster([w.url for w in workers], headers=_bearer(ACME_KEY))
    moved = next(a for a in agents if placed[a.session] == 1 and a is not idle)
    status, reply = gone.call("/agentcache/session/close", {"session": moved.session})
    assert status == 200 and reply["worker"] == workers[0].url and reply["statuses"][workers[1].url] == 0, reply
    # The idle session lived on the dead worker only: closing it is done (twice), nothing fails. (A
    # session close retires its credential with tenancy: a third close would be the 403 of a retired one.)
    for path, body in (("/agentcache/branch/close", {"session": idle.session, "branch": "main"}),
                       ("/agentcache/branch/close", {"session": idle.session, "branch": "main"}),
                       ("/agentcache/session/close", {"session": idle.session})):
        status, reply = gone.call(path, body)
        assert status == 200 and reply["closed"] is False and reply["unreachable"] == [workers[1].url], reply
    stats = gone.stats()
    assert workers[1].url in stats["unreachable"] and set(stats["workers"]) == {workers[0].url}
    _integrity(workers[:1])
