"""Tenancy and trust on a real SGLang server (CPU): API keys bind requests to tenant namespaces, no
prefix is ever shared across tenants, session credentials cannot be forged, borrowed, outlived or
replayed, hint values are clipped to each tenant's ceilings, and a purge removes a tenant from the
cache (from HiCache's host pool too: ``test_agentcache_on_hicache_server.py``).

One server with two tenants (``acme`` with tight ceilings, ``globex`` with the defaults) and an admin
key, started with ``AGENTCACHE_TENANTS`` (a TOML tenants file), ``AGENTCACHE_SECRET`` and an audit log.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.tenancy import key_digest

pytestmark = pytest.mark.server

ACME_KEY = "ak-acme-test-key-0123456789"
GLOBEX_KEY = "ak-globex-test-key-0123456789"
ADMIN_KEY = "ak-admin-test-key-0123456789"
SECRET = "s" * 48
TOOL_PRIORS = {"grep": {"median_s": 0.02, "sigma": 0.5}, "ci_run": {"median_s": 60.0, "sigma": 1.5}}
ACME_CEILINGS = {"max_retention_s": 5, "max_kept_branches": 1, "max_priority": 3, "max_stable_prefix_tokens": 64}

TENANTS_TOML = f"""
require_signed_sessions = true
admin_keys = ["{key_digest(ADMIN_KEY)}"]

[defaults]
max_retention_s = 600

[tenants.acme]
keys = ["{key_digest(ACME_KEY)}"]
ceilings = {{ {", ".join(f"{k} = {v}" for k, v in ACME_CEILINGS.items())} }}

