"""Probe what SGLang's router passes to agentcache workers (issue #21; findings in docs/scale-out.md).

Starts two CPU workers with the ``agentcache`` backend (tiny random-weight model) and the router
(``python -m sglang_router.launch_router --policy manual``), sends keyed sessions through it with
lifecycle hints in the ``/generate`` body and in our header, then prints, per worker, the prefix
hits of each prefill (affinity: a session's later turns hit its first turn) and the resident tokens
by class (a hint that arrived tags tokens; none did through sglang-router 0.3.2), and what our
routes answer through the router.

The router is not a dependency of this project: install it where this script can import it, e.g.
``pip install --target /tmp/sr sglang-router==0.3.2`` and run
``ROUTER_PYTHONPATH=/tmp/sr .venv/bin/python tools/router_probe.py``. Takes about two minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sgl_agentcache.cpu_server import CpuServer, free_port
from sgl_agentcache.hints import HINT_HEADER, lifecycle_envelope
from sgl_agentcache.tiny_model import make_tiny_model


def _call(url: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait(predicate, seconds: float = 120.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except OSError:
            pass
        time.sleep(1)
    return False


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="router-probe-"))
    model = make_tiny_model(work / "model")
    workers = [CpuServer(str(model.path), log_path=work / f"worker{i}.log", max_total_tokens=2048,
                         context_length=1024) for i in range(2)]
    router = None
    try:
        for worker in workers:
            worker.start()
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.environ.get("ROUTER_PYTHONPATH", ""))
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[w.url for w in workers],
             "--policy", "manual", "--assignment-mode", "min_group", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=open(work / "router.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        if not _wait(lambda: '"total":2' in _call(url, "/workers")[1]):
            print(f"the router did not register both workers; see {work / 'router.log'}")
            return 1
        for mode in ("body", "header"):
            for session in ("a", "b", "c", "d"):
                for turn in range(3):
                    hint = {"session": mode + session, "branch": "main", "stable_prefix_tokens": 8}
                    body = {"input_ids": list(range(3, 40)) + [40 + ord(session)] * 5,
                            "sampling_params": {"max_new_tokens": 2}}
                    headers = {"x-smg-routing-key": f"ns/{mode}{session}"}
                    if mode == "body":
                        body["kv_hints"] = lifecycle_envelope(hint, message_id=f"{mode}{session}{turn}")
                    else:
                        headers[HINT_HEADER] = json.dumps(hint)
                    status, text = _call(url, "/generate", body, headers)
                    if status != 200:
                        print(f"/generate through the router: {status} {text[:200]}")
                        return 1
        for i, worker in enumerate(workers):
            hits = re.findall(r"#new-token: (\d+), #cached-token: (\d+)", (work / f"worker{i}.log").read_text(errors="replace"))
            stats = json.loads(_call(worker.url, "/agentcache/stats")[1])
            print(f"worker {i}: prefills (new, cached) {hits}")
            print(f"worker {i}: resident tokens by class {stats['resident_tokens']}")
        for path, body in (("/agentcache/stats", None), ("/agentcache/branch/close", {"session": "bodya", "branch": "main"})):
            print(f"{path} through the router: {_call(url, path, body)[0]}")
        return 0
    finally:
        if router is not None:
            os.killpg(router.pid, 15)
            router.wait(timeout=30)
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    sys.exit(main())
