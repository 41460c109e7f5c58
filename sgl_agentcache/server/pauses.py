"""Tool-call pauses in the scheduler: keep / offload / discard / release a paused branch's KV.

One :class:`PauseBook` per :class:`~sgl_agentcache.server.cache.AgentRadixCache`. Its inputs arrive as
messages (the ``/agentcache/pause`` route, the replayer), identical on every TP rank; the clock-dependent
parts of a decision (the tool class's learned latency distribution, time left to the deadline) are
computed once by the sender and travel in the message. Everything else the policy reads is tree state
(retained tokens, free and evictable tokens, host headroom) or configuration (bandwidths and prefill
rate of the deployment's profile), so every rank takes the same decision. Transfer bandwidths are
measured here; they enter decisions only as figures relayed back through the messages (rank 0's, see
:meth:`PauseBook.measured`), never as each rank's own clock readings.

Two modes (``AGENTCACHE_PAUSE_MODE``). **Lazy**, the default while the node spill runs or there is no
host tier: the decision is advice and nothing moves at the pause. The branch stays ranked as before;
what eviction later takes of it is spilled to host and kept there ahead of other host entries
(OFFLOAD), spilled like any evicted node (KEEP), or spilled only into free host room and dropped
first (DISCARD). Its next request loads back what was spilled; a prefetch loads it earlier; RELEASE
(deadline) frees it on every tier at once. Nothing is pinned, so the ``max_kept_*`` caps have
nothing to bound. Measured on the replay suite, moving or pinning at the pause recomputed more than it
saved, because a pause rarely coincides with the moment memory is needed.

**Eager** (``AGENTCACHE_PAUSE_MODE=eager``, or the node spill off beside a host tier): the decision is
carried out at once, on the branch's *movable suffix* -- the chain of device nodes it owns at the end
of its path that nothing else holds (unlocked, no other device children; never the shared prefix):

- KEEP: the branch is pinned: its nodes rank above every unpinned node for eviction, until resume,
  deadline or close. Pins are capped per namespace (branches and tokens); over the cap KEEP degrades
  to OFFLOAD (or DISCARD without host room) and the clip is counted.
- OFFLOAD: the suffix is copied to the host tier and its device slots are freed. Resume (the
  branch's next request when the scheduler matches it, the resume route or a prefetch) copies back
  what the device lost. A full host tier or a failed copy falls back to DISCARD.
- DISCARD: every unlocked node the branch owns is freed now; resume re-prefills.
- RELEASE: DISCARD plus the host copy; the pause is over (deadline passed, nothing worth keeping).

The moves themselves -- the movable suffix, the copy out and back, the anchors copies hang from --
are :mod:`sgl_agentcache.server.host_copies` (``PauseBook.copies``); this module decides and keeps the
pause records, pins and prefetch. A resumed request's copy comes back when the scheduler matches the
request for a batch; with no room then (running requests hold the pool) it stays on host, the pause
``resuming``, and is tried again at the request's next match.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from array import array
from collections import deque
from dataclasses import dataclass, field

from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.distributions import LatencyDistribution
from sgl_agentcache.policy.pause import Incumbent, PauseAction, PauseDecision, PauseInputs, Placement, PolicyConfig, decide
from sgl_agentcache.policy.retention import displaced_host_seconds, prefetch_worthwhile
from sgl_agentcache.server.hicache_moves import demote_chain
from sgl_agentcache.server.host_copies import HostCopies, PreparedRestore
from sgl_agentcache.server.host_tier import HOST_TOKENS_ENV, HostTier

logger = logging.getLogger(__name__)

MAX_KEPT_BRANCHES_ENV = "AGENTCACHE_MAX_KEPT_BRANCHES"      # per namespace, default 16
MAX_KEPT_TOKENS_ENV = "AGENTCACHE_MAX_KEPT_TOKENS"          # per namespace, default pool / 2
PREFETCH_TOKENS_ENV = "AGENTCACHE_PREFETCH_BUDGET_TOKENS"   # unused speculative tokens per namespace
PROFILE_ENV = "AGENTCACHE_PROFILE"                          # bandwidths and prefill rate for decisions
#: "1": decisions use the transfer bandwidths the host tier measured (relayed from rank 0, so every rank
#: uses the same figures) once each direction has MIN_MEASURED_TRANSFERS copies; "0": the profile's.
#: Default: on unless AGENTCACHE_PROFILE pins a profile.
MEASURED_BANDWIDTH_ENV = "AGENTCACHE_USE_MEASURED_BANDWIDTH"
#: "lazy" (default): a pause decision is advice to eviction and the host tier, nothing moves at the
#: pause (see PauseBook.pause); "eager": the decision is carried out at once (offload copies the suffix
#: out and frees it, discard frees it, keep pins it).
PAUSE_MODE_ENV = "AGENTCACHE_PAUSE_MODE"
MIN_MEASURED_TRANSFERS = 4
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
    use_measured_bandwidth: bool = False  # see MEASURED_BANDWIDTH_ENV
    lazy: bool = True  # see PAUSE_MODE_ENV
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def default_settings(allocator, pool_tokens: int) -> PauseSettings:
    """Settings from the environment and the deployment profile.

    Bandwidths and prefill rate come from the profile named by ``AGENTCACHE_PROFILE`` (default
    ``seed``; or the path of a profile written by ``bench/gpu/calibrate.py``). KV bytes per token are measured from the pool, unless the profile is named explicitly:
    then the profile's figure is used too (a tiny CPU test model priced as the deployment it stands for).
    """
    from sgl_agentcache.policy.profiles import resolve_profile

    named = os.environ.get(PROFILE_ENV)
    profile = resolve_profile(named or "seed")  # a built-in name or a calibrated profile file
    kv = allocator.get_kvcache() if allocator is not None else None
    per_token = profile.kv_bytes_per_token if named else 0
    if not named and kv is not None and hasattr(kv, "get_kv_size_bytes") and getattr(kv, "size", 0):
        total = kv.get_kv_size_bytes()  # (k bytes, v bytes) for MHA pools, one figure for others
        total = sum(total) if isinstance(total, (tuple, list)) else total
        per_token = int(total) // (kv.size + kv.page_size)  # SGLang pads the pool with one page
    env = lambda name, default: int(os.environ.get(name, 0)) or default  # noqa: E731
    return PauseSettings(
        h2d_bytes_per_s=profile.h2d_bytes_per_s, d2h_bytes_per_s=profile.d2h_bytes_per_s,
        prefill_tokens_per_s=profile.prefill_tokens_per_s, bytes_per_token=max(per_token, 1),
        max_kept_branches=env(MAX_KEPT_BRANCHES_ENV, 16), max_kept_tokens=env(MAX_KEPT_TOKENS_ENV, pool_tokens // 2),
        prefetch_budget_tokens=env(PREFETCH_TOKENS_ENV, max(pool_tokens // 8, 1)),
        use_measured_bandwidth=os.environ.get(MEASURED_BANDWIDTH_ENV, "0" if named else "1") == "1",
        lazy=pause_mode() == "lazy")


def pause_mode() -> str:
    """``AGENTCACHE_PAUSE_MODE``: "lazy" (the default) or "eager"; anything else stops the server."""
    mode = os.environ.get(PAUSE_MODE_ENV, "lazy").strip().lower()
    if mode not in ("lazy", "eager"):
        raise ValueError(f"{PAUSE_MODE_ENV}={mode!r}: expected 'lazy' or 'eager'")
    return mode


@dataclass
class PauseRecord:
    branch: BranchKey
    tool_class: str
    placement: Placement
    decision: PauseDecision | None
    tokens: int  # the movable suffix when the pause began
    prefetched_tokens: int = 0  # restored speculatively, not yet used by a request
    prefetch_seconds: float = 0.0  # measured copy time of that restore (stats only)
    resuming: bool = False  # the branch's request arrived; its host copy waits for the request's match
    advice: PauseAction | None = None  # lazy mode: the decision, carried out by eviction and the host tier
    path: tuple | None = None  # lazy mode: (tokens, extra_key, cache_salt) of the branch's path (prefetch)
    prefetch_end: int = 0  # lazy mode: the path's device match right after its prefetch


def _path_key(path: tuple):
    """The RadixKey of a lazy record's ``path`` ((tokens, extra_key, cache_salt), see ``_path_of``)."""
    tokens, extra_key, salt = path
    return RadixKey(array("q", tokens), extra_key, cache_salt=salt)


