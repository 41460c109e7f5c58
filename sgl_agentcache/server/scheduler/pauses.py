"""Tool-call pauses in the scheduler: keep / offload / discard / release a paused branch's KV.

One :class:`PauseBook` per :class:`~sgl_agentcache.server.scheduler.cache.AgentRadixCache`. Its inputs arrive as
messages (the ``/agentcache/pause`` route, the replayer), identical on every TP rank; the clock-dependent
parts of a decision (the tool class's learned latency distribution, time left to the deadline) are
computed once by the sender and travel in the message. Everything else the policy reads is tree state
(retained tokens, free and evictable tokens, host headroom) or configuration (bandwidths and prefill
rate of the deployment's profile), so every rank takes the same decision.

The host tier is SGLang's HiCache (``--enable-hierarchical-cache``): its host pool, cache controller and
L3 storage carry every host copy; a server without it has no host tier, as stock SGLang, and an
offload there can only be a discard.

Two modes (``AGENTCACHE_PAUSE_MODE``). **Lazy** (the default): the decision is advice and nothing moves
at the pause. The branch stays ranked as before; what eviction later pushes of it into HiCache's host
pool ranks there by the advice (``AgentRadixCache.hicache_host_key``): kept ahead of other host
entries (OFFLOAD, KEEP), or dropped first (DISCARD). Its next request loads back what HiCache holds; a
prefetch loads it earlier (host -> device into free memory, and, with an L3 store, what left the host
pool for L3 starts back to host through HiCache's storage prefetch); RELEASE (deadline) frees it on every tier at once. Nothing is pinned, so
the ``max_kept_*`` caps have nothing to bound. Measured on the replay suite, moving or pinning at the
pause recomputed more than it saved, because a pause rarely coincides with the moment memory is needed.

**Eager** (``AGENTCACHE_PAUSE_MODE=eager``): the decision is carried out at once, on the branch's
*movable suffix* (``branch_walks.movable_suffix``: the chain of device nodes it owns at the end of its
path that nothing else holds):

- KEEP: the branch is pinned: its nodes rank above every unpinned node for eviction, until resume,
  deadline or close. Pins are capped per namespace (branches and tokens); over the cap KEEP degrades
  to OFFLOAD and the clip is counted.
- OFFLOAD: on HiCache the suffix is backed up and demoted into HiCache's host pool now
  (``hicache_moves.demote_chain``), and the pause is recorded as OFFLOAD advice; without HiCache there
  is no host room and it falls back to DISCARD (``offload_fallbacks["host_full"]``).
- DISCARD: every unlocked node the branch owns is freed now, on every tier; resume re-prefills.
- RELEASE: DISCARD, and the pause is over (deadline passed, nothing worth keeping).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field

from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.distributions import LatencyDistribution
from sgl_agentcache.policy.pause import Incumbent, PauseAction, PauseDecision, PauseInputs, Placement, PolicyConfig, decide
from sgl_agentcache.policy.retention import displaced_host_seconds, prefetch_worthwhile
from sgl_agentcache.server.scheduler.branch_walks import movable_suffix, path_key, path_of, tip
from sgl_agentcache.server.scheduler.hicache_moves import demote_chain
from sgl_agentcache.settings import Settings

logger = logging.getLogger(__name__)

#: Namespaces whose prefetch precision is remembered (see PauseBook._prefetch_enabled).
PREFETCH_NAMESPACES = 4096


@dataclass
class PauseSettings:
    """Server-side constants of pause decisions; no hint can change them."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    prefill_tokens_per_s: float
    bytes_per_token: int  # KV bytes per token of this pool (all layers)
    max_kept_branches: int
    max_kept_tokens: int
    prefetch_budget_tokens: int
    prefetch_min_precision: float = 0.5  # below this (over the last window), prefetch turns itself off
    prefetch_window: int = 32
    prefetch_probe_every: int = 8  # while off, every n-th prefetch still runs, so it can turn back on
    lazy: bool = True  # AGENTCACHE_PAUSE_MODE=lazy (the default): decisions are advice
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def default_settings(allocator, pool_tokens: int, settings: Settings | None = None) -> PauseSettings:
    """Pause settings from the operator's (``settings``; default: the environment's) and the
    deployment profile.

    Bandwidths and prefill rate come from the profile named by ``AGENTCACHE_PROFILE`` (default
    ``seed``; or the path of a profile written by ``bench/gpu/calibrate.py``). KV bytes per token are
    measured from the pool, unless the profile is named explicitly: then the profile's figure is used
    too (a tiny CPU test model priced as the deployment it stands for).
    """
    from sgl_agentcache.policy.profiles import resolve_profile

    settings = Settings.from_env() if settings is None else settings
    named = settings.profile
    profile = resolve_profile(named or "seed")  # a built-in name or a calibrated profile file
    kv = allocator.get_kvcache() if allocator is not None else None
    per_token = profile.kv_bytes_per_token if named else 0
    if not named and kv is not None and hasattr(kv, "get_kv_size_bytes") and getattr(kv, "size", 0):
        total = kv.get_kv_size_bytes()  # (k bytes, v bytes) for MHA pools, one figure for others
        total = sum(total) if isinstance(total, (tuple, list)) else total
        per_token = int(total) // (kv.size + kv.page_size)  # SGLang pads the pool with one page
    s = settings
    return PauseSettings(
        h2d_bytes_per_s=profile.h2d_bytes_per_s, d2h_bytes_per_s=profile.d2h_bytes_per_s,
        prefill_tokens_per_s=profile.prefill_tokens_per_s, bytes_per_token=max(per_token, 1),
        max_kept_branches=s.max_kept_branches or 16, max_kept_tokens=s.max_kept_tokens or pool_tokens // 2,
        prefetch_budget_tokens=s.prefetch_budget_tokens or max(pool_tokens // 8, 1),
        lazy=s.pause_mode == "lazy")


@dataclass
class PauseRecord:
    branch: BranchKey
    tool_class: str
    placement: Placement  # DEVICE (advised, kept or offloaded to HiCache) or NONE (discarded)
    decision: PauseDecision | None
    tokens: int  # what the decision concerned when the pause began
    prefetched_tokens: int = 0  # loaded back speculatively, not yet used by a request
    prefetch_seconds: float = 0.0  # that load's transfer time at the profile's rate (stats only)
    advice: PauseAction | None = None  # the decision, carried out by eviction and HiCache's host pool
    path: tuple | None = None  # (tokens, extra_key, cache_salt) of the branch's path (prefetch)
    prefetch_end: int = 0  # the path's device match right after its prefetch
    storage_fetch: object | None = None  # HiCache's request handle of its L3 prefetch, while paused


class PauseBook:
    """The scheduler's pause state for one cache (see the module docstring)."""

    def __init__(self, cache, settings: PauseSettings):
        self.cache = cache
        self.settings = settings
        self.records: dict[BranchKey, PauseRecord] = {}
        self.kept: dict[BranchKey, int] = {}  # pinned branch -> tokens pinned
        # Paused branch -> the decision, read by HiCache's host eviction (AgentRadixCache.hicache_host_key).
        self.advice: dict[BranchKey, PauseAction] = {}
        self.counters = {"decisions": {a.value: 0 for a in PauseAction}, "forced": 0, "kept_clipped": 0,
                         "refused_closed": 0, "too_small": 0,
                         "offload_fallbacks": {"host_full": 0},
                         "offload_partial": 0,
                         "deadline_releases": 0, "released_tokens": 0, "hicache_offloaded_tokens": 0}
        self.prefetch = {"issued": 0, "used": 0, "wasted": 0, "tokens_prefetched": 0, "tokens_used": 0,
                         "tokens_wasted": 0, "refused_budget": 0, "refused_disabled": 0, "refused_nothing": 0,
                         "refused_room": 0, "refused_no_gain": 0, "refused_queue": 0,
                         "saved_transfer_s": 0.0,
                         # L3 -> host (HiCache's storage prefetch): started, tokens asked, tokens landed
                         "storage_issued": 0, "storage_tokens_asked": 0, "storage_tokens_loaded": 0}
        # namespace -> [recent prefetch outcomes (True = used), refusals since the last probe]: each
        # namespace's precision gates its own prefetch; the least recently used namespace is forgotten
        # past PREFETCH_NAMESPACES (its prefetch is on again).
        self._outcomes: NamespacedLRU[str, list] = NamespacedLRU(PREFETCH_NAMESPACES, 1, namespace_of=lambda ns: ns)
        self.log: deque = deque(maxlen=256)  # recent decisions with their inputs, for /agentcache/stats

    def _namespace_kept(self, namespace: str) -> tuple[int, int]:
        mine = [t for b, t in self.kept.items() if b.namespace == namespace]
        return len(mine), sum(mine)

    # ---- pause ----

    def inputs(self, branch: BranchKey, latency: LatencyDistribution, *, elapsed_s: float = 0.0,
               deadline_s: float | None = None, priority: int = 0, resume_probability: float = 1.0,
               prefetch_lead_s: float = 0.0) -> PauseInputs:
        """The policy's inputs for ``branch`` now: tree facts plus the sender's clock-derived values."""
        core = self.cache.tree_core
        record = self.records.get(branch)
        if self.lazy:  # advice covers whatever of the branch eviction may later take: all it owns
            tokens = core.owned_count.get(branch, 0)
        else:  # an applied decision moves the movable suffix
            tokens = sum(len(n.key) for n in movable_suffix(core, branch))
        placement = Placement.DEVICE
        previous = None
        if record is not None:
            placement = record.placement
            if record.decision is not None:
                previous = Incumbent(record.decision.action, record.decision.cost)
        allocator, s = self.cache.token_to_kv_pool_allocator, self.settings
        # What host memory costs this pause: the value of the host entries an offload would displace.
        retention = dataclasses.replace(self.cache.retention, host_reuse=self.cache.host_reuse_rate())
        free_host, host_room = self.cache.host_room()
        displaced = displaced_host_seconds(retention, tokens, free_host) if placement is Placement.DEVICE else 0.0
        return PauseInputs(
            retained_tokens=tokens, bytes_per_token=s.bytes_per_token, latency=latency,
            device_free_tokens=allocator.available_size(), device_evictable_tokens=self.cache.evictable_size(),
            device_total_tokens=allocator.size,
            host_free_bytes=host_room * s.bytes_per_token,
            h2d_bandwidth_Bps=s.h2d_bytes_per_s, d2h_bandwidth_Bps=s.d2h_bytes_per_s,
            prefill_tokens_per_s=s.prefill_tokens_per_s, elapsed_s=elapsed_s, deadline_s=deadline_s,
            priority=priority, resume_probability=resume_probability, prefetch_lead_s=prefetch_lead_s,
            placement=placement, previous=previous, host_displaced_s=displaced)

    def pause(self, branch: BranchKey, latency: LatencyDistribution | None = None, *, tool_class: str = "default",
              force: PauseAction | None = None, caps: dict | None = None, **inputs) -> dict:
        """Decide and apply. ``force`` (baselines, tests) skips the policy; a pause of a branch that is
        already paused re-evaluates it (hysteresis against the previous decision). ``caps`` (a tenant's
        ceilings, from the HTTP side) can only lower the server-wide ``max_kept_*`` caps."""
        if branch in self.cache.closed:
            self.counters["refused_closed"] += 1
            return {"paused": False, "reason": "branch is closed"}
        decision = None
        if force is None:
            if latency is None:
                raise ValueError("pause needs a latency distribution unless the action is forced")
            decision = decide(self.inputs(branch, latency, **inputs), self.settings.policy)
            action = decision.action
            if action is PauseAction.RELEASE and decision.inputs.retained_tokens < self.settings.policy.min_tokens:
                # Too small to be worth a decision: not tracked, and left to ordinary eviction (freeing
                # it would only cost a re-prefill if the branch comes back). A branch already paused
                # keeps its pause as it is: its device suffix can be small because what it holds is
                # elsewhere (in HiCache's host pool, or under its subagents' nodes when a join re-prices
                # it), and releasing would drop that on every tier.
                self.counters["too_small"] += 1
                return {"paused": branch in self.records, "action": "none",
                        "tokens": decision.inputs.retained_tokens, "branch": branch.to_dict(),
                        "tool_class": tool_class, "reason": decision.reason}
        else:
            action = force
            self.counters["forced"] += 1
        record = self.records.get(branch)
        # A re-pause (a join re-priced) makes a new record: an L3 fetch of the old one stops; the next
        # prefetch starts another. (A pause too small to decide keeps the old record, and its fetch.)
        self._end_storage_fetch(record)
        if force is None and self.lazy and action is not PauseAction.RELEASE and (
                record is None or record.placement is Placement.DEVICE):
            return self._advise(branch, tool_class, action, decision)
        applied = action
        if applied is PauseAction.KEEP:
            pinned = sum(len(n.key) for n in movable_suffix(self.cache.tree_core, branch))
            if self._keep_clipped(branch, pinned, caps):
                applied = PauseAction.OFFLOAD
        if applied is PauseAction.OFFLOAD:
            if self.cache.on_hicache:
                return self._offload_on_hicache(branch, tool_class, decision, decided=action)
            self.counters["offload_fallbacks"]["host_full"] += 1  # no host tier without HiCache
            applied = PauseAction.DISCARD
        self.advice.pop(branch, None)  # a lazy pause becomes an applied one
        if applied is PauseAction.KEEP:
            tokens = self.kept[branch] = pinned
        else:
            self.kept.pop(branch, None)
            tokens, host = self._discard(branch)
            if applied is PauseAction.RELEASE:
                self.counters["released_tokens"] += tokens + host
        self.counters["decisions"][applied.value] += 1
        if applied is PauseAction.RELEASE:
            self.records.pop(branch, None)
        else:
            where = Placement.DEVICE if applied is PauseAction.KEEP else Placement.NONE
            self.records[branch] = PauseRecord(branch, tool_class, where, decision, tokens)
        entry = self._entry(branch, tool_class, applied, action, decision, tokens)
        self.log.append(entry)
        logger.info("agentcache pause %s/%s (%s): %s", branch.session, branch.branch, tool_class,
                    entry["reason"] if applied is action else f"{action.value} -> {applied.value}")
        return {"paused": applied is not PauseAction.RELEASE} | entry

    @staticmethod
    def _entry(branch: BranchKey, tool_class: str, applied: PauseAction, decided: PauseAction,
               decision: PauseDecision | None, tokens: int) -> dict:
        """One decision as the route returns it and ``recent_decisions`` shows it (``forced``: no
        ``decision``, the action was given)."""
        entry = {"branch": branch.to_dict(), "tool_class": tool_class, "action": applied.value,
                 "decided": decided.value, "forced": decision is None, "tokens": tokens,
                 "reason": decision.reason if decision is not None else "forced"}
        if decision is not None:
            entry["costs"] = {o.action.value: o.cost for o in decision.options if o.feasible}
            entry["inputs"] = {"retained_tokens": decision.inputs.retained_tokens,
                               "device_free_tokens": decision.inputs.device_free_tokens,
                               "device_evictable_tokens": decision.inputs.device_evictable_tokens,
                               "host_free_bytes": decision.inputs.host_free_bytes,
                               "latency_p50_s": decision.inputs.latency_p50_s,
                               "latency_p99_s": decision.inputs.latency_p99_s,
                               "deadline_s": decision.inputs.deadline_s, "priority": decision.inputs.priority,
                               "h2d_bytes_per_s": decision.inputs.h2d_bandwidth_Bps,
                               "d2h_bytes_per_s": decision.inputs.d2h_bandwidth_Bps}
        return entry

    @property
    def lazy(self) -> bool:
        """Pauses are advice (the default; ``AGENTCACHE_PAUSE_MODE=eager`` applies them at once). On the
        replay suite an applied pause -- a pin, a drop, a move at the pause -- recomputed more than
        leaving the branch to eviction, up to 1.8x stock without a host tier."""
        return self.settings.lazy

    def _keep_clipped(self, branch: BranchKey, tokens: int, caps: dict | None) -> bool:
        """Whether pinning ``tokens`` of ``branch`` (its movable suffix) would pass its namespace's kept
        caps (counted)."""
        count, pinned = self._namespace_kept(branch.namespace)
        pinned -= self.kept.get(branch, 0)
        count -= branch in self.kept
        max_branches, max_tokens = self._cap("max_kept_branches", caps), self._cap("max_kept_tokens", caps)
        if count + 1 <= max_branches and pinned + tokens <= max_tokens:
            return False
        self.counters["kept_clipped"] += 1
        logger.info("agentcache: keep of %s/%s clipped (%d kept branches, %d + %d tokens; caps %d, %d)",
                    branch.session, branch.branch, count, pinned, tokens, max_branches, max_tokens)
        return True

    def _discard(self, branch: BranchKey) -> tuple[int, int]:
        """Free every unlocked node ``branch`` owns, on the device and (HiCache) in the host pool and L3.
        Returns (device tokens, host tokens) freed."""
        return self.cache.free_nodes(self.cache.tree_core.owner_index.get(branch, ()))

    def _offload_on_hicache(self, branch: BranchKey, tool_class: str, decision: PauseDecision | None,
                            decided: PauseAction = PauseAction.OFFLOAD) -> dict:
        """An applied offload (forced, eager mode, or a clipped keep) on HiCache: the branch's movable
        suffix is backed up and demoted into HiCache's host pool now (``hicache_moves.demote_chain``),
        and the pause is recorded as an offload advice is, because from here on it is one: its host
        copies rank in the protected band, a prefetch or the branch's next request loads them back
        through HiCache, and what found no host room stays on the device for eviction to judge."""
        self.kept.pop(branch, None)
        chain = movable_suffix(self.cache.tree_core, branch)
        entry = self._advise(branch, tool_class, PauseAction.OFFLOAD, decision, chain)
        moved = demote_chain(self.cache, chain)
        self.counters["hicache_offloaded_tokens"] += moved
        if moved < entry["tokens"]:
            self.counters["offload_partial"] += 1
        entry.update(lazy=False, decided=decided.value, moved_tokens=moved)
        return entry

    def _advise(self, branch: BranchKey, tool_class: str, action: PauseAction,
                decision: PauseDecision | None, chain: list | None = None) -> dict:
        """Lazy mode: record the decision as advice, move nothing. The branch's KV stays where it is,
        ranked as before; what eviction later pushes of it into HiCache's host pool is kept there ahead
        of other host entries (OFFLOAD, and KEEP: judged worth device memory, so when pressure pushes
        it to host anyway it must not go before an offloaded one), or dropped first (DISCARD: not
        worth displacing anything) (``AgentRadixCache.hicache_host_key``). Its next request loads back
        what HiCache holds when it is matched; a prefetch loads it back earlier. Nothing is pinned:
        measured on the replay suite, moving or pinning at the pause cost more recompute than it
        saved (module docstring). ``chain``: the branch's movable suffix, if the caller has it."""
        core = self.cache.tree_core
        end = tip(core, branch)
        chain = movable_suffix(core, branch) if chain is None else chain
        tokens = sum(len(n.key) for n in chain)
        self.kept.pop(branch, None)
        self.records[branch] = PauseRecord(branch, tool_class, Placement.DEVICE, decision, tokens, advice=action,
                                           path=path_of(core, end) if end is not None else None)
        self.counters["decisions"][action.value] += 1
        self.advice[branch] = action
        entry = self._entry(branch, tool_class, action, action, decision, tokens) | {"lazy": True}
        self.log.append(entry)
        logger.info("agentcache pause %s/%s (%s, lazy): %s", branch.session, branch.branch, tool_class,
                    entry["reason"])
        return {"paused": True} | entry

    def _cap(self, name: str, caps: dict | None) -> int:
        """A server-wide cap, lowered (never raised) by a tenant's ceiling of the same name."""
        value = getattr(self.settings, name)
        return min(value, int(caps[name])) if caps and caps.get(name) is not None else value

    # ---- resume, prefetch, deadline, close ----

    def resume(self, branch: BranchKey) -> dict:
        """The tool returned (route) or the branch's next request arrived: the pause ends, the branch
        is unpinned and its host copies (HiCache's) are ordinary host entries again. Its request
        loads back what HiCache holds when the scheduler matches it."""
        record = self.records.pop(branch, None)
        if record is None:
            return {"resumed": False, "reason": "branch is not paused"}
        self._end_storage_fetch(record)  # what it fetched is in the host pool; the request loads it back
        self.kept.pop(branch, None)
        self.advice.pop(branch, None)
        prefetched = record.prefetched_tokens
        if prefetched:
            self._prefetch_outcome(branch, record)
        return {"resumed": True, "placement": record.placement.value, "prefetched_tokens": prefetched}

    def prefetch_branch(self, branch: BranchKey, queued: int = 0, caps: dict | None = None) -> dict:
        """"Tool nearly done": load the branch's host copies back now (HiCache's load path), ahead of
        the request, within the namespace's speculative budget, into free memory only, and only while no
        request waits for admission (``queued``, the scheduler's waiting queue): speculation never
        competes with work that is already here. With an L3 store, the part of the branch's path past
        its host copies starts back from L3 to host at the same time (``storage_tokens`` in the reply;
        once per pause); a later prefetch or the request loads it on to the device."""
        record = self.records.get(branch)
        if record is None or record.path is None or record.prefetched_tokens or not self.cache.on_hicache:
            self.prefetch["refused_nothing"] += 1
            return {"prefetched": False, "reason": "nothing on host for this branch (or already prefetched)"}
        if queued > 0:
            self.prefetch["refused_queue"] += 1
            return {"prefetched": False, "reason": f"{queued} requests wait for admission"}
        ns = branch.namespace
        if not self._prefetch_enabled(ns):
            self.prefetch["refused_disabled"] += 1
            return {"prefetched": False, "reason": "prefetch is off for this namespace (precision below "
                                                     f"{self.settings.prefetch_min_precision})"}
        key = path_key(record.path)
        budget = self._cap("prefetch_budget_tokens", caps)
        stored = self._fetch_from_storage(record, key, budget)
        reply = self._load_from_host(branch, record, key, budget)
        if stored:  # L3 -> host started, whatever the host part did
            reply |= {"prefetched": True, "storage_tokens": stored}
        return reply

    def _fetch_from_storage(self, record: PauseRecord, key, budget: int) -> int:
        """The part of the branch's path past its host match that HiCache's L3 store may hold: its storage
        prefetch starts now (L3 -> host; at most ``budget`` tokens, the speculative budget: host room is
        HiCache's to manage). Once per pause. Returns the tokens asked of L3."""
        if record.storage_fetch is not None:
            return 0
        handle, tokens = self.cache.fetch_from_storage(key, budget)
        if handle is None:
            return 0
        record.storage_fetch = handle
        self.prefetch["storage_issued"] += 1
        self.prefetch["storage_tokens_asked"] += tokens
        return tokens

    def _end_storage_fetch(self, record: PauseRecord | None) -> None:
        if record is not None and record.storage_fetch is not None:
            self.prefetch["storage_tokens_loaded"] += self.cache.end_storage_fetch(record.storage_fetch)
            record.storage_fetch = None

    def _load_from_host(self, branch: BranchKey, record: PauseRecord, key, budget: int) -> dict:
        """The host part of a prefetch: HiCache's load-back of the branch's host copies into free device
        memory, within the namespace's speculative budget."""
        ns = branch.namespace
        pending = sum(r.prefetched_tokens for b, r in self.records.items() if b.namespace == ns)
        need = self.cache.host_tokens_continuing(key)
        if need == 0:
            self.prefetch["refused_nothing"] += 1
            return {"prefetched": False, "reason": "nothing of this branch is on host"}
        free = self.cache.token_to_kv_pool_allocator.available_size()
        if not prefetch_worthwhile(self.cache.retention, need, free):
            # Speculation only fills free memory: it never evicts what someone may still hit.
            room = need > free
            self.prefetch["refused_room" if room else "refused_no_gain"] += 1
            return {"prefetched": False, "reason": f"{need} tokens do not fit in free device memory "
                                                     "(prefetch never evicts)" if room else
                    "a host copy saves nothing at this server's prefill and transfer rates"}
        if pending + need > budget:
            self.prefetch["refused_budget"] += 1
            return {"prefetched": False, "reason": f"speculative budget: {pending} + {need} > {budget} tokens"}
        restored = self.cache.load_from_host(key, evict=False)
        record.prefetch_end = self.cache.resident_prefix_len(key)
        record.prefetched_tokens = restored
        s = self.settings
        record.prefetch_seconds = restored * s.bytes_per_token / s.h2d_bytes_per_s
        self.prefetch["issued"] += 1
        self.prefetch["tokens_prefetched"] += restored
        return {"prefetched": restored > 0, "restored_tokens": restored}

    def _prefetch_still_resident(self, record: PauseRecord) -> bool:
        """The branch's path still matches on the device as far as the prefetch brought it (its other
        resident tokens do not count)."""
        return self.cache.resident_prefix_len(path_key(record.path)) >= record.prefetch_end

    def _prefetch_enabled(self, ns: str) -> bool:
        state = self._outcomes.get(ns)
        outcomes = state[0] if state is not None else ()
        if len(outcomes) < self.settings.prefetch_window // 4:
            return True
        if sum(outcomes) / len(outcomes) >= self.settings.prefetch_min_precision:
            return True
        n = state[1] + 1
        state[1] = n % self.settings.prefetch_probe_every
        return n % self.settings.prefetch_probe_every == 0  # a probe, so prefetch can turn back on

    def _prefetch_outcome(self, branch: BranchKey, record: PauseRecord, used: bool | None = None) -> None:
        if used is None:  # used iff the prefetched tokens are still on device when the request comes
            used = self._prefetch_still_resident(record)
        kind = "used" if used else "wasted"
        self.prefetch[kind] += 1
        self.prefetch[f"tokens_{kind}"] += record.prefetched_tokens
        if used:
            self.prefetch["saved_transfer_s"] += record.prefetch_seconds
        state = self._outcomes.get(branch.namespace) or [deque(maxlen=self.settings.prefetch_window), 0]
        self._outcomes.put(branch.namespace, state)
        state[0].append(used)
        record.prefetched_tokens = record.prefetch_end = 0

    def expire(self, branch: BranchKey) -> dict:
        """The deadline passed (or the server's maximum retention): release on every tier."""
        record = self.records.get(branch)
        if record is None:
            return {"expired": False, "reason": "branch is not paused"}
        if record.prefetched_tokens:
            self._prefetch_outcome(branch, record, used=False)
        self._end_storage_fetch(self.records.pop(branch, None))
        self.kept.pop(branch, None)
        self.advice.pop(branch, None)
        freed, host = self._discard(branch)
        self.counters["released_tokens"] += freed + host
        self.counters["deadline_releases"] += 1
        return {"expired": True, "freed_tokens": freed, "host_freed_tokens": host}

    def forget(self, branch: BranchKey) -> None:
        """The branch closed: drop its pause state (its nodes go with the close)."""
        record = self.records.pop(branch, None)
        if record is not None and record.prefetched_tokens:
            self._prefetch_outcome(branch, record, used=False)
        self._end_storage_fetch(record)
        self.kept.pop(branch, None)
        self.advice.pop(branch, None)

    def reset(self) -> None:
        """The tree was rebuilt empty (SGLang's full reset: ``/flush_cache``, a weight update): every
        pause record and pin referred to it, so all go. Counters stay (they are cumulative, like the
        metrics that export them)."""
        for branch, record in self.records.items():
            if record.prefetched_tokens:
                self._prefetch_outcome(branch, record, used=False)
            self._end_storage_fetch(record)
        self.records.clear()
        self.kept.clear()
        self.advice.clear()

    # ---- views ----

    def stats(self) -> dict:
        by_place = {p.value: 0 for p in Placement}
        for r in self.records.values():
            by_place[r.placement.value] += 1
        prefetch = dict(self.prefetch)
        judged = prefetch["used"] + prefetch["wasted"]
        prefetch["precision"] = prefetch["used"] / judged if judged else None
        return {"paused_branches": len(self.records), "paused_by_placement": by_place,
                "kept_branches": len(self.kept), "kept_tokens": sum(self.kept.values()),
                "prefetch": prefetch, **self.counters,
                "settings": {"bytes_per_token": self.settings.bytes_per_token,
                             "h2d_bytes_per_s": self.settings.h2d_bytes_per_s,
                             "d2h_bytes_per_s": self.settings.d2h_bytes_per_s,
                             "prefill_tokens_per_s": self.settings.prefill_tokens_per_s,
                             "max_kept_branches": self.settings.max_kept_branches,
                             "max_kept_tokens": self.settings.max_kept_tokens,
                             "prefetch_budget_tokens": self.settings.prefetch_budget_tokens,
                             "lazy": self.lazy},
                "recent_decisions": list(self.log)[-16:]}


__all__ = ["PauseBook", "PauseRecord", "PauseSettings", "default_settings"]
