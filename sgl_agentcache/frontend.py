"""SGLang frontend integration: ``sgl.function`` programs whose forks carry branch identity.

Use :class:`AgentRuntimeEndpoint` instead of ``sglang.RuntimeEndpoint``::

    sgl.set_default_backend(AgentRuntimeEndpoint("http://127.0.0.1:30000", session="task-42"))

and every request the program sends carries a lifecycle hint (``kv_hints``) automatically:

- the program's own state is branch ``main`` of the session (the session defaults to a fresh id per
  program run, or the ``agent_session`` argument of the program);
- ``s.fork(n)`` commits the shared prefix as ``main``'s history, and each forked state becomes a
  branch whose parent is the state it was forked from (nested forks nest): its tokens past the shared
  prefix are charged to its own branch quota and never to the parent;
- when a fork group is joined, its branches are closed (``POST /agentcache/branch/close``), so their
  scratch is freed at once while the parent keeps its prefix. Pass ``close_on_join=False`` to keep them.

How it attaches: SGLang's ``RuntimeEndpoint`` builds each request body inside its methods and sends it
through ``sglang.lang.backend.runtime_endpoint.http_request``. :func:`install` wraps that function
once so that a request sent while one of *our* endpoint's methods runs on behalf of a stream executor
gets that executor's hint; requests from any other endpoint are untouched. It also wraps
``StreamExecutor.fork`` (to record lineage on forks of states that use our endpoint) and
``ProgramStateGroup.join`` (to close joined branches). This module never imports SGLang's server.
"""

from __future__ import annotations

import contextvars
import logging
import uuid

from sglang.lang.backend import runtime_endpoint as _rt
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.interpreter import ProgramStateGroup, StreamExecutor
from sglang.lang.ir import SglCommitLazy

from sgl_agentcache.hints import lifecycle_envelope

logger = logging.getLogger(__name__)
_current_hint: contextvars.ContextVar[dict | None] = contextvars.ContextVar("agentcache_hint", default=None)
_installed = False


def branch_identity(s: StreamExecutor, default_session: str | None) -> dict:
    """The lifecycle hint fields of a stream executor (root states are branch ``main``)."""
    ident = getattr(s, "agentcache_identity", None)
    if ident is None:
        session = default_session or str(s.arguments.get("agent_session") or uuid.uuid4().hex)
        ident = s.agentcache_identity = {"session": session, "branch": "main"}
    return ident


class AgentRuntimeEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` whose requests carry session/branch lifecycle hints."""

    def __init__(self, base_url: str, *args, session: str | None = None, close_on_join: bool = True, **kwargs):
        install()
        super().__init__(base_url, *args, **kwargs)
        self.session = session
        self.close_on_join = close_on_join

    def _with_hint(self, s: StreamExecutor, send, *args):
        token = _current_hint.set(branch_identity(s, self.session))
        try:
            return send(s, *args)
        finally:
            _current_hint.reset(token)

    def generate(self, s, sampling_params):
        return self._with_hint(s, super().generate, sampling_params)

    def generate_stream(self, s, sampling_params):
        return self._with_hint(s, super().generate_stream, sampling_params)

    def commit_lazy_operations(self, s):
        return self._with_hint(s, super().commit_lazy_operations)

    def fill_image(self, s):
        return self._with_hint(s, super().fill_image)

    def select(self, s, choices, temperature, choices_method):
        return self._with_hint(s, super().select, choices, temperature, choices_method)

    def close_branch(self, session: str, branch: str) -> bool:
        """Close one branch; False if the server never saw it (it sent no request)."""
        res = _rt.http_request(self.base_url + "/agentcache/branch/close",
                               json={"session": session, "branch": branch}, api_key=self.api_key,
                               verify=self.verify)
        if res.status_code == 404:
            return False
        self._assert_success(res)
        return True

    def close_session(self, session: str) -> None:
        res = _rt.http_request(self.base_url + "/agentcache/session/close", json={"session": session},
                               api_key=self.api_key, verify=self.verify)
        if res.status_code != 404:
            self._assert_success(res)


def _http_request_with_hint(original):
    def http_request(url, json=None, *args, **kwargs):
        hint = _current_hint.get()
        if hint is not None and json is not None and url.endswith("/generate") and "kv_hints" not in json:
            json = {**json, "kv_hints": lifecycle_envelope(hint, message_id=uuid.uuid4().hex)}
        return original(url, json, *args, **kwargs)

    http_request.agentcache_wrapped = True
    return http_request


def _fork_with_lineage(original):
    def fork(self, size=1, position_ids_offset=None):
        ours = isinstance(self.backend, AgentRuntimeEndpoint)
        if ours:
            # SGLang decides whether to commit the shared prefix from ``text_`` before it syncs the
            # worker, so a prefix still queued is never committed; sync first. It also commits only
            # for size > 1; the server must know the parent branch before a child names it, so
            # commit single forks (``copy()``) too.
            self.sync()
            if int(size) <= 1 and str(self.text_):
                self.submit(SglCommitLazy())
        children = original(self, size, position_ids_offset)
        if ours:
            parent = branch_identity(self, self.backend.session)
            for child in children:
                child.agentcache_identity = {"session": parent["session"], "branch": child.sid}
                if str(self.text_):  # an empty parent shares nothing: the child is its own root
                    child.agentcache_identity["parent_branch"] = parent["branch"]
        return children

    fork.agentcache_wrapped = True
    return fork


def _join_and_close(original):
    def join(self, mode="gather_variable"):
        result = original(self, mode)
        for state in self.states:
            s = state.stream_executor
            backend, ident = s.backend, getattr(s, "agentcache_identity", None)
            if isinstance(backend, AgentRuntimeEndpoint) and backend.close_on_join and ident is not None:
                s.sync()
                backend.close_branch(ident["session"], ident["branch"])
        return result

    join.agentcache_wrapped = True
    return join


def install() -> None:
    """Wrap the three SGLang frontend functions once (idempotent)."""
    global _installed
    if _installed:
        return
    if not getattr(_rt.http_request, "agentcache_wrapped", False):
        _rt.http_request = _http_request_with_hint(_rt.http_request)
    if not getattr(StreamExecutor.fork, "agentcache_wrapped", False):
        StreamExecutor.fork = _fork_with_lineage(StreamExecutor.fork)
    if not getattr(ProgramStateGroup.join, "agentcache_wrapped", False):
        ProgramStateGroup.join = _join_and_close(ProgramStateGroup.join)
    _installed = True