[tenants.globex]
keys = ["{GLOBEX_KEY}"]
"""


@pytest.fixture(scope="module")
def tserver(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenancy")
    (root / "tenants.toml").write_text(TENANTS_TOML)
    # Two running requests at most, with SGLang's priority scheduling: the queue-jump test needs a queue.
    srv = CpuServer(str(tiny_model.path), log_path=root / "sglang.log", max_total_tokens=4096,
                    extra_args=("--enable-cache-report", "--enable-metrics", "--enable-priority-scheduling",
                                "--max-running-requests", "2"),
                    env={"AGENTCACHE_TENANTS": str(root / "tenants.toml"), "AGENTCACHE_SECRET": SECRET,
                         "AGENTCACHE_AUDIT_LOG": str(root / "audit.jsonl"), "AGENTCACHE_PROFILE": "seed",
                         "AGENTCACHE_TOOL_PRIORS": json.dumps(TOOL_PRIORS)})
    srv.audit_log = root / "audit.jsonl"
    with srv.start():
        yield srv


def _call(srv, method, path, key=None, body=None, headers=None):
    return srv.request(method, path, body, headers={**({"x-agentcache-key": key} if key else {}), **(headers or {})})


def _open(srv, key, **body):
    status, reply = _call(srv, "POST", "/agentcache/session/open", key, body)
    assert status == 200, reply
    return reply["session"]


def _gen(srv, key, ids, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
            **extra}
    return _call(srv, "POST", "/generate", key, body)


def _hinted(srv, key, ids, session, hint=None, **kw):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
            "kv_hints": lifecycle_envelope({"session": session, **(hint or {})}, message_id=f"m-{time.monotonic_ns()}"),
            **kw}
    return _call(srv, "POST", "/generate", key, body)


def _stats(srv, key):
    status, stats = _call(srv, "GET", "/agentcache/stats", key)
    assert status == 200, stats
    return stats


def _tree_view(srv):
    """What any refused request must leave unchanged: every tenant's view and the admin's counts."""
    admin = _stats(srv, ADMIN_KEY)
    return (_stats(srv, ACME_KEY), _stats(srv, GLOBEX_KEY),
            admin["resident_tokens"], admin["branches"], admin["pauses"]["paused_branches"],
            admin["pauses"]["kept_branches"])


def test_keys_decide_who_may_call_what(tserver):
    ids = [5, 6, 7, 8]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    assert _call(tserver, "POST", "/generate", None, body)[0] == 401
    assert _call(tserver, "POST", "/generate", "ak-not-a-key-at-all-000", body)[0] == 401
    assert _call(tserver, "POST", "/generate", ADMIN_KEY, body)[0] == 403  # admins do not generate
    assert _call(tserver, "POST", "/generate", None, body, {"Authorization": f"Bearer {ACME_KEY}"})[0] == 200
    assert _call(tserver, "POST", "/agentcache/admin/purge", ACME_KEY, {"tenant": "globex"})[0] == 403
    assert _call(tserver, "GET", "/agentcache/check", GLOBEX_KEY)[0] == 403
    assert _call(tserver, "POST", "/flush_cache", ACME_KEY)[0] == 403  # SGLang's own admin routes
    assert _call(tserver, "GET", "/agentcache/check", ADMIN_KEY)[0] == 200
    with urllib.request.urlopen(tserver.url + "/health", timeout=10) as resp:  # probes need no key
        assert resp.status == 200
    assert _call(tserver, "GET", "/v1/models")[0] == 200
    acme = _stats(tserver, ACME_KEY)
    assert acme["tenant"] == "acme" and "branches" in acme and "trust" not in acme
    assert acme["ceilings"]["max_kept_branches"] == 1


def test_identical_prompts_never_hit_across_tenants(tserver, tokens):
    claims = ({}, {"cache_salt": "acme"}, {"extra_key": "acme", "cache_salt": "agentcache:acme"})
    prompts = [tokens.ids(200) for _ in claims]
    for prompt in prompts:
        status, first = _gen(tserver, ACME_KEY, prompt)
        assert status == 200 and first["meta_info"]["cached_tokens"] == 0
        status, again = _gen(tserver, ACME_KEY, prompt)
        assert again["meta_info"]["cached_tokens"] >= 190  # the same tenant does hit
    before = _stats(tserver, ADMIN_KEY)["trust"]["namespace_overwritten"]
    # globex sends the identical prompts, even claiming acme's namespace: never a hit.
    for prompt, claim in zip(prompts, claims):
        status, other = _gen(tserver, GLOBEX_KEY, prompt, **claim)
        assert status == 200 and other["meta_info"]["cached_tokens"] == 0, (claim, other["meta_info"])
    assert _stats(tserver, ADMIN_KEY)["trust"]["namespace_overwritten"] == before + 2
    # The OpenAI route is bound the same way.
    completion = {"model": "default", "prompt": tokens.ids(150), "max_tokens": 1}
    assert _call(tserver, "POST", "/v1/completions", ACME_KEY, completion)[0] == 200
    status, reply = _call(tserver, "POST", "/v1/completions", ACME_KEY, completion)
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, reply["usage"]
    status, reply = _call(tserver, "POST", "/v1/completions", GLOBEX_KEY, completion)
    assert status == 200 and (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_forged_borrowed_expired_and_replayed_credentials_change_nothing(tserver, tokens):
    acme, globex = _open(tserver, ACME_KEY), _open(tserver, GLOBEX_KEY)
    prompt = tokens.ids(120)
    assert _hinted(tserver, ACME_KEY, prompt, acme)[0] == 200
    assert _hinted(tserver, GLOBEX_KEY, prompt, globex)[0] == 200
    sid, expiry, mac = acme.split(".")
    forged = [
        f"{sid}.{expiry}.{'A' * 22}",                  # a made-up MAC
        f"{sid}.{int(expiry) + 3600}.{mac}",           # a longer life under the old MAC
        "plain-session-id",                            # not a credential at all
    ]
    before = _tree_view(tserver)
    for session in forged:
        status, reply = _hinted(tserver, ACME_KEY, prompt, session)
        assert status == 403, (session, reply)
        assert _call(tserver, "POST", "/agentcache/pause", ACME_KEY, {"session": session})[0] == 403
    # Another tenant's genuine credential, with one's own key: refused on every route.
    assert _hinted(tserver, ACME_KEY, prompt, globex)[0] == 403
    for path in ("/agentcache/session/close", "/agentcache/branch/close", "/agentcache/pause",
                 "/agentcache/resume", "/agentcache/prefetch"):
        status, reply = _call(tserver, "POST", path, ACME_KEY, {"session": globex})
        assert status == 403, (path, reply)
    header = {"x-sgl-agentcache-hint": json.dumps({"session": globex})}
    completion = {"model": "default", "prompt": prompt[:50], "max_tokens": 1}
    assert _call(tserver, "POST", "/v1/completions", ACME_KEY, completion, header)[0] == 403
    # Expired.
    short = _open(tserver, ACME_KEY, ttl_s=1)
    time.sleep(1.2)
    assert _hinted(tserver, ACME_KEY, prompt, short)[0] == 401
    assert _call(tserver, "POST", "/agentcache/resume", ACME_KEY, {"session": short})[0] == 401
    assert _tree_view(tserver) == before
    # Replayed after close.
    assert _call(tserver, "POST", "/agentcache/session/close", ACME_KEY, {"session": acme})[0] == 200
    after_close = _tree_view(tserver)
    assert _hinted(tserver, ACME_KEY, prompt, acme)[0] == 403
    assert _call(tserver, "POST", "/agentcache/branch/close", ACME_KEY, {"session": acme})[0] == 403
    assert _tree_view(tserver) == after_close
    rejected = _stats(tserver, ADMIN_KEY)["trust"]["rejected"]
    for reason in ("forged_session", "unsigned_session", "expired_session", "closed_session"):
        assert rejected.get(reason, 0) >= 1, rejected
    deadline = time.monotonic() + 10  # the audit log is appended by a writer thread, off the request path
    while "closed_session" not in (audit := tserver.audit_log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "forged_session" in audit and ACME_KEY not in audit and mac not in audit


def test_ceilings_clip_greedy_hints_and_hold_under_a_flood(tserver, tokens):
    stable = tokens.ids(200)
    sessions = [_open(tserver, ACME_KEY) for _ in range(5)]
    before = _stats(tserver, ADMIN_KEY)["trust"]["clipped"]
    for session in sessions:
        prompt = stable + tokens.ids(200)
        status, _ = _hinted(tserver, ACME_KEY, prompt, session, {"stable_prefix_tokens": 400})
        assert status == 200
    acme = _stats(tserver, ACME_KEY)
    assert acme["resident_tokens"]["stable"] <= ACME_CEILINGS["max_stable_prefix_tokens"]
    replies = []
    for session in sessions:  # a flood of pauses on a short tool, each asking for a day and top priority
        status, reply = _call(tserver, "POST", "/agentcache/pause", ACME_KEY,
                              {"session": session, "tool_class": "grep", "deadline_ms": 86_400_000, "priority": 100})
        assert status == 200, reply
        replies.append(reply)
    assert all(r["deadline_s"] == ACME_CEILINGS["max_retention_s"] for r in replies)
    assert all(r["clipped"]["priority"]["granted"] == ACME_CEILINGS["max_priority"] for r in replies)
    # The default (lazy) pause mode pins nothing, whatever is asked: a "keep" is advice to eviction, so
    # no tenant can hold memory through pauses (the eager mode's caps are tested in test_pauses.py).
    assert all(r["lazy"] for r in replies)
    assert _stats(tserver, ACME_KEY)["kept_branches"] == 0
    acme = _stats(tserver, ACME_KEY)
    assert acme["kept_branches"] <= ACME_CEILINGS["max_kept_branches"]
    clipped = _stats(tserver, ADMIN_KEY)["trust"]["clipped"]
    for name, n in (("stable_prefix_tokens", 5), ("deadline_ms", 5), ("priority", 5)):
        assert clipped.get(name, 0) - before.get(name, 0) == n, clipped
    with urllib.request.urlopen(tserver.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'sglang:agentcache_hints_clipped_total{field="deadline_ms"}' in metrics
    assert "sglang:agentcache_hints_rejected_total" in metrics
    for session in sessions:
        _call(tserver, "POST", "/agentcache/session/close", ACME_KEY, {"session": session})


def test_purge_removes_a_tenant_from_the_cache_and_spares_the_others(tserver, tokens):
    prompt = tokens.ids(300)
    acme, globex = _open(tserver, ACME_KEY), _open(tserver, GLOBEX_KEY)
    assert _hinted(tserver, ACME_KEY, prompt, acme, {"stable_prefix_tokens": 32})[0] == 200
    assert _hinted(tserver, GLOBEX_KEY, prompt, globex, {"stable_prefix_tokens": 32})[0] == 200
    status, paused = _call(tserver, "POST", "/agentcache/pause", ACME_KEY, {"session": acme, "tool_class": "ci_run"})
    assert status == 200 and paused["paused"] and paused["lazy"], paused  # advice: nothing moved
    held = _stats(tserver, ACME_KEY)
    # Device-only server: acme holds its prompt on the device, nothing on host; the paused branch too.
    assert sum(held["resident_tokens"].values()) >= len(prompt) and held["host_tokens"] == 0, held
    assert held["paused_branches"] == 1 and held["coordinator"]["active_pauses"] == 1, held
    status, result = _call(tserver, "POST", "/agentcache/admin/purge", ADMIN_KEY, {"tenant": "acme"})
    assert status == 200 and result["locked_tokens"] == 0 and result["freed_tokens"] >= len(prompt), result
    gone = _stats(tserver, ACME_KEY)
    assert sum(gone["resident_tokens"].values()) == 0 and gone["host_tokens"] == 0, gone
    assert gone["branches"] == [] and gone["paused_branches"] == gone["kept_branches"] == 0
    assert gone["coordinator"]["active_pauses"] == 0
    # The purged tenant recomputes; the other tenant's identical prompt still hits.
    status, again = _gen(tserver, ACME_KEY, prompt)
    assert again["meta_info"]["cached_tokens"] == 0
    status, other = _gen(tserver, GLOBEX_KEY, prompt)
    assert other["meta_info"]["cached_tokens"] >= 290
    assert _call(tserver, "POST", "/agentcache/admin/purge", ADMIN_KEY, {"tenant": "nobody"})[0] == 404
    status, report = _call(tserver, "GET", "/agentcache/check", ADMIN_KEY)
    assert status == 200 and report["ok"], report


def test_an_urgent_turn_jumps_the_queue_and_gets_no_memory_for_it(tserver, tokens):
    """Priority is queue order, never residency: with both running slots taken by long low-priority
    turns and two more waiting, a priority-10 turn is admitted ahead of the waiting ones, so it is back
    before either of them finishes (under FIFO it would come back last). The long turns are then
    aborted, so the test's duration does not depend on the machine's speed."""
    finished: dict[str, float] = {}
    prompt = tokens.ids(64)
    sessions = {name: _open(tserver, GLOBEX_KEY) for name in ("low0", "low1", "low2", "low3", "urgent")}

    def turn(name, priority, new_tokens):
        body = {"input_ids": prompt + tokens.ids(8),
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
                "kv_hints": lifecycle_envelope({"session": sessions[name], "priority": priority}, message_id=name)}
        _call(tserver, "POST", "/generate", GLOBEX_KEY, body)
        finished[name] = time.monotonic()

    low = [threading.Thread(target=turn, args=(f"low{i}", -5, 900)) for i in range(4)]
    for t in low:
        t.start()
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while _stats(tserver, ADMIN_KEY)["queue_by_priority"]["low"]["waiting"] < 2:  # counted by class
        assert time.monotonic() < deadline, "the low-priority turns never queued"
        time.sleep(0.1)
    urgent = threading.Thread(target=turn, args=("urgent", 10, 4))
    urgent.start()
    urgent.join(300)
    back_before_urgent = [name for name in finished if name != "urgent"]
    try:
        assert "urgent" in finished and len(back_before_urgent) <= 2, back_before_urgent
    finally:
        assert _call(tserver, "POST", "/abort_request", ADMIN_KEY, {"abort_all": True})[0] == 200
        for t in low:
            t.join(300)
    assert _stats(tserver, GLOBEX_KEY)["session_quota_tokens"] == _stats(tserver, ACME_KEY)["session_quota_tokens"]
    with urllib.request.urlopen(tserver.url + "/metrics", timeout=10) as resp:
        assert "sglang:agentcache_queue_age_seconds" in resp.read().decode()


@pytest.mark.parametrize("path, body", [
    ("/agentcache/session/open", {"ttl_s": -1}), ("/agentcache/session/open", {"ttl_s": "long"}),
    ("/agentcache/session/open", {"ttl_s": 10**30}), ("/agentcache/session/open", {"tenant": "globex"}),
    ("/agentcache/admin/purge", {}), ("/agentcache/admin/purge", {"tenant": 5}),
    ("/agentcache/admin/purge", {"tenant": "x" * 10_000}), ("/agentcache/pause", {"session": "s" * 500}),
])
def test_malformed_tenancy_bodies_are_400_and_change_nothing(tserver, path, body):
    key = ADMIN_KEY if "/admin/" in path else ACME_KEY
    before = _tree_view(tserver)
    status, reply = _call(tserver, "POST", path, key, body)
    assert status == 400 and "error" in reply, (status, reply)
    assert _tree_view(tserver) == before
