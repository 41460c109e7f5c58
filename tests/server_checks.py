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
