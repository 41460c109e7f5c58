"""The ``agentcache`` backend on SGLang's own HiCache (issue #36 item 2), real CPU servers.

``--radix-cache-backend agentcache --enable-hierarchical-cache`` serves: HiCache's host pool and cache
controller carry every host copy (HiCache is the only host tier: without it a server has none), and our
lifecycle decides what they keep. Checked against a real server, under both write policies:

- a branch's close deletes its nodes on the device *and* in HiCache's host pool: the host pool's free
  slots come back, no node of the branch is left, and its prompt sent again gets no host hit (stock
  eviction would have demoted the backed-up nodes to host, where they would live on);
- what the session keeps still comes back from host after device pressure, with the same logprobs as
  a device hit (the lifecycle changes what is held, never the bytes);
- under write-through, a fork over its branch quota is not backed up (the first to go on either tier),
  while the session's history is;
- HiCache's host eviction follows the lifecycle: a branch paused with OFFLOAD advice keeps its host
  copy while newer sessions' copies go first (LRU would have dropped it: it is the oldest);
- with our deleting ``file`` store (``server/scheduler/l3_store.py``), a close deletes the fork's L3 pages too,
  and the session's pages stay; after a restart (the tree that knew them gone) a tenant purge still
  deletes every L3 page the tenant wrote, through its purge manifest, and spares the other tenant's;
- a tenant purge removes the tenant's nodes from HiCache's host pool too, and spares the other tenant;
- a paused branch pushed out to host is prefetched ("the tool is nearly done") through HiCache's own
  load path, and its next turn finds it on the device;
- one pushed on out to the ``file`` L3 store (by newer paused branches) is fetched back to host by its
  prefetch through HiCache's own storage prefetch, and its next turn hits on host instead of in storage.
"""

from __future__ import annotations

import time

import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope
from server_checks import check_when_idle

pytestmark = pytest.mark.server

POOL_TOKENS = 1024
PROMPT_TOKENS = 300
#: A request whose prefix SGLang finds in L3 waits for that prefetch to finish (SGLang's default,
#: best_effort, takes whatever has arrived when the request is scheduled: on a loaded CI machine that
#: can be nothing, and a test of L3 hits would see a miss).
WAIT_FOR_L3 = ("--hicache-storage-prefetch-policy", "wait_complete")
SCRATCH_TOKENS = 200


#: Decisions priced as the seed deployment (36 KiB/token: a host copy is worth loading back), and a
#: prefetch budget a whole history fits in.
PRICED = {"AGENTCACHE_PROFILE": "seed", "AGENTCACHE_PREFETCH_BUDGET_TOKENS": "512"}


def _server(tiny_model, tmp_path, *flags: str, **env: str) -> CpuServer:
    """Our backend on HiCache with the ``direct`` io backend (the one the CPU shim provides), plus ``flags``."""
    return CpuServer(str(tiny_model.path), log_path=tmp_path / "sglang.log", max_total_tokens=POOL_TOKENS, env=env,
                     extra_args=("--enable-cache-report", "--enable-hierarchical-cache", "--hicache-io-backend",
                                 "direct", *flags))


def _policy(policy: str, layout: str = "layer_first", ratio: int = 4) -> tuple[str, ...]:
    return ("--hicache-write-policy", policy, "--hicache-mem-layout", layout, "--hicache-ratio", str(ratio))


