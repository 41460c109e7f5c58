"""``AgentRadixCache`` and the ``agentcache`` radix-cache backend factory.

The cache is a ``UnifiedRadixCache`` (so session-radix references, streaming sessions, TLRU and
HiCache keep working) built by SGLang's own ``create_unified_radix_cache(ctx, cache_class=...)`` on top of
:class:`~sgl_agentcache.server.scheduler.tree_core.AgentTreeCore`, which SGLang selects through
``CacheInitParams.tree_core_backend``.

What it adds to the stock cache:

- every insert is classified from the request's lifecycle hint (:meth:`checkpoint_into_tree`): the
  nodes it creates are split at the stable-prefix and fork boundaries and stamped STABLE / SESSION /
  SCRATCH with their owner; nodes it matched are shared and never charged;
- a branch's charge is bounded by a server-side quota, as a fairness bound rather than a cap: a branch
  may hold more while memory is free, but under pressure an over-quota branch's nodes go first (its
  own oldest first), before anything else alive, and in HiCache's host pool they are the first dropped
  (under write-through they are not backed up at all);
- closing a branch (route, ``close`` hint, abort of a fork, session close) stamps its nodes terminated and frees the
  unlocked ones in the same scheduler step; locked ones go when their request releases them;
- eviction ranks leaves by the retention policy's :func:`~sgl_agentcache.policy.retention.device_rank`
  (band: ended, over quota, valued, pinned; then value per token, which orders scratch = untagged <
  session < stable; then session-radix references; then the configured policy), the same policy that
  ranks HiCache's host entries (:meth:`AgentRadixCache.hicache_host_key`) and prices host memory in
  pause decisions (``pauses.py``).

The host tier is SGLang's HiCache (``--enable-hierarchical-cache``): its host pool, cache controller and
L3 storage carry the bytes, our lifecycle decides what they hold (:meth:`AgentRadixCache.init_hicache`).
Without it there is no host tier, as in stock SGLang.

All decisions depend only on the tree and the order of messages, never on a clock, so every TP rank
takes the same ones.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging

import msgspec
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_agentcache import BACKEND_NAME
from sgl_agentcache.fork_points import BranchContexts
from sgl_agentcache.hints import HintError, LifecycleHint, find_lifecycle_hint, insert_plan
from sgl_agentcache.lifecycle import (KEPT_ON_CLOSE_STATE, UNTAGGED_PLAN, BranchKey, InsertPlan, NodeClass,
                                      RecentBranches, namespace_key, namespace_salt, parent_refusal)
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.idle import IDLE_CLASS
from sgl_agentcache.policy.retention import Band, RetentionModel, device_rank, host_band, learned_rate
from sgl_agentcache.server.scheduler.integrity import IntegrityReport, check_tree
from sgl_agentcache.server.scheduler.leaf_tails import device_tail, tail_floor
from sgl_agentcache.server.metrics import SchedulerMetrics, metrics_enabled
from sgl_agentcache.server.scheduler.hicache_moves import (FETCH_RID_PREFIX, back_up_head, end_storage_fetch,
                                                           fetch_from_storage, host_evictable_tokens)
from sgl_agentcache.server.scheduler.pauses import PauseBook, default_settings
from sgl_agentcache.server.scheduler.program_admission import ProgramAdmission, admission_settings
from sgl_agentcache.server.scheduler.request_state import state_of
from sgl_agentcache.server.scheduler.tree_core import AgentTreeCore
from sgl_agentcache.settings import Settings

logger = logging.getLogger(__name__)
FULL = ComponentType.FULL
_STOCK_FLUSH = UnifiedRadixCache.flush_pending_backups  # the per-step tick we extend (pinned)
_STOCK_CHECKPOINT = UnifiedRadixCache.checkpoint_into_tree  # every insert goes through it (pinned)
_STOCK_ON_RELEASE = UnifiedRadixCache.on_release  # every request's release (pinned)


def _tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # noqa: BLE001 - no published parallel config (offline): rank 0
        return 0


def namespace_of(req) -> str:
    """The cache namespace a request's tree path lives in."""
    return namespace_key(req.extra_key, req.cache_salt)


class _LifecycleStrategy:
    """``EvictionStrategy`` for components other than FULL (no session references there)."""

    def __init__(self, cache, base):
        self.cache = cache
        self.base = base

    def get_priority(self, node):
        return self.cache.eviction_key(node, 0, self.base.get_priority(node))


class AgentRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache on the agent tree core, with lifecycle-aware retention."""

    def __init__(self, params):
        super().__init__(params)
        core = self.tree_core
        if not isinstance(core, AgentTreeCore):
            raise RuntimeError(f"AgentRadixCache needs the {BACKEND_NAME!r} tree core, got {type(core).__name__}")
        pool = self.token_to_kv_pool_allocator.size if self.token_to_kv_pool_allocator is not None else 0
        # The operator's settings, parsed once for this scheduler (sgl_agentcache/settings.py).
        settings = self.settings = Settings.from_env()
        self.branch_quota_tokens = settings.branch_quota_tokens or max(pool // 4, 1)
        # A session's history defaults to the whole pool (on both tiers together): half the pool put
        # the one long session a coding agent lives in first in line whenever the pool filled, so its
        # tail went to host and came back at every resume while idle neighbours stayed (38 real Claude
        # Code sessions: resume p50 0.98x at host 0.5x and 0.96x at 1x of half's, recompute level).
        self.session_quota_tokens = settings.session_quota_tokens or max(pool, 1)
        if settings.record_evictions:  # tests compare the server's deletions with the replayer's
            core.record_deletions()
        # Bounded per namespace; a branch that still holds tokens (tree, pause) is never forgotten.
        holds = lambda b: b in self.tree_core.owner_index or b in self.pauses.records  # noqa: E731
        self.closed = RecentBranches(retained=holds)
        self.seen = RecentBranches(by_session=True, retained=holds)
        self.scheduler = None  # set on the first request; read only by queue metrics
        # Each open branch's quota, as its own requests set it (bounded like the branch sets).
        self.quotas: NamespacedLRU[BranchKey, int] = NamespacedLRU(self.closed.limit, self.closed.namespace_limit)
        self.freed_on_close_tokens = 0
        self.kept_on_close_tokens = 0  # closes that kept the KV as untagged cache (inferred closes)
        self.quota_trimmed_tokens = 0  # over-quota branches' tokens eviction took first
        self._device_need = None  # inside a device eviction walk: what it must free (_evict_components)
        core.device_tail_floor = tail_floor(pool, self.page_size)
        self.invalid_hints = 0
        self.adopted_tokens = 0  # siblings' scratch a request reused, made the session's history
        self.inferred_orphans = 0  # inferred forks run without their parent (it was unknown or closed)
        self.shared_prefill_waits = 0  # steps requests waited for another's prefill of their stable prefix
        # Program-aware admission order (server/scheduler/program_admission.py), when the operator turns it on.
        admission = admission_settings(settings)
        self.admission = ProgramAdmission(admission) if admission is not None else None
        # Each branch's last finished context, so a fork whose hint gives no fork point still charges
        # the parent's history it recomputes to the parent (fork_points.py).
        self.contexts = BranchContexts()
        self.inferred_fork_points = 0
        self.context_edit_freed_tokens = 0
        self.pauses = PauseBook(self, default_settings(self.token_to_kv_pool_allocator, pool, settings))
        self._retention: tuple | None = None  # (rates, model): see the retention property
        # The model's device value per class, looked up per candidate leaf (refreshed with the model).
        self._device_values: dict = self.retention.device_values()
        # Set by init_hicache when SGLang attaches HiCache (--enable-hierarchical-cache): its host pool,
        # controller and L3 storage then carry the host bytes. Without it there is no host tier.
        self.on_hicache = False
        self.hicache_deletes = {"device_tokens": 0, "host_tokens": 0, "backups_skipped_tokens": 0}
        # Write-back leaves longer than the host room whose head was kept (server/scheduler/hicache_moves.py).
        self.partial_backups = {"leaves": 0, "kept_tokens": 0, "dropped_tokens": 0}
        self.l3 = None  # an L3Deleter when HiCache runs with a storage backend
        self.storage_fetch_count = 0  # storage prefetches started (names their request handles)
        self.metrics = SchedulerMetrics(_tp_rank()) if metrics_enabled() else None
        # How leaves are ranked for eviction (smallest first): the lifecycle rank, unless a replayed
        # baseline hands the cache its own key (set_eviction_key).
        self.eviction_key = self._lifecycle_key
        # Inserts start at the request's locked node instead of re-walking its prefix from the root
        # (AgentTreeCore._skip_locked_prefix: same tree, same decisions). Off only to measure it.
        self.skip_locked_prefix = True
        base = core.eviction_strategy
        core.eviction_strategy = _LifecycleStrategy(self, base)
        full = self.components[FULL]
        full.session_ref_eviction_strategy = lambda node: self.eviction_key(
            node, full.session_ref(node), base.get_priority(node))

    def init_hicache(self, server_args, params) -> None:
        """SGLang attaches HiCache after ``__init__`` (``registry.create_unified_radix_cache``). From here
        on HiCache's host pool, cache controller and storage backend hold every host copy, and our
        lifecycle decides what they hold: closes and purges delete a branch's nodes on the device and
        in the host pool (never demote them), and a terminated node under eviction is deleted, not
        backed up. Pauses are advice (lazy) by default; an applied offload demotes the branch into
        HiCache's host pool (``PauseBook._offload_on_hicache``)."""
        super().init_hicache(server_args, params)
        self.on_hicache = True
        self.tree_core.backup_veto = self._no_host_copy
        self.tree_core.host_tail_floor = tail_floor(self.host_tier_tokens, self.page_size)
        # L3: deleted nodes' pages go from the store too, where the backend can delete (server/scheduler/l3_store.py).
        from sgl_agentcache.server.scheduler.l3_store import L3Deleter

        self.l3 = L3Deleter(self.cache_controller.storage_backend) if self.enable_storage else None
        self.tree_core.mark_reclaim_due()

    def write_backup_storage(self, node_id) -> None:
        """HiCache writes a node's pages to L3 (``UnifiedRadixCache.write_backup_storage``, called in the
        same order on every rank); with a deleting store, a salted node's page keys also go into the
        salt's purge manifest, so a purge reaches them after the node has left the tree
        (``server/scheduler/l3_store.py``). Rank-local disk work only, off the scheduler thread."""
        queued = len(self.ongoing_backup)
        super().write_backup_storage(node_id)
        if self.l3 is None or self.l3.manifest is None or len(self.ongoing_backup) == queued:
            return  # no store that deletes, or nothing was written
        node = self.tree_core.node_by_id(node_id)
        salt = getattr(node.key, "cache_salt", None)
        if salt and node.hash_value:
            self.l3.record(salt, list(node.hash_value))

    def _no_host_copy(self, node) -> bool:
        """HiCache write-through asks whether to back ``node`` up: not a terminated node (nobody reads it
        again), nor one of a branch over its quota (the TRIM band: the first to go on either tier)."""
        state = node.agent
        return state.terminated or (state.owner is not None and self.over_quota(state.owner))

    @property
    def retention(self) -> RetentionModel:
        """What a token is worth on each tier (policy/retention.py), at the pause settings' rates: the
        deployment profile's, never a rank's own measurements, so every TP rank ranks alike. Rebuilt
        when those settings change (the replay sets its profile's)."""
        s = self.pauses.settings
        rates = (s.prefill_tokens_per_s, s.h2d_bytes_per_s, s.bytes_per_token)
        if self._retention is None or self._retention[0] != rates:
            model = RetentionModel(prefill_tokens_per_s=rates[0], h2d_bytes_per_s=rates[1], bytes_per_token=rates[2])
            self._retention = (rates, model)
            self._device_values = model.device_values()
        return self._retention[1]

    def set_eviction_key(self, key=None) -> None:
        """Rank leaves for eviction with ``key(node, session_ref, base_priority) -> tuple`` (smallest
        goes first; ``base_priority`` is the configured policy's, LRU by default) instead of the
        lifecycle rank. For replayed baselines (``sgl_agentcache.sim.rankings``); None restores ours.
        Called per candidate leaf on every eviction: keep it cheap and free of side effects. A baseline
        also gets SGLang's whole-leaf eviction on both tiers (no tail trims, ``leaf_tails``)."""
        self.eviction_key = self._lifecycle_key if key is None else key
        self.tree_core.trim_host_tails = self.tree_core.trim_device_tails = key is None

    def _lifecycle_key(self, node, session_ref: int, base_priority) -> tuple:
        if self.on_hicache and node.evicted:  # only HiCache's host eviction ranks host-only nodes
            return self.hicache_host_key(node, base_priority)
        state = node.agent
        owner = state.owner
        return device_rank(self._device_values, state, session_ref, base_priority, owner in self.pauses.kept,
                           owner is not None and not state.terminated and self.over_quota(owner))

    def hicache_host_key(self, node, base_priority) -> tuple:
        """Host eviction order of a HiCache host leaf (policy/retention.py ``host_band``): an ended
        branch's first, then a branch over its quota or
        paused with DISCARD advice, then the rest, then a branch paused with OFFLOAD advice (the pause
        policy judged its copy worth the room) or with KEEP advice (judged worth device memory: when
        pressure pushes it to host anyway it must not go before an offloaded one); recency (SGLang's
        priority) within a band."""
        state = node.agent
        owner = state.owner
        if state.terminated:
            return (Band.ENDED, 0.0, False, 0, base_priority)
        advice = self.pauses.advice.get(owner) if owner is not None and self.pauses.advice else None
        advised = advice.value if advice is not None else None
        low = advised == "discard" or (owner is not None and self.over_quota(owner))
        # An idle pause (a branch waiting on its user, priced by the sweep) is a guess about a human:
        # its advice never lifts a copy over others -- hours-idle sessions advised OFFLOAD pushed out a
        # conversation idle for 40 s -- so its copies rank by recency with the rest.
        protected = advised in ("offload", "keep") and not self._idle_pause(owner)
        return (host_band(low_value=low, protected=protected), 0.0, False, 0, base_priority)

    def _idle_pause(self, owner) -> bool:
        record = self.pauses.records.get(owner)
        return record is not None and record.tool_class == IDLE_CLASS

    @property
    def host_tier_tokens(self) -> int:
        """The host tier's size in tokens: HiCache's host pool when attached, else 0 (no host tier)."""
        return int(self.cache_controller.mem_pool_host.size) if self.on_hicache else 0

    def host_free(self) -> int:
        """Host tokens a copy can take at no loss (0 without HiCache): its host pool's free slots plus,
        under write-back, the host copies of device-resident nodes it can release
        (``drive_host_eviction`` reclaims those duplicates first, and dropping one loses nothing: the
        device still holds it). Counted as taken, the duplicates made a write-back pool read as full and
        priced every offload as displacing valued host entries: on the real Claude Code mix one seed's
        pauses went 385 keep / 98 offload (146 offloads with them counted free)."""
        if not self.on_hicache:
            return 0
        core = self.tree_core
        free = int(self.cache_controller.mem_pool_host.available_size())
        if self.is_write_back and not envs.SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM.get():
            free += sum(len(n.component_data[FULL].host_value) for n in core.full_host_duplicates.values()
                        if core._can_reclaim_full_host_duplicate(n))
        return free

    def host_room(self) -> tuple[int, int]:
        """(free host tokens, tokens a host copy could get): what pause decisions price host memory
        with; (0, 0) without HiCache. Free is :meth:`host_free`; the room adds every host-only subtree
        HiCache's host eviction can take (``hicache_moves.host_evictable_tokens``: leaves, then their
        parents). Counting only the leaves of host-only chains read a host full of closed branches' KV
        (kept as cache) as full: on ``branch_heavy`` with chat inference, pauses of 1.4-2.5k tokens read
        a 7k-token host holding 4k of such cache as 1.1k of room and discarded."""
        if not self.on_hicache:
            return 0, 0
        free = self.host_free()
        return free, free + host_evictable_tokens(self)

    def branch_tokens(self, branch: BranchKey) -> int:
        """Tokens ``branch`` owns in the tree (device-resident or in HiCache's host pool)."""
        return self.tree_core.owned_count.get(branch, 0)

    def over_quota(self, branch: BranchKey) -> bool:
        """``branch`` holds more than its quota (:meth:`quota_of`)."""
        return self.branch_tokens(branch) > self.quota_of(branch)

    def quota_of(self, branch: BranchKey) -> int:
        """``branch``'s quota: the one its own requests set, else the session quota (a parent charged by
        forks that never sent a request of its own)."""
        return self.quotas.get(branch, self.session_quota_tokens)

    # ---- inserts ----

    def _plan(self, req) -> InsertPlan:
        """The request's insert plan: built at its first call, rebuilt only when a branch it names has
        closed since (its tokens are then born terminated, never revived)."""
        state, closed = state_of(req), self.closed
        plan = state.plan
        if plan is not None:
            if state.closed_version == closed.version:  # no branch closed since: every insert
                return plan
            state.closed_version = closed.version
            if not ((plan.own.owner in closed and not plan.own.terminated)
                    or (plan.parent is not None and plan.parent.owner in closed and not plan.parent.terminated)):
                return plan
            plan = insert_plan(state.hint, namespace_of(req), closed)
        else:
            try:
                hint = find_lifecycle_hint(req.kv_hints)
            except HintError as exc:  # the HTTP layer rejects these; never fail a request here
                self.invalid_hints += 1
                logger.warning("agentcache: ignoring invalid lifecycle hint on %s: %s", req.rid, exc)
                hint = None
            if hint is not None and hint.is_fork and hint.fork_point_tokens is None:
                hint = self._with_fork_point(hint, req)
            plan = insert_plan(hint, namespace_of(req), closed)
            state.hint = hint
        state.plan, state.closed_version = plan, closed.version
        if plan.own.owner is not None:
            self.quotas.put(plan.own.owner, self.quota_for(plan))
        return plan

    def _with_fork_point(self, hint: LifecycleHint, req) -> LifecycleHint:
        """``hint`` with the fork point its prompt shows, if it continues the parent's last context."""
        parent = BranchKey(namespace_of(req), hint.session, hint.parent_branch)
        if parent in self.closed:  # the fork is refused (or, inferred, runs alone): nothing to find
            return hint
        found = self.contexts.fork_point(parent, req.origin_input_ids)
        if not found or found <= hint.stable_prefix_tokens:
            return hint
        self.inferred_fork_points += 1
        return msgspec.structs.replace(hint, fork_point_tokens=found)

    def admit(self, req) -> str | None:
        """Build the request's plan at admission; return why it must be refused, or None."""
        plan, state = self._plan(req), state_of(req)
        # Only a *new* fork needs a live parent: a subagent that already runs keeps working after its
        # lead closed (what it inherited from the parent is born terminated, see _plan).
        if plan.parent is not None and plan.own.owner not in self.seen:
            refusal = parent_refusal(plan.parent.owner, self.seen, self.closed)
            if refusal is not None:
                if not state.hint.inferred:
                    return refusal
                # The server guessed the fork (chat inference): run it as a branch of its own.
                self.inferred_orphans += 1
                state.hint = msgspec.structs.replace(state.hint, parent_branch=None, fork_point_tokens=None)
                plan = state.plan = insert_plan(state.hint, namespace_of(req), self.closed)
                self.quotas.put(plan.own.owner, self.quota_for(plan))
        # What HiCache holds of it comes back when the scheduler admits it (SGLang's load-back).
        if plan.own.owner is not None:
            self.seen.add(plan.own.owner)
            if plan.own.owner in self.pauses.records:  # the tool returned: the pause ends
                self.pauses.resume(plan.own.owner)
        return None

    def resident_prefix_len(self, key) -> int:
        """How much of ``key`` matches on the device now (a stock match: nothing is loaded back)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return super().match_prefix(MatchPrefixParams(key=key)).device_prefix_len

    def load_from_host(self, key, *, evict: bool) -> int:
        """Load the host-only part of ``key``'s match back now, ahead of its request (a prefetch); with
        ``evict=False`` only into free memory. Returns the tokens being loaded (0 without HiCache)."""
        return self._load_from_hicache_host(key, evict=evict) if self.on_hicache else 0

    def fetch_from_storage(self, key, max_tokens: int):
        """HiCache with an L3 store: start its storage prefetch (L3 -> host pool) for what of ``key`` lies
        past its device and host match, at most ``max_tokens``; the next request loads it back from host.
        Returns ``(handle, tokens asked)``, ``(None, 0)`` when nothing was started
        (:func:`~sgl_agentcache.server.scheduler.hicache_moves.fetch_from_storage`). Pass the handle to
        :meth:`end_storage_fetch` once the pause ends."""
        if not self.on_hicache:
            return None, 0
        self.storage_fetch_count += 1  # the same on every rank: control ops arrive in one order
        return fetch_from_storage(self, key, f"{FETCH_RID_PREFIX}-{self.storage_fetch_count}", max_tokens)

    def end_storage_fetch(self, handle) -> int:
        """Forget a storage prefetch (stopped if still reading); the tokens it brought into the host pool."""
        return end_storage_fetch(self, handle)

    def host_tokens_continuing(self, key) -> int:
        """HiCache attached: tokens of ``key`` that match on HiCache's host pool past its device prefix
        (what a load-back would bring); 0 without HiCache."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        if not self.on_hicache:
            return 0
        return int(super().match_prefix(MatchPrefixParams(key=key)).host_hit_length)

    def _load_from_hicache_host(self, key, *, evict: bool) -> int:
        """A prefetch on HiCache's own load path: the host-only part of ``key``'s match goes back to the
        device through the cache controller (``load_back``, then the copy starts now instead of with
        the next prefill batch; ``loading_check`` reaps it as any load-back). With ``evict=False`` only
        into free device memory. Skipped while HiCache's load-back slots are all in use. Returns the
        tokens being loaded."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        result = super().match_prefix(MatchPrefixParams(key=key))
        if result.host_hit_length <= 0 or not self.has_free_load_back_slot():
            return 0
        quota = self.token_to_kv_pool_allocator.available_size() if not evict else None
        if not self.load_back(result.last_host_node, mem_quota=quota, req=None):
            return 0
        self.ready_to_load_host_cache()
        return int(result.host_hit_length)

    def load_back(self, node_id, mem_quota=None, req=None) -> bool:
        """HiCache's load-back (a match's or a prefetch's), counting the host tokens it brings back:
        the reuse rate the retention policy prices host room with (:meth:`host_reuse_rate`)."""
        core = self.tree_core
        tokens, node = 0, core.node_by_id(node_id)
        while node is not core.root_node and node.evicted:
            tokens += len(node.key)
            node = node.parent
        loaded = super().load_back(node_id, mem_quota, req=req)
        if loaded:
            core.host_loaded_tokens += tokens
        return loaded

    def host_reuse_rate(self) -> float:
        """The learned share of HiCache's host tokens used again (loaded back, against lost to host
        eviction; the prior until both are seen). Tree counters only, the same on every rank."""
        core = self.tree_core
        return learned_rate(core.host_loaded_tokens, core.host_lost_tokens)

    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        # Runs for every insert (twice per request at least): the common case -- the request's plan
        # is current, the branch is within its quota, the insert only extends the branch past its
        # boundaries -- costs a few attribute reads around the stock insert.
        state = state_of(req)
        if state.closed_version == self.closed.version:
            plan = state.plan
        else:
            first = state.plan is None
            plan = self._plan(req)
            if first and plan.own.owner is not None:  # a request that never passed admit(): seen now
                self.seen.add(plan.own.owner)
        core = self.tree_core
        if plan is UNTAGGED_PLAN or self.disable:
            core.insert_from = self._insert_start(req)
            try:
                return _STOCK_CHECKPOINT(self, req, up_to=up_to, **kwargs)
            finally:
                core.insert_from = None
        own = plan.own
        owner = own.owner
        hint = state.hint
        if hint is not None and hint.edit_from_tokens is not None and not state.edited:
            state.edited = True
            self.context_edit_freed_tokens += self._drop_edited_history(req, owner, hint.edit_from_tokens)
        locked = req.kv.cache_protected_len  # in the tree and locked: the insert creates nodes past it only
        first_insert = not state.adopted
        if first_insert:
            state.adopted = True
            self._adopt_shared_context(req, plan)
        core.insert_state = own
        core.insert_from = self._insert_start(req)
        try:
            _STOCK_CHECKPOINT(self, req, up_to=up_to, **kwargs)
        finally:
            core.insert_state = core.insert_from = None
        fresh = core.take_fresh()
        if fresh and plan.boundaries and req.last_node is not None:
            self._settle(req, plan, locked, fresh)
        if first_insert and plan.parent is not None:
            # Siblings forked together are prefilled in one batch: none matches another's tokens at
            # admission, so what they share past the fork point (the tokens after the lead's output that
            # each of their prompts carries) is created by whichever inserts first and only *matched*
            # by the others' inserts. Their first insert adopts it too (above their own new nodes).
            self._adopt_shared_context(req, plan, past_own=True)

    def _adopt_shared_context(self, req, plan: InsertPlan, *, past_own: bool = False) -> None:
        """Nodes another branch's scratch created that this request reuses become the session's history.

        A fork creates the first tokens past its fork point; when its siblings' or its lead's next
        prompts carry the same tokens (what the harness appended to the lead's context before forking),
        those nodes are the lead's context, not the fork's scratch: they would otherwise die with the
        fork that happened to run first, and the lead's next turn would recompute them. Walks up from
        the request's matched node while nodes are scratch of *other* branches of the same session
        (usually none or one node); charges them to the lead within its quota, as :meth:`_stamp` does.
        ``past_own``: start above the request's own nodes (after its insert, which created them).
        """
        if req.last_node is None:
            return
        heir_state = plan.parent if plan.parent is not None else plan.own
        me, heir = plan.own.owner, heir_state.owner
        if heir is None or heir_state.terminated or plan.own.terminated:
            return
        core = self.tree_core
        try:
            node = core.node_by_id(req.last_node)
        except KeyError:
            return
        if past_own:
            while node is not core.root_node and node.agent.owner == me:
                node = node.parent
        while node is not core.root_node:
            state = node.agent
            owner = state.owner
            if (owner is None or owner == me or owner == heir or state.cls is not NodeClass.SCRATCH
                    or owner.session != heir.session or owner.namespace != heir.namespace):
                return
            if self.branch_tokens(heir) + len(node.key) > self.quota_of(heir):
                return
            core.set_state(node, heir_state)
            self.adopted_tokens += len(node.key)
            node = node.parent

    def _insert_start(self, req):
        """The node ``req`` holds locked, where its insert may start (see
        ``AgentTreeCore._skip_locked_prefix``); None: the insert walks from the root, as stock's does."""
        if not self.skip_locked_prefix or req.last_node is None:
            return None
        try:
            return self.tree_core.node_by_id(req.last_node)
        except KeyError:  # not a tree node (a streaming session's virtual node): SGLang's walk decides
            return None

    def _stamp(self, node, plan: InsertPlan, start: int) -> None:
        """Give a created node the plan's state for its first token. Tokens a fork assigns to its parent
        are charged to the parent only within the parent's quota; past it they are the fork's own, so no
        hint can push another branch over its quota (and into the first-to-go rank)."""
        state = plan.state_at(start)
        owner = state.owner
        if owner is not None and owner != plan.own.owner:
            if self.branch_tokens(owner) + len(node.key) > self.quota_of(owner):
                state = plan.own
        self.tree_core.set_state(node, state)

    def _drop_edited_history(self, req, owner: BranchKey, edit_from: int) -> int:
        """Terminate ``owner``'s tokens past ``edit_from`` that this request's prompt does not share.

        Called once per request, before its first insert. Nodes on the request's matched path are kept
        (the new prompt still uses them, possibly past ``edit_from``); a node straddling ``edit_from`` is
        split there so only its stale tail goes. Returns tokens freed now.
        """
        core = self.tree_core
        keep = set(core.path_to(core.node_by_id(req.last_node))) if req.last_node is not None else set()
        ended = []
        for node in list(core.owner_index.get(owner, ())):
            if node in keep:
                continue
            start = core.depth(node)
            # The tree splits at page boundaries only: the page holding ``edit_from`` goes with the
            # stale suffix (its shared head is re-prefilled; reuse stays exact).
            cut = edit_from - edit_from % self.page_size
            if start + len(node.key) <= cut:
                continue
            if start < cut:
                front, action = core._split_node(node.key, node, cut - start)
                if action is not None:
                    self._apply_cache_actions([action])
            core.set_state(node, node.agent.ended())
            ended.append(node)
        return self._evict_nodes(core.terminated, budget=None)

    def quota_for(self, plan: InsertPlan) -> int:
        """Forked branches get the branch quota; a session's root branch the (larger) session quota."""
        return self.branch_quota_tokens if plan.parent is not None else self.session_quota_tokens

    def _settle(self, req, plan: InsertPlan, locked: int, fresh: set) -> None:
        """Split the ``fresh`` nodes this insert created at the plan's boundaries and stamp each part
        (``locked``: the request's tokens the tree held, locked, before the insert)."""
        core, boundaries = self.tree_core, plan.boundaries
        # The common insert extends a branch past its fork point and stable prefix: every created node
        # (the tail of the path) already has the plan's own state, stamped at birth, which is what
        # _stamp would give it; skip the walk. The boundary rounds up to its page's end.
        last = boundaries[-1] + (-boundaries[-1] % self.page_size)
        if locked >= last:
            return
        node = core.node_by_id(req.last_node)
        while node.parent in fresh:
            node = node.parent
        if node in fresh and core.depth(node) >= last:
            return
        self.classify_created(req.last_node, fresh, boundaries, lambda node, start: self._stamp(node, plan, start))

    def classify_created(self, last_node_id, fresh, boundaries, stamp) -> None:
        """Split the ``fresh`` nodes on the path to ``last_node_id`` at ``boundaries`` (absolute token
        offsets) and call ``stamp(node, start)`` on each created part (``start``: its first token)."""
        core = self.tree_core
        start = 0
        for node in core.path_to(core.node_by_id(last_node_id)):
            end = start + len(node.key)
            if node in fresh:
                for boundary in boundaries:
                    # The tree splits only at page boundaries: a page takes the class and owner of
                    # its first token (a boundary inside a page rounds up to the page's end).
                    boundary += -boundary % self.page_size
                    if start < boundary < end:
                        front, action = core._split_node(node.key, node, boundary - start)
                        if action is not None:
                            self._apply_cache_actions([action])
                        stamp(front, start)
                        start = boundary
                stamp(node, start)
            start = end

    # ---- termination ----

    def free_nodes(self, nodes) -> tuple[int, int]:
        """Free every unlocked node of ``nodes`` now, on every tier: the device, HiCache's host pool and
        L3 where the store deletes (``_delete_from_l3``). Returns (device tokens, host tokens) freed."""
        host = self.hicache_deletes["host_tokens"]
        device = self._evict_nodes(nodes, budget=None)
        return device, self.hicache_deletes["host_tokens"] - host

    def close_branch(self, branch: BranchKey, *, keep_cached: bool = False) -> dict:
        """Terminate ``branch``: its nodes become reclaimable, unlocked ones are freed now.

        ``keep_cached`` (a close the server only guessed: chat inference's idle close): the branch
        ends just the same (no quota, no pause, never a parent again), but its nodes on every tier
        stay as untagged cache, ranked by recency as stock SGLang ranks everything, rather than being
        freed; they are marked as kept (``KEPT_ON_CLOSE_STATE``), so device eviction may still take
        only the tail of one of their leaves, as it does a branch's. A wrong guess -- the conversation
        comes back after a long human pause -- then costs what stock caching would cost, not a
        recompute of the whole history."""
        known = branch in self.seen or branch in self.tree_core.owner_index
        already = branch in self.closed
        if not known and not already:
            return {"closed": False, "reason": "unknown branch"}
        self.closed.add(branch)
        self.quotas.pop(branch)
        self.contexts.forget(branch)
        core = self.tree_core
        self.pauses.forget(branch)
        if keep_cached:
            kept = 0
            for node in list(core.owner_index.get(branch, ())):
                kept += len(node.key)
                core.set_state(node, KEPT_ON_CLOSE_STATE)
            self.kept_on_close_tokens += kept
            return {"closed": True, "already_closed": already, "freed_tokens": 0, "host_freed_tokens": 0,
                    "kept_tokens": kept, "pending_tokens": 0}
        for node in list(core.owner_index.get(branch, ())):
            if not node.agent.terminated:
                core.set_state(node, node.agent.ended())
        hicache_host = self.hicache_deletes["host_tokens"]
        freed = self.reclaim_terminated()
        host_freed = self.hicache_deletes["host_tokens"] - hicache_host
        return {"closed": True, "already_closed": already, "freed_tokens": freed, "host_freed_tokens": host_freed,
                "pending_tokens": core.owned_tokens(branch)}

    def close_session(self, namespace: str | None, session: str) -> dict:
        """Close every branch of ``session`` in ``namespace`` (in every namespace when None)."""
        # The branches seen (indexed by session: there may be tens of thousands), and any that still
        # owns nodes but is no longer remembered (the seen set is bounded; the tree's owners are few).
        found = set(self.seen.of_session(session))
        found.update(b for b in self.tree_core.owner_index if b.session == session)
        branches = sorted((b for b in found if namespace is None or b.namespace == namespace),
                          key=lambda b: (b.namespace, b.branch))
        results = [self.close_branch(b) for b in branches]
        return {"branches": len(branches), "freed_tokens": sum(r.get("freed_tokens", 0) for r in results)}

    def purge_salt(self, salt: str) -> dict:
        """Remove every trace of the namespaces salted ``salt`` (one tenant) from every tier.

        Every branch of it is closed (host copies, pins and prefetch state go with it), then every
        unlocked node of its subtrees is deleted, whatever its class (stable prefixes too). Nodes that a
        running request still locks cannot be freed now: they are reported as ``locked_tokens`` and stay
        in the tenant's own namespace as ordinary cache until evicted (purge again once the tenant is
        idle for a complete wipe). Deterministic on every rank: victims are ordered as in any reclaim.
        """
        pauses = self.pauses
        branches = {b for b in (set(self.tree_core.owner_index) | set(self.seen) | set(pauses.records))
                    if namespace_salt(b.namespace) == salt}
        freed = host_freed = 0
        for branch in sorted(branches, key=lambda b: (b.namespace, b.session, b.branch)):
            closed = self.close_branch(branch)
            freed += closed.get("freed_tokens", 0)
            host_freed += closed.get("host_freed_tokens", 0)
            self.seen.discard(branch)
        self.contexts.forget_where(lambda b: namespace_salt(b.namespace) == salt)
        device, host = self.free_nodes(self._salted_nodes(salt))
        freed += device
        host_freed += host
        left = self._salted_nodes(salt)  # what the purge could not free (locked, or a copy in flight)
        locked = sum(len(n.key) for n in left if n.component_data[FULL].value is not None)
        # L3 pages of the salt's nodes that already left the tree: its purge manifest names them. Nodes
        # still here (locked by a running request or an L3 write in flight) stay in the manifest, so a
        # later purge or eviction can still reach their pages.
        l3_manifest = False
        if self.l3 is not None:
            kept = [h for n in left for h in (n.hash_value or ())]
            l3_manifest = self.l3.purge(salt, keep=kept)
        return {"branches_closed": len(branches), "freed_tokens": freed,
                "host_freed_tokens": host_freed,
                "locked_tokens": locked, "l3_manifest_purged": l3_manifest}

    def _salted_nodes(self, salt: str) -> list:
        core = self.tree_core
        return [n for n in core.all_nodes() if n is not core.root_node and n.key.cache_salt == salt]

    def reclaim_terminated(self) -> int:
        """Free every terminated node that is an unlocked device leaf, bottom-up. Returns tokens freed."""
        core = self.tree_core
        if not core.reclaimable():  # runs every scheduler step: the common case must cost ~nothing
            return 0
        freed = self._evict_nodes(core.terminated, budget=None)
        core.reclaimed()  # after, not before: the parents this reclaim exposed were candidates too
        self.freed_on_close_tokens += freed
        return freed

    def _evict_nodes(self, candidates, budget: int | None) -> int:
        """Delete unlocked device leaves among ``candidates`` (oldest first; a parent that becomes a leaf
        and is a candidate follows) until ``budget`` tokens are freed or none is left.

        Deleted, never written to host (state nobody will read again); on HiCache from its host pool and
        L3 too (:meth:`_delete_everywhere`). Ties are broken by node id so every rank picks the same
        victims.
        """
        if self.on_hicache:
            return self._delete_everywhere(candidates)
        core = self.tree_core
        members = set(candidates)
        heap = [(n.last_access_time, n.id, n) for n in members if core.is_device_leaf(n)]
        heapq.heapify(heap)
        tracker = {ct: 0 for ct in self.tree_components}
        while heap and (budget is None or tracker[FULL] < budget):
            _, _, node = heapq.heappop(heap)
            if not core.is_device_leaf(node):
                continue
            parent = node.parent
            result = core.evict_device_leaf(node.id, is_write_back=False)
            self._apply_eviction_result(result)
            self._accumulate_tracker(tracker, result.tracker)
            if parent in members and core.is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return tracker[FULL]

    def _delete_everywhere(self, candidates) -> int:
        """HiCache attached: delete ``candidates`` from the device *and* HiCache's host pool, leaves
        first (a parent whose last child went follows), oldest first with node ids breaking ties, so
        every rank deletes the same nodes in the same order. A candidate that is locked, has a copy
        in flight, or has children that are not candidates stays; it is retried when a lock or ack
        releases it (``AgentTreeCore._update_evictable_leaf_sets`` marks the reclaim due). Returns
        device tokens freed; host tokens go to ``hicache_deletes``."""
        core = self.tree_core
        members = set(candidates)
        heap = [(n.last_access_time, n.id, n) for n in members if core.deletable_everywhere(n)]
        heapq.heapify(heap)
        device_before = self.hicache_deletes["device_tokens"]
        pages: list[str] | None = [] if self.l3 is not None else None
        while heap:
            _, _, node = heapq.heappop(heap)
            if not core.deletable_everywhere(node):
                continue
            parent = node.parent
            self._delete_node_everywhere(node, pages)
            if parent in members and core.deletable_everywhere(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if pages:
            self._delete_from_l3(pages)
        return self.hicache_deletes["device_tokens"] - device_before

    def _delete_node_everywhere(self, node, pages: list[str] | None):
        """Delete one node ``AgentTreeCore.deletable_everywhere`` allows, on the device and in HiCache's
        host pool, and count it; its L3 page hashes are appended to ``pages`` (None: no L3 store) for
        the caller to delete in one batch. Returns the drained step result."""
        data, counts = node.component_data[FULL], self.hicache_deletes
        counts["device_tokens"] += len(data.value) if data.value is not None else 0
        counts["host_tokens"] += len(data.host_value) if data.host_value is not None else 0
        if pages is not None and node.hash_value:
            pages.extend(node.hash_value)
        result = self.tree_core.delete_everywhere(node)
        self._apply_eviction_result(result)
        return result

    def _delete_from_l3(self, pages: list[str]) -> None:
        """Deleted nodes' L3 pages: forgotten by HiCache's belief of what storage holds (on every rank,
        in the same order: those beliefs decide prefetches), then deleted from the store off-thread."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        self.storage_existence_cache.pool(PoolName.KV).invalidate_beyond(pages, 0)
        self.l3.delete(pages)

    def _evict_components(self, request_by_type, tracker, available_size_targets=None, *,
                          allocation_reclaim_satisfied=None):
        """SGLang's device eviction walk, remembering what it must free so that its last victim gives up
        only the tail that need requires (:meth:`_device_need_left`, ``leaf_tails.device_tail``)."""
        # A walk under an allocator's own predicate does not say how much is left: whole leaves there.
        self._device_need = None if allocation_reclaim_satisfied is not None else (
            request_by_type.get(FULL, 0), (available_size_targets or {}).get(FULL))
        try:
            return super()._evict_components(request_by_type, tracker, available_size_targets,
                                             allocation_reclaim_satisfied=allocation_reclaim_satisfied)
        finally:
            self._device_need = None

    def _device_need_left(self, tracker) -> int | None:
        """Device tokens the running eviction walk still has to free (None: unknown, or no walk): to its
        target of free slots for an allocation (``evict_for_alloc``), else to its requested count."""
        need = self._device_need
        if need is None:
            return None
        requested, target = need
        if target is None:
            return requested - tracker[FULL]
        component, size = target
        return size - self._component_available_size(FULL) if component == FULL else None

    def _evict_device_leaf(self, node_id, tracker):
        """Stock eviction of one leaf (memory pressure), counting what an over-quota branch loses (its
        nodes rank first); on HiCache :meth:`_evict_device_leaf_on_hicache`. A leaf longer than what
        the walk still needs gives up only that tail (``leaf_tails.device_tail``: the tail keeps the
        node id, its head stays)."""
        node = self.tree_core.node_by_id(node_id)
        need = self._device_need_left(tracker)
        if need is not None:
            device_tail(self.tree_core, node, need)
        if self.on_hicache:
            return self._evict_device_leaf_on_hicache(node_id, tracker)
        state = node.agent
        if state.owner is not None and not state.terminated and self.over_quota(state.owner):
            self.quota_trimmed_tokens += len(node.key)
        return super()._evict_device_leaf(node_id, tracker)

    def _evict_device_leaf_on_hicache(self, node_id, tracker):
        """HiCache's eviction of one leaf (demote a backed-up one, back up then demote under
        write-back), except a terminated node, deleted on both tiers instead: nobody will read it
        again, and a backup would spend host room and a copy on it (and, with L3, storage); and a
        write-back leaf longer than the host room, whose head is backed up (SGLang drops it whole)."""
        core = self.tree_core
        node = core.node_by_id(node_id)
        if node.agent.terminated and core.deletable_everywhere(node):
            if node.component_data[FULL].host_value is None:
                self.hicache_deletes["backups_skipped_tokens"] += len(node.key)
            pages: list[str] | None = [] if self.l3 is not None else None
            self._accumulate_tracker(tracker, self._delete_node_everywhere(node, pages).tracker)
            if pages:
                self._delete_from_l3(pages)
            return None
        if back_up_head(self, node, tracker):  # too long for the host room: its head goes to host
            return None
        return super()._evict_device_leaf(node_id, tracker)

    def evict(self, params):
        """Stock eviction, then reclaim of terminated nodes it exposed as leaves (same step)."""
        result = super().evict(params)
        freed = self.reclaim_terminated()
        return dataclasses.replace(result, num_tokens_evicted=result.num_tokens_evicted + freed) if freed else result

    def on_release(self, req, *, checkpointed: bool) -> None:
        _STOCK_ON_RELEASE(self, req, checkpointed=checkpointed)
        state = state_of(req)
        plan = state.plan
        if self.admission is not None:
            self.admission.released(req, answered=req.finished() and not isinstance(req.finished_reason, FINISH_ABORT))
        if plan is not None and plan.own.owner is not None and not state.refused:
            # An aborted subagent (fork) is cancelled for good; an aborted turn of a root branch (a
            # client timeout on the lead agent) must not drop the whole session's history.
            hint = state.hint
            if ((plan.parent is not None and isinstance(req.finished_reason, FINISH_ABORT))
                    or (hint is not None and hint.close and req.finished())):
                self.close_branch(plan.own.owner)
            elif (req.finished() and not isinstance(req.finished_reason, FINISH_ABORT)
                  and plan.own.owner not in self.closed):  # a closed branch's late call leaves no context
                self.contexts.record(plan.own.owner, req.origin_input_ids, req.output_ids)
        if self.tree_core.reclaim_due:  # the request's unlock may have exposed terminated leaves
            self.reclaim_terminated()

    def reset(self) -> None:
        """SGLang's full reset (``Scheduler.flush_cache``: ``/flush_cache``, weight updates) empties the
        tree; pause state hangs from its nodes, so it goes too. What a branch *is* stays: a closed
        branch is still closed after a flush, and quotas still apply."""
        super().reset()
        pauses = getattr(self, "pauses", None)  # SGLang's __init__ calls reset before ours runs
        if pauses is not None:
            pauses.reset()

    def release_radix_session(self, session_id: str) -> int:
        result = super().release_radix_session(session_id)
        self.close_session(None, session_id)
        return result

    def flush_pending_backups(self) -> None:
        # Runs every scheduler step: the stock method is called directly (cheaper than super()) and
        # an idle step costs two attribute tests.
        _STOCK_FLUSH(self)
        if self.tree_core.reclaim_due:
            self.reclaim_terminated()
        if self.metrics is not None:
            self.metrics.maybe_publish(self)

    # ---- read-only views (served by /agentcache/stats and /agentcache/check) ----

    def resident_tokens_by_class(self, namespace: str | None = None) -> dict[str, int]:
        """Device-resident tokens per lifecycle class, plus ``terminated`` (not yet reclaimed); only
        those of ``namespace`` when given."""
        counts = {"stable": 0, "session": 0, "scratch": 0, "untagged": 0, "terminated": 0}
        for node in self.tree_core.all_nodes():
            value = node.component_data[FULL].value
            if node is self.tree_core.root_node or value is None:
                continue
            if namespace is not None and namespace_key(node.key.extra_key, node.key.cache_salt) != namespace:
                continue
            counts["terminated" if node.agent.terminated else node.agent.cls.name.lower()] += len(value)
        return counts

    def agent_stats(self) -> dict:
        """The scheduler-side half of ``GET /agentcache/stats``; identical on every TP rank."""
        core = self.tree_core
        branches = sorted(core.owner_index, key=lambda b: (b.namespace, b.session, b.branch))
        return {
            "impl": type(self).__name__,
            "tree_core": type(core).__name__,
            "page_size": self.page_size,
            "pool_tokens": self.token_to_kv_pool_allocator.size,
            "evictable_tokens": self.evictable_size(),
            "protected_tokens": self.protected_size(),
            "resident_tokens": self.resident_tokens_by_class(),
            "branch_quota_tokens": self.branch_quota_tokens,
            "session_quota_tokens": self.session_quota_tokens,
            "branches": [b.to_dict() | {"owned_tokens": core.owned_tokens(b), "closed": b in self.closed}
                         for b in branches],
            "closed_branches": len(self.closed),
            "freed_on_close_tokens": self.freed_on_close_tokens,
            "kept_on_close_tokens": self.kept_on_close_tokens,
            "terminated_pending_tokens": sum(len(n.key) for n in core.terminated),
            "quota_trimmed_tokens": self.quota_trimmed_tokens,
            "device_trims": dict(self.tree_core.device_trims),  # eviction split a leaf and kept its head
            "over_quota_branches": sum(self.over_quota(b) for b in core.owner_index),
            "invalid_hints": self.invalid_hints,
            "inferred_orphans": self.inferred_orphans,
            "shared_prefill_waits": self.shared_prefill_waits,
            "inferred_fork_points": self.inferred_fork_points,
            "adopted_shared_tokens": self.adopted_tokens,
            "context_edit_freed_tokens": self.context_edit_freed_tokens,
            "pauses": self.pauses.stats(),
            "hicache": self.hicache_stats(),
            "admission": self.admission.stats() if self.admission is not None else {"strategy": "off"},
        }

    def hicache_stats(self) -> dict:
        """HiCache's host pool as our lifecycle sees it (``{"attached": False}`` without HiCache): its
        size and free slots, host-only tokens per class, and what closes deleted on each tier."""
        if not self.on_hicache:
            return {"attached": False}
        counts = {"stable": 0, "session": 0, "scratch": 0, "untagged": 0, "terminated": 0}
        for node in self.tree_core.host_holders():
            counts["terminated" if node.agent.terminated else node.agent.cls.name.lower()] += \
                len(node.component_data[FULL].host_value)
        host = self.cache_controller.mem_pool_host
        return {"attached": True, "write_policy": "write_back" if self.is_write_back else "write_through",
                "host_pool_tokens": int(host.size), "host_available_tokens": int(host.available_size()),
                "host_tokens_by_class": counts, "storage_backend": bool(self.enable_storage),
                "deleted": dict(self.hicache_deletes) | (self.l3.counters if self.l3 is not None else {}),
                "partial_backups": dict(self.partial_backups),
                "host_trims": dict(self.tree_core.host_trims),
                # storage prefetches of paused branches (L3 -> host) whose reads have not finished
                "storage_fetches_in_flight": sum(1 for h in getattr(self, "ongoing_prefetch", ())
                                                 if h.rid.startswith(FETCH_RID_PREFIX)),
                "vetoed_backup_tokens": self.tree_core.vetoed_backup_tokens}

    def _hicache_host_tokens(self, namespace: str) -> int:
        """Tokens of ``namespace`` in HiCache's host pool (0 without HiCache)."""
        if not self.on_hicache:
            return 0
        return sum(len(n.component_data[FULL].host_value) for n in self.tree_core.host_holders()
                   if namespace_key(n.key.extra_key, n.key.cache_salt) == namespace)

    def namespace_stats(self, namespace: str) -> dict:
        """One namespace's own view of the cache (what a tenant may read: nothing of anyone else's)."""
        core, pauses = self.tree_core, self.pauses
        branches = sorted((b for b in core.owner_index if b.namespace == namespace),
                          key=lambda b: (b.session, b.branch))
        kept = [t for b, t in pauses.kept.items() if b.namespace == namespace]
        return {
            "namespace": namespace,
            "resident_tokens": self.resident_tokens_by_class(namespace),
            "host_tokens": self._hicache_host_tokens(namespace),
            "branches": [b.to_dict() | {"owned_tokens": core.owned_tokens(b), "closed": b in self.closed}
                         for b in branches],
            "paused_branches": sum(b.namespace == namespace for b in pauses.records),
            "kept_branches": len(kept), "kept_tokens": sum(kept),
            "branch_quota_tokens": self.branch_quota_tokens,
            "session_quota_tokens": self.session_quota_tokens,
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
    from sgl_agentcache.server.topology import UnsupportedTopology, refusal

    check_pinned_internals()
    _check_settings()
    if ctx.disable_radix_cache:
        logger.info("agentcache: --disable-radix-cache is set; deferring to SGLang's default cache chain")
        return registry.default_radix_cache_factory(ctx)
    # Normally refused before any process starts (server/topology.py); again here for a scheduler built
    # any other way, before anything of ours runs across pipeline stages.
    reason = refusal(BACKEND_NAME, 1, 1, 1, False, pp_size=int(getattr(ctx.params, "pp_size", 1) or 1))
    if reason is not None:
        raise UnsupportedTopology(reason)
    ctx.params.tree_core_backend = BACKEND_NAME
    return registry.create_unified_radix_cache(ctx, cache_class=AgentRadixCache)


def _check_settings() -> None:
    """A bad ``AGENTCACHE_*`` setting (the HTTP process's as well as ours) or changed chat internals
    stop start-up here: the HTTP process's plugin hook that reads them can only log (SGLang logs plugin
    errors and goes on)."""
    from sgl_agentcache.server.pins import CHAT_PINS, check_pinned_internals

    if Settings.from_env().infer_mode() == "chat":
        check_pinned_internals(CHAT_PINS)


def agent_tree_core_factory(params, components) -> AgentTreeCore:
    return AgentTreeCore(params, components)


def register_backends() -> None:
    """Register the ``agentcache`` tree-core and radix-cache backends with SGLang if absent (idempotent).

    The cache's own registrations, shared by the plugin entry point (serving processes) and the offline
    driver (no server, so none of the plugin's HTTP, ingress or IPC hooks).
    """
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        get_tree_core_factory,
        register_tree_core_backend,
    )

    if get_tree_core_factory(BACKEND_NAME) is None:
        register_tree_core_backend(BACKEND_NAME, agent_tree_core_factory)
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, agentcache_factory)
