"""Start a real SGLang 0.5.23 server on CPU with a tiny random-weight model (tests, demo, benchmarks).

Only the standard library is imported here; the server runs in its own process group so that
:meth:`CpuServer.stop` (also run on context exit, including on errors) leaves no orphan processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

#: Flags that make SGLang 0.5.23 serve on a CPU-only machine (see docs/cpu-sglang-recipe in shared docs).
CPU_FLAGS = (
    "--device", "cpu", "--load-format", "dummy", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--disable-cuda-graph", "--dtype", "float32",
    "--mem-fraction-static", "0.05",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS,
               "--context-length", str(self.context_length), "--max-total-tokens", str(self.max_total_tokens),
               "--max-running-requests", "8", "--log-level", "info"]
        if self.backend:
            cmd += ["--radix-cache-backend", self.backend]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 240.0) -> "CpuServer":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), env=cpu_env() | self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} during start-up; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang server not healthy after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """Terminate the whole process group (server, scheduler, detokenizer); kill it if it lingers."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children may outlive the leader for a moment; make sure the group is gone.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self) -> "CpuServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- small JSON client (standard library only) ----

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                timeout: float = 120.0) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, _json_or_text(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, _json_or_text(err.read(), key="error")

    def stream_generate(self, body: dict, timeout: float = 300.0) -> tuple[int, float | None, dict]:
        """``/generate`` with ``stream: true``: returns the status, the seconds until the first chunk (the
        time to first token) and the last chunk (cumulative ``output_ids`` and ``meta_info``)."""
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body | {"stream": True}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
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

    def generate(self, body: dict, **kw) -> dict:
        status, out = self.request("POST", "/generate", body, **kw)
        if status != 200:
            raise RuntimeError(f"/generate returned {status}: {out}")
        return out
