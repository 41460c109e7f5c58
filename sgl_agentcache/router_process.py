"""Start and stop SGLang's own router (``sglang-router``, the ``smg`` gateway) in front of workers.

This launches the router the package index ships (``python -m sglang_router.launch_router``); it is not
a router of ours. Tests, ``tools/router_probe.py`` and the two-worker benchmark use it. The router is
an optional dependency (``pip install "sgl-agentcache[test]"`` brings ``sglang-router==0.3.2``);
``ROUTER_PYTHONPATH`` points at another install of it (``pip install --target DIR sglang-router``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sgl_agentcache.cpu_server import free_port, json_request, stop_process_group

__all__ = ["RouterProcess", "router_available"]

#: Runtime health checks every second, a worker unhealthy after two misses: a test sees a dead worker
#: leave the rotation in seconds (the router's defaults: 60 s and 3 misses).
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--health-check-timeout-secs", "2")
#: Retries that outlast that detection: a request sent to a worker that just died keeps retrying (backoff
#: 50 ms growing to 1 s, about 4.5 s in all) until the health check takes the worker out and the manual
#: policy re-pins its key. The router's default (5 retries, about 0.7 s) ends before a loaded machine's
#: health check has noticed, and the client sees a 500.
PATIENT_RETRIES = ("--retry-max-retries", "10", "--retry-max-backoff-ms", "1000")


def _env() -> dict[str, str]:
    extra = os.environ.get("ROUTER_PYTHONPATH")
    if not extra:
        return dict(os.environ)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [extra, os.environ.get("PYTHONPATH")])))


def router_available() -> bool:
    """Whether ``sglang_router`` can be launched from this interpreter (with ``ROUTER_PYTHONPATH``)."""
    probe = subprocess.run([sys.executable, "-c", "import sglang_router.launch_router"], env=_env(),
                           capture_output=True)
    return probe.returncode == 0


@dataclass
class RouterProcess:
    """A running router on 127.0.0.1 in front of ``workers`` (base URLs)."""

    workers: list[str]
    policy: str = "manual"
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    #: The router's Prometheus exporter (its default, 29000, would collide between two routers).
    metrics_port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *self.workers, "--policy", self.policy, *FAST_HEALTH, *PATIENT_RETRIES,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        if self.policy == "manual":  # a new session key goes to the worker holding the fewest keys
            cmd += ["--assignment-mode", "min_group"]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 120.0) -> "RouterProcess":
        """Launch the router and wait until it lists every worker as healthy (it registers them in the
        background after it starts listening). On failure the process is stopped before raising."""
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.command(), env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        try:
            self._wait_registered(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def listed(self) -> list[dict]:
        """The router's worker list (``GET /workers``)."""
        status, body = self.request("GET", "/workers")
        return body.get("workers", []) if status == 200 else []

    def _wait_registered(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                listed = self.listed()
            except OSError:
                listed = []
            if len(listed) == len(self.workers) and all(w.get("is_healthy") for w in listed):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the router did not register {len(self.workers)} healthy workers in {timeout:.0f}s; "
                           f"see {self.log_path}")

    def wait_healthy(self, count: int, timeout: float = 60.0) -> list[dict]:
        """Wait until exactly ``count`` listed workers are healthy; return the list."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = self.listed()
            if sum(bool(w.get("is_healthy")) for w in listed) == count:
                return listed
            time.sleep(0.5)
        raise TimeoutError(f"the router did not reach {count} healthy workers in {timeout:.0f}s: {self.listed()}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, term_wait_s=15)
            self.proc = None

    def __enter__(self) -> "RouterProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                timeout: float = 120.0) -> tuple[int, dict]:
        """One JSON call to the router (see :func:`~sgl_agentcache.cpu_server.json_request`)."""
        return json_request(self.url, method, path, body, headers, timeout)
