"""Server-path hardening on a real SGLang server (CPU), issue #22: what one tenant could do to a shared
server, and the documented guarantees hostile testing broke.

The server is this module's own (never the session's shared one): several inputs here killed an
unguarded SGLang 0.5.23 scheduler, and a regression must take down only this module. It runs with
tenancy (two tenants and an admin key). Every test that sends a prompt the server must refuse checks
afterwards that the scheduler still generates (``/health_generate``).
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
import urllib.error
import urllib.request

import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.tenancy import key_digest

pytestmark = pytest.mark.server

ACME_KEY = "ak-acme-hardening-0123456789"
GLOBEX_KEY = "ak-globex-hardening-0123456789"
ADMIN_KEY = "ak-admin-hardening-0123456789"
ACME_MAX_TTL_S = 600

TENANTS_TOML = f"""
admin_keys = ["{key_digest(ADMIN_KEY)}"]

[tenants.acme]
keys = ["{key_digest(ACME_KEY)}"]
ceilings = {{ max_session_ttl_s = {ACME_MAX_TTL_S} }}

[tenants.globex]
keys = ["{key_digest(GLOBEX_KEY)}"]
"""


@pytest.fixture(scope="module")
def hserver(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    (root / "tenants.toml").write_text(TENANTS_TOML)
    os.mkfifo(root / "events.fifo")  # an event log nobody reads: writing to it blocks (see the last test)
    srv = CpuServer(str(tiny_model.path), log_path=root / "sglang.log", max_total_tokens=4096,
                    env={"AGENTCACHE_TENANTS": str(root / "tenants.toml"), "AGENTCACHE_SECRET": "h" * 48,
                         "AGENTCACHE_AUDIT_LOG": str(root / "audit.jsonl"),
                         "AGENTCACHE_EVENT_LOG": str(root / "events.fifo"), "AGENTCACHE_PROFILE": "seed"})
    srv.vocab_size = tiny_model.vocab_size
    srv.audit_log, srv.event_log = root / "audit.jsonl", root / "events.fifo"
    hammer = _KeylessHammer(srv.url)  # a keyless local client racing SGLang's own warmup (item 5)
    try:
        srv.start()
        srv.up_at = time.monotonic()
    finally:
        srv.hammered = hammer.stop()
    with srv:
        yield srv


class _KeylessHammer:
    """Threads that POST keyless ``/generate`` calls from loopback from before the port opens until
    stopped, recording (time answered, status)."""

    def __init__(self, url: str, threads: int = 4):
        self.url, self.stopped, self.answers = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": GREEDY}).encode()
        while not self.stopped.is_set():
            request = urllib.request.Request(self.url + "/generate", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    self.answers.append((time.monotonic(), reply.status))
            except urllib.error.HTTPError as err:
                self.answers.append((time.monotonic(), err.code))
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or going down
            self.stopped.wait(0.05)

    def stop(self) -> list[tuple[float, int]]:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)
        return self.answers


def _call(srv, method, path, key=None, body=None, timeout=60.0):
    return srv.request(method, path, body, headers={"x-agentcache-key": key} if key else {}, timeout=timeout)


def _error(reply) -> str:
    error = reply.get("error") if isinstance(reply, dict) else reply
    if isinstance(error, dict):
        error = error.get("message")
    return str(error or reply.get("detail") or reply.get("message") or reply)


def _assert_alive(srv) -> None:
    """The scheduler still runs: a generation through it answers (SGLang's own probe)."""
    status, reply = _call(srv, "GET", "/health_generate", timeout=60)
    assert status == 200, reply
    assert srv.proc.poll() is None


GREEDY = {"max_new_tokens": 1, "temperature": 0.0}

# ---- start-up (items 15, 5) ----


@pytest.mark.parametrize("args, env, needle", [
    pytest.param(("--dp-size", "2"), {}, "does not support data parallelism", id="dp-2"),
    pytest.param(("--tokenizer-worker-num", "2"), {}, "does not support --tokenizer-worker-num 2", id="workers-2"),
])
def test_unsupported_deployments_refuse_to_start_with_the_reason(tiny_model, tmp_path, args, env, needle):
    """DP > 1 (each rank its own tree, control replies from the first rank only) and several
    tokenizer workers (one process holds the coordinator and the tenancy state) stop start-up, saying
    why."""
    srv = CpuServer(str(tiny_model.path), log_path=tmp_path / "sglang.log", extra_args=args, env=env)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            srv.start(timeout=180)
    finally:
        srv.stop()
    assert needle in (tmp_path / "sglang.log").read_text()


# ---- start-up warmup (item 5) ----


def test_start_up_warmup_is_never_starved_by_a_keyless_client(hserver):
    """Keyless loopback requests during start-up were admitted (four, the warmup's allowance), SGLang's
    own warmup then got a 401 and the server killed itself. Only the warmup's own requests (from this
    very process) are admitted now: the server came up, and every keyless request during start-up was
    refused."""
    during = [status for at, status in hserver.hammered if at < hserver.up_at]
    assert during, "the keyless client never reached the server during its start-up"
    assert set(status for _, status in hserver.hammered) == {401}, hserver.hammered
    _assert_alive(hserver)


# ---- one tenant must not be able to kill the shared server (items 1, 2) ----


@pytest.mark.parametrize("body, needle", [
    pytest.param({"input_ids": [5, 6, "vocab"]}, "`input_ids[2]` = {vocab}", id="id-at-vocab"),
    pytest.param({"input_ids": [-1, 5]}, "`input_ids[0]` = -1", id="negative-id"),
    pytest.param({"input_ids": [[5, 6], [7, "vocab", 8]]}, "`input_ids[1][1]` = {vocab}", id="batch-id-at-vocab"),
    pytest.param({"input_ids": [[5, 6], [7, 10**6]]}, "`input_ids[1][1]` = 1000000", id="batch-huge-id"),
    pytest.param({"input_ids": [[5, 6], []]}, "`input_ids[1]` is empty", id="batch-empty-prompt"),
    pytest.param({"input_ids": [[]]}, "`input_ids[0]` is empty", id="batch-of-one-empty"),
    pytest.param({"text": ""}, "empty once tokenized", id="empty-text"),
    pytest.param({"text": ["agent: plan", ""]}, "empty once tokenized", id="batch-empty-text"),
])
def test_generate_refuses_prompts_that_kill_sglang(hserver, body, needle):
    """Out-of-vocabulary ids (IndexError in the scheduler) and empty prompts in a batch (an assertion at
    release) or after tokenization (a reshape error) are a 400 naming the field; the server lives on."""
    body = json.loads(json.dumps(body).replace('"vocab"', str(hserver.vocab_size)))
    status, reply = _call(hserver, "POST", "/generate", ACME_KEY, {**body, "sampling_params": GREEDY})
    assert status == 400, reply
    assert needle.format(vocab=hserver.vocab_size) in _error(reply), reply
    _assert_alive(hserver)


@pytest.mark.parametrize("prompt, needle", [
    pytest.param([5, "vocab"], "`prompt[1]` = {vocab}", id="id-at-vocab"),
    pytest.param([[5, 6], [-3]], "`prompt[1][0]` = -3", id="batch-negative-id"),
    pytest.param([[5, 6], []], "`prompt[1]` is empty", id="batch-empty-prompt"),
    pytest.param(["agent: plan", ""], "empty once tokenized", id="batch-empty-text"),
])
def test_completions_refuse_prompts_that_kill_sglang(hserver, prompt, needle):
    prompt = json.loads(json.dumps(prompt).replace('"vocab"', str(hserver.vocab_size)))
    body = {"model": "default", "prompt": prompt, "max_tokens": 1}
    status, reply = _call(hserver, "POST", "/v1/completions", GLOBEX_KEY, body)
    assert status == 400, reply
    assert needle.format(vocab=hserver.vocab_size) in _error(reply), reply
    _assert_alive(hserver)


@pytest.mark.parametrize("path, body", [
    pytest.param("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": "vocab+1",
                               "sampling_params": GREEDY}, id="generate"),
    pytest.param("/generate", {"input_ids": [[5, 6], [7]], "return_logprob": True, "top_logprobs_num": [1, 500],
                               "sampling_params": GREEDY}, id="generate-batch"),
    pytest.param("/generate", {"text": "plan", "return_logprob": True, "top_logprobs_num": -2,
                               "sampling_params": GREEDY}, id="generate-negative"),
    pytest.param("/v1/completions", {"model": "default", "prompt": [5, 6], "max_tokens": 1, "logprobs": 500},
                 id="completions"),
    pytest.param("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1, "logprobs": True, "top_logprobs": 500}, id="chat"),
])
def test_top_logprobs_past_the_vocabulary_are_refused(hserver, path, body):
    """Issue #38 item 2: more top log-probabilities per token than the vocabulary has killed SGLang
    0.5.23's scheduler (``selected index k out of range``), stock SGLang too. A 400 now, on every route."""
    body = json.loads(json.dumps(body).replace('"vocab+1"', str(hserver.vocab_size + 1)))
    status, reply = _call(hserver, "POST", path, ACME_KEY, body)
    assert status == 400, reply
    assert "top log-probabilities" in _error(reply) and str(hserver.vocab_size) in _error(reply), reply
    _assert_alive(hserver)


def test_top_logprobs_up_to_the_vocabulary_still_answer(hserver):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": hserver.vocab_size,
            "sampling_params": GREEDY}
    status, reply = _call(hserver, "POST", "/generate", ACME_KEY, body)
    assert status == 200, reply
    assert len(reply["meta_info"]["output_top_logprobs"][0]) == hserver.vocab_size
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "top_logprobs": 500}  # without `logprobs` the number is never used: not refused
    status, reply = _call(hserver, "POST", "/v1/chat/completions", ACME_KEY, body)
    assert status == 200, reply


