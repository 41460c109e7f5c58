"""A paused branch's host copy comes back when its request is admitted, not while it waits (issue #22
item 12), on a real SGLang server (CPU) with ``--schedule-policy lpm``.

With a cache-aware policy the scheduler matches every waiting request at every step to rank the queue
(``SchedulePolicy.calc_priority``), and each of those matches used to run the request's restore. Here a
long prompt is prefilled in 8-token chunks, so a returning agent turn that arrives meanwhile waits for
dozens of steps, ranked at each; its copy must stay on host until the step that admits it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.hints import lifecycle_envelope

pytestmark = pytest.mark.server

STABLE = 32
TOOL_PRIORS = {"ci_run": {"median_s": 60.0, "sigma": 1.5}}  # long-tailed: a pause is offloaded


@pytest.fixture(scope="module")
def lpm_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("lpm-server") / "sglang.log"
    srv = CpuServer(str(tiny_model.path), log_path=log, max_total_tokens=4096, context_length=2048,
                    extra_args=("--schedule-policy", "lpm", "--chunked-prefill-size", "8", "--enable-cache-report"),
                    # Eager pauses: the offload puts the copy on host at the pause, so the test can watch
                    # it stay there until admission (lazy pauses load spilled nodes back at the same match).
                    env={"AGENTCACHE_PROFILE": "seed", "AGENTCACHE_TOOL_PRIORS": json.dumps(TOOL_PRIORS),
                         "AGENTCACHE_PAUSE_MODE": "eager", "AGENTCACHE_HOST_SPILL": "0"})
    with srv.start():
        yield srv


def _stats(srv) -> dict:
    status, stats = srv.request("GET", "/agentcache/stats")
    assert status == 200, stats
    return stats


def _body(ids, session=None, max_new_tokens=6) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                   "ignore_eos": True}}
    if session is not None:
        body["kv_hints"] = lifecycle_envelope({"session": session, "stable_prefix_tokens": STABLE},
                                              message_id=f"m-{time.monotonic_ns()}")
    return body


def _long_prefill_running(stats: dict, before: dict) -> bool:
    """The long untagged prompt is the scheduler's chunked request: its first chunks are in the tree
    and it no longer waits in the queue (a snapshot taken between its arrival and its first step sees
    it queued)."""
    queued = sum(q["waiting"] for q in stats["queue_by_priority"].values())
    return stats["resident_tokens"]["untagged"] > before["resident_tokens"]["untagged"] and queued == 0


def _in_thread(srv, body) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(srv.generate(body)), daemon=True)
    thread.start()
    return thread, out


def test_a_waiting_turns_copy_stays_on_host_until_the_turn_is_admitted(lpm_server, tokens):
    srv = lpm_server
    prompt = tokens.ids(300)
    first = srv.generate(_body(prompt, "agent"))
    status, paused = srv.request("POST", "/agentcache/pause", {"session": "agent", "tool_class": "ci_run"})
    assert status == 200 and paused["action"] == "offload", paused
    before = _stats(srv)
    on_host = before["pauses"]["host"]["used_tokens"]
    assert on_host >= paused["tokens"] > 0

    long_thread, _ = _in_thread(srv, _body(tokens.ids(1900), max_new_tokens=1))  # ~240 chunks of 8
    deadline = time.monotonic() + 60
    while not _long_prefill_running(_stats(srv), before):
        assert time.monotonic() < deadline and long_thread.is_alive(), "the long prefill never started"
        time.sleep(0.01)

    turn = prompt + first["output_ids"] + tokens.ids(40)  # the tool returned: the agent's next turn
    turn_thread, turn_out = _in_thread(srv, _body(turn, "agent"))
    waiting = []  # snapshots taken while the turn waited in the queue
    while turn_thread.is_alive():
        stats = _stats(srv)
        if sum(q["waiting"] for q in stats["queue_by_priority"].values()) >= 1:
            waiting.append(stats)
    turn_thread.join()
    long_thread.join()

    # Only snapshots taken after the scheduler ranked the turn: a snapshot can see the queue before
    # the turn's first step there, and the turn is the only request whose copy waits.
    ranked = [s for s in waiting if s["ranking_deferred_restores"] > before["ranking_deferred_restores"]]
    assert len(ranked) >= 2, "the turn was never ranked while it waited (the long prefill ended too soon)"
    for stats in ranked:  # ranked at every step, restored at none of them
        assert stats["pauses"]["host"]["used_tokens"] == on_host, stats["pauses"]
        assert stats["pauses"]["resuming_branches"] == 1, stats["pauses"]
        assert stats["pauses"]["restores"] == before["pauses"]["restores"]
    after = _stats(srv)
    assert turn_out["meta_info"]["cached_tokens"] == STABLE + paused["tokens"]  # restored when admitted
    assert after["pauses"]["restores"] == before["pauses"]["restores"] + 1
    assert after["pauses"]["host"]["used_tokens"] == on_host - paused["tokens"]
    status, report = srv.request("GET", "/agentcache/check")
    assert status == 200 and report["ok"], report