class PauseBook:
    """The scheduler's pause state for one cache (see the module docstring)."""

    def __init__(self, cache, settings: PauseSettings, host: HostTier):
        self.cache = cache
        self.settings = settings
        self.host = host
        self.records: dict[BranchKey, PauseRecord] = {}
        self.kept: dict[BranchKey, int] = {}  # pinned branch -> tokens pinned
        self.counters = {"decisions": {a.value: 0 for a in PauseAction}, "forced": 0, "kept_clipped": 0,
                         "refused_closed": 0, "too_small": 0,
                         "offload_fallbacks": {"host_full": 0, "transfer_failed": 0},
                         "offload_partial": 0,
                         "restores": 0, "restored_tokens": 0, "fork_restores": 0, "parent_restores": 0,
                         "restores_deferred": 0, "anchor_spills": 0, "anchor_spilled_tokens": 0,
                         "anchor_spill_copied_tokens": 0,
                         "anchor_spill_refused": {"quota": 0, "host_full": 0, "transfer_failed": 0},
                         "restore_failures": {"gap": 0, "no_room": 0, "transfer_failed": 0, "error": 0},
                         "deadline_releases": 0, "released_tokens": 0, "hicache_offloaded_tokens": 0}
        self.prefetch = {"issued": 0, "used": 0, "wasted": 0, "tokens_prefetched": 0, "tokens_used": 0,
                         "tokens_wasted": 0, "refused_budget": 0, "refused_disabled": 0, "refused_nothing": 0, "refused_room": 0, "refused_no_gain": 0,
                         "refused_queue": 0,
                         "saved_transfer_s": 0.0}
        # namespace -> [recent prefetch outcomes (True = used), refusals since the last probe]: each
        # namespace's precision gates its own prefetch; the least recently used namespace is forgotten
        # past PREFETCH_NAMESPACES (its prefetch is on again).
        self._outcomes: NamespacedLRU[str, list] = NamespacedLRU(PREFETCH_NAMESPACES, 1, namespace_of=lambda ns: ns)
        self.log: deque = deque(maxlen=256)  # recent decisions with their inputs, for /agentcache/stats
        self.copies = HostCopies(cache, host, self.counters)  # the moves between device and host

    def _namespace_kept(self, namespace: str) -> tuple[int, int]:
        mine = [t for b, t in self.kept.items() if b.namespace == namespace]
        return len(mine), sum(mine)

    # ---- pause ----

    def measured(self) -> dict:
        """This rank's measured effective transfer bandwidths, per direction with enough copies behind
        it. The HTTP side relays rank 0's figures back in later pause messages (see :meth:`inputs`)."""
        out = {}
        for name, stats in (("d2h_bytes_per_s", self.host.demotes), ("h2d_bytes_per_s", self.host.promotes)):
            if stats.count >= MIN_MEASURED_TRANSFERS and stats.seconds > 0:
                out[name] = stats.bytes / stats.seconds
        return out

    def _bandwidths(self, measured: dict | None) -> tuple[float, float, str]:
        s = self.settings
        if s.use_measured_bandwidth and measured:
            h2d, d2h = measured.get("h2d_bytes_per_s"), measured.get("d2h_bytes_per_s")
            if h2d or d2h:
                return float(h2d or s.h2d_bytes_per_s), float(d2h or s.d2h_bytes_per_s), "measured"
        return s.h2d_bytes_per_s, s.d2h_bytes_per_s, "profile"

    def inputs(self, branch: BranchKey, latency: LatencyDistribution, *, elapsed_s: float = 0.0,
               deadline_s: float | None = None, priority: int = 0, resume_probability: float = 1.0,
               prefetch_lead_s: float = 0.0, measured: dict | None = None) -> PauseInputs:
        """The policy's inputs for ``branch`` now: tree facts plus the sender's clock-derived values.

        ``measured`` is the sender's copy of rank 0's :meth:`measured` bandwidths (message data, so
        every rank decides with the same figures); used when ``use_measured_bandwidth`` is on."""
        record = self.records.get(branch)
        if self.lazy:  # advice covers whatever of the branch eviction may later take: all it owns
            tokens = self.cache.tree_core.owned_count.get(branch, 0)
        else:  # an applied decision moves the movable suffix
            tokens = sum(len(n.key) for n in self.copies.movable_suffix(branch))
        placement = Placement.DEVICE
        previous = None
        if record is not None:
            placement = record.placement
            if record.placement is Placement.HOST:
                tokens = self.host.tokens_of(branch)
            if record.decision is not None:
                previous = Incumbent(record.decision.action, record.decision.cost)
        allocator, s = self.cache.token_to_kv_pool_allocator, self.settings
        h2d, d2h, _ = self._bandwidths(measured)
        # What host memory costs this pause: the value of the host entries an offload would displace.
        retention = dataclasses.replace(self.cache.retention, h2d_bytes_per_s=h2d,
                                        host_reuse=self.cache.host_reuse_rate())
        free_host, host_room = self.cache.host_room()
        displaced = displaced_host_seconds(retention, tokens, free_host) if placement is Placement.DEVICE else 0.0
        return PauseInputs(
            retained_tokens=tokens, bytes_per_token=s.bytes_per_token, latency=latency,
            device_free_tokens=allocator.available_size(), device_evictable_tokens=self.cache.evictable_size(),
            device_total_tokens=allocator.size,
            host_free_bytes=host_room * s.bytes_per_token,
            h2d_bandwidth_Bps=h2d, d2h_bandwidth_Bps=d2h,
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
                # elsewhere (on host, or under its subagents' nodes when a join re-prices it), and
                # releasing would drop that on every tier.
                self.counters["too_small"] += 1
                return {"paused": branch in self.records, "action": "none",
                        "tokens": decision.inputs.retained_tokens, "branch": branch.to_dict(),
                        "tool_class": tool_class, "reason": decision.reason}
        else:
            action = force
            self.counters["forced"] += 1
        record = self.records.get(branch)
        placement = record.placement if record is not None else Placement.DEVICE
        if action is not PauseAction.RELEASE and placement is Placement.DEVICE:
            if force is None and self.lazy:
                return self._advise(branch, tool_class, action, decision)
            if action is PauseAction.OFFLOAD and self.cache.on_hicache:
                return self._offload_on_hicache(branch, tool_class, decision)
        if record is not None and record.advice is not None:  # a lazy pause becomes an applied one
            self.cache.spill.advise(branch, None)
        applied, moved = self._apply(branch, action, placement, caps)
        tokens = self.host.tokens_of(branch) if applied is PauseAction.OFFLOAD else moved
        self.counters["decisions"][applied.value] += 1
        if applied is PauseAction.RELEASE:
            self.records.pop(branch, None)
        else:
            where = {PauseAction.KEEP: Placement.DEVICE, PauseAction.OFFLOAD: Placement.HOST,
                     PauseAction.DISCARD: Placement.NONE}[applied]
            self.records[branch] = PauseRecord(branch, tool_class, where, decision, tokens)
        entry = {"branch": branch.to_dict(), "tool_class": tool_class, "action": applied.value,
                 "decided": action.value, "forced": force is not None, "tokens": tokens,
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
                               "d2h_bytes_per_s": decision.inputs.d2h_bandwidth_Bps,
                               "bandwidth_source": self._bandwidths(inputs.get("measured"))[2]}
        entry["measured"] = self.measured()
        self.log.append(entry)
        logger.info("agentcache pause %s/%s (%s): %s", branch.session, branch.branch, tool_class,
                    entry["reason"] if applied is action else f"{action.value} -> {applied.value}")
        return {"paused": applied is not PauseAction.RELEASE} | entry

    @property
    def lazy(self) -> bool:
        """Pauses are advice (the default) while the node spill runs (it is what carries the advice out)
        and when there is no host tier at all (an applied pause could only pin or drop the branch; on the
        replay suite both recomputed more than leaving it to eviction, up to 1.8x stock). With
        ``AGENTCACHE_HOST_SPILL=0`` and a host tier, a pause is applied at once, as in eager mode."""
        return self.settings.lazy and (self.cache.spill.enabled or self.host.capacity_tokens == 0)

    def _offload_on_hicache(self, branch: BranchKey, tool_class: str, decision: PauseDecision | None) -> dict:
        """An applied offload (forced, or eager mode) on HiCache: the branch's movable suffix is backed
        up and demoted into HiCache's host pool now (``hicache_moves.demote_chain``), and the pause is
        recorded as an offload advice is, because from here on it is one: its host copies rank in the
        protected band, a prefetch or the branch's next request loads them back through HiCache, and
        what found no host room stays on the device for eviction to judge."""
        chain = self.copies.movable_suffix(branch)
        entry = self._advise(branch, tool_class, PauseAction.OFFLOAD, decision, chain)
        moved = demote_chain(self.cache, chain)
        self.counters["hicache_offloaded_tokens"] += moved
        if moved < entry["tokens"]:
            self.counters["offload_partial"] += 1
        entry.update(lazy=False, forced=decision is None, moved_tokens=moved)
        return entry

    def _advise(self, branch: BranchKey, tool_class: str, action: PauseAction,
                decision: PauseDecision | None, chain: list | None = None) -> dict:
        """Lazy mode: record the decision as advice, move nothing. The branch's KV stays where it is,
        ranked as before; what eviction later takes of it is spilled to host and kept there ahead of
        other host entries (OFFLOAD), spilled as usual (KEEP; on HiCache kept ahead like OFFLOAD:
        ``AgentRadixCache._hicache_host_key``), or only into free host room, dropped first (DISCARD:
        not worth displacing anything). Its next request loads back what was spilled
        when it is matched; a prefetch loads it back earlier. Nothing is pinned: measured on the replay
        suite, moving or pinning at the pause cost more recompute than it saved (module docstring)."""
        tip = self.copies.tip(branch)
        chain = self.copies.movable_suffix(branch) if chain is None else chain  # the caller's, if it has it
        tokens = sum(len(n.key) for n in chain)
        self.kept.pop(branch, None)
        record = PauseRecord(branch, tool_class, Placement.DEVICE, decision, tokens, advice=action,
                             path=self.copies.path_of(tip) if tip is not None else None)
        self.records[branch] = record
        self.counters["decisions"][action.value] += 1
        self.cache.spill.advise(branch, action)
        reason = decision.reason if decision is not None else "forced"
        entry = {"branch": branch.to_dict(), "tool_class": tool_class, "action": action.value,
                 "decided": action.value, "forced": False, "tokens": tokens, "lazy": True, "reason": reason,
                 "costs": {o.action.value: o.cost for o in decision.options if o.feasible} if decision else {}}
        self.log.append(entry)
        logger.info("agentcache pause %s/%s (%s, lazy): %s", branch.session, branch.branch, tool_class, reason)
        return {"paused": True} | entry

    def _cap(self, name: str, caps: dict | None) -> int:
        """A server-wide cap, lowered (never raised) by a tenant's ceiling of the same name."""
        value = getattr(self.settings, name)
        return min(value, int(caps[name])) if caps and caps.get(name) is not None else value

    def _apply(self, branch: BranchKey, action: PauseAction, placement: Placement,
               caps: dict | None = None) -> tuple[PauseAction, int]:
        """Carry out ``action``; returns the action actually applied (after caps and fallbacks) and
        the tokens it concerned."""
        if action is PauseAction.KEEP:
            if placement is Placement.HOST and not self.copies.cancel_offload(branch):
                if self.copies.restore(branch) == 0:
                    return self._apply(branch, PauseAction.DISCARD, Placement.NONE)
            tokens = sum(len(n.key) for n in self.copies.movable_suffix(branch))
            count, pinned = self._namespace_kept(branch.namespace)
            pinned -= self.kept.get(branch, 0)
            count -= branch in self.kept
            max_branches, max_tokens = self._cap("max_kept_branches", caps), self._cap("max_kept_tokens", caps)
            if count + 1 > max_branches or pinned + tokens > max_tokens:
                self.counters["kept_clipped"] += 1
                logger.info("agentcache: keep of %s/%s clipped (%d kept branches, %d + %d tokens; caps %d, %d)",
                            branch.session, branch.branch, count, pinned, tokens, max_branches, max_tokens)
                return self._apply(branch, PauseAction.OFFLOAD, placement, caps)
            self.kept[branch] = tokens
            return PauseAction.KEEP, tokens
        self.kept.pop(branch, None)
        if action is PauseAction.OFFLOAD:
            if placement is Placement.HOST:
                return PauseAction.OFFLOAD, self.host.tokens_of(branch)
            moved = self.copies.offload(branch)
            if moved is None:
                return self._apply(branch, PauseAction.DISCARD, placement)
            return PauseAction.OFFLOAD, moved
        freed = self.copies.drop(branch) + self.copies.discard(branch)
        if action is PauseAction.RELEASE:  # every tier: what eviction spilled of it too
            self.cache.spill.advise(branch, None)
            freed += self.cache.spill.drop_owner(branch)
            self.counters["released_tokens"] += freed
        return action, freed

    def land_copies(self, *, wait: bool = True) -> None:
        """The scheduler's step (or an idle poll, a stats or check call): offloads and prefetches whose
        copy a worker made land (without ``wait``, only copies already made on every rank)."""
        if self.copies.offloading:
            self.land_offloads(wait=wait)
        loads = self.cache.loads
        if loads.prefetches:
            loads.land_prefetches(wait=wait)

    def land_offloads(self, branch: BranchKey | None = None, *, wait: bool = True) -> None:
        """Offloads whose copy a worker made land (``HostCopies.land``: all, or ``branch``'s; without
        ``wait``, only copies already made); a branch whose copy failed is discarded, as a failed
        synchronous offload is."""
        for branch in self.copies.land(branch, wait=wait):
            record = self.records.get(branch)
            if record is not None and record.placement is Placement.HOST:
                record.placement = Placement.NONE
            self.copies.discard(branch)

    # ---- resume, prefetch, deadline, close ----

    def resume(self, branch: BranchKey, restore: bool = True) -> dict:
        """The tool returned (route) or the branch's next request arrived: unpin or restore. Without
        ``restore`` the host copy stays for :meth:`restore_for_request` (the request's own match)."""
        self.cache.loads.settle(branch)  # a prefetch in flight lands before it is judged below
        record = self.records.pop(branch, None)
        if record is None:
            return {"resumed": False, "reason": "branch is not paused"}
        self.kept.pop(branch, None)
        if record.advice is not None:  # lazy: its spilled nodes are ordinary host entries again
            self.cache.spill.advise(branch, None)
        prefetched = record.prefetched_tokens
        if prefetched:  # judged before the restore below can bring back what was evicted again
            self._prefetch_outcome(branch, record)
        restored = 0
        if record.placement is Placement.HOST and not self.copies.cancel_offload(branch) and restore:
            restored = self._restore_ahead(branch)
        return {"resumed": True, "placement": record.placement.value, "restored_tokens": restored,
                "prefetched_tokens": prefetched}

    def _restore_ahead(self, branch: BranchKey) -> int:
        """Bring an ended pause's host copy back ahead of its request (the resume route). With
        asynchronous loads a worker copies it and it lands like a prefetch (``AsyncLoads``: at a later
        step, or when the branch's request comes); returns the tokens it restores (or will)."""
        loads = self.cache.loads
        if not loads.enabled:
            return self.copies.restore(branch)
        prepared = self.copies.prepare_restore(branch, hold=True)
        if not isinstance(prepared, PreparedRestore):
            return prepared or 0
        loads.issue_prefetch(prepared)  # not kept on host: the landing drops the copy
        return prepared.entry.end - prepared.begin

    def begin_resume(self, branch: BranchKey) -> BranchKey | None:
        """The paused ``branch``'s next request arrived. A host copy stays, with its record (now
        ``resuming``), until that request is matched for a batch (:meth:`restore_for_request`): a
        request can wait in the queue for many steps, and KV restored at arrival would sit unlocked
        meanwhile, in the pool the running batch evicts from. Returns ``branch`` when its copy waits
        for the match; otherwise the pause ends now (unpinned) and it returns None."""
        self.cache.loads.settle(branch)  # a prefetch in flight lands before it is judged below
        record = self.records.get(branch)
        if record is not None and record.placement is Placement.HOST and self.copies.cancel_offload(branch):
            record.placement = Placement.DEVICE  # its offload had not landed: the device still holds it all
        if record is None or record.placement is not Placement.HOST or branch not in self.host.entries:
            self.resume(branch, restore=False)
            return None
        if record.prefetched_tokens:  # judged now: the request is here, whatever the restore finds
            self._prefetch_outcome(branch, record)
            record.prefetched_tokens = 0
        record.resuming = True
        return branch

    def restore_for_request(self, parent: BranchKey | None, own: BranchKey | None, rid: str | None = None
                            ) -> tuple | None:
        """A request is being matched for a batch: bring back the host copies its admission deferred
        (``AgentRadixCache.admit``): a paused ``parent``'s history for a fork (kept on host too: the
        parent is still paused), then ``own`` branch's copy, which ends ``own``'s pause. A branch closed
        since admission has no copy left (the close dropped it).

        A copy that finds no room (running requests hold the pool) stays for the next match: the
        scheduler cannot admit the request either until room appears. Returns the ``(parent, own)``
        still to restore, or None when nothing is left.

        With asynchronous loads (``AGENTCACHE_ASYNC_LOAD``) and the request's ``rid``, each copy is made
        by a worker, one per match: the match allocates the slots and issues it, the scheduler skips the
        request for the step, and its next match inserts the copy (the parent's first, ``own``'s at the
        match after, which ends the pause; ``AsyncLoads.finish``). A parent being copied back for a
        sibling fork already stays pending here (the cache holds the request back until it lands)."""
        loads = self.cache.loads
        asynchronous = rid is not None and loads.enabled
        if parent is not None:
            if asynchronous:
                parent = self._issue_fork_restore(parent, rid)
            elif self.restore_for_fork(parent, defer=True) is not None:
                parent = None
        if own is not None:
            record = self.records.get(own)
            if record is None or not record.resuming:  # closed, expired or paused afresh meanwhile
                own = None
            elif asynchronous and (parent is not None or loads.pending(rid)):
                pass  # one copy in flight per request: ``own``'s is issued at its next match
            elif asynchronous:
                prepared = self.copies.prepare_restore(own, defer=True, hold=True)
                if isinstance(prepared, PreparedRestore):
                    loads.issue_restore(rid, prepared)  # its finish ends the pause
                    own = None
                elif prepared is not None:  # nothing to copy back, or failed for good: consumed
                    self.end_resume(own)
                    own = None
            elif self.copies.restore(own, defer=True) is not None:  # restored, or failed for good: consumed
                self.end_resume(own)
                own = None
        return (parent, own) if parent or own else None

    def abandon_restores(self, parent: BranchKey | None, own: BranchKey | None) -> None:
        """A request's deferred restores (:meth:`restore_for_request`) raised: the request recomputes.
        Their host copies go (a copy that broke once is not tried again), ``own``'s pause ends and a
        paused ``parent`` stays paused with nothing on host. Counted as ``restore_failures["error"]``."""
        self.counters["restore_failures"]["error"] += 1
        for branch in (parent, own):
            if branch is None:
                continue
            try:
                self.copies.drop(branch)
                record = self.records.get(branch)
                if record is None:
                    continue
                if branch == own and record.resuming:
                    self.records.pop(branch)
                elif record.placement is Placement.HOST:
                    record.placement = Placement.NONE
            except Exception:  # noqa: BLE001 - cleanup of a failure: log, never raise
                logger.exception("agentcache: dropping %s/%s's host copy after a failed restore failed",
                                 branch.session, branch.branch)

    def end_resume(self, branch: BranchKey, abandoned: bool = False) -> None:
        """End a ``resuming`` pause: its request restored the copy, or (``abandoned``) ran or left
        without it (the tokens were recomputed). The record and the host copy go."""
        record = self.records.get(branch)
        if record is None or not record.resuming:
            return
        if abandoned:
            self.counters["restore_failures"]["no_room"] += 1
            logger.info("agentcache: restore of %s/%s: its request ran without it (no room); recomputed",
                        branch.session, branch.branch)
        self.records.pop(branch)
        self.copies.drop(branch)  # already gone unless abandoned

    def _issue_fork_restore(self, parent: BranchKey, rid: str) -> BranchKey | None:
        """:meth:`restore_for_fork` with the copy made by a worker for request ``rid`` (it lands at the
        request's next match, :meth:`fork_restore_landed`). Returns ``parent`` while it is still to do
        (no room yet, or being copied back for a sibling), None when issued or nothing is left to do."""
        record = self.records.get(parent)
        if record is None or record.placement is not Placement.HOST:
            return None
        loads = self.cache.loads
        if loads.copying_back(parent):
            return parent
        prepared = self.copies.prepare_restore(parent, keep_host=True, defer=True, hold=True)
        if prepared is None:
            return parent
        if isinstance(prepared, PreparedRestore):
            loads.issue_restore(rid, prepared, for_fork=True)
            return None
        self.fork_restore_landed(parent, prepared)  # nothing to copy (all resident, or a gap): done
        return None

    def fork_restore_landed(self, parent: BranchKey, restored: int) -> None:
        """A fork's restore of its paused parent's history is in the tree (``restored`` tokens; 0 when
        it failed): the parent stays paused, on host too while its copy is kept."""
        record = self.records.get(parent)
        if record is not None and parent not in self.host.entries:
            record.placement = Placement.NONE
        if restored:
            self.counters["fork_restores"] += 1

    def restore_for_fork(self, parent: BranchKey, defer: bool = False) -> int | None:
        """A new fork of a paused parent needs the parent's history: bring a host copy back now. The
        parent stays paused (its tool is still running), its KV on device (unpinned) and on host.
        ``defer``: see :meth:`HostCopies.restore` (None: no room yet, try again)."""
        record = self.records.get(parent)
        if record is None or record.placement is not Placement.HOST:
            return 0
        restored = self.copies.restore(parent, keep_host=True, defer=defer)
        if restored is None:
            return None
        if parent not in self.host.entries:
            record.placement = Placement.NONE
        self.counters["fork_restores"] += 1
        return restored

    def prefetch_branch(self, branch: BranchKey, queued: int = 0, caps: dict | None = None) -> dict:
        """"Tool nearly done": restore now, ahead of the request, within the namespace's speculative
        budget, into free memory only, and only while no request waits for admission (``queued``, the
        scheduler's waiting queue): speculation never competes with work that is already here."""
        record = self.records.get(branch)
        lazy = record is not None and record.advice is not None and record.path is not None
        if record is None or (record.placement is not Placement.HOST and not lazy) or record.prefetched_tokens:
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
        pending = sum(r.prefetched_tokens for b, r in self.records.items() if b.namespace == ns)
        if lazy:  # what eviction spilled of it: to our host tier, or HiCache's host pool when attached
            need = (self.cache.host_tokens_continuing(_path_key(record.path)) if self.cache.on_hicache
                    else self.cache.spill.owner_tokens.get(branch, 0))
        else:
            need = self.host.tokens_of(branch)
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
        budget = self._cap("prefetch_budget_tokens", caps)
        if pending + need > budget:
            self.prefetch["refused_budget"] += 1
            return {"prefetched": False, "reason": f"speculative budget: {pending} + {need} > {budget} tokens"}
        before = self.host.promotes.seconds
        loads = self.cache.loads
        if lazy:
            key = _path_key(record.path)
            restored = self.cache.load_spilled(key, evict=False)
            record.prefetch_end = self.cache.resident_prefix_len(key)
        elif loads.enabled:  # a worker copies it back; it lands at a later step (prefetch_landed)
            prepared = self.copies.prepare_restore(branch, keep_host=True, hold=True)
            if isinstance(prepared, PreparedRestore):
                loads.issue_prefetch(prepared)
                restored = prepared.entry.end - prepared.begin  # what it will restore, corrected on landing
            else:
                restored = prepared or 0
        else:
            restored = self.copies.restore(branch, keep_host=True)
        if not lazy and branch not in self.host.entries:
            record.placement = Placement.NONE
        record.prefetched_tokens = restored
        record.prefetch_seconds = self.host.promotes.seconds - before
        self.prefetch["issued"] += 1
        self.prefetch["tokens_prefetched"] += restored
        return {"prefetched": restored > 0, "restored_tokens": restored}

    def prefetch_landed(self, branch: BranchKey, restored: int, seconds: float) -> None:
        """A prefetch a worker copied back was inserted (``AsyncLoads``): ``restored`` tokens in
        ``seconds`` of copy (0: it failed, or found the tokens resident already)."""
        record = self.records.get(branch)
        if record is None:
            return
        self.prefetch["tokens_prefetched"] += restored - record.prefetched_tokens
        record.prefetched_tokens = restored
        record.prefetch_seconds = seconds
        if branch not in self.host.entries:
            record.placement = Placement.NONE

    def _prefetch_still_resident(self, branch: BranchKey, record: PauseRecord) -> bool:
        """Lazy mode: the branch's path still matches on the device as far as the prefetch brought it
        (its other resident tokens do not count). Eager mode: the branch owns at least as many
        resident tokens as were restored."""
        if record.prefetch_end:
            return self.cache.resident_prefix_len(_path_key(record.path)) >= record.prefetch_end
        return self.cache.tree_core.resident_owned_tokens(branch) >= record.prefetched_tokens

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
            used = self._prefetch_still_resident(branch, record)
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
        _, freed = self._apply(branch, PauseAction.RELEASE, record.placement)
        self.records.pop(branch, None)
        self.counters["deadline_releases"] += 1
        return {"expired": True, "freed_tokens": freed}

    def forget(self, branch: BranchKey) -> int:
        """The branch closed: drop its pause state and host copy (device nodes go with the close)."""
        record = self.records.pop(branch, None)
        if record is not None and record.prefetched_tokens:
            self._prefetch_outcome(branch, record, used=False)
        self.kept.pop(branch, None)
        self.cache.spill.advise(branch, None)
        return self.copies.drop(branch)

    def reset(self) -> int:
        """The tree was rebuilt empty (SGLang's full reset: ``/flush_cache``, a weight update): every
        pause record, pin, anchor and host copy referred to it, so all go. Returns host tokens freed.
        Counters stay (they are cumulative, like the metrics that export them)."""
        for branch, record in self.records.items():
            if record.prefetched_tokens:
                self._prefetch_outcome(branch, record, used=False)
        freed = self.copies.reset()
        self.records.clear()
        self.kept.clear()
        return freed

    # ---- views ----

    def stats(self) -> dict:
        by_place = {p.value: 0 for p in Placement}
        for r in self.records.values():
            by_place[r.placement.value] += 1
        prefetch = dict(self.prefetch)
        judged = prefetch["used"] + prefetch["wasted"]
        prefetch["precision"] = prefetch["used"] / judged if judged else None
        return {"paused_branches": len(self.records), "paused_by_placement": by_place,
                "resuming_branches": sum(r.resuming for r in self.records.values()),
                "kept_branches": len(self.kept), "kept_tokens": sum(self.kept.values()),
                "offload_copies": {"async": self.copies.async_offload, "in_flight": len(self.copies.offloading),
                                   "joined_running": self.copies.joined_running},
                "host": self.host.stats(), "prefetch": prefetch, **self.counters,
                "settings": {"bytes_per_token": self.settings.bytes_per_token,
                             "h2d_bytes_per_s": self.settings.h2d_bytes_per_s,
                             "d2h_bytes_per_s": self.settings.d2h_bytes_per_s,
                             "prefill_tokens_per_s": self.settings.prefill_tokens_per_s,
                             "max_kept_branches": self.settings.max_kept_branches,
                             "max_kept_tokens": self.settings.max_kept_tokens,
                             "prefetch_budget_tokens": self.settings.prefetch_budget_tokens,
                             "use_measured_bandwidth": self.settings.use_measured_bandwidth,
                             "lazy": self.lazy},
                "measured": self.measured(),
                "recent_decisions": list(self.log)[-16:]}


def host_capacity_tokens(pool_tokens: int) -> int:
    """``AGENTCACHE_HOST_TOKENS`` (0 is no host tier), else 4x the device pool."""
    value = os.environ.get(HOST_TOKENS_ENV, "").strip()
    return max(int(value), 0) if value else 4 * pool_tokens


__all__ = ["PauseBook", "PauseRecord", "PauseSettings", "default_settings", "host_capacity_tokens"]
