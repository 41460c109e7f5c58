"""A shortened soak on the shared CPU server (``make soak`` runs the long one on a fresh server)."""

from __future__ import annotations

import pytest

from sgl_agentcache.soak import Soak

pytestmark = pytest.mark.server


def test_soak_leaves_nothing_behind(server, tiny_model):
    report = Soak(server, tiny_model.vocab_size, workers=3, seconds=20, seed=7).run()
    assert report["unexpected_failures"] == []
    assert report["health"] == 200 and report["check_ok"]
    assert report["open_soak_branches"] == [] and report["leaked_tokens"] == 0
    assert report["terminated_pending_tokens"] == 0
    assert report["host_tokens"]["after"] <= report["host_tokens"]["before"]  # other tests' pauses may remain
    calls = report["calls"]
    assert calls["generate"] > 10 and calls["session_close"] >= 3
    assert calls.get("pause", 0) + calls.get("resume", 0) > 0


def test_eager_soak_with_prefetches_leaves_nothing_behind(eager_server, tiny_model):
    """Eager pauses: offloads demoted into HiCache's host pool and prefetches loaded back through its load
    path, copies in flight while the scheduler idles (issue #38 item 1 killed the server there)."""
    from sgl_agentcache.soak import passed

    report = Soak(eager_server, tiny_model.vocab_size, workers=3, seconds=20, seed=8).run()
    assert report["unexpected_failures"] == [] and passed(report), report
    assert eager_server.proc.poll() is None
    assert report["calls"].get("prefetch", 0) > 0 and report["calls"]["generate"] > 10


def test_two_tenant_flood_soak_leaves_nothing_behind(tiny_model, tmp_path):
    """Two tenants on a fresh tenancy server: one floods (pausing calls as fast as they are answered,
    over-long chats the server refuses), the other runs agents and reads its stats meanwhile."""
    import json

    from sgl_agentcache.cpu_server import CpuServer
    from sgl_agentcache.soak import TOOL_PRIORS, passed, run_tenants, tenants_file

    tenants_file(tmp_path / "tenants.toml")
    server = CpuServer(str(tiny_model.path), log_path=tmp_path / "sglang.log", extra_args=("--enable-cache-report",),
                       env={"AGENTCACHE_TENANTS": str(tmp_path / "tenants.toml"), "AGENTCACHE_SECRET": "k" * 48,
                            "AGENTCACHE_INFER": "chat", "AGENTCACHE_PROFILE": "seed",
                            "AGENTCACHE_TOOL_PRIORS": json.dumps(TOOL_PRIORS)})
    with server.start():
        runs = run_tenants(server, tiny_model.vocab_size, seconds=20, workers=3, seed=9)
        assert server.proc.poll() is None
    for name, run in runs.items():
        assert run["unexpected_failures"] == [] and passed(run), (name, run)
    # The flooder really flooded: refused over-long chats, and calls at a pace no agent keeps (a fresh-clone
    # CI run on a loaded 2-core machine made 46 in the 20 s; 50 was too tight a floor).
    assert runs["flooder"]["calls"]["generate"] > 20 and runs["flooder"]["calls"].get("flood_refused_chat", 0) > 0
    assert runs["victim"]["stats_wait_s"]["n"] > 10
