"""Checks shared by tests that drive a real CPU server (``CpuServer``)."""

from __future__ import annotations

import time


def check_when_idle(server, timeout: float = 30.0) -> None:
    """``GET /agentcache/check`` passes, and once with the scheduler idle (so its idle-only checks ran
    too: pool conservation, HiCache's host recount). A check taken while a copy the last request
    started is still in flight (a HiCache backup or load-back acknowledged a step or two later) is not
    idle: it is taken again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        status, report = server.request("GET", "/agentcache/check")
        assert status == 200 and report["ok"], report
        if report["idle"]:
            return
        assert time.monotonic() < deadline, report
        time.sleep(0.2)


#: What the idle sweep's pauses change by design (advice only: the coordinator's counters, the pause
#: book, and the tokens KEEP advice protects); the request path's effects are everywhere else.
SWEEP_FIELDS = ("coordinator", "pauses", "protected_tokens", "evictable_tokens")


def sweep_intervened(before: dict, after: dict) -> bool:
    """The idle sweep fired between two ``/agentcache/stats`` snapshots (its pauses change the tree and
    counters by design), so a diff between them cannot be blamed on the request in between."""
    b, a = before["coordinator"], after["coordinator"]
    swept = any(a.get(event) != b.get(event) for event in ("idle_pauses", "idle_repriced"))
    return swept or a.get("pending_pauses", 0) > 0


def without_sweep(doc: dict, fields: tuple[str, ...] = SWEEP_FIELDS) -> dict:
    """``doc`` without ``fields`` (what the idle sweep may move)."""
    return {key: value for key, value in doc.items() if key not in fields}