def test_valid_prompts_at_the_vocabulary_edges_still_generate(hserver):
    edges = [0, hserver.vocab_size - 1, 5]
    body = {"input_ids": [edges, [7]], "sampling_params": GREEDY}
    status, reply = _call(hserver, "POST", "/generate", ACME_KEY, body)
    assert status == 200 and len(reply) == 2, reply
    body = {"model": "default", "prompt": edges, "max_tokens": 1}
    assert _call(hserver, "POST", "/v1/completions", ACME_KEY, body)[0] == 200


# ---- documented guarantees (items 5-8) ----


def _open(srv, key, **body) -> dict:
    status, reply = _call(srv, "POST", "/agentcache/session/open", key, body)
    assert status == 200, reply
    return reply


def _hinted(srv, key, session, ids, **hint):
    body = {"input_ids": ids, "sampling_params": GREEDY,
            "kv_hints": lifecycle_envelope({"session": session, **hint}, message_id=f"m-{time.monotonic_ns()}")}
    return _call(srv, "POST", "/generate", key, body)


def test_a_closed_session_stays_closed_whatever_the_spelling_of_its_credential(hserver):
    """A credential whose expiry had leading zeros verified (same MAC) as a different session id: after
    ``session/close`` it still worked. Only the canonical spelling is a credential now."""
    session = _open(hserver, ACME_KEY)["session"]
    assert _hinted(hserver, ACME_KEY, session, [5, 6, 7, 8])[0] == 200
    assert _call(hserver, "POST", "/agentcache/session/close", ACME_KEY, {"session": session})[0] == 200
    sid, expiry, mac = session.split(".")
    variant = f"{sid}.0{expiry}.{mac}"
    status, reply = _hinted(hserver, ACME_KEY, variant, [5, 6, 7, 8])
    assert status == 403, reply
    for route in ("/agentcache/branch/close", "/agentcache/session/close", "/agentcache/pause"):
        body = {"session": variant, "tool_class": "grep"} if route.endswith("pause") else {"session": variant}
        assert _call(hserver, "POST", route, ACME_KEY, body)[0] == 403, route
    assert _hinted(hserver, ACME_KEY, session, [5, 6, 7, 8])[0] == 403


