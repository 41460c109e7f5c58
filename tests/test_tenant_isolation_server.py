"""Two tenants on one real SGLang server (CPU): one tenant's traffic never slows, forgets or reclassifies
another's (issue #38 items 3-6), with chat inference on.

The server is this module's own, with tenancy (acme, globex, an admin key), ``AGENTCACHE_INFER=chat``,
at most 8 background pauses pending per namespace, and prefetch turned off for a namespace whose lead
times are under 5 s (a lead time counts the prefetch's own HiCache load, tens of ms on a loaded CPU). Requests go over plain HTTP as JSON (the chat requests here test the server's
bookkeeping, not a client library).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.tenancy import key_digest

pytestmark = pytest.mark.server

ACME, GLOBEX, ADMIN = "ak-acme-isolation-0123456789", "ak-globex-isolation-0123456789", "ak-admin-isolation-012345678"
TENANTS = f"""
admin_keys = ["{key_digest(ADMIN)}"]
[tenants.acme]
keys = ["{key_digest(ACME)}"]
[tenants.globex]
keys = ["{key_digest(GLOBEX)}"]
"""
GREEDY = {"max_new_tokens": 1, "temperature": 0.0}
TOOLS = [{"type": "function", "function": {"name": "ci_run", "description": "run the project's test suite",
                                           "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = {"role": "system", "content": "you are a coding agent. read, run the tests, report what failed."}


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    (root / "tenants.toml").write_text(TENANTS)
    # On SGLang's HiCache (the host tier): an eager offload demotes there and a prefetch loads it back.
    server = CpuServer(str(tiny_model.path), log_path=root / "sglang.log",
                       extra_args=("--enable-cache-report", "--enable-hierarchical-cache", "--hicache-io-backend",
                                   "direct", "--hicache-write-policy", "write_back", "--hicache-ratio", "4"),
                       env={"AGENTCACHE_TENANTS": str(root / "tenants.toml"), "AGENTCACHE_SECRET": "i" * 48,
                            "AGENTCACHE_INFER": "chat", "AGENTCACHE_MAX_PENDING_PAUSES": "8",
                            "AGENTCACHE_PREFETCH_MIN_LEAD_MS": "5000", "AGENTCACHE_PAUSE_MODE": "eager",
                            "AGENTCACHE_PROFILE": "seed",
                            "AGENTCACHE_TOOL_PRIORS": json.dumps({"ci_run": {"median_s": 60.0, "sigma": 1.5}})})
    server.vocab_size = tiny_model.vocab_size
    with server.start():
        yield server


def _call(srv, method, path, key, body=None, timeout=120.0):
    return srv.request(method, path, body, headers={"x-agentcache-key": key}, timeout=timeout)


def _open(srv, key) -> str:
    status, reply = _call(srv, "POST", "/agentcache/session/open", key, {})
    assert status == 200, reply
    return reply["session"]


def _generate(srv, key, session, ids, **hint):
    body = {"input_ids": ids, "sampling_params": GREEDY,
            "kv_hints": lifecycle_envelope({"session": session, **hint}, message_id=f"m-{time.monotonic_ns()}")}
    return _call(srv, "POST", "/generate", key, body)


def _admin_stats(srv) -> dict:
    status, stats = _call(srv, "GET", "/agentcache/stats", ADMIN)
    assert status == 200, stats
    return stats


def test_a_pause_flood_of_one_tenant_does_not_stall_anothers_stats(srv):
    """Item 3: acme's threads send hinted calls that pause on ``grep`` as they finish. Every control
    route used to wait for every tenant's pending pauses, sent one scheduler round trip each: globex's
    ``GET /agentcache/stats`` took 24 s (1.5 s median on a 2-core machine). It waits for its own
    namespace only now, and the control channel batches the pauses and serves namespaces in turn."""
    stop, sent = threading.Event(), [0]

    def flood(seed: int) -> None:
        rng, session = random.Random(seed), _open(srv, ACME)
        while not stop.is_set():
            ids = [rng.randrange(3, srv.vocab_size) for _ in range(8)]
            _generate(srv, ACME, session, ids, branch=f"b{rng.randrange(40)}", tool_class="grep")
            sent[0] += 1

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(10)]
    for thread in threads:
        thread.start()
    waits = []
    try:
        time.sleep(2.0)  # the flood is under way
        for _ in range(20):
            started = time.monotonic()
            status, reply = _call(srv, "GET", "/agentcache/stats", GLOBEX)
            waits.append(time.monotonic() - started)
            assert status == 200 and reply["tenant"] == "globex", reply
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert sent[0] > 200, sent  # the flood ran
    assert statistics.median(waits) < 0.5, waits
    coordinator = _admin_stats(srv)
    assert coordinator["control_channel"]["batches"] > 0 and coordinator["coordinator"]["pending_pauses"] <= 8


def test_a_refused_chat_leaves_no_inferred_state(srv):
    """Item 4: chats of many empty user messages were refused (longer than the context) but inference
    had already recorded every message: 990k fingerprints from ten of them, enough to close another
    tenant's conversations at the shared bound. A refused request leaves nothing behind now."""
    before = _admin_stats(srv)["chat_inference"]
    huge = {"model": "default", "max_tokens": 1, "messages": [SYSTEM] + [{"role": "user", "content": ""}] * 3000}
    for _ in range(3):
        status, reply = _call(srv, "POST", "/v1/chat/completions", ACME, huge)
        assert status == 400, reply
    after = _admin_stats(srv)["chat_inference"]
    assert after["refused"] == before["refused"] + 3
    assert (after["fingerprints"], after["sessions"], after["requests"]) == (
        before["fingerprints"], before["sessions"], before["requests"])
    # globex's conversation goes on as one branch, its second turn hitting the first one's prompt.
    chat = [SYSTEM, {"role": "user", "content": "fix the failing test in the parser module"}]
    status, first = _call(srv, "POST", "/v1/chat/completions", GLOBEX, {"model": "default", "messages": chat,
                                                                         "max_tokens": 2, "temperature": 0})
    assert status == 200, first
    chat += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
             {"role": "user", "content": "and now run the tests"}]
    status, second = _call(srv, "POST", "/v1/chat/completions", GLOBEX, {"model": "default", "messages": chat,
                                                                          "max_tokens": 2, "temperature": 0})
    assert status == 200, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 8
    # Accepted requests count, parallel sampling too (SGLang validates each sample on a copy of the request).
    before = _admin_stats(srv)["chat_inference"]
    status, reply = _call(srv, "POST", "/v1/chat/completions", GLOBEX, {"model": "default", "messages": chat, "n": 2,
                                                                         "max_tokens": 2, "temperature": 0.5})
    assert status == 200 and len(reply["choices"]) == 2, reply
    after = _admin_stats(srv)["chat_inference"]
    assert after["requests"] == before["requests"] + 1 and after["refused"] == before["refused"]


