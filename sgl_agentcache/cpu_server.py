"""Start a real SGLang 0.5.23 server on CPU with a tiny random-weight model (tests, demo, benchmarks).

Only the standard library is imported here; the server runs in its own process group so that
:meth:`CpuServer.stop` (also run on context exit, including on errors and on an interrupted start-up)
leaves no orphan processes. A command that must also clean up when it is killed wraps its work in
:func:`exit_on_signals`, which turns SIGTERM/SIGINT/SIGHUP into an ordinary exit that runs that clean-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

#: Flags that make SGLang 0.5.23 serve on a CPU-only machine: torch-native attention and sampling, no CUDA
#: graphs, float32, and dummy weights (tiny random-weight models; nothing is downloaded).
CPU_FLAGS = (
    "--device", "cpu", "--load-format", "dummy", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--disable-cuda-graph", "--dtype", "float32",
    "--mem-fraction-static", "0.05",
    # An idle scheduler otherwise busy-polls a core: a few servers alive at once (a test session's
    # shared server plus a module's own) starve a 2-core machine. This parks it on its sockets
    # (zmq poll, woken by any request), so nothing waits longer.
    "--sleep-on-idle",
)
#: The same server on a CUDA GPU (``CpuServer(gpu=True)``, ``bench/gpu/hicache_lifecycle.sh``): random
#: weights, SGLang's default attention, sampling and CUDA graphs; the pool is still capped by
#: ``--max-total-tokens``, so every compared backend gets the same one.
GPU_FLAGS = ("--load-format", "dummy", "--mem-fraction-static", "0.6")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could bind ``127.0.0.1:port`` now (a check, not a reservation)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is not "in use"
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not count).

    Reads ``/proc`` where there is one; elsewhere any member, zombies included, counts.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its ')'.
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # the process exited while we looked
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


class Terminated(SystemExit):
    """Raised in the main thread by :func:`exit_on_signals` on SIGTERM, SIGINT or SIGHUP."""


#: While a :func:`signals_deferred` block runs: the signals :func:`exit_on_signals` held back (else None).
_DEFERRED: list[int] | None = None


@contextlib.contextmanager
def signals_deferred():
    """Hold :func:`exit_on_signals`' :class:`Terminated` back while the block runs and raise it when the
    block ends. For steps an exception must not cut in two: raised between a child's fork and
    ``Popen``'s return, it leaves a started server no one holds (``CpuServer.start`` has no ``proc`` to
    stop; the demo's SIGTERM test caught one alive after the demo had exited). Only the main thread
    defers (signal handlers run there); elsewhere the block runs as it is."""
    global _DEFERRED
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _DEFERRED
    if outer is None:
        _DEFERRED = []
    try:
        yield
    finally:
        held = _DEFERRED
        _DEFERRED = outer
    if outer is None and held:
        raise Terminated(128 + held[0])


@contextlib.contextmanager
def exit_on_signals(announce=None):
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Terminated` (exit status 128 + signal).

    By default SIGTERM and SIGHUP kill the process without running ``finally`` blocks or context exits,
    which would leave a :class:`CpuServer` (its own process group, which a terminal's Ctrl-C does not
    reach either) and temporary directories behind. After the first signal the three are ignored, so
    that the clean-up itself is not cut short by a second one.
    ``announce(signum)`` is called first, e.g. to print what is being cleaned up. Previous handlers are
    restored on exit. Outside the main thread (where Python cannot set handlers) it does nothing.
    """
    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        for sig in signums:
            signal.signal(sig, signal.SIG_IGN)
        if announce is not None:
            announce(signum)
        if _DEFERRED is not None:  # inside signals_deferred: raised when that block ends
            _DEFERRED.append(signum)
            return
        raise Terminated(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in signums}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_process_group(proc: subprocess.Popen, term_wait_s: float = 20.0) -> None:
    """Stop ``proc``'s whole process group (started with ``start_new_session``): SIGTERM, SIGKILL if it
    lingers, then SIGKILL any child that outlives the leader. Returns once the group is gone (or 10 s
    after trying)."""
    for sig, wait in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # Children may outlive the leader for a moment; make sure the group is gone before returning.
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.05)