def _audit(srv, until, timeout: float = 10.0) -> list[dict]:
    """The audit log's records once ``until(records)`` holds (a writer thread appends them)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in srv.audit_log.read_text().splitlines()]
        if until(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def test_audit_log_keeps_a_bounded_piece_of_a_refused_path(hserver):
    """Every 401 is audited with its path; a client-chosen 8 KiB path used to be logged whole (2,000
    such requests: 16 MB)."""
    marker = "x" * 8000
    assert _call(hserver, "GET", f"/{marker}")[0] == 401
    assert _call(hserver, "POST", f"/agentcache/{marker}", "ak-not-a-key-0000000000", {})[0] == 401
    records = _audit(hserver, lambda rs: sum(marker[:100] in r.get("path", "") for r in rs) >= 2)
    logged = [r for r in records if marker[:100] in r.get("path", "")]
    assert len(logged) >= 2 and all(len(json.dumps(r)) < 1024 for r in logged), logged[0]["path"][:300]
    assert all(r["path"].endswith("chars)") for r in logged)


def test_session_open_reports_a_clipped_lifetime(hserver):
    reply = _open(hserver, ACME_KEY, ttl_s=ACME_MAX_TTL_S * 10)
    assert reply["clipped"] == {"ttl_s": {"asked": ACME_MAX_TTL_S * 10, "granted": ACME_MAX_TTL_S}}, reply
    assert reply["expires_at"] - time.time() <= ACME_MAX_TTL_S
    assert "clipped" not in _open(hserver, ACME_KEY, ttl_s=60)


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY}),
])
def test_one_rule_for_generation_tenants_generate_admins_never(hserver, path, body):
    """The admin key generated on routes outside the tenant list (``/v1/messages``) while ``/generate``
    refused it, and tenants could not use those routes at all."""
    status, reply = _call(hserver, "POST", path, ADMIN_KEY, body)
    assert status == 403, reply
    status, reply = _call(hserver, "POST", path, ACME_KEY, body)
    assert status == 200, reply


def _read_fifo(path, until, timeout: float = 30.0) -> list[dict]:
    """Open the event log's FIFO for reading and collect records until ``until(records)`` holds."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                data += os.read(fd, 1 << 16)
            records = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
            if until(records):
                return records
    finally:
        os.close(fd)
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def test_a_stuck_event_log_delays_no_request_and_holds_no_credential(hserver):
    """The event log is a FIFO that nobody reads: opening it for writing blocks. Written on the HTTP
    event loop (as it was), the first state change froze every request; now a writer thread waits on it.
    Once read, the record names the session by its id part, never by the whole credential."""
    session = _open(hserver, GLOBEX_KEY)["session"]
    assert _hinted(hserver, GLOBEX_KEY, session, [5, 6, 7, 8, 9])[0] == 200
    for _ in range(3):  # each close is a 'completed' record: the log's writer is stuck on the FIFO now
        status, reply = _call(hserver, "POST", "/agentcache/session/close", GLOBEX_KEY, {"session": session},
                              timeout=15)
        assert status in (200, 403), reply  # closed once, then its credential is retired
    assert _call(hserver, "GET", "/agentcache/stats", GLOBEX_KEY, timeout=15)[0] == 200
    _assert_alive(hserver)
    sid = session.split(".")[0]
    records = _read_fifo(hserver.event_log, lambda rs: any(r.get("session") == sid for r in rs))
    completed = [r for r in records if r.get("session") == sid]
    assert completed and completed[0]["state"] == "completed", records
    assert all(session not in json.dumps(r) and session.split(".")[2] not in json.dumps(r) for r in records)
