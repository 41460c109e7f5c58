"""Every ``AGENTCACHE_*`` setting parses into one object, and a bad one names its variable (issue #36 item 6)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sgl_agentcache.policy.distributions import LogNormal
from sgl_agentcache.settings import Settings, SettingsError, env_name

ROOT = Path(__file__).resolve().parent.parent
#: Variables read outside Settings: tenancy's files and secret (loaded with their own checks in
#: ``tenancy.py``, once per HTTP process, when the server is configured).
TENANCY_VARIABLES = {"AGENTCACHE_TENANTS", "AGENTCACHE_SECRET"}


def test_unset_variables_keep_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings().pause_mode == "lazy"


def test_chat_inference_is_on_by_default_with_our_backend_only():
    """Issue #37: zero-config inference beats SGLang's HiCache on the real sessions, so it runs unless
    the operator turns it off; with another backend only when asked for (a stock cache ignores hints)."""
    assert Settings().infer_mode() == "chat" and Settings().infer_mode(backend_is_ours=False) == ""
    off, on = Settings.from_env({"AGENTCACHE_INFER": "off"}), Settings.from_env({"AGENTCACHE_INFER": "chat"})
    assert off.infer_mode() == "" == off.infer_mode(backend_is_ours=False)
    assert on.infer_mode() == "chat" == on.infer_mode(backend_is_ours=False)


def test_each_variable_sets_its_field():
    s = Settings.from_env({
        "AGENTCACHE_BRANCH_QUOTA_TOKENS": "512", "AGENTCACHE_PAUSE_MODE": " Eager ", "AGENTCACHE_RECORD_EVICTIONS": "1",
        "AGENTCACHE_PREFETCH_MIN_LEAD_MS": "50", "AGENTCACHE_MAX_PENDING_PAUSES": "8", "AGENTCACHE_INFER": "chat",
        "AGENTCACHE_TOOL_PRIORS": '{"ci_run": {"median_s": 60, "sigma": 1.5}}', "AGENTCACHE_ADMISSION": "Agent",
        "AGENTCACHE_EVENT_LOG": "/tmp/events.jsonl", "UNRELATED": "x"})
    assert (s.branch_quota_tokens, s.pause_mode, s.record_evictions, s.prefetch_min_lead_ms) == (512, "eager", True, 50.0)
    assert (s.max_pending_pauses, s.infer_mode(), s.admission, s.event_log) == (8, "chat", "agent", "/tmp/events.jsonl")
    assert s.tool_priors == {"ci_run": LogNormal(median_s=60.0, sigma=1.5)}
    assert env_name("max_pending_pauses") == "AGENTCACHE_MAX_PENDING_PAUSES"


@pytest.mark.parametrize("variable,value", [
    ("AGENTCACHE_MAX_PENDING_PAUSES", "lots"), ("AGENTCACHE_MAX_PENDING_PAUSES", "0"),
    ("AGENTCACHE_PAUSE_MODE", "soon"), ("AGENTCACHE_INFER", "chats"), ("AGENTCACHE_INFER_IDLE_S", "-1"),
    ("AGENTCACHE_INFER_LEARN_AFTER", "100000"), ("AGENTCACHE_ADMISSION_TENANT_SLACK", "0.5"),
    ("AGENTCACHE_BRANCH_QUOTA_TOKENS", "-5"), ("AGENTCACHE_RECORD_EVICTIONS", "maybe"),
    ("AGENTCACHE_TOOL_PRIORS", "{"), ("AGENTCACHE_TOOL_PRIORS", '{"ci": {"median": 1}}'),
    ("AGENTCACHE_TOOL_PRIORS", '{"ci": {"median_s": -1, "sigma": 1}}'),
])
def test_a_bad_value_is_refused_naming_its_variable(variable, value):
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env({variable: value})


def test_every_documented_variable_is_a_setting():
    """The README and docs name no variable the server does not read, and every setting is documented."""
    documented = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        documented |= set(re.findall(r"\bAGENTCACHE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    fields = {env_name(name) for name in Settings.__struct_fields__}
    assert documented - fields - TENANCY_VARIABLES == set()
    assert fields - documented == set(), "settings the README and docs/ never mention"
