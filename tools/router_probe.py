"""Probe what SGLang's router passes to agentcache workers (issue #21; findings in docs/scale-out.md).

Starts two CPU workers with the ``agentcache`` backend (tiny random-weight model) and the router
(``sgl_agentcache.router_process``: ``--policy manual --assignment-mode min_group``), sends keyed
sessions through it with the lifecycle hint carried three ways -- a ``kv_hints`` envelope in the
``/generate`` body, our ``x-sgl-agentcache-hint`` header, a ``tracestate`` member
(``gateway.gateway_headers``) -- then prints, per worker, the prefix hits of each prefill (affinity: a
session's later turns hit its first turn), the resident tokens of each session (a hint that arrived
tags its tokens as the session's; one that did not leaves them untagged) and what our routes answer
through the router. On sglang-router 0.3.2 only the tracestate carrier arrives.

The router comes with the test extra (``sglang-router==0.3.2``); elsewhere install it where this
script can import it (``pip install --target /tmp/sr sglang-router`` and ``ROUTER_PYTHONPATH=/tmp/sr``).
Run ``.venv/bin/python tools/router_probe.py``. Takes about two minutes.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from sgl_agentcache.cpu_server import CpuServer
from sgl_agentcache.gateway import gateway_headers, routing_key
from sgl_agentcache.hints import HINT_HEADER, lifecycle_envelope
from sgl_agentcache.router_process import RouterProcess
from sgl_agentcache.tiny_model import make_tiny_model

MODES = ("body", "header", "tracestate")


def _send(router: RouterProcess, mode: str, session: str, turn: int) -> int:
    hint = {"session": mode + session, "branch": "main", "stable_prefix_tokens": 8}
    body = {"input_ids": list(range(3, 40)) + [40 + ord(session)] * 5, "sampling_params": {"max_new_tokens": 2}}
    headers = {"x-smg-routing-key": routing_key(hint["session"])}
    if mode == "body":
        body["kv_hints"] = lifecycle_envelope(hint, message_id=f"{mode}{session}{turn}")
    elif mode == "header":
        headers[HINT_HEADER] = json.dumps(hint)
    else:
        headers = gateway_headers(hint)
    status, reply = router.request("POST", "/generate", body, headers)
    if status != 200:
        print(f"/generate through the router ({mode}): {status} {reply}")
    return status


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="router-probe-"))
    model = make_tiny_model(work / "model")
    workers = [CpuServer(str(model.path), log_path=work / f"worker{i}.log", max_total_tokens=2048,
                         context_length=1024) for i in range(2)]
    router = RouterProcess([w.url for w in workers], log_path=work / "router.log")
    try:
        for worker in workers:
            worker.start()
        router.start()
        for mode in MODES:
            for session in "abcd":
                for turn in range(3):
                    if _send(router, mode, session, turn) != 200:
                        return 1
        for i, worker in enumerate(workers):
            hits = re.findall(r"#new-token: (\d+), #cached-token: (\d+)",
                              (work / f"worker{i}.log").read_text(errors="replace"))
            stats = worker.request("GET", "/agentcache/stats")[1]
            owned = {b["session"]: b["owned_tokens"] for b in stats["branches"]}
            print(f"worker {i}: prefills (new, cached) {hits}")
            print(f"worker {i}: resident tokens by class {stats['resident_tokens']}")
            for mode in MODES:
                print(f"worker {i}: {mode:10s} sessions tagged: {sorted(s for s in owned if s.startswith(mode))}")
        for path, body in (("/agentcache/stats", None), ("/agentcache/branch/close", {"session": "bodya"})):
            print(f"{path} through the router: {router.request('POST' if body else 'GET', path, body)[0]}")
        return 0
    finally:
        router.stop()
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    sys.exit(main())
