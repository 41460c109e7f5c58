"""An L3 store the lifecycle can delete from: SGLang's ``file`` HiCache storage plus per-page deletes.

SGLang 0.5.23's storage API (``HiCacheStorage``) has get / set / exists and ``clear()`` (everything),
but no per-key delete, so a closed branch's or a purged tenant's pages would stay in L3 until the
store's own LRU eviction. :class:`DeletingFileStorage` is SGLang's ``HiCacheFile`` -- the same files,
keys and directory (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), so it reads a store the stock ``file``
backend wrote -- plus :meth:`DeletingFileStorage.delete_keys`. Start SGLang with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "agentcache_file", "module_path": "sgl_agentcache.server.scheduler.l3_store",
        "class_name": "DeletingFileStorage"}'

With any other backend the lifecycle still deletes on the device and in the host pool, and counts the
L3 pages it could not delete (``/agentcache/stats`` ``hicache.deleted.l3_pages_left``).

The cache calls :meth:`L3Deleter.delete` on the scheduler thread; the disk work runs on one worker
thread of its own, so a purge never stalls a batch. File deletes are rank-local (each TP rank owns its
own files) and never feed a tree decision, so ranks cannot diverge on them.

**Purge manifest.** A page's key is a hash seeded with its ``cache_salt``, so once its node has left
the tree (evicted from host, a cache flush, a restart) nothing could find a tenant's pages to purge
them. :class:`PurgeManifest` keeps, per salt, the keys of every page written to the store for it: an
append-only file per salt in ``agentcache-manifests/`` beside the pages (named by a hash of the salt,
never the salt), so it outlives the tree and the process. A purge deletes what the manifest names and
the manifest with it (:meth:`L3Deleter.purge`). Keys of pages the store later evicted on its own are
deleted again harmlessly (a missing file is not an error).
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName

logger = logging.getLogger(__name__)

#: ``--hicache-storage-backend-extra-config`` for :class:`DeletingFileStorage` (JSON).
EXTRA_CONFIG = ('{"backend_name": "agentcache_file", "module_path": "sgl_agentcache.server.scheduler.l3_store", '
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


class PurgeManifest:
    """Per ``cache_salt``, the L3 page keys written for it (see the module docstring). Not thread-safe:
    :class:`L3Deleter` calls it from its one worker thread only."""

    DIRECTORY = "agentcache-manifests"

    def __init__(self, store_path: str, suffix: str = ""):
        """``suffix``: the store's per-rank file suffix (``HiCacheFile.tp_config_suffix``): every TP rank
        writes, and deletes, its own files of a page, so each keeps its own manifest."""
        self.root = os.path.join(store_path, self.DIRECTORY)
        self.suffix = suffix
        os.makedirs(self.root, exist_ok=True)

    def path(self, salt: str) -> str:
        """The salt's manifest file: named by a digest, so a salt never becomes a path."""
        return os.path.join(self.root, hashlib.sha256(salt.encode()).hexdigest()[:32] + self.suffix + ".pages")

    def record(self, salt: str, keys) -> None:
        """Append ``keys`` (pages written for ``salt``). Workers sharing a store append to one file: one
        ``write`` of whole lines, in append mode."""
        with open(self.path(salt), "a", encoding="ascii") as f:
            f.write("".join(f"{key}\n" for key in keys))

    def take(self, salt: str) -> list[str]:
        """Every key recorded for ``salt``, removing its manifest (none: an empty list). The file is
        renamed away before it is read, so a key another worker appends meanwhile starts a new one."""
        path = self.path(salt)
        taken = f"{path}.{os.getpid()}.taken"
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            return []
        with open(taken, encoding="ascii") as f:
            keys = [line.strip() for line in f if line.strip()]
        os.remove(taken)
        return list(dict.fromkeys(keys))


class L3Deleter:
    """Deletes pages from the cache's storage backend off the scheduler thread (one worker, in order),
    and keeps the purge manifest of a store on disk (:class:`PurgeManifest`)."""

    def __init__(self, backend):
        self.delete_keys = getattr(backend, "delete_keys", None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentcache-l3-delete") \
            if self.delete_keys is not None else None
        store_path = getattr(backend, "file_path", None)
        self.manifest = (PurgeManifest(store_path, getattr(backend, "tp_config_suffix", ""))
                         if self._pool is not None and store_path else None)
        self.counters = {"l3_pages_deleted": 0, "l3_files_removed": 0, "l3_pages_left": 0, "l3_delete_errors": 0,
                         "l3_pages_recorded": 0, "l3_pages_purged": 0}
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
        self._last = self._pool.submit(self._guarded, "deleting", self._delete, list(keys))

    def record(self, salt: str, keys: list[str]) -> None:
        """Pages written to the store for ``salt``: into its manifest (off-thread, in order with deletes)."""
        if self.manifest is None or not keys:
            return
        self.counters["l3_pages_recorded"] += len(keys)
        self._last = self._pool.submit(self._guarded, "recording", self.manifest.record, salt, list(keys))

    def purge(self, salt: str, keep=()) -> bool:
        """Delete every page the manifest names for ``salt``, in the tree or not, except ``keep`` (pages of
        nodes the purge could not free yet: they go back into the manifest). Returns whether this store
        keeps a manifest (else pages of nodes gone from the tree stay)."""
        if self.manifest is None:
            return False
        self._last = self._pool.submit(self._guarded, "purging", self._purge, salt, set(keep))
        return True

    def _purge(self, salt: str, keep: set[str]) -> None:
        keys = self.manifest.take(salt)
        doomed = [k for k in keys if k not in keep]
        if keep:
            self.manifest.record(salt, [k for k in keys if k in keep])
        self.counters["l3_pages_purged"] += len(doomed)
        self.counters["l3_files_removed"] += self.delete_keys(doomed)

    def _delete(self, keys: list[str]) -> None:
        self.counters["l3_files_removed"] += self.delete_keys(keys)

    def _guarded(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a failed delete leaves pages for the store's eviction; never fatal
            self.counters["l3_delete_errors"] += 1
            logger.exception("agentcache: %s L3 pages failed", what)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the deletes queued so far (tests, the idle check)."""
        if self._last is not None:
            self._last.result(timeout=timeout)


__all__ = ["DeletingFileStorage", "EXTRA_CONFIG", "L3Deleter", "PurgeManifest"]
