"""The fan-out's combining rules (sgl_agentcache.cluster), over real HTTP against scripted workers.

The workers here are tiny stdlib HTTP servers that answer each route with a set status, so every
combination (holder / nobody / refused / dead) can be produced; real agentcache workers behind the
real router are in tests/test_router_server.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_agentcache.cluster import Cluster, ClusterError, sum_stats
from sgl_agentcache.cpu_server import free_port


class _Scripted:
    """A worker answering POSTs with ``status`` (and a body naming itself), GET stats with ``stats``."""

    def __init__(self, status: int, stats: dict | None = None):
        self.status, self.stats, self.seen = status, stats or {}, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.seen.append(("GET", self.path, self.headers.get("Authorization")))
                self._reply(200, outer.stats)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append(("POST", self.path, body))
                self._reply(outer.status, {"closed": True, "freed_tokens": 5} if outer.status == 200
                            else {"error": f"status {outer.status}"})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(status: int, stats: dict | None = None) -> _Scripted:
        made.append(_Scripted(status, stats))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


DEAD = "http://127.0.0.1:9"  # discard port: nothing listens


def test_the_holders_answer_wins_and_every_worker_is_asked(scripted):
    holder, other = scripted(200), scripted(404)
    cluster = Cluster([other.url, holder.url], headers={"Authorization": "Bearer k"})
    status, reply = cluster.call("/agentcache/branch/close", {"session": "s", "branch": "b"})
    assert status == 200 and reply["worker"] == holder.url and reply["freed_tokens"] == 5
    assert reply["statuses"] == {other.url: 404, holder.url: 200}
    assert other.seen == holder.seen == [("POST", "/agentcache/branch/close", {"session": "s", "branch": "b"})]


def test_closes_are_idempotent_without_a_holder_and_pauses_are_not(scripted):
    a, b = scripted(404), scripted(404)
    status, reply = Cluster([a.url, b.url, DEAD]).call("/agentcache/session/close", {"session": "s"})
    assert status == 200 and reply["closed"] is False and reply["unreachable"] == [DEAD]
    status, reply = Cluster([a.url, DEAD]).call("/agentcache/pause", {"session": "s"})
    assert status == 404 and reply["statuses"] == {a.url: 404, DEAD: 0}


def test_a_refusal_is_returned_as_the_worker_said_it_and_nobody_answering_is_502(scripted):
    refused, holder = scripted(403), scripted(200)
    status, reply = Cluster([holder.url, refused.url]).call("/agentcache/resume", {"session": "s"})
    assert status == 403 and reply["worker"] == refused.url and reply["error"] == "status 403"
    status, reply = Cluster([DEAD]).call("/agentcache/branch/close", {"session": "s"})
    assert status == 502 and DEAD in reply["unreachable"]
    with pytest.raises(ClusterError, match="not a route"):
        Cluster([DEAD]).call("/agentcache/check", {})
    with pytest.raises(ClusterError, match="no workers"):
        Cluster([])


def test_stats_sum_every_number_join_branch_lists_and_report_the_dead(scripted):
    a = scripted(200, {"backend": "agentcache", "resident_tokens": {"session": 10, "stable": 2}, "evictions": 3,
                       "branches": [{"session": "s1", "owned_tokens": 10}], "tenancy": False})
    b = scripted(200, {"backend": "agentcache", "resident_tokens": {"session": 5, "scratch": 7}, "evictions": 1,
                       "branches": [{"session": "s2", "owned_tokens": 5}], "tenancy": False})
    stats = Cluster([a.url, b.url, DEAD], headers={"Authorization": "Bearer op"}).stats()
    total = stats["total"]
    assert total["resident_tokens"] == {"session": 15, "stable": 2, "scratch": 7} and total["evictions"] == 4
    assert total["backend"] == "agentcache" and total["tenancy"] is False
    assert total["branches"] == [{"session": "s1", "owned_tokens": 10, "worker": a.url},
                                 {"session": "s2", "owned_tokens": 5, "worker": b.url}]
    assert set(stats["workers"]) == {a.url, b.url} and set(stats["unreachable"]) == {DEAD}
    assert a.seen == [("GET", "/agentcache/stats", "Bearer op")]
    assert sum_stats({}) == {}


def test_the_router_lists_the_workers(scripted):
    router = scripted(200, {"workers": [{"url": "http://w0:1", "is_healthy": True},
                                        {"url": "http://w1:1", "is_healthy": False}], "total": 2})
    assert Cluster.from_router(router.url).workers == ["http://w0:1", "http://w1:1"]
    with pytest.raises(ClusterError, match="did not answer"):
        Cluster.from_router(DEAD)


def test_the_cluster_command(scripted, capsys):
    from sgl_agentcache.cli import main

    holder, other = scripted(200, {"evictions": 2}), scripted(404, {"evictions": 3})
    assert main(["cluster", "--worker", holder.url, "--worker", other.url, "call", "branch/close",
                 '{"session": "s", "branch": "b"}']) == 0
    assert json.loads(capsys.readouterr().out)["worker"] == holder.url
    assert main(["cluster", "--worker", holder.url, "--worker", other.url, "--api-key", "k", "stats"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == {"evictions": 5}
    assert holder.seen[-1] == ("GET", "/agentcache/stats", "Bearer k")
    assert main(["cluster", "--worker", other.url, "call", "pause", '{"session": "s"}']) == 1  # nobody holds it
    capsys.readouterr()
    assert main(["cluster", "--worker", holder.url, "call", "pause", "{not json"]) == 2
    assert "BODY is not JSON" in capsys.readouterr().err
    assert main(["cluster", "--worker", DEAD, "stats"]) == 1
