"""The agentcache backend inside a real SGLang 0.5.23 HTTP server on CPU (tiny random-weight model)."""

from __future__ import annotations

import pytest

from sgl_agentcache.cpu_server import CpuServer

pytestmark = pytest.mark.server

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _gen(server, ids):
    return server.generate({"input_ids": ids, "sampling_params": GREEDY})


def test_server_really_uses_agentcache_backend(server):
    status, stats = server.request("GET", "/agentcache/stats")
    assert status == 200
    assert stats["backend"] == "agentcache"
    assert stats["impl"] == "AgentRadixCache"
    assert stats["tree_core"] == "AgentTreeCore"  # the Python core: nodes carry lifecycle state
    log = server.log_path.read_text(errors="replace")
    assert "Tree cache initialized: source=registered('agentcache') impl=AgentRadixCache" in log
    assert "Tree Core: AgentTreeCore" in log


def test_shared_prefix_is_served_from_cache(server, tokens):
    prefix = tokens.ids(200)
    first = _gen(server, prefix + tokens.ids(10))
    second = _gen(server, prefix + tokens.ids(10))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(prefix)


def test_filling_the_pool_evicts_and_tree_stays_consistent(server, tokens):
    _, before = server.request("GET", "/agentcache/stats")
    assert before["hicache"] == {"attached": False}  # the shared server is device-only: no host tier
    prompts = [tokens.ids(900) for _ in range(7)]  # 6300 prompt tokens > 4096-token pool
    for ids in prompts:
        _gen(server, ids)
    _, after = server.request("GET", "/agentcache/stats")
    assert after["evictable_tokens"] + after["protected_tokens"] <= 4096
    # LRU: the oldest prompt was evicted, and with no host tier what eviction took is gone: sent
    # again it is prefilled from scratch (a few tokens may match another test's prompt by chance);
    # the newest is still resident.
    oldest = _gen(server, prompts[0])["meta_info"]
    assert oldest["cached_tokens"] < 16, oldest
    assert _gen(server, prompts[-1])["meta_info"]["cached_tokens"] >= len(prompts[-1]) - 1
    status, report = server.request("GET", "/agentcache/check")
    assert status == 200 and report["idle"], report
    assert report["ok"], report["errors"]
    assert report["available_tokens"] + report["evictable_tokens"] == report["pool_tokens"] == 4096
    assert before["impl"] == after["impl"] == "AgentRadixCache"


def test_text_prompts_and_openai_route_share_the_cache(server):
    prompt = "system: you are an agent with tools. user: search the repository and run the tests. " * 3
    body = {"text": prompt, "sampling_params": GREEDY}
    server.generate(body)
    assert server.generate(body)["meta_info"]["cached_tokens"] > 0
    status, out = server.request("POST", "/v1/completions",
                                 {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert status == 200, out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_disable_radix_cache_defers_to_stock_chain(tiny_model, tmp_path):
    log = tmp_path / "sglang.log"
    with CpuServer(str(tiny_model.path), log_path=log, extra_args=("--disable-radix-cache",)) as srv:
        status, body = srv.request("GET", "/agentcache/stats")
        assert status == 409 and "not the agentcache backend" in body["error"]
        assert srv.generate({"text": "hello agent", "sampling_params": GREEDY})["meta_info"]["cached_tokens"] == 0
    assert "deferring to SGLang's default cache chain" in log.read_text(errors="replace")