def _wait_for(done, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _generate(srv: CpuServer, ids: list[int], hint: dict | None = None) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    if hint is not None:
        body["kv_hints"] = lifecycle_envelope(hint, message_id=f"m-{time.monotonic_ns()}")
    status, reply = srv.request("POST", "/generate", body)
    assert status == 200, reply
    return reply["meta_info"]


def _hicache(srv: CpuServer) -> dict:
    status, stats = srv.request("GET", "/agentcache/stats")
    assert status == 200, stats
    return stats["hicache"] | {"branches": {b["branch"]: b["owned_tokens"] for b in stats["branches"]}}


def _settled(srv: CpuServer, done, timeout: float = 30.0) -> dict:
    """Stats once ``done(stats)`` holds (HiCache acknowledges copies a scheduler step or two later)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _hicache(srv)
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _logprobs(meta: dict) -> list:
    return [(lp, tok) for lp, tok, *_ in meta["output_token_logprobs"]]


@pytest.mark.parametrize("policy,layout", [("write_through", "page_first_direct"), ("write_back", "layer_first")])
def test_a_closed_fork_leaves_neither_the_device_nor_hicaches_host_pool(tiny_model, tokens, tmp_path, policy, layout):
    """write_through backs the fork's scratch up as it is inserted, so the close finds it on both tiers;
    write_back backs it up only when device pressure evicts it, so the close finds it on host only."""
    with _server(tiny_model, tmp_path, *_policy(policy, layout), **PRICED).start() as srv:
        stats = _hicache(srv)
        assert stats["attached"] and stats["write_policy"] == policy
        assert stats["host_pool_tokens"] >= 4 * POOL_TOKENS
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "s"})
        device_hit = _generate(srv, history, {"session": "s"})
        assert device_hit["cached_tokens_details"] == {"device": PROMPT_TOKENS - 1, "host": 0}
        fork_prompt = history + tokens.ids(SCRATCH_TOKENS)
        _generate(srv, fork_prompt, {"session": "s", "branch": "f1", "parent_branch": "main"})
        if policy == "write_back":  # other sessions' histories push ours and the fork's scratch to host
            for i in range(6):  # (untagged prompts would not: they go before any session's history)
                _generate(srv, tokens.ids(PROMPT_TOKENS), {"session": f"other{i}"})
        before = _settled(srv, lambda s: s["host_tokens_by_class"]["scratch"] >= SCRATCH_TOKENS)
        assert before["host_tokens_by_class"]["scratch"] >= SCRATCH_TOKENS, before
        assert before["branches"]["f1"] >= SCRATCH_TOKENS

        status, closed = srv.request("POST", "/agentcache/branch/close", {"session": "s", "branch": "f1"})
        assert status == 200 and closed["closed"], closed
        after = _settled(srv, lambda s: "f1" not in s["branches"] and s["host_tokens_by_class"]["terminated"] == 0)
        assert "f1" not in after["branches"], after  # no node of the branch is left, on any tier
        assert after["host_tokens_by_class"]["scratch"] == after["host_tokens_by_class"]["terminated"] == 0
        freed_host = before["host_tokens_by_class"]["scratch"]
        assert after["host_available_tokens"] == before["host_available_tokens"] + freed_host
        assert after["deleted"]["host_tokens"] - before["deleted"]["host_tokens"] == freed_host
        if policy == "write_back":
            assert closed["freed_tokens"] == 0 and closed["host_freed_tokens"] == freed_host
        check_when_idle(srv)

        # What the session keeps still comes back, from host under write_back, with the same bytes.
        back = _generate(srv, history, {"session": "s"})
        assert sum(back["cached_tokens_details"].values()) == PROMPT_TOKENS - 1
        if policy == "write_back":
            assert back["cached_tokens_details"]["host"] > 0
        assert _logprobs(back) == _logprobs(device_hit)
        # The fork's tokens are gone from host too: sent again, only the session's history is a hit.
        again = _generate(srv, fork_prompt)
        assert sum(again["cached_tokens_details"].values()) <= PROMPT_TOKENS, again["cached_tokens_details"]
        check_when_idle(srv)
    assert "hicache_attached=True" in (tmp_path / "sglang.log").read_text()


def test_a_paused_branch_is_prefetched_through_hicaches_load_path(tiny_model, tokens, tmp_path):
    with _server(tiny_model, tmp_path, *_policy("write_back"), **PRICED).start() as srv:
        history = tokens.ids(PROMPT_TOKENS)
        device_hit = _generate(srv, history, {"session": "p"})
        device_hit = _generate(srv, history, {"session": "p"})
        status, paused = srv.request("POST", "/agentcache/pause", {"session": "p", "tool_class": "ci_run"})
        assert status == 200 and paused["paused"], paused
        for i in range(6):
            _generate(srv, tokens.ids(PROMPT_TOKENS), {"session": f"other{i}"})
        for i in range(6):  # free device room for the prefetch (it never evicts)
            srv.request("POST", "/agentcache/session/close", {"session": f"other{i}"})
        on_host = _hicache(srv)["host_tokens_by_class"]["session"]
        assert on_host >= PROMPT_TOKENS, on_host
        status, prefetched = srv.request("POST", "/agentcache/prefetch", {"session": "p"})
        assert status == 200 and prefetched["prefetched"], prefetched
        assert prefetched["restored_tokens"] >= PROMPT_TOKENS - 1
        resumed = _generate(srv, history, {"session": "p"})
        assert resumed["cached_tokens_details"] == {"device": PROMPT_TOKENS - 1, "host": 0}
        assert _logprobs(resumed) == _logprobs(device_hit)
        status, stats = srv.request("GET", "/agentcache/stats")
        assert stats["pauses"]["prefetch"]["issued"] == 1
        check_when_idle(srv)


def test_with_a_file_l3_store_a_sessions_history_comes_back_from_storage(tiny_model, tokens, tmp_path):
    """HiCache's L3 under our lifecycle: host is only twice the device pool, so other sessions push the
    history out of both tiers; the ``file`` store (pages of 16) returns it with the same logprobs."""
    store = tmp_path / "l3"
    store.mkdir()
    srv = _server(tiny_model, tmp_path, "--hicache-ratio", "2", "--hicache-storage-backend", "file", "--page-size",
                  "16", *WAIT_FOR_L3, SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(store))
    stored = PROMPT_TOKENS // 16 * 16
    with srv.start():
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "l3"})
        device_hit = _generate(srv, history, {"session": "l3"})
        assert device_hit["cached_tokens_details"]["device"] == stored
        assert _hicache(srv)["storage_backend"] is True
        for i in range(10):
            _generate(srv, tokens.ids(PROMPT_TOKENS), {"session": f"other{i}"})
        from_l3 = _generate(srv, history, {"session": "l3"})
        assert from_l3["cached_tokens_details"]["storage"] == stored, from_l3["cached_tokens_details"]
        assert _logprobs(from_l3) == _logprobs(device_hit)
        check_when_idle(srv)


def test_a_prefetch_starts_a_paused_branchs_history_back_from_l3_to_host(tiny_model, tokens, tmp_path):
    """Item 2, storage prefetch for L3: a branch pauses on a tool (OFFLOAD advice), then ten more sessions
    pause on the same tool; the host pool (twice the device pool) holds six of them, so the oldest, ours,
    goes on to the ``file`` store. "The tool is nearly done" starts HiCache's own storage prefetch
    (L3 -> host) under our request handle; the next turn then hits on the device and host, not in
    storage, with the same logprobs."""
    import json

    store = tmp_path / "l3"
    store.mkdir()
    srv = _server(tiny_model, tmp_path, "--hicache-ratio", "2", "--hicache-storage-backend", "file", "--page-size",
                  "16", SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(store), **PRICED,
                  AGENTCACHE_TOOL_PRIORS=json.dumps({"ci_run": {"median_s": 60.0, "sigma": 1.5}}))
    stored = PROMPT_TOKENS // 16 * 16
    with srv.start():
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "l3"})
        device_hit = _generate(srv, history, {"session": "l3"})
        status, paused = srv.request("POST", "/agentcache/pause", {"session": "l3", "tool_class": "ci_run"})
        assert status == 200 and paused["paused"] and paused["action"] == "offload", paused
        for i in range(10):
            _generate(srv, tokens.ids(PROMPT_TOKENS), {"session": f"other{i}"})
            srv.request("POST", "/agentcache/pause", {"session": f"other{i}", "tool_class": "ci_run"})
        assert _hicache(srv)["host_tokens_by_class"]["session"] < 11 * stored  # someone left the host pool
        status, prefetched = srv.request("POST", "/agentcache/prefetch", {"session": "l3"})
        assert status == 200 and prefetched["prefetched"], prefetched
        assert prefetched["storage_tokens"] == stored and prefetched.get("restored_tokens", 0) == 0, prefetched
        landed = _settled(srv, lambda st: st["storage_fetches_in_flight"] == 0)
        assert landed["storage_fetches_in_flight"] == 0, landed
        back = _generate(srv, history, {"session": "l3"})
        details = back["cached_tokens_details"]
        assert details.get("storage", 0) == 0 and details["device"] + details["host"] == stored, details
        assert _logprobs(back) == _logprobs(device_hit)
        status, stats = srv.request("GET", "/agentcache/stats")
        prefetch = stats["pauses"]["prefetch"]
        assert prefetch["storage_issued"] == 1 and prefetch["storage_tokens_loaded"] == stored, prefetch
        check_when_idle(srv)


def test_write_through_backs_up_no_scratch_of_a_fork_over_its_quota(tiny_model, tokens, tmp_path):
    with _server(tiny_model, tmp_path, *_policy("write_through"), **PRICED,
                 AGENTCACHE_BRANCH_QUOTA_TOKENS="64").start() as srv:
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "q"})
        _generate(srv, history + tokens.ids(SCRATCH_TOKENS), {"session": "q", "branch": "big", "parent_branch": "main"})
        stats = _settled(srv, lambda s: s["host_tokens_by_class"]["session"] >= PROMPT_TOKENS)
        assert stats["host_tokens_by_class"]["session"] >= PROMPT_TOKENS  # the history is backed up
        assert stats["branches"]["big"] >= SCRATCH_TOKENS  # the fork holds its scratch on the device
        assert stats["host_tokens_by_class"]["scratch"] == 0 and stats["vetoed_backup_tokens"] >= SCRATCH_TOKENS
        check_when_idle(srv)


def test_host_eviction_keeps_a_branch_paused_with_offload_advice(tiny_model, tokens, tmp_path):
    import json

    priors = json.dumps({"ci_run": {"median_s": 60.0, "sigma": 1.5}})
    srv = _server(tiny_model, tmp_path, "--hicache-write-policy", "write_back", "--hicache-ratio", "1",
                  AGENTCACHE_PROFILE="seed", AGENTCACHE_TOOL_PRIORS=priors)
    with srv.start():
        history = tokens.ids(PROMPT_TOKENS)
        device_hit = _generate(srv, history, {"session": "paused"})
        device_hit = _generate(srv, history, {"session": "paused"})
        status, paused = srv.request("POST", "/agentcache/pause", {"session": "paused", "tool_class": "ci_run"})
        assert status == 200 and paused["action"] == "offload", paused
        # 2,400 newer tokens through a 1,024-token device pool and a host pool of the same size.
        for i in range(8):
            _generate(srv, tokens.ids(PROMPT_TOKENS), {"session": f"newer{i}"})
        back = _generate(srv, history, {"session": "paused"})
        assert back["cached_tokens_details"] == {"device": 0, "host": PROMPT_TOKENS - 1}, back
        assert _logprobs(back) == _logprobs(device_hit)
        check_when_idle(srv)


def test_a_tenant_purge_empties_its_share_of_hicaches_host_pool(tiny_model, tokens, tmp_path):
    from sgl_agentcache.tenancy import key_digest

    keys = {"acme": "ak-acme-hicache-test-0123456789", "globex": "ak-globex-hicache-test-0123456789"}
    admin = "ak-admin-hicache-test-0123456789"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'admin_keys = ["{key_digest(admin)}"]\n\n'
                       + "".join(f'[tenants.{name}]\nkeys = ["{key_digest(key)}"]\n\n' for name, key in keys.items()))
    srv = _server(tiny_model, tmp_path, "--hicache-write-policy", "write_through", "--hicache-ratio", "4",
                  AGENTCACHE_TENANTS=str(tenants), AGENTCACHE_SECRET="s" * 48)

    def call(tenant_key, method, path, body=None):
        status, reply = srv.request(method, path, body, headers={"x-agentcache-key": tenant_key})
        assert status == 200, reply
        return reply

    def generate(tenant, ids):
        return call(keys[tenant], "POST", "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})

    prompt = tokens.ids(PROMPT_TOKENS)
    with srv.start():
        for tenant in keys:  # the same prompt from both: write-through backs each tenant's copy up
            generate(tenant, prompt)
        _wait_for(lambda: call(keys["acme"], "GET", "/agentcache/stats")["host_tokens"] >= PROMPT_TOKENS,
                  "acme's prompt never reached HiCache's host pool")
        before = call(admin, "GET", "/agentcache/stats")["hicache"]
        purged = call(admin, "POST", "/agentcache/admin/purge", {"tenant": "acme"})
        assert purged["locked_tokens"] == 0 and purged["host_freed_tokens"] >= PROMPT_TOKENS, purged
        after = call(admin, "GET", "/agentcache/stats")["hicache"]
        assert after["host_available_tokens"] == before["host_available_tokens"] + purged["host_freed_tokens"]
        assert call(keys["acme"], "GET", "/agentcache/stats")["host_tokens"] == 0
        assert call(keys["globex"], "GET", "/agentcache/stats")["host_tokens"] >= PROMPT_TOKENS
        assert generate("acme", prompt)["meta_info"]["cached_tokens"] == 0  # nothing of it left, on any tier
        assert generate("globex", prompt)["meta_info"]["cached_tokens"] == PROMPT_TOKENS - 1
        # Idle (the host recount runs too) once the copies the last requests started have landed.
        _wait_for(lambda: call(admin, "GET", "/agentcache/check")["idle"], "the scheduler never went idle")
        report = call(admin, "GET", "/agentcache/check")
        assert report["ok"], report


def test_a_close_deletes_the_forks_pages_from_the_deleting_file_store(tiny_model, tokens, tmp_path):
    from sgl_agentcache.server.scheduler.l3_store import EXTRA_CONFIG

    store = tmp_path / "l3"
    store.mkdir()
    srv = _server(tiny_model, tmp_path, "--hicache-write-policy", "write_through", "--hicache-ratio", "2",
                  "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", EXTRA_CONFIG,
                  "--page-size", "16", SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(store))
    pages = lambda: len(list(store.glob("*.bin")))  # noqa: E731
    history_pages = PROMPT_TOKENS // 16

    with srv.start():
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "s"})
        _wait_for(lambda: pages() >= history_pages, "the history never reached the store")
        _generate(srv, history + tokens.ids(SCRATCH_TOKENS), {"session": "s", "branch": "f1", "parent_branch": "main"})
        # The fork owns the full pages past its fork point's page (a boundary inside a page rounds up).
        scratch_pages = (PROMPT_TOKENS + SCRATCH_TOKENS) // 16 - -(-PROMPT_TOKENS // 16)
        _wait_for(lambda: pages() >= history_pages + scratch_pages, "the fork's scratch never reached the store")
        before = pages()
        status, closed = srv.request("POST", "/agentcache/branch/close", {"session": "s", "branch": "f1"})
        assert status == 200 and closed["closed"], closed
        _wait_for(lambda: "f1" not in _hicache(srv)["branches"], "the fork's nodes were never deleted")
        _wait_for(lambda: pages() <= before - scratch_pages, "the fork's pages stayed in the store")
        deleted = _hicache(srv)["deleted"]
        assert deleted["l3_pages_deleted"] == deleted["l3_files_removed"] == scratch_pages, deleted
        assert deleted["l3_delete_errors"] == 0
        assert pages() >= history_pages  # the session's own pages stay
        check_when_idle(srv)


def test_a_tenant_purge_after_a_restart_deletes_its_l3_pages_through_the_manifest(tiny_model, tokens, tmp_path):
    """A page's L3 key is salted, so once the tree that wrote it is gone only the purge manifest can find
    it: two tenants send the same prompt to a server with the deleting store; a second server on the
    same store (a restart: empty tree) purges one tenant; its pages leave the store, the other's stay
    and still come back from L3."""
    from sgl_agentcache.server.scheduler.l3_store import EXTRA_CONFIG, PurgeManifest
    from sgl_agentcache.tenancy import key_digest

    keys = {"acme": "ak-acme-manifest-test-0123456789", "globex": "ak-globex-manifest-test-0123456789"}
    admin = "ak-admin-manifest-test-0123456789"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'admin_keys = ["{key_digest(admin)}"]\n\n'
                       + "".join(f'[tenants.{name}]\nkeys = ["{key_digest(key)}"]\n\n' for name, key in keys.items()))
    store = tmp_path / "l3"
    store.mkdir()
    pages = lambda: len(list(store.glob("*.bin")))  # noqa: E731
    prompt_pages = PROMPT_TOKENS // 16
    prompt = tokens.ids(PROMPT_TOKENS)

    def server(log: str) -> CpuServer:
        return CpuServer(str(tiny_model.path), log_path=tmp_path / log, max_total_tokens=POOL_TOKENS,
                         env={"AGENTCACHE_TENANTS": str(tenants), "AGENTCACHE_SECRET": "s" * 48,
                              "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)},
                         extra_args=("--enable-cache-report", "--enable-hierarchical-cache", "--hicache-io-backend",
                                     "direct", "--hicache-write-policy", "write_through", "--hicache-ratio", "2",
                                     "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                                     EXTRA_CONFIG, "--page-size", "16", *WAIT_FOR_L3))

    def call(srv, key, method, path, body=None):
        status, reply = srv.request(method, path, body, headers={"x-agentcache-key": key})
        assert status == 200, reply
        return reply

    def generate(srv, tenant):
        return call(srv, keys[tenant], "POST", "/generate", {
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})

    first = server("first.log")
    with first.start():
        for tenant in keys:  # the same prompt: two salts, so two sets of pages
            generate(first, tenant)
        _wait_for(lambda: pages() >= 2 * prompt_pages, "the tenants' pages never reached the store")
        _wait_for(lambda: call(first, admin, "GET", "/agentcache/check")["idle"], "the first server never went idle")
        recorded = call(first, admin, "GET", "/agentcache/stats")["hicache"]["deleted"]["l3_pages_recorded"]
        assert recorded >= 2 * prompt_pages
    manifests = lambda: {p.name: len(p.read_text().split()) for p in (store / PurgeManifest.DIRECTORY).glob("*.pages")}  # noqa: E731
    written = manifests()  # each tenant's (and the server warmup's) salt has its own
    assert sum(n >= prompt_pages for n in written.values()) >= 2, written
    before = pages()

    second = server("second.log")
    with second.start():
        purged = call(second, admin, "POST", "/agentcache/admin/purge", {"tenant": "acme"})
        assert purged["l3_manifest_purged"] is True, purged
        _wait_for(lambda: pages() <= before - prompt_pages, "acme's pages stayed in the store")
        assert pages() >= prompt_pages  # globex's stay
        gone = set(written) - set(manifests())
        assert len(gone) == 1 and written[gone.pop()] >= prompt_pages  # acme's manifest went with its pages
        deleted = call(second, admin, "GET", "/agentcache/stats")["hicache"]["deleted"]
        assert deleted["l3_pages_purged"] >= prompt_pages and deleted["l3_delete_errors"] == 0, deleted
        from_l3 = generate(second, "globex")["meta_info"]
        assert from_l3["cached_tokens_details"]["storage"] >= prompt_pages * 16 - 16, from_l3
        assert generate(second, "acme")["meta_info"]["cached_tokens"] == 0  # nothing of acme's left anywhere


def test_an_eager_offload_demotes_the_paused_branch_into_hicaches_host_pool_at_once(tiny_model, tokens, tmp_path):
    """``AGENTCACHE_PAUSE_MODE=eager`` on HiCache: an OFFLOAD decision moves the paused branch's history
    into HiCache's host pool at the pause (no device pressure needed), and its next turn loads it all
    back from host, with the same logprobs as a device hit."""
    import json

    priors = json.dumps({"ci_run": {"median_s": 60.0, "sigma": 1.5}})
    srv = _server(tiny_model, tmp_path, *_policy("write_back"), AGENTCACHE_PROFILE="seed",
                  AGENTCACHE_TOOL_PRIORS=priors, AGENTCACHE_PAUSE_MODE="eager")
    with srv.start():
        history = tokens.ids(PROMPT_TOKENS)
        _generate(srv, history, {"session": "eager"})
        device_hit = _generate(srv, history, {"session": "eager"})
        assert device_hit["cached_tokens_details"]["device"] == PROMPT_TOKENS - 1
        status, paused = srv.request("POST", "/agentcache/pause", {"session": "eager", "tool_class": "ci_run"})
        assert status == 200 and paused["action"] == "offload" and paused["lazy"] is False, paused
        assert paused["moved_tokens"] >= PROMPT_TOKENS - 1, paused
        stats = _settled(srv, lambda s: s["host_tokens_by_class"]["session"] >= PROMPT_TOKENS - 1)
        assert stats["host_tokens_by_class"]["session"] >= PROMPT_TOKENS - 1
        back = _generate(srv, history, {"session": "eager"})
        assert back["cached_tokens_details"] == {"device": 0, "host": PROMPT_TOKENS - 1}, back
        assert _logprobs(back) == _logprobs(device_hit)
        check_when_idle(srv)
