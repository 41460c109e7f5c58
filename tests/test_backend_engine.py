"""The agentcache backend under an in-process ``sglang.Engine`` (CPU, tiny model, no tokenizer needed)."""

from __future__ import annotations

import pytest

from sgl_agentcache.server.control import engine_call

pytestmark = pytest.mark.engine

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def test_engine_uses_backend_and_hits_prefix(engine, tokens):
    reply = engine_call(engine, "stats")
    assert reply.status == 200
    assert (reply.result["impl"], reply.result["tree_core"]) == ("AgentRadixCache", "AgentTreeCore")
    prefix = tokens.ids(120)
    engine.generate(input_ids=prefix + tokens.ids(5), sampling_params=GREEDY)
    out = engine.generate(input_ids=prefix + tokens.ids(5), sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= len(prefix)
    batch = engine.generate(input_ids=[prefix + tokens.ids(3) for _ in range(3)], sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= len(prefix) for o in batch)
    check = engine_call(engine, "check")
    assert check.status == 200 and check.result["ok"], check.result


def test_unknown_op_is_a_clear_error(engine):
    reply = engine_call(engine, "no-such-op")
    assert reply.status == 404 and "unknown agentcache op" in reply.result["error"]
