"""``sgl-agentcache demo`` killed by a signal leaves nothing behind: no process of its SGLang server's group
and no temporary file or directory (its own and the server's), whether the signal comes while the server
starts or while the agent program talks to it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from sgl_agentcache.cpu_server import free_port, group_alive

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server


class Demo:
    """``sgl-agentcache demo --port PORT`` in its own session, with a private TMPDIR, output collected."""

    def __init__(self, port: int, tmpdir: str):
        env = dict(os.environ, TMPDIR=tmpdir, SGLANG_USE_CPU_ENGINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "sgl_agentcache.cli", "demo", "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"demo exited ({self.proc.returncode}) before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s:\n{self.output()}"
            time.sleep(0.05)

    def server(self) -> psutil.Process | None:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "sglang.launch_server" in child.cmdline():
                    return child
            except psutil.NoSuchProcess:
                continue
        return None


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("phase", ["starting", "serving"])
def test_sigterm_stops_the_server_group_and_removes_temporary_files(phase):
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="acd-")  # short, like /tmp: SGLang's socket paths live under it
    demo = Demo(port, tmpdir)
    pgid = None
    try:
        if phase == "starting":
            # The server process exists but is not healthy yet (it takes tens of seconds on CPU).
            demo.wait_for(lambda: demo.server() is not None, "SGLang server process")
        else:
            # The demo has found the server healthy and runs its agent program. Freeze the server so
            # the program cannot finish before the signal lands; it resumes right after.
            demo.wait_for(lambda: "server up" in demo.output(), "'server up' line")  # printed once /health is 200
        server = demo.server()
        pgid = os.getpgid(server.pid)
        members = [server, *server.children(recursive=True)]
        assert pgid != os.getpgid(demo.proc.pid)  # the server has a group of its own
        if phase == "serving":
            os.killpg(pgid, signal.SIGSTOP)
        demo.proc.send_signal(signal.SIGTERM)
        if phase == "serving":
            time.sleep(0.5)
            os.killpg(pgid, signal.SIGCONT)
        rc = demo.proc.wait(timeout=90)
        demo._reader.join(timeout=10)

        assert rc == 128 + signal.SIGTERM, demo.output()
        assert "demo: got SIGTERM: stopping the server" in demo.output()
        assert not group_alive(pgid)
        assert not [p.pid for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not healthy(port)
        assert os.listdir(tmpdir) == []  # the demo's model/log directory and the server's IPC files
    finally:  # after a failure: kill the server's group too (the demo is its parent only while it lives)
        if demo.proc.poll() is None:
            server = demo.server()
            if pgid is None and server is not None:
                try:
                    pgid = os.getpgid(server.pid)
                except ProcessLookupError:
                    pass
            demo.proc.kill()
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)
