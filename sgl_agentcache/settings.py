"""Every ``AGENTCACHE_*`` setting, parsed into one typed object.

SGLang gives a plugin no flags of its own on ``sglang serve``, so the operator configures us through
the environment: field ``x`` of :class:`Settings` is read from ``AGENTCACHE_X`` (``max_pending_pauses``
from ``AGENTCACHE_MAX_PENDING_PAUSES``). :meth:`Settings.from_env` parses and checks them all at once;
each process does so once when it starts (the scheduler when it builds the cache, the HTTP front when
it builds its coordinator and hooks), and every part reads its fields from that object. A bad value
stops start-up with the variable's name and what was expected; nothing is re-read while serving.

Defaults that depend on the KV pool (quotas, pin caps, the prefetch budget) are ``None`` here and
resolved by their owner once the pool size is known.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal, Mapping

import msgspec
from msgspec import Meta

from sgl_agentcache.policy.gap_bounds import MIN_GAPS, WINDOW
from sgl_agentcache.policy.distributions import LogNormal

PREFIX = "AGENTCACHE_"

Positive = Annotated[float, Meta(gt=0)]
Count = Annotated[int, Meta(ge=1)]
Tokens = Annotated[int, Meta(ge=1)]


class SettingsError(ValueError):
    """A setting the server cannot run with (raised at start-up)."""


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The operator's settings; field ``x`` is set by ``AGENTCACHE_X`` (:func:`env_name`)."""

    # ---- the scheduler's tree ----
    branch_quota_tokens: Tokens | None = None  # forked branches (subagents); None: pool / 4
    session_quota_tokens: Tokens | None = None  # root branches (a session's history); None: the pool
    record_evictions: bool = False  # tests compare the server's deletions with the replayer's

    # ---- tool-call pauses (scheduler) ----
    pause_mode: Literal["lazy", "eager"] = "lazy"  # lazy: decisions are advice; eager: carried out at once
    profile: str | None = None  # bandwidths and prefill rate: a built-in profile or a calibrated file
    max_kept_branches: Count | None = None  # pinned (KEEP) branches per namespace; None: 16
    max_kept_tokens: Tokens | None = None  # pinned tokens per namespace; None: pool / 2
    prefetch_budget_tokens: Tokens | None = None  # unused speculative tokens per namespace; None: pool / 8

    # ---- program-aware admission (scheduler) ----
    admission: str = "off"  # off, or a strategy of policy/admission_order.py
    admission_starvation_steps: Count = 256
    admission_tenant_slack: Annotated[float, Meta(ge=1)] = 1.5

    # ---- the HTTP front: pause coordinator ----
    max_retention_s: Positive = 600.0  # a pause never outlives this, whatever its hint says
    prefetch_min_lead_ms: Annotated[float, Meta(ge=0)] = 1.0  # prefetch turns off below this median lead
    tool_priors: dict[str, LogNormal] = {}  # per tool class: {"median_s": float, "sigma": float}
    idle_sweep_s: Annotated[float, Meta(ge=0)] = 2.0
    max_pending_pauses: Count = 64  # background pauses pending per namespace
    max_paused_branches: Count = 16_384  # paused branches per namespace
    event_log: str | None = None  # a JSON-lines file of lifecycle events

    # ---- the HTTP front: chat inference, audit, observability ----
    # Chat inference (hints for chat requests that carry none): "" (unset) on where the server runs our
    # backend, "chat" on, "off" off (infer_mode).
    infer: Literal["", "off", "chat"] = ""
    infer_idle_s: Positive = 300.0  # an inferred branch idle this long is closed
    infer_learn_after: Annotated[int, Meta(ge=0, le=WINDOW)] = MIN_GAPS  # gaps before bounds are learned
    audit_log: str | None = None  # a JSON-lines file of refused hints and auth failures
    starvation_s: Positive = 30.0  # a request waiting longer counts as starved (metrics only)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Parse every ``AGENTCACHE_<FIELD>`` of ``environ`` (default ``os.environ``); unset ones keep
        their default. Raises :class:`SettingsError` naming the first variable that is wrong."""
        environ = os.environ if environ is None else environ
        raw: dict = {}
        for name in cls.__struct_fields__:
            value = environ.get(env_name(name))
            if value is None:
                continue
            if name == "tool_priors":
                if not value.strip():
                    continue
                try:
                    value = msgspec.json.decode(value)
                except msgspec.DecodeError as exc:
                    raise SettingsError(f"{env_name(name)} is not JSON: {exc}") from None
            elif name in ("pause_mode", "infer", "admission"):
                value = value.strip().lower()
            raw[name] = value
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise SettingsError(_named(str(exc), raw)) from None

    def infer_mode(self, backend_is_ours: bool = True) -> str:
        """The chat inference mode, "chat" or "" (off). On by default where the server runs our backend
        (``--radix-cache-backend agentcache``): on the 38 real Claude Code sessions it recomputes less
        than SGLang's HiCache at every host size (issue #37). ``AGENTCACHE_INFER=off`` turns it off;
        ``AGENTCACHE_INFER=chat`` keeps it on whatever the backend."""
        if self.infer == "off":
            return ""
        return "chat" if self.infer == "chat" or backend_is_ours else ""


def env_name(field: str) -> str:
    """The environment variable of a :class:`Settings` field."""
    return PREFIX + field.upper()


def _named(message: str, raw: dict) -> str:
    """msgspec's ``<what> - at `$.field...``` as ``AGENTCACHE_FIELD='value': <what>``."""
    found = re.search(r" - at `\$\.([a-z_0-9]+)", message)
    if found is None:
        return f"agentcache settings: {message}"
    field = found.group(1)
    value = raw.get(field)
    shown = f"={value!r}" if isinstance(value, str) else ""
    return f"{env_name(field)}{shown}: {message[:found.start()]}"


__all__ = ["Settings", "SettingsError", "env_name"]
