"""The deleting L3 store (server/l3_store.py) without a server: SGLang's own ``HiCacheFile`` writes pages,
``DeletingFileStorage`` deletes exactly the ones named (every pool's file, LRU bytes refunded), and the
deleter counts what a backend without deletes leaves behind."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from sgl_agentcache.server.l3_store import DeletingFileStorage, L3Deleter


def _config() -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="tiny", extra_config=None)


def test_deletes_exactly_the_named_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    store = DeletingFileStorage(_config(), {})
    for key in ("a", "b", "c"):
        assert store.set(key, torch.full((16,), 1.0))
    assert all(store.exists(k) for k in ("a", "b", "c"))
    assert store.delete_keys(["a", "c", "never-written"]) == 2
    assert not store.exists("a") and store.exists("b") and not store.exists("c")
    assert store.delete_keys(["a"]) == 0  # already gone: not an error


def test_the_deleter_runs_off_thread_and_counts_what_it_cannot_delete(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    store = DeletingFileStorage(_config(), {})
    store.set("p", torch.zeros(8))
    deleter = L3Deleter(store)
    assert deleter.enabled
    deleter.delete(["p", "q"])
    deleter.drain(timeout=10)
    assert deleter.counters == {"l3_pages_deleted": 2, "l3_files_removed": 1, "l3_pages_left": 0,
                                "l3_delete_errors": 0}
    plain = L3Deleter(object())  # a backend with no per-key delete
    plain.delete(["x", "y"])
    assert not plain.enabled and plain.counters["l3_pages_left"] == 2
