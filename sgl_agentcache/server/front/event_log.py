"""Append-only JSONL logs (the event log and the audit log) written off the HTTP event loop.

:meth:`EventLog.emit` runs on the HTTP server's event loop, inside request handlers. A file write there
(an open, a slow disk, a full NFS mount, a FIFO nobody reads) would stall every request of every tenant,
so ``emit`` only time-stamps the record and puts it on a bounded queue; one daemon thread per log encodes
and appends. When the queue is full the record is dropped and counted (``dropped``): ``emit`` never waits.
A write that fails is counted (``failed``) and logged once; the writer keeps going.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

logger = logging.getLogger(__name__)

#: Records waiting for the writer at most; past it, new records are dropped (and counted).
QUEUE_RECORDS = 10_000


class EventLog:
    """Append-only JSONL of records; a no-op without a path.

    Counters (records): ``written`` -- accepted by :meth:`emit`, appended in order by the writer (counted
    at ``emit``, so it moves with the request that caused it, never later); ``dropped`` -- refused, the
    queue was full; ``failed`` -- accepted, but the write failed.
    """

    def __init__(self, path: str | None, kind_key: str = "state", max_queued: int = QUEUE_RECORDS):
        self.path = path
        self.kind_key = kind_key
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[dict] = queue.Queue(max_queued)
        self._writer: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def emit(self, state: str, branch: dict, **fields) -> None:
        """Queue one record (never blocks; a full queue drops it)."""
        if not self.path:
            return
        if self._writer is None:
            self._start()
        try:
            self._queue.put_nowait({"ts": time.time(), self.kind_key: state, **branch, **fields})
        except queue.Full:
            self.dropped += 1
        else:
            self.written += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record is written (or ``timeout`` passes); True if drained."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _start(self) -> None:
        with self._start_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name=f"agentcache-log:{self.kind_key}", daemon=True)
                self._writer.start()

    def _run(self) -> None:
        handle = None
        while True:
            batch = [self._queue.get()]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if handle is None:
                    handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the thread's life
                handle.write("".join(json.dumps(record, default=str) + "\n" for record in batch))
                handle.flush()
            except OSError:
                if not self.failed:
                    logger.warning("agentcache: cannot write %s (records are dropped and counted)", self.path,
                                   exc_info=True)
                self.failed += len(batch)
                if handle is not None:
                    try:
                        handle.close()
                    except OSError:
                        pass
                handle = None  # reopened for the next batch
            finally:
                for _ in batch:
                    self._queue.task_done()
