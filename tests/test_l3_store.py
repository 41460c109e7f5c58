"""The deleting L3 store (server/scheduler/l3_store.py) without a server: SGLang's own ``HiCacheFile`` writes pages,
``DeletingFileStorage`` deletes exactly the ones named (every pool's file, LRU bytes refunded), and the
deleter counts what a backend without deletes leaves behind."""

from __future__ import annotations

import os

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from sgl_agentcache.server.scheduler.l3_store import DeletingFileStorage, L3Deleter, PurgeManifest


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
                                "l3_delete_errors": 0, "l3_pages_recorded": 0, "l3_pages_purged": 0}
    plain = L3Deleter(object())  # a backend with no per-key delete
    plain.delete(["x", "y"])
    assert not plain.enabled and plain.counters["l3_pages_left"] == 2


def test_a_purge_deletes_every_page_the_manifest_names_across_restarts(tmp_path, monkeypatch):
    """Pages recorded for a salt are deleted by its purge, even by a new deleter over the same store (a
    restarted server: the tree that knew them is gone); another salt's pages and manifest stay. The
    manifest file is named by a digest of the salt, never the salt."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    store = DeletingFileStorage(_config(), {})
    for key in ("a1", "a2", "b1"):
        store.set(key, torch.zeros(8))
    first = L3Deleter(store)
    first.record("tenant-a/../x", ["a1", "a2"])
    first.record("tenant-b", ["b1"])
    first.record("tenant-a/../x", ["a2"])  # written again: deleted once
    first.drain(timeout=10)
    names = sorted(p.name for p in (tmp_path / PurgeManifest.DIRECTORY).iterdir())
    assert len(names) == 2 and all(n.endswith(".pages") and "tenant" not in n for n in names)

    restarted = L3Deleter(DeletingFileStorage(_config(), {}))
    assert restarted.purge("tenant-a/../x")
    restarted.drain(timeout=10)
    assert not store.exists("a1") and not store.exists("a2") and store.exists("b1")
    assert restarted.counters["l3_pages_purged"] == 2 and restarted.counters["l3_files_removed"] == 2
    manifests = restarted.manifest
    assert not os.path.exists(manifests.path("tenant-a/../x")) and os.path.exists(manifests.path("tenant-b"))
    assert restarted.purge("tenant-a/../x")  # nothing left to purge: not an error
    restarted.drain(timeout=10)
    assert restarted.counters["l3_pages_purged"] == 2
    assert not L3Deleter(object()).purge("tenant-b")  # a backend without deletes keeps no manifest


def test_a_purge_keeps_the_pages_of_nodes_it_could_not_free(tmp_path, monkeypatch):
    """Pages of nodes a purge could not free yet (locked) stay in the store and in the manifest, so the
    next purge reaches them; the manifest is per TP rank (the store's file suffix)."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    store = DeletingFileStorage(_config(), {})
    for key in ("x1", "x2"):
        store.set(key, torch.zeros(8))
    deleter = L3Deleter(store)
    assert deleter.manifest.path("t").endswith(store.tp_config_suffix + ".pages")
    deleter.record("t", ["x1", "x2"])
    deleter.purge("t", keep=["x2"])
    deleter.drain(timeout=10)
    assert not store.exists("x1") and store.exists("x2")
    deleter.purge("t")
    deleter.drain(timeout=10)
    assert not store.exists("x2") and deleter.counters["l3_pages_purged"] == 2