def _stable_tokens(srv, key) -> int:
    status, stats = _call(srv, "GET", "/agentcache/stats", key)
    assert status == 200, stats
    return stats["resident_tokens"]["stable"]


def test_the_stable_prefix_is_what_this_request_renders_not_what_another_tenant_rendered(srv):
    """Item 5: the stable-prefix length was cached by system messages and tools only, for all tenants.
    After acme's request rendered the tools, globex's with ``tool_choice: "none"`` (the template then
    renders no tools) was classed STABLE for 168 of its 173 tokens instead of 77, and its private user
    tokens outlived its branch. The cache is per namespace now, keyed by everything that changes the
    rendering: globex's stable prefix is its system message alone, as without tools at all."""
    plain = {"model": "default", "max_tokens": 1, "temperature": 0,
             "messages": [SYSTEM, {"role": "user", "content": "what does the parser do"}]}
    assert _call(srv, "POST", "/v1/chat/completions", GLOBEX, plain)[0] == 200
    system_only = _stable_tokens(srv, GLOBEX)
    assert system_only > 0
    with_tools = {"model": "default", "max_tokens": 1, "temperature": 0, "tools": TOOLS, "tool_choice": "auto",
                  "messages": [SYSTEM, {"role": "user", "content": "run the suite"}]}
    assert _call(srv, "POST", "/v1/chat/completions", ACME, with_tools)[0] == 200
    assert _stable_tokens(srv, ACME) > system_only  # acme's stable prefix holds the tools
    none = with_tools | {"tool_choice": "none",
                         "messages": [SYSTEM, {"role": "user", "content": "summarise the failures in a long list"}]}
    assert _call(srv, "POST", "/v1/chat/completions", GLOBEX, none)[0] == 200
    assert _stable_tokens(srv, GLOBEX) == system_only


def test_one_tenants_fast_prefetches_do_not_turn_off_anothers(srv):
    """Item 6: the prefetch lead-time window (its median gates prefetch) was one for all tenants: acme's
    prefetches issued just before each resume turned globex's prefetch off. Each namespace has its own."""
    rng = random.Random(3)

    def paused(key, session) -> None:
        assert _generate(srv, key, session, [rng.randrange(3, srv.vocab_size) for _ in range(120)])[0] == 200
        status, reply = _call(srv, "POST", "/agentcache/pause", key, {"session": session, "tool_class": "ci_run"})
        assert status == 200 and reply["paused"], reply

    for _ in range(9):  # resumed a few ms after "nearly done": acme's lead times are far under 5 s
        session = _open(srv, ACME)
        paused(ACME, session)
        assert _call(srv, "POST", "/agentcache/prefetch", ACME, {"session": session})[0] == 200
        assert _call(srv, "POST", "/agentcache/resume", ACME, {"session": session})[0] == 200
    session = _open(srv, ACME)
    paused(ACME, session)
    status, reply = _call(srv, "POST", "/agentcache/prefetch", ACME, {"session": session})
    assert status == 200 and not reply["prefetched"] and "lead time" in reply["reason"], reply  # acme's is off
    session = _open(srv, GLOBEX)
    paused(GLOBEX, session)
    status, reply = _call(srv, "POST", "/agentcache/prefetch", GLOBEX, {"session": session})
    assert status == 200 and "lead time" not in reply.get("reason", ""), reply
    assert reply["prefetched"], reply
    status, report = _call(srv, "GET", "/agentcache/check", ADMIN)
    assert status == 200 and report["ok"], report
