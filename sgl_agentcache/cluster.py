"""Our ``/agentcache/*`` routes across many workers behind SGLang's router (fan-out; standard library HTTP).

The router proxies generation routes only (``/agentcache/*`` through it is a 404), and which worker it
pinned a session to is its own state. So a route goes to every worker, in parallel, and the answers
are combined; this never picks a worker for a generation request (that stays the router's job):

- ``stats``: every worker's figures, and their sum (every number, at any depth; branch lists joined,
  each branch tagged with its worker);
- ``branch/close``, ``session/close``, ``admin/purge``: done when the worker holding the branch closed
  it, and also when no reachable worker knows it (never seen, or its worker is gone and its state with
  it): a close is idempotent, a dead worker's sessions need none;
- ``pause``, ``resume``, ``prefetch``: the answer of the worker holding the branch (200), else 404;
- any other 4xx is the caller's error and is returned as it is (every worker runs the same tenants
  file and secret, so they agree); a worker that does not answer is listed under ``unreachable``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from sgl_agentcache.cpu_server import json_request

__all__ = ["CLOSE_ROUTES", "Cluster", "ClusterError", "sum_stats"]

#: Routes whose "nobody knows this branch" answer is success (idempotent closes).
CLOSE_ROUTES = frozenset({"/agentcache/branch/close", "/agentcache/session/close", "/agentcache/admin/purge"})
#: Routes answered by the one worker that holds the branch.
HOLDER_ROUTES = frozenset({"/agentcache/pause", "/agentcache/resume", "/agentcache/prefetch"})


class ClusterError(RuntimeError):
    """The cluster could not be reached or listed (no worker, or the router's list failed)."""


class Reply(NamedTuple):
    """One worker's answer: its HTTP status and JSON body, or status 0 and the error when unreachable."""

    worker: str
    status: int
    body: Any


class Cluster:
    """The agentcache routes of a set of workers (their base URLs)."""

    def __init__(self, workers: list[str], *, headers: dict[str, str] | None = None, timeout: float = 30.0):
        if not workers:
            raise ClusterError("no workers to talk to")
        self.workers = [w.rstrip("/") for w in workers]
        self.headers = dict(headers or {})  # e.g. authorization: the same credential is valid on every worker
        self.timeout = timeout

    @classmethod
    def from_router(cls, router: str, *, headers: dict[str, str] | None = None, timeout: float = 30.0) -> "Cluster":
        """The workers the router lists (``GET /workers``), healthy or not: an unhealthy one is reported
        unreachable by the calls that cannot reach it."""
        try:
            status, listing = json_request(router.rstrip("/"), "GET", "/workers", None, headers, timeout)
        except OSError as exc:
            raise ClusterError(f"the router at {router} did not answer: {exc}") from None
        if status != 200 or not isinstance(listing, dict):
            raise ClusterError(f"the router at {router} answered {status} to GET /workers: {listing}")
        return cls([w["url"] for w in listing.get("workers", []) if w.get("url")], headers=headers, timeout=timeout)

    def _all(self, method: str, path: str, body: dict | None = None) -> list[Reply]:
        def one(worker: str) -> Reply:
            try:
                return Reply(worker, *json_request(worker, method, path, body, self.headers, self.timeout))
            except OSError as exc:
                return Reply(worker, 0, {"error": f"{type(exc).__name__}: {exc}"})

        with ThreadPoolExecutor(max_workers=min(16, len(self.workers))) as pool:
            return list(pool.map(one, self.workers))

    def stats(self) -> dict:
        """Every worker's ``/agentcache/stats``, their sum, and the workers that did not answer."""
        replies = self._all("GET", "/agentcache/stats")
        answered = {r.worker: r.body for r in replies if r.status == 200}
        return {"total": sum_stats(answered), "workers": answered,
                "unreachable": {r.worker: r.body for r in replies if r.status != 200}}

    def call(self, path: str, body: dict) -> tuple[int, dict]:
        """POST a route to every worker; (status, combined answer) by the rules of the module docstring."""
        if path not in CLOSE_ROUTES | HOLDER_ROUTES:
            raise ClusterError(f"{path} is not a route the fan-out combines (one of: "
                               f"{', '.join(sorted(CLOSE_ROUTES | HOLDER_ROUTES))})")
        replies = self._all("POST", path, body)
        statuses = {r.worker: r.status for r in replies}
        unreachable = [r.worker for r in replies if r.status == 0]
        ok = [r for r in replies if r.status == 200]
        refused = [r for r in replies if r.status not in (0, 200, 404)]
        if refused:  # the caller's error (4xx) or a worker's failure (5xx): say it as the worker did
            first = refused[0]
            return first.status, {**_as_dict(first.body), "worker": first.worker, "statuses": statuses}
        if ok:
            return 200, {**_as_dict(ok[0].body), "worker": ok[0].worker, "statuses": statuses,
                         **({"also": [r.worker for r in ok[1:]]} if len(ok) > 1 else {})}
        if len(unreachable) == len(replies):
            return 502, {"error": "no worker answered", "statuses": statuses,
                         "unreachable": {r.worker: r.body for r in replies}}
        if path in CLOSE_ROUTES:
            return 200, {"closed": False, "statuses": statuses, "unreachable": unreachable,
                         "note": "no reachable worker holds it: never seen, or its worker is gone with its state"}
        return 404, {"error": "no reachable worker holds this branch", "statuses": statuses,
                     "unreachable": unreachable}


def _as_dict(body: Any) -> dict:
    return body if isinstance(body, dict) else {"body": body}


def sum_stats(per_worker: dict[str, dict]) -> dict:
    """The sum of the workers' stats: numbers add up at any depth (booleans and strings are not
    summed: the first worker's value is kept), lists are joined with each dict item tagged
    ``worker``, keys missing on some workers count as zero there."""
    total: dict = {}
    for worker, stats in per_worker.items():
        _add(total, stats, worker)
    return total


def _add(total: dict, stats: dict, worker: str) -> None:
    for key, value in stats.items():
        if isinstance(value, bool) or value is None or isinstance(value, str):
            total.setdefault(key, value)
        elif isinstance(value, (int, float)):
            prior = total.get(key, 0)
            total[key] = prior + value if isinstance(prior, (int, float)) and not isinstance(prior, bool) else prior
        elif isinstance(value, dict):
            inner = total.setdefault(key, {})
            if isinstance(inner, dict):
                _add(inner, value, worker)
        elif isinstance(value, list):
            joined = total.setdefault(key, [])
            if isinstance(joined, list):
                joined.extend({**item, "worker": worker} if isinstance(item, dict) else item for item in value)
