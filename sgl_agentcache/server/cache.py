"""``AgentRadixCache`` and the ``agentcache`` radix-cache backend factory.

The cache is a ``UnifiedRadixCache`` (so HiCache, session-radix references, streaming sessions and TLRU
keep working) built by SGLang's own ``create_unified_radix_cache(ctx, cache_class=...)`` on top of
:class:`~sgl_agentcache.server.tree_core.AgentTreeCore`, which SGLang selects through
``CacheInitParams.tree_core_backend``.
"""

from __future__ import annotations

import logging
from collections import Counter

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_agentcache import BACKEND_NAME
from sgl_agentcache.server.integrity import IntegrityReport, check_tree
from sgl_agentcache.server.tree_core import AgentTreeCore

logger = logging.getLogger(__name__)


class AgentRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache on the agent tree core."""

    def __init__(self, params):
        super().__init__(params)
        if not isinstance(self.tree_core, AgentTreeCore):
            raise RuntimeError(
                f"AgentRadixCache needs the {BACKEND_NAME!r} tree core, got {type(self.tree_core).__name__}"
            )

    # ---- read-only views (served by /agentcache/stats and /agentcache/check) ----

    def resident_tokens_by_class(self) -> dict[str, int]:
        """Device-resident tokens per lifecycle class, plus ``terminated`` (not yet reclaimed)."""
        counts: Counter[str] = Counter()
        for node in self.tree_core.all_nodes():
            if node is self.tree_core.root_node:
                continue
            value = node.component_data[ComponentType.FULL].value
            if value is None:
                continue
            key = "terminated" if node.agent.terminated else node.agent.cls.name.lower()
            counts[key] += len(value)
        return {name: counts.get(name, 0) for name in ("stable", "session", "scratch", "terminated")}

    def agent_stats(self) -> dict:
        """The scheduler-side half of ``GET /agentcache/stats``; identical on every TP rank."""
        return {
            "impl": type(self).__name__,
            "tree_core": type(self.tree_core).__name__,
            "page_size": self.page_size,
            "evictable_tokens": self.evictable_size(),
            "protected_tokens": self.protected_size(),
            "resident_tokens": self.resident_tokens_by_class(),
        }

    def check_integrity(self, *, idle: bool) -> IntegrityReport:
        return check_tree(self, idle=idle)


def agentcache_factory(ctx):
    """Radix-cache backend factory registered as ``agentcache`` (runs in every scheduler rank).

    Checks the pinned SGLang internals first, so a mismatched SGLang stops the server here with one
    clear message instead of misbehaving later.
    """
    from sglang.srt.mem_cache import registry

    from sgl_agentcache.server.pins import check_pinned_internals

    check_pinned_internals()
    if ctx.disable_radix_cache:
        logger.info("agentcache: --disable-radix-cache is set; deferring to SGLang's default cache chain")
        return registry.default_radix_cache_factory(ctx)
    ctx.params.tree_core_backend = BACKEND_NAME
    return registry.create_unified_radix_cache(ctx, cache_class=AgentRadixCache)


def agent_tree_core_factory(params, components) -> AgentTreeCore:
    return AgentTreeCore(params, components)
