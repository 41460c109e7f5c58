"""The start-up self-check names every changed SGLang internal and the version we need."""

from __future__ import annotations

import pytest

from sgl_agentcache.server.pins import PINS, Pin, PinnedInternalsChanged, check_pinned_internals


def test_pins_hold_on_installed_sglang():
    check_pinned_internals()  # raises if any pinned internal changed


def test_changed_signature_fails_loudly(monkeypatch):
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    def _split_node(self, key, child, split_len, new_arg):  # a hypothetical future signature
        raise AssertionError("never called")

    monkeypatch.setattr(UnifiedTreeCore, "_split_node", _split_node)
    with pytest.raises(PinnedInternalsChanged) as info:
        check_pinned_internals()
    message = str(info.value)
    assert "sglang==0.5.23" in message and "_split_node" in message and "new_arg" in message


def test_missing_internal_fails_loudly():
    with pytest.raises(PinnedInternalsChanged, match="missing"):
        check_pinned_internals((Pin("sglang.srt.mem_cache.registry:no_such_function", (), "test"),))


@pytest.mark.parametrize("ours,theirs", [
    ("sgl_agentcache.server.scheduler.tree_core:AgentTreeCore",
     "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore"),
    ("sgl_agentcache.server.scheduler.cache:AgentRadixCache", "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"),
])
def test_every_override_is_pinned(ours, theirs):
    """Each SGLang method we override is in the pin table, so a signature change fails at start-up."""
    import pkgutil

    ours, theirs = pkgutil.resolve_name(ours), pkgutil.resolve_name(theirs)
    overridden = {name for name, value in vars(ours).items()
                  if callable(value) and hasattr(theirs, name) and (name == "__init__" or not name.startswith("__"))}
    pinned = {p.target.rsplit(".", 1)[1] for p in PINS if p.target.split(":")[1].startswith(theirs.__name__ + ".")}
    assert overridden <= pinned, f"unpinned overrides: {overridden - pinned}"


def test_backend_factory_refuses_to_build_on_changed_sglang(monkeypatch):
    """The check runs inside the factory (scheduler start-up), before any tree is built."""
    from sglang.srt.mem_cache import registry

    from sgl_agentcache.server.scheduler.cache import agentcache_factory

    def create_unified_radix_cache(ctx, *, cache_class=None, extra=None):
        raise AssertionError("must not be reached")

    monkeypatch.setattr(registry, "create_unified_radix_cache", create_unified_radix_cache)
    with pytest.raises(PinnedInternalsChanged, match="create_unified_radix_cache"):
        agentcache_factory(ctx=None)
