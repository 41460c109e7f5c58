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
    assert set(report["spill_failures"]) == {"spill_failed", "load_failed"}  # counted, not raised
    assert report["host_tokens"]["after"] <= report["host_tokens"]["before"]  # other tests' pauses may remain
    calls = report["calls"]
    assert calls["generate"] > 10 and calls["session_close"] >= 3
    assert calls.get("pause", 0) + calls.get("resume", 0) > 0