def cpu_env() -> dict[str, str]:
    """Environment for SGLang processes on CPU (``SGLANG_USE_CPU_ENGINE=1`` is mandatory there)."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def _json_or_text(payload: bytes, key: str = "text") -> dict:
    """A JSON object body, or a plain-text one wrapped as ``{key: text}`` (some SGLang routes reply text)."""
    try:
        return json.loads(payload or b"{}")
    except ValueError:
        return {key: payload.decode(errors="replace")}


#: Relaunches of a server whose HTTP port was taken while it started (see :meth:`CpuServer.start`).
BIND_RETRIES = 2


class PortTaken(RuntimeError):
    """The server's HTTP port was taken before it could bind it (by one of its own internal ports, or
    another process): this launch cannot come up."""


@dataclass
class CpuServer:
    """A running ``python -m sglang.launch_server`` process on 127.0.0.1."""

    model_path: str
    port: int = field(default_factory=free_port)
    backend: str | None = "agentcache"
    max_total_tokens: int = 4096
    context_length: int = 1024
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    #: The server's own TMPDIR (SGLang leaves its IPC socket files there); removed by :meth:`stop`.
    scratch_dir: str | None = field(default=None, repr=False)
    #: On a CUDA GPU instead (GPU_FLAGS, no CPU engine): for ``bench/gpu/``; tests never set it.
    gpu: bool = False
    #: Servers started and not yet stopped in this process (a failing test reports their logs).
    running: ClassVar[dict[int, "CpuServer"]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port), *(GPU_FLAGS if self.gpu else CPU_FLAGS),
               "--context-length", str(self.context_length), "--max-total-tokens", str(self.max_total_tokens),
               "--max-running-requests", "8", "--log-level", "info"]
        if self.backend:
            cmd += ["--radix-cache-backend", self.backend]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 480.0) -> "CpuServer":
        """Launch the server and wait until ``/health`` answers 200.

        SGLang picks its internal ports at random before its HTTP server binds ``port``, so one of them
        can take that port (its log then says the bind failed, and the process lingers): the launch is
        stopped and retried on the same port (the URL others already hold), up to
        :data:`BIND_RETRIES` times. Needs ``log_path`` to see it.

        On any failure or interruption while waiting (including :class:`Terminated` or
        ``KeyboardInterrupt``) the process group is stopped before the exception propagates: a ``with``
        block whose ``__enter__`` raises never runs ``__exit__``.
        """
        for _ in range(BIND_RETRIES):
            try:
                return self._launch(timeout)
            except PortTaken:
                deadline = time.monotonic() + 30
                while not port_is_free(self.port) and time.monotonic() < deadline:
                    time.sleep(0.5)
        return self._launch(timeout)

    def _launch(self, timeout: float) -> "CpuServer":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.scratch_dir = tempfile.mkdtemp(prefix="sglang-")  # short: ZMQ socket paths must fit 107 bytes
        try:
            with signals_deferred():  # a signal raised inside Popen would orphan the started group
                try:
                    base = dict(os.environ) if self.gpu else cpu_env()
                    self.proc = subprocess.Popen(self.command(), env=base | {"TMPDIR": self.scratch_dir} | self.env,
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                finally:
                    if log is not subprocess.DEVNULL:
                        log.close()  # the child holds its own copy of the descriptor
                CpuServer.running[id(self)] = self
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _port_taken(self) -> bool:
        """Whether the server's log says its HTTP server could not bind ``port``."""
        return f"error while attempting to bind on address ('127.0.0.1', {self.port})" in self.log_tail(40)

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server's log ("" without a log file)."""
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 64 * 1024, 0))
            text = f.read().decode(errors="replace")
        return "\n".join(line[:300] for line in text.splitlines()[-lines:])

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The tail goes into the error: a CI run keeps the test's output, not its temporary log.
                tail = self.log_tail(25)
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} during start-up; "
                                   f"see {self.log_path}; its last lines:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                if self._port_taken():
                    raise PortTaken(f"127.0.0.1:{self.port} was taken before SGLang bound it; see {self.log_path}")
            time.sleep(0.5)
        raise TimeoutError(f"SGLang server not healthy after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """Terminate the whole process group (server, scheduler, detokenizer), killing it if it lingers,
        then remove the server's scratch directory."""
        CpuServer.running.pop(id(self), None)
        if self.proc is not None:
            stop_process_group(self.proc, term_wait_s=20)
            self.proc = None
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.scratch_dir = None

    def __enter__(self) -> "CpuServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- small JSON client (standard library only) ----

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                timeout: float = 120.0) -> tuple[int, dict]:
        return json_request(self.url, method, path, body, headers, timeout)

    def stream_generate(self, body: dict, timeout: float = 300.0, headers: dict | None = None
                        ) -> tuple[int, float | None, dict]:
        """``/generate`` with ``stream: true``: see :func:`stream_generate`."""
        return stream_generate(self.url, body, timeout, headers)

    def generate(self, body: dict, **kw) -> dict:
        status, out = self.request("POST", "/generate", body, **kw)
        if status != 200:
            raise RuntimeError(f"/generate returned {status}: {out}")
        return out


def json_request(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                 timeout: float = 120.0) -> tuple[int, dict]:
    """One JSON call to ``url + path``: the status and the decoded body (a text body is wrapped as
    ``{"text": ...}``, or ``{"error": ...}`` with an error status). Raises ``OSError`` (``URLError``,
    a timeout) when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _json_or_text(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _json_or_text(err.read(), key="error")


def stream_generate(url: str, body: dict, timeout: float = 300.0, headers: dict | None = None
                    ) -> tuple[int, float | None, dict]:
    """``POST {url}/generate`` with ``stream: true`` (a server, or a router in front of servers): returns
    the status, the seconds until the first chunk (the time to first token) and the last chunk
    (cumulative ``output_ids`` and ``meta_info``)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body | {"stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json", **(headers or {})})
    sent, first, last = time.monotonic(), None, {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if first is None:
                    first = time.monotonic() - sent
                last = _json_or_text(line[6:].strip(), key="error")
                if "error" in last:  # an error event inside the 200 stream
                    return 500, first, last
            return resp.status, first, last
    except urllib.error.HTTPError as err:
        return err.code, None, _json_or_text(err.read(), key="error")
