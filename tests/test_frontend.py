"""``sgl.function`` programs with ``fork()`` on AgentRuntimeEndpoint against the real CPU server."""

from __future__ import annotations

import pytest
import sglang as sgl

from sgl_agentcache.frontend import AgentRuntimeEndpoint

pytestmark = pytest.mark.server

SYSTEM = "system: you are a coding agent with tools search, read and run. " * 6


def _owned(server, session):
    _, stats = server.request("GET", "/agentcache/stats")
    return {b["branch"]: b["owned_tokens"] for b in stats["branches"] if b["session"] == session}, stats


def test_forked_program_shares_prefix_charges_branches_and_closes_them(server):
    endpoint = AgentRuntimeEndpoint(server.url, session="fe-fork")
    holder = {}

    @sgl.function
    def lead(s):
        s += SYSTEM + "user: find the bug.\n"
        workers = s.fork(4)
        for i, w in enumerate(workers):
            w += f"{'ABCD'[i]} worker {i}: read part {i}. "
            w += sgl.gen("finding", max_tokens=6, temperature=0, ignore_eos=True)
        for w in workers:
            w.sync()
        holder["workers"] = workers
        return workers

    state = lead.run(backend=endpoint)
    workers = state.ret_value
    ids = [w.stream_executor.agentcache_identity for w in workers]
    assert all(i["parent_branch"] == "main" and i["session"] == "fe-fork" for i in ids)
    metas = [w.get_meta_info("finding") for w in workers]
    owned, before = _owned(server, "fe-fork")
    prefix_tokens = owned["main"]  # the committed shared prefix, charged to the lead once
    assert prefix_tokens > 100
    for ident, meta in zip(ids, metas):
        assert meta["cached_tokens"] >= prefix_tokens  # prefilled once, shared by every branch
        # each branch is charged exactly the tokens it created (the last sampled token has no KV)
        assert owned[ident["branch"]] == meta["prompt_tokens"] - meta["cached_tokens"] + meta["completion_tokens"] - 1

    closed = [i["branch"] for i in ids[:3]]
    for branch in closed:
        assert endpoint.close_branch("fe-fork", branch)
    owned_after, after = _owned(server, "fe-fork")
    freed = sum(owned[b] for b in closed)
    assert set(owned_after) == {"main", ids[3]["branch"]}
    assert after["freed_on_close_tokens"] - before["freed_on_close_tokens"] == freed
    assert after["resident_tokens"]["scratch"] == before["resident_tokens"]["scratch"] - freed

    # The fourth branch still hits the prefix (and its own history) on its next call.
    w = workers[3]
    w += " then run the tests. " + sgl.gen("more", max_tokens=4, temperature=0, ignore_eos=True)
    assert w.get_meta_info("more")["cached_tokens"] >= prefix_tokens + owned[ids[3]["branch"]] - 1
    workers.join()  # closes the fourth branch
    owned_final, _ = _owned(server, "fe-fork")
    assert set(owned_final) == {"main"}
    status, report = server.request("GET", "/agentcache/check")
    assert report["ok"], report["errors"]


def test_plain_runtime_endpoint_is_untouched(server):
    """Installing our wrappers must not add hints to requests of a stock RuntimeEndpoint."""
    AgentRuntimeEndpoint(server.url)  # installs the wrappers
    _, before = server.request("GET", "/agentcache/stats")

    @sgl.function
    def plain(s):
        s += "user: hello there, agent. " * 4
        forks = s.fork(2)
        for f in forks:
            f += "ok " + sgl.gen("x", max_tokens=2, temperature=0)
        forks.join()

    plain.run(backend=sgl.RuntimeEndpoint(server.url))
    _, after = server.request("GET", "/agentcache/stats")
    assert after["branches"] == before["branches"]
