"""A server whose HTTP port is taken while it starts comes up on the same port after all.

SGLang picks its internal ports at random before its HTTP server binds the one it was given, so one
of them can take that port; the bind then fails, the process lingers, and a test used to wait out the
whole start-up timeout (a CI run lost ``test_a_tenant_purge_after_a_restart...`` to it). Here a socket
of the test's holds the port until the first launch has failed to bind it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sgl_agentcache.cpu_server import CpuServer

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


def test_a_server_whose_port_is_taken_while_it_starts_is_relaunched_on_the_same_port(tiny_model, tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    srv = CpuServer(str(tiny_model.path), port=port, log_path=tmp_path / "server.log", max_total_tokens=512,
                    backend=None)
    seen = threading.Event()

    def release_once_the_bind_failed():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not srv._port_taken():
            time.sleep(0.2)
        seen.set()
        holder.close()

    releaser = threading.Thread(target=release_once_the_bind_failed, daemon=True)
    releaser.start()
    try:
        with srv.start():
            assert seen.is_set()  # the first launch did fail to bind
            assert srv.port == port and srv.url.endswith(f":{port}")
            status, _ = srv.request("GET", "/health")
            assert status == 200
    finally:
        holder.close()
        releaser.join(timeout=5)
