"""An L3 store the lifecycle can delete from: SGLang's ``file`` HiCache storage plus per-page deletes.

SGLang 0.5.23's storage API (``HiCacheStorage``) has get / set / exists and ``clear()`` (everything),
but no per-key delete, so a closed branch's or a purged tenant's pages would stay in L3 until the
store's own LRU eviction. :class:`DeletingFileStorage` is SGLang's ``HiCacheFile`` -- the same files,
keys and directory (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), so it reads a store the stock ``file``
backend wrote -- plus :meth:`DeletingFileStorage.delete_keys`. Start SGLang with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "agentcache_file", "module_path": "sgl_agentcache.server.l3_store",
        "class_name": "DeletingFileStorage"}'

With any other backend the lifecycle still deletes on the device and in the host pool, and counts the
L3 pages it could not delete (``/agentcache/stats`` ``hicache.deleted.l3_pages_left``).

The cache calls :meth:`L3Deleter.delete` on the scheduler thread; the disk work runs on one worker
thread of its own, so a purge never stalls a batch. File deletes are rank-local (each TP rank owns its
own files) and never feed a tree decision, so ranks cannot diverge on them.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName

logger = logging.getLogger(__name__)

#: ``--hicache-storage-backend-extra-config`` for :class:`DeletingFileStorage` (JSON).
EXTRA_CONFIG = ('{"backend_name": "agentcache_file", "module_path": "sgl_agentcache.server.l3_store", '
                '"class_name": "DeletingFileStorage"}')


class DeletingFileStorage(HiCacheFile):
    """SGLang's ``file`` storage backend with per-page deletes."""

    def __init__(self, storage_config, kwargs=None):
        # SGLang's dynamic backend factory calls ``backend_class(storage_config, kwargs)``.
        super().__init__(storage_config)

    def delete_keys(self, keys) -> int:
        """Delete the files of page keys ``keys`` in every registered pool (KV and any side pool), with
        their LRU and metadata bookkeeping. A missing file is not an error (never written, or already
        evicted). Returns the files removed."""
        pools = list(getattr(self, "registered_pools", None) or ()) or [PoolName.KV]
        removed = 0
        for key in keys:
            for pool in pools:
                suffixed = self._get_component_key(key, pool)
                try:
                    os.remove(os.path.join(self.file_path, f"{suffixed}.bin"))
                    removed += 1
                except FileNotFoundError:
                    pass
                self._evictor.abort(suffixed)  # forget its bytes (a no-op when the file was never tracked)
                if self.metadata_cache is not None:
                    self.metadata_cache.remove(suffixed)
        return removed


class L3Deleter:
    """Deletes pages from the cache's storage backend off the scheduler thread (one worker, in order)."""

    def __init__(self, backend):
        self.delete_keys = getattr(backend, "delete_keys", None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentcache-l3-delete") \
            if self.delete_keys is not None else None
        self.counters = {"l3_pages_deleted": 0, "l3_files_removed": 0, "l3_pages_left": 0, "l3_delete_errors": 0}
        self._last: Future | None = None

    @property
    def enabled(self) -> bool:
        """The backend can delete pages (else deleted nodes' pages stay in L3 and are counted)."""
        return self._pool is not None

    def delete(self, keys: list[str]) -> None:
        """Queue ``keys`` for deletion (or count them as left behind when the backend cannot delete)."""
        if not keys:
            return
        if self._pool is None:
            self.counters["l3_pages_left"] += len(keys)
            return
        self.counters["l3_pages_deleted"] += len(keys)
        self._last = self._pool.submit(self._run, list(keys))

    def _run(self, keys: list[str]) -> None:
        try:
            self.counters["l3_files_removed"] += self.delete_keys(keys)
        except Exception:  # noqa: BLE001 - a failed delete leaves pages for the store's eviction; never fatal
            self.counters["l3_delete_errors"] += 1
            logger.exception("agentcache: deleting %d L3 pages failed", len(keys))

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the deletes queued so far (tests, the idle check)."""
        if self._last is not None:
            self._last.result(timeout=timeout)


__all__ = ["DeletingFileStorage", "EXTRA_CONFIG", "L3Deleter"]
