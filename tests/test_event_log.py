"""The JSONL event and audit logs never block the caller (issue #22, item 16): ``emit`` runs on the HTTP
server's event loop, so a slow or stuck file must cost it nothing. A FIFO nobody reads is the stuck
file: opening it for writing blocks until a reader comes."""

from __future__ import annotations

import json
import os
import threading
import time

from sgl_agentcache.server.front.event_log import EventLog


def _emit_in_thread(log: EventLog, n: int) -> threading.Thread:
    thread = threading.Thread(target=lambda: [log.emit("tool_wait", {"session": f"s{i}"}, i=i) for i in range(n)],
                              daemon=True)
    thread.start()
    thread.join(2.0)
    return thread


def test_emit_never_blocks_on_a_stuck_file_and_drops_past_its_queue(tmp_path):
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    log = EventLog(str(fifo), max_queued=100)
    started = time.monotonic()
    assert not _emit_in_thread(log, 1000).is_alive(), "emit blocked on a file nobody reads"
    assert time.monotonic() - started < 2.0
    # The writer holds one batch (blocked opening the FIFO), the queue 100 more; the rest were dropped.
    assert log.written + log.dropped == 1000 and 100 <= log.written <= 100 + 256
    with open(fifo, encoding="utf-8") as reader:  # a reader comes: what was accepted is written, in order
        assert log.flush(10.0)
        lines = []
        while len(lines) < log.written:
            lines.extend(reader.readline() for _ in range(log.written - len(lines)))
    records = [json.loads(line) for line in lines]
    order = [r["i"] for r in records]
    # Accepted records are the writer's first batch plus whatever the queue held when emit stopped
    # dropping: not contiguous (which ones were dropped depends on thread timing), but in emit order.
    assert len(order) == log.written and order[0] == 0 and order == sorted(set(order))
    assert all(r["state"] == "tool_wait" and "ts" in r for r in records)


def test_records_are_appended_in_order_and_counted(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = EventLog(str(path), kind_key="event")
    for i in range(500):
        log.emit("rejected", {"tenant": "acme"}, i=i)
    assert log.flush(10.0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["i"] for r in records] == list(range(500)) and records[0]["event"] == "rejected"
    assert (log.written, log.dropped, log.failed) == (500, 0, 0)
    EventLog(None).emit("x", {})  # no path: a no-op


def test_a_failing_write_is_counted_and_the_writer_keeps_going(tmp_path):
    log = EventLog(str(tmp_path / "missing-dir" / "events.jsonl"))
    log.emit("decode", {"session": "s"})
    assert log.flush(5.0) and log.failed == 1
    (tmp_path / "missing-dir").mkdir()
    log.emit("decode", {"session": "s"})
    assert log.flush(5.0) and log.failed == 1
    assert len((tmp_path / "missing-dir" / "events.jsonl").read_text().splitlines()) == 1
