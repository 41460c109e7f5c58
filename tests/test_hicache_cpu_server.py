"""Stock SGLang 0.5.23's HiCache (``--enable-hierarchical-cache``) serving on CPU through our shims.

``sgl-agentcache cpu-setup`` installs ``_hicache_cpu_shim`` (see its docstring): unpinned host pools,
the ``direct`` io backend's copies written in torch, and a stream stand-in. These tests start stock
SGLang (no ``--radix-cache-backend``) with HiCache on and check what an operator would: a prefix pushed
out of the device pool comes back from host (``meta_info.cached_tokens_details``), under both write
policies and both direct layouts; with ``--hicache-storage-backend file``, a prefix pushed out of host
too comes back from L3, also after a restart. Each hit must give the *same* logprobs as a device hit
of the same prompt: the copies carry the KV bytes exactly, not just a count. With tenancy on, two
tenants sending the same prompt through one shared L3 store get no hit on each other's pages.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.cpu_setup import SHIMS

POOL_TOKENS = 1024
PROMPT_TOKENS = 300
#: A request whose prefix SGLang finds in L3 waits for that prefetch to finish (SGLang's default,
#: best_effort, takes whatever has arrived when the request is scheduled: on a loaded CI machine that
#: was nothing, and a test of L3 hits saw a miss).
WAIT_FOR_L3 = ("--hicache-storage-prefetch-policy", "wait_complete")


def _shim():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hicache_cpu_shim_under_test", SHIMS / "_hicache_cpu_shim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layers(n_layers: int, tokens: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, 2, 4, generator=gen) for _ in range(n_layers)]


def test_direct_layer_first_copies_token_rows_between_layers():
    shim = _shim()
    src, dst = _layers(3, 32, 1), [torch.zeros(40, 2, 4) for _ in range(3)]
    src_idx, dst_idx = torch.tensor([5, 6, 7, 20]), torch.tensor([0, 1, 2, 39])
    shim.transfer_kv_direct(src, dst, src_idx, dst_idx, page_size=1)
    for s, d in zip(src, dst):
        assert torch.equal(d[dst_idx], s[src_idx])
        assert d[3:39].abs().sum() == 0  # nothing else written
    with pytest.raises(ValueError, match="index counts differ"):
        shim.transfer_kv_direct(src, dst, src_idx, dst_idx[:2], page_size=1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_direct_page_first_round_trip_matches_the_device_rows(page_size):
    """Back up every layer into a ``[page, layer, offset, head, dim]`` host buffer, load each layer back
    elsewhere: the rows come back unchanged, and host token ``t`` sits at ``[t // page, layer, t % page]``."""
    shim = _shim()
    layers, tokens = 3, 32
    device_k, device_v = _layers(layers, tokens, 2), _layers(layers, tokens, 3)
    host_k = torch.zeros(tokens // page_size, layers, page_size, 2, 4)
    host_v = torch.zeros_like(host_k)
    device_idx = torch.arange(8, 8 + 2 * page_size)
    host_idx = torch.arange(4 * page_size, 6 * page_size)
    shim.transfer_kv_all_layer_direct_lf_pf(device_k + device_v, [host_k, host_v], device_idx, host_idx, page_size)
    for layer in range(layers):
        t = int(host_idx[0])
        assert torch.equal(host_k[t // page_size, layer, t % page_size], device_k[layer][int(device_idx[0])])
    back_k = [torch.zeros(tokens, 2, 4) for _ in range(layers)]
    back_v = [torch.zeros(tokens, 2, 4) for _ in range(layers)]
    target = torch.arange(2 * page_size)
    for layer in range(layers):
        shim.transfer_kv_per_layer_direct_pf_lf([host_k, host_v], [back_k[layer], back_v[layer]], host_idx, target,
                                                layer, page_size)
        assert torch.equal(back_k[layer][target], device_k[layer][device_idx])
        assert torch.equal(back_v[layer][target], device_v[layer][device_idx])


def test_on_cpu_the_host_memory_reserve_is_one_gib():
    """SGLang's 10 GiB reserve would refuse a few-MB pool on a 24 GiB machine running several servers."""
    import types

    shim = _shim()
    base = types.ModuleType("sglang.srt.mem_cache.pool_host.base")
    base.HostKVCache = type("HostKVCache", (), {"pin_memory": True})
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3
    shim._patch(base)
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1024**3 and base.HostKVCache().pin_memory is False
    from sglang.srt.mem_cache.pool_host import base as real  # this environment's, patched by the .pth hook

    assert real.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1024**3


def test_the_shim_leaves_a_real_kernel_build_alone(tmp_path):
    """Next to a GPU torch nothing is patched (stand-in modules: no GPU torch can run here)."""
    import subprocess
    import sys
    import textwrap

    fake = tmp_path / "fake"
    base = fake / "sglang" / "srt" / "mem_cache" / "pool_host"
    base.mkdir(parents=True)
    for pkg in (fake / "sglang", fake / "sglang" / "srt", fake / "sglang" / "srt" / "mem_cache", base):
        (pkg / "__init__.py").write_text("")
    (base / "base.py").write_text("class HostKVCache:\n    pin_memory = True\n")
    (fake / "torch").mkdir()
    (fake / "torch" / "__init__.py").write_text(textwrap.dedent("""
        class version:
            cuda = "12.8"
            hip = None
        """))
    code = ("import _hicache_cpu_shim\n"
            "from sglang.srt.mem_cache.pool_host.base import HostKVCache\n"
            "print(HostKVCache.pin_memory)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{fake}:{SHIMS}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


# ---- a real server ----

def _generate(srv: CpuServer, ids: list[int]) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"{srv.url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["meta_info"]


def _hicache_server(tiny_model, log_path, *flags: str, env: dict | None = None) -> CpuServer:
    return CpuServer(str(tiny_model.path), backend=None, log_path=log_path, max_total_tokens=POOL_TOKENS,
                     extra_args=("--enable-cache-report", "--enable-hierarchical-cache",
                                 "--hicache-io-backend", "direct", *flags), env=env or {})


def _push_out(srv: CpuServer, tokens, prompts: int) -> None:
    for _ in range(prompts):
        _generate(srv, tokens.ids(PROMPT_TOKENS))


def _logprobs(meta: dict) -> list:
    return [(lp, tok) for lp, tok, *_ in meta["output_token_logprobs"]]


@pytest.mark.server
@pytest.mark.parametrize("policy,layout", [("write_through", "page_first_direct"), ("write_back", "layer_first")])
def test_a_prefix_evicted_from_the_device_comes_back_from_host(tiny_model, tokens, tmp_path, policy, layout):
    flags = ("--hicache-write-policy", policy, "--hicache-mem-layout", layout, "--hicache-ratio", "4")
    with _hicache_server(tiny_model, tmp_path / "sglang.log", *flags).start() as srv:
        prompt = tokens.ids(PROMPT_TOKENS)
        assert _generate(srv, prompt)["cached_tokens"] == 0
        device_hit = _generate(srv, prompt)
        assert device_hit["cached_tokens_details"] == {"device": PROMPT_TOKENS - 1, "host": 0}
        _push_out(srv, tokens, 6)  # 1,800 other tokens through a 1,024-token device pool
        host_hit = _generate(srv, prompt)
        assert host_hit["cached_tokens_details"] == {"device": 0, "host": PROMPT_TOKENS - 1}
        assert _logprobs(host_hit) == _logprobs(device_hit)  # the same KV bytes came back
    assert "hicache_attached=True" in (tmp_path / "sglang.log").read_text()


@pytest.mark.server
def test_a_prefix_evicted_from_host_comes_back_from_file_storage_also_after_a_restart(tiny_model, tokens, tmp_path):
    """L3: host is only twice the device pool, so ten other prompts push the prefix out of both; the
    ``file`` backend (pages of 16 tokens) still holds it, and so does a fresh server on the same directory."""
    store = tmp_path / "l3"
    store.mkdir()
    flags = ("--hicache-ratio", "2", "--hicache-storage-backend", "file", "--page-size", "16", *WAIT_FOR_L3)
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)}
    stored = PROMPT_TOKENS // 16 * 16
    prompt = tokens.ids(PROMPT_TOKENS)
    with _hicache_server(tiny_model, tmp_path / "first.log", *flags, env=env).start() as srv:
        _generate(srv, prompt)
        device_hit = _generate(srv, prompt)
        assert device_hit["cached_tokens_details"]["device"] == stored
        _push_out(srv, tokens, 10)
        l3_hit = _generate(srv, prompt)
        assert l3_hit["cached_tokens_details"]["storage"] == stored, l3_hit["cached_tokens_details"]
        assert l3_hit["cached_tokens_details"]["device"] == l3_hit["cached_tokens_details"]["host"] == 0
        assert _logprobs(l3_hit) == _logprobs(device_hit)
    assert any(store.iterdir())
    with _hicache_server(tiny_model, tmp_path / "restart.log", *flags, env=env).start() as srv:
        after_restart = _generate(srv, prompt)
        assert after_restart["cached_tokens_details"]["storage"] == stored
        assert _logprobs(after_restart) == _logprobs(device_hit)


@pytest.mark.server
def test_two_tenants_sending_the_same_prompt_share_no_l3_page(tiny_model, tokens, tmp_path):
    """Tenancy binds each tenant's requests to its own ``cache_salt``, and SGLang seeds every L3 page
    key's hash chain with it: one tenant's prompt, pushed out to the shared ``file`` store, is no L3 hit
    for another tenant sending the same tokens, and remains one for its own tenant."""
    from sgl_agentcache.tenancy import key_digest

    keys = {"acme": "ak-acme-l3-test-key-0123456789", "globex": "ak-globex-l3-test-key-0123456789"}
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{name}]\nkeys = ["{key_digest(key)}"]\n\n' for name, key in keys.items()))
    store = tmp_path / "l3"
    store.mkdir()
    flags = ("--hicache-ratio", "2", "--hicache-storage-backend", "file", "--page-size", "16", *WAIT_FOR_L3)
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store), "AGENTCACHE_TENANTS": str(tenants),
           "AGENTCACHE_SECRET": "s" * 48}
    stored = PROMPT_TOKENS // 16 * 16
    prompt = tokens.ids(PROMPT_TOKENS)

    def generate(srv, tenant, ids):
        status, reply = srv.request("POST", "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}},
            headers={"x-agentcache-key": keys[tenant]})
        assert status == 200, reply
        return reply["meta_info"]

    with _hicache_server(tiny_model, tmp_path / "sglang.log", *flags, env=env).start() as srv:
        generate(srv, "acme", prompt)
        assert generate(srv, "acme", prompt)["cached_tokens_details"]["device"] == stored
        for _ in range(10):  # out of the device pool and out of host: only L3 holds acme's pages now
            generate(srv, "acme", tokens.ids(PROMPT_TOKENS))
        other = generate(srv, "globex", prompt)
        assert other["cached_tokens"] == 0, other["cached_tokens_details"]
        own = generate(srv, "acme", prompt)
        assert own["cached_tokens_details"]["storage"] == stored, own["cached_tokens_details"]
