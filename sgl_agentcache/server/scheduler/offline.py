"""The real ``AgentRadixCache`` on CPU, without a model or a scheduler, driven through SGLang's own code.

:func:`build_offline_cache` builds the cache exactly the way a scheduler rank does -- SGLang's
``create_tree_cache(TreeCacheBuildContext)`` routes ``--radix-cache-backend agentcache`` to our
registered factory, which checks the pinned SGLang internals and calls
``create_unified_radix_cache(ctx, cache_class=AgentRadixCache)`` on the ``agentcache`` tree core -- over
real SGLang memory pools: a ``ReqToTokenPool``, the smallest possible ``MHATokenToKVPool`` (1 layer,
1 head, head_dim 1, float32 on CPU: the KV *contents* never matter here, the allocator's slot
accounting does) and the stock ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` the
scheduler would pick for that page size.

:class:`OfflineDriver` then plays the scheduler's part for one request at a time, calling the same
SGLang functions the scheduler calls, in the same order:

- ``admit``: ``Req(...)`` and, for a hinted request, ``AgentRadixCache.admit`` (the plugin's hook on
  ``Scheduler._create_generation_req``) -- :meth:`OfflineDriver.queue` alone, with
  :meth:`OfflineDriver.rank` for the queue ranking in between --;
  ``Req.init_next_round_input(tree_cache)`` (``match_kv_cache``);
  ``tree_cache.lock(last_node)`` (``PrefillAdder._commit_prefill_admission``); then ``alloc_for_extend``
  for a batch of one: ``alloc_req_slots``, ``alloc_token_slots`` / ``alloc_paged_token_slots_extend``
  (which evict through ``allocator.evict_to_free_tokens`` -> ``tree_cache.evict_for_alloc``),
  ``write_cache_indices``, ``maybe_hand_to_session``; ``cached_tokens`` is counted as
  ``ScheduleBatch.prepare_for_extend`` counts it.
- ``checkpoint``: ``checkpoint_kv_cache`` (``Scheduler.stash_chunked_request``, between chunks).
- ``prefill_next_chunk``: the next chunk of a chunked prefill (``alloc_for_extend`` on the held row).
- ``extend``: the first output token is the prefill's result -- append, then ``checkpoint_kv_cache``
  (``process_batch_result_prefill``); every later token is one decode step --
  ``alloc_token_slots`` / ``alloc_paged_token_slots_decode`` and the row write (``alloc_for_decode``),
  then append.
- ``finish``: a length finish (the ``FINISH_LENGTH`` branch of ``Req.update_finish_state``), then
  ``release_kv_cache(req, tree_cache, checkpoint=True)``.
- ``abort``: ``prepare_abort`` + ``Scheduler._release_aborted_request`` +
  ``release_kv_cache(req, tree_cache, checkpoint=False)`` (the queued / chunked-prefill abort path);
  ``abort(checkpoint=True)`` is the running-request path (``to_finish``, then a checkpointing release).

After every batch-result step (``extend`` per token, ``finish``, ``abort``) the driver calls
``tree_cache.flush_pending_backups()``, as ``Scheduler.process_batch_result`` does.

**Runtime context.** SGLang code reads process-wide configuration through getters such as
``get_memory()``, ``get_disagg()``, ``get_serving()`` and ``get_spec()``
(``sglang.srt.runtime_context``), which fail until a config is published. The supported offline way,
the one SGLang's own test helpers use (``sglang.test.test_utils.published_topology``), is a
``ServerArgs(model_path="dummy", ...)``: the resolution pipeline short-circuits its model-dependent
steps for ``"dummy"``, so nothing is downloaded or loaded. We do *not* ``publish`` it process-wide
(that would clobber the config of an ``sglang.Engine`` living in the same process): we build a private
``RuntimeContext`` with ``runtime_context.create_context(server_args, role="scheduler", ...)`` and
activate it with ``runtime_context.use_context`` around every driver call. Code that calls SGLang on
the cache directly (``cache.evict``, ``cache.close_branch`` ...) should do so inside
``with activated(cache):`` (or ``driver.activated()``).

**HiCache.** With ``hicache=OfflineHiCache(...)`` the cache gets SGLang's own HiCache attached, the way
the registry attaches it for ``--enable-hierarchical-cache`` (``init_hicache``: its host pool, cache
controller and ``direct`` io backend on CPU, through the CPU shims), for stock SGLang and for ours alike.
The driver then does what the scheduler does with it: a request whose match found a host hit passes the
budget with those tokens counted as new, and only then is loaded back (``PrefillAdder.add_one_req``:
``init_load_back`` under a host lock, then ``ready_to_load_host_cache``), and every step polls HiCache's
events (``check_hicache_events``) so backups and loads are acknowledged. CPU copies finish at once, so
a load lands in the step that issued it.

Differences from a live server, by design: there is no batching, no admission budget (``admit``
allocates or raises :class:`OfflineOutOfMemory`), no retraction (a decode step that cannot get a slot
raises :class:`OfflineOutOfMemory`), and token ids are never checked against a vocabulary.
Run with ``SGLANG_USE_CPU_ENGINE=1`` on a CPU-only SGLang install.
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocation import (
    alloc_paged_token_slots_decode,
    alloc_paged_token_slots_extend,
    alloc_req_slots,
    alloc_token_slots,
    write_cache_indices,
)
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.runtime_context import SpawnRanks, create_context, get_memory, use_context
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_agentcache import BACKEND_NAME
from sgl_agentcache.server.scheduler.cache import AgentRadixCache, namespace_of, register_backends
from sgl_agentcache.server.scheduler.integrity import IntegrityReport, check_tree

if TYPE_CHECKING:
    from sglang.srt.runtime_context import RuntimeContext
    from sglang.srt.server_args import ServerArgs

__all__ = [
    "OfflineDriver",
    "OfflineHiCache",
    "OfflineOutOfMemory",
    "OfflineRefused",
    "OfflineReq",
    "activated",
    "build_offline_cache",
    "context_of",
    "offline_context",
    "offline_server_args",
]

#: ``max_new_tokens`` given to offline requests: they finish only when the driver says so.
UNBOUNDED_NEW_TOKENS = 1 << 30

# The private runtime context each offline cache was built under (see the module docstring).
_CONTEXTS: "weakref.WeakKeyDictionary[AgentRadixCache, RuntimeContext]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class OfflineHiCache:
    """SGLang's own HiCache for an offline cache: ``--enable-hierarchical-cache`` with a host pool of
    exactly ``host_tokens`` KV slots (whole pages), ``--hicache-write-policy write_policy``,
    ``--hicache-io-backend direct`` and ``--hicache-mem-layout layout`` (the CPU shims support
    ``layer_first`` and ``page_first_direct``)."""

    host_tokens: int
    write_policy: str = "write_back"
    layout: str = "layer_first"

    def server_fields(self, pool_tokens: int, page_size: int) -> dict[str, Any]:
        """``ServerArgs`` fields that give this host pool. SGLang sizes it as ``int(pool * ratio)``
        rounded down to pages plus one padding page, so the ratio aims one page short."""
        if self.host_tokens < page_size or self.host_tokens % page_size:
            raise ValueError(f"host_tokens={self.host_tokens} must be a positive multiple of page_size={page_size}")
        if self.write_policy not in ("write_back", "write_through", "write_through_selective"):
            raise ValueError(f"unknown HiCache write policy {self.write_policy!r}")
        return dict(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout=self.layout,
                    hicache_write_policy=self.write_policy,
                    hicache_ratio=(self.host_tokens - page_size + 0.5) / pool_tokens)


class _LayerCounterSink:
    """Stands for the model worker the registry hands HiCache's layer-done counter to (the offline cache
    runs no forward pass that would wait on it)."""

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


class OfflineOutOfMemory(RuntimeError):
    """The pool cannot supply the KV slots (or the request row) an operation needs, even after evicting
    everything evictable. Raised *before* any slot is taken, so the cache is unchanged (eviction aside:
    nothing is evicted when the demand is known to be unsatisfiable)."""

    def __init__(self, message: str, *, needed: int = 0, available: int = 0, evictable: int = 0):
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.evictable = evictable


class OfflineRefused(ValueError):
    """The agent cache refused the request when it was created (``AgentRadixCache.admit``, which the
    plugin runs from its hook on ``Scheduler._create_generation_req``), e.g. a fork of a parent branch
    the server never saw or already closed. A server finishes such a request with an HTTP 400 abort
    before it holds any KV; offline nothing is admitted."""


class OfflineReq(Req):
    """SGLang's own ``Req``, created the way the scheduler creates one; nothing is overridden.

    The subclass exists only to name the type the driver hands out. Useful attributes (all SGLang's):
    ``rid``, ``origin_input_ids``, ``output_ids``, ``cached_tokens`` (prefix tokens reused from the tree,
    counted as ``ScheduleBatch.prepare_for_extend`` does), ``prefix_len``, ``extend_end``,
    ``finished_reason`` and ``kv`` (the request's ``ReqKvInfo``: row, committed/allocated lengths).
    """

    @property
    def prefill_done(self) -> bool:
        """Whether the whole prompt has been prefilled (no chunk left)."""
        return self.extend_end is not None and self.extend_end >= len(self.origin_input_ids)


# ---- construction ----------------------------------------------------------------------------


def offline_server_args(*, page_size: int = 1, enable_session_radix_cache: bool = False,
                        **fields: Any) -> ServerArgs:
    """A ``ServerArgs`` for an offline cache: dummy model (nothing loaded), CPU, the ``agentcache``
    backend, and the torch-native attention backend (so SGLang's CPU code paths are the ones taken).
    ``fields`` override or add ``ServerArgs`` fields (e.g. ``radix_eviction_policy="lru"``)."""
    from sglang.srt.server_args import ServerArgs

    register_backends()  # the backend flag accepts registered names only
    values = dict(
        model_path="dummy",
        device="cpu",
        page_size=page_size,
        radix_cache_backend=BACKEND_NAME,
        enable_session_radix_cache=enable_session_radix_cache,
        attention_backend="torch_native",
    )
    values.update(fields)
    return ServerArgs(**values)


def offline_context(server_args: ServerArgs | None = None) -> RuntimeContext:
    """A private SGLang ``RuntimeContext`` for ``server_args`` (default :func:`offline_server_args`),
    placed as WORLD rank 0 of a single-rank scheduler. It is not installed process-wide; activate it
    with ``sglang.srt.runtime_context.use_context``."""
    if server_args is None:
        server_args = offline_server_args()
    return create_context(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))


def build_offline_cache(pool_tokens: int = 4096, page_size: int = 1, max_reqs: int = 64,
                        enable_session_radix_cache: bool = False, *, context_len: int | None = None,
                        server_args: ServerArgs | None = None, stock: bool = False,
                        tp_group: Any = None, hicache: OfflineHiCache | None = None) -> AgentRadixCache:
    """Build the real ``AgentRadixCache`` over real SGLang memory pools on CPU.

    - ``pool_tokens``: KV slots in the pool (the allocator's ``size``; rounded down to whole pages).
    - ``page_size``: tokens per KV page (1 selects ``TokenToKVPoolAllocator``, more the paged one).
    - ``max_reqs``: rows of the ``ReqToTokenPool`` (concurrently live requests).
    - ``enable_session_radix_cache``: SGLang's ``--enable-session-radix-cache``.
    - ``context_len``: the longest request (prompt + output) a row can hold; default ``pool_tokens``.
    - ``server_args``: a ready ``ServerArgs`` instead of :func:`offline_server_args` (its ``page_size``
      and ``enable_session_radix_cache`` must agree with the arguments).
    - ``stock``: build SGLang's own ``UnifiedRadixCache`` on its Python tree core instead (the
      default chain, no plugin): the baseline the replayer measures against.
    - ``tp_group``: a CPU (gloo) ``torch.distributed`` group standing for the TP ranks (the scheduler
      passes its ``tp_cache_group``; HiCache reduces over it). Tests only.
    - ``hicache``: attach SGLang's own HiCache (see :class:`OfflineHiCache`), the host tier; without it
      there is none. Not with ``server_args`` (give its fields there).

    The cache is built through ``sglang.srt.mem_cache.registry.create_tree_cache`` -- the scheduler's
    own entry -- so our registered ``agentcache`` factory (with its pinned-internals check) runs. The
    private runtime context it was built under is remembered; see :func:`activated`.
    """
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    if page_size < 1 or max_reqs < 1:
        raise ValueError("page_size and max_reqs must be >= 1")
    pool_tokens = pool_tokens // page_size * page_size
    if pool_tokens < page_size:
        raise ValueError(f"pool_tokens must hold at least one {page_size}-token page")
    if hicache is not None and server_args is not None:
        raise ValueError("pass HiCache either as hicache= or in server_args, not both")
    if server_args is None:
        server_args = offline_server_args(page_size=page_size,
                                          enable_session_radix_cache=enable_session_radix_cache,
                                          **({"radix_cache_backend": None} if stock else {}),
                                          **(hicache.server_fields(pool_tokens, page_size) if hicache else {}))
    elif server_args.page_size not in (None, page_size):
        raise ValueError(f"server_args.page_size={server_args.page_size} but page_size={page_size}")
    context = offline_context(server_args)
    device, dtype = "cpu", torch.float32
    with use_context(context):
        memory = get_memory()
        kv_pool = MHATokenToKVPool(
            size=pool_tokens, page_size=page_size, dtype=dtype, head_num=1, head_dim=1, layer_num=1,
            device=device, enable_memory_saver=False, enable_alt_stream=False,
        )
        if page_size == 1:
            allocator = TokenToKVPoolAllocator(pool_tokens, dtype=dtype, device=device, kvcache=kv_pool,
                                               need_sort=False)
        else:
            allocator = PagedTokenToKVPoolAllocator(pool_tokens, page_size=page_size, dtype=dtype,
                                                    device=device, kvcache=kv_pool, need_sort=False)
        # SGLang sizes rows as context_len + a few slack tokens (get_req_to_token_extra_context_len).
        req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=(context_len or pool_tokens) + 4,
                                           device=device, enable_memory_saver=False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            eviction_policy=memory.radix_eviction_policy,
            eviction_policy_config=memory.radix_eviction_policy_config,
            enable_session_radix_cache=memory.enable_session_radix_cache,
            tree_core_backend="python" if stock else BACKEND_NAME,  # agentcache_factory sets it too
            tp_cache_group=tp_group,
        )
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(group=tp_group)
        tp_rank = 0 if tp_group is None else torch.distributed.get_rank(group=tp_group)
        build = TreeCacheBuildContext(
            server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=bool(server_args.enable_hierarchical_cache), disable_radix_cache=False,
            tp_worker=_LayerCounterSink(), model_config=None,
            tp_size=tp_size, tp_rank=tp_rank, tp_group=tp_group,
        )
        cache = create_tree_cache(build)
    if not stock and not isinstance(cache, AgentRadixCache):
        raise RuntimeError(f"create_tree_cache built {type(cache).__name__}, not AgentRadixCache "
                           f"(radix_cache_backend={server_args.radix_cache_backend!r})")
    _CONTEXTS[cache] = context
    if hicache is not None and cache.cache_controller.mem_pool_host.size != hicache.host_tokens:
        raise RuntimeError(f"HiCache sized its host pool {cache.cache_controller.mem_pool_host.size} tokens, "
                           f"not {hicache.host_tokens}: SGLang's sizing rule changed")
    return cache


def context_of(cache: AgentRadixCache) -> RuntimeContext:
    """The private runtime context ``cache`` was built under by :func:`build_offline_cache`."""
    try:
        return _CONTEXTS[cache]
    except KeyError:
        raise ValueError("this cache was not built by build_offline_cache") from None


@contextmanager
def activated(cache: AgentRadixCache) -> Iterator[AgentRadixCache]:
    """Make ``cache``'s runtime context the active SGLang config for the block (not thread-safe, like
    ``use_context`` itself); use it around direct calls into SGLang code on an offline cache."""
    with use_context(context_of(cache)):
        yield cache


# ---- the driver ------------------------------------------------------------------------------


class OfflineDriver:
    """Drives request lifecycles through an offline ``AgentRadixCache`` the way SGLang's scheduler does.

    Requests are handled one at a time (a batch of one), but any number may be live at once, up to
    the request pool's rows. Each request is in one of these states: *live* (admitted, holds a
    request row, its prefix locked in the tree), then *released* by :meth:`finish` or :meth:`abort`.
    Methods raise ``ValueError`` for a request that is not live or for a call out of order, and
    :class:`OfflineOutOfMemory` when the pool cannot supply the slots even after eviction.
    """

    def __init__(self, cache: AgentRadixCache | None = None, **build_kwargs: Any):
        """Wrap ``cache`` (built by :func:`build_offline_cache`) or build one from ``build_kwargs``."""
        if cache is None:
            cache = build_offline_cache(**build_kwargs)
        elif build_kwargs:
            raise TypeError("pass either a cache or build arguments, not both")
        self.cache = cache
        self.context = context_of(cache)
        self.live: dict[str, OfflineReq] = {}
        self.hicache_loaded_tokens = 0  # what admissions loaded back from HiCache's host pool
        # Every copy HiCache's cache controller starts, in tokens (the replay's bytes moved, for ours and
        # for SGLang's own cache alike): device->host backups and host->device loads.
        self.hicache_moved = {"d2h_tokens": 0, "h2d_tokens": 0}
        if getattr(cache, "cache_controller", None) is not None:
            self._count_hicache_copies(cache.cache_controller)

    def _count_hicache_copies(self, controller) -> None:
        """Wrap this cache controller's ``write`` (a backup: device indices in) and ``load`` (host indices
        in) to count the tokens of every copy it accepts (a None result: refused for room, nothing moves)."""
        moved, write, load = self.hicache_moved, controller.write, controller.load

        def counted_write(device_indices, *args, **kwargs):
            host_indices = write(device_indices, *args, **kwargs)
            if host_indices is not None:
                moved["d2h_tokens"] += len(device_indices)
            return host_indices

        def counted_load(host_indices, *args, **kwargs):
            device_indices = load(host_indices, *args, **kwargs)
            if device_indices is not None:
                moved["h2d_tokens"] += len(host_indices)
            return device_indices

        controller.write, controller.load = counted_write, counted_load

    # ---- views ----

    @property
    def allocator(self):
        return self.cache.token_to_kv_pool_allocator

    @property
    def req_to_token_pool(self):
        return self.cache.req_to_token_pool

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def pool_tokens(self) -> int:
        """KV slots in the pool."""
        return self.allocator.size

    def free_tokens(self) -> int:
        """Slots the allocator can hand out without evicting."""
        return self.allocator.available_size()

    def idle_free_tokens(self) -> int:
        """Slots an allocation could get right now: free slots plus unlocked (evictable) tree KV.

        With no live request and nothing leaked this equals :attr:`pool_tokens`."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def check(self) -> IntegrityReport:
        """``cache.check_integrity`` -- idle (conservation enforced) when no request is live."""
        with self.activated():
            if isinstance(self.cache, AgentRadixCache):
                return self.cache.check_integrity(idle=not self.live)
            return check_tree(self.cache, idle=not self.live, agent_state=False)

    @contextmanager
    def activated(self) -> Iterator[AgentRadixCache]:
        """Activate this cache's SGLang runtime context (see :func:`activated`)."""
        with use_context(self.context):
            yield self.cache

    # ---- lifecycle ----

    def admit(self, rid: str, input_ids: Sequence[int], kv_hints: dict | Any | None = None,
              extra_key: str | None = None, cache_salt: str | None = None, session_id: str | None = None,
              *, max_prefill_tokens: int | None = None, budget: int | None = None) -> OfflineReq:
        """Create, match, lock and allocate a request, as the scheduler does when it admits one.

        ``kv_hints`` is a ``kv_hints`` envelope (a dict such as
        :func:`sgl_agentcache.hints.lifecycle_envelope` builds, or a ``KvHintsEnvelope``); it is decoded
        with SGLang's ``decode_kv_hints_envelope`` like ``GenerateReqInput`` does (a malformed
        envelope raises ``ValueError``; a malformed lifecycle hint inside is ignored and counted by the
        cache, as on the server). With ``session_id`` and ``--enable-session-radix-cache``, the request
        gets its session generation as in ``Scheduler.handle_generate_request``. A hinted request is
        first offered to ``AgentRadixCache.admit`` as the plugin's scheduler hook does; a refusal raises
        :class:`OfflineRefused` and admits nothing.

        The prompt's prefix found in the tree is reused (``req.cached_tokens``; at most
        ``len(input_ids) - 1`` tokens, as SGLang always recomputes the last one) and locked; slots for
        the rest are allocated, evicting unlocked tree KV if the pool is short. ``max_prefill_tokens``
        makes this the first chunk of a chunked prefill (floored to whole pages); continue it with
        :meth:`checkpoint` and :meth:`prefill_next_chunk`. ``budget``: the scheduler's token budget
        check (``PrefillAdder.add_one_req``) -- with the match locked, the new tokens plus ``budget``
        (the request's output and what running requests will still decode) must stay below free plus
        evictable slots, else :class:`OfflineOutOfMemory` and nothing is admitted.
        """
        req = self.queue(rid, input_ids, kv_hints, extra_key, cache_salt, session_id)
        return self.admit_queued(req, max_prefill_tokens=max_prefill_tokens, budget=budget)

    def queue(self, rid: str, input_ids: Sequence[int], kv_hints: dict | Any | None = None,
              extra_key: str | None = None, cache_salt: str | None = None,
              session_id: str | None = None, max_new_tokens: int = UNBOUNDED_NEW_TOKENS) -> OfflineReq:
        """The first half of :meth:`admit`: create the request as the scheduler does when it arrives
        (``Req(...)`` and the plugin's admission hook), without matching or allocating; it waits in the
        queue until :meth:`admit_queued`. Meanwhile :meth:`rank` can rank it as the scheduler does.
        ``max_new_tokens`` is its sampling
        parameter (what SGLang's prefill budget reserves for it; the driver itself feeds any output)."""
        with self.activated():
            if rid in self.live:
                raise ValueError(f"request {rid!r} is already live")
            if len(input_ids) == 0:
                raise ValueError("input_ids must not be empty")
            if len(input_ids) > self.req_to_token_pool.max_context_len:
                raise ValueError(f"{len(input_ids)} input tokens exceed the row length "
                                 f"{self.req_to_token_pool.max_context_len}")
            envelope = decode_kv_hints_envelope(kv_hints) if kv_hints else None
            req = OfflineReq(
                rid, "", array("q", input_ids), SamplingParams(max_new_tokens=max_new_tokens),
                kv_hints=envelope, extra_key=extra_key, cache_salt=cache_salt, session_id=session_id,
            )
            cache = self.cache
            # The plugin's AROUND hook on Scheduler._create_generation_req (server/scheduler/admission.py).
            if req.kv_hints is not None and isinstance(cache, AgentRadixCache):
                refusal = cache.admit(req)
                if refusal is not None:
                    raise OfflineRefused(f"request {rid!r} refused: {refusal}")
            if getattr(cache, "admission", None) is not None:  # program-aware admission notes it
                cache.admission.received(req, namespace_of(req))
            if session_id is not None and cache.enable_session_radix_cache:
                req.session_generation = cache.ensure_session_generation(session_id)
            return req

    def rank(self, waiting: Sequence[OfflineReq], policy: str = "lpm") -> list[OfflineReq]:
        """Rank queued requests as ``Scheduler.get_new_batch_prefill`` does at every step before it
        admits any: SGLang's ``SchedulePolicy(policy).calc_priority`` (which matches each request
        against the tree for cache-aware policies), through the plugin's hook on it. Returns the
        requests in SGLang's order; nothing is admitted."""
        from sglang.srt.managers.schedule_policy import SchedulePolicy

        from sgl_agentcache.server.scheduler.admission import around_calc_priority

        with self.activated():
            queue = list(waiting)
            scheduler_policy = SchedulePolicy(policy, self.cache, False, False, False)
            around_calc_priority(SchedulePolicy.calc_priority, scheduler_policy, queue)
            return queue

    def admit_queued(self, req: OfflineReq, *, max_prefill_tokens: int | None = None,
                     budget: int | None = None) -> OfflineReq:
        """The second half of :meth:`admit`: match, lock and allocate a :meth:`queue`d request.

        With a ``budget``, a request that does not fit raises :class:`OfflineOutOfMemory` having moved
        nothing: its HiCache host hit loads back only once it passed the budget counting those tokens as
        new (SGLang loads a host hit in ``PrefillAdder.add_one_req`` after that check)."""
        with self.activated():
            if req.rid in self.live:
                raise ValueError(f"request {req.rid!r} is already live")
            cache = self.cache
            # Scheduler.get_new_batch_prefill: match the prefix (match_kv_cache) ...
            req.init_next_round_input(cache)
            # ... PrefillAdder: pick the extend and pin the match (_commit_prefill_admission).
            req.extend_end = self._chunk_end(req, max_prefill_tokens)
            req.lock = cache.lock(req.last_node)
            try:
                if budget is not None:
                    self._check_budget(req, budget)
                if self.hicache and req.host_hit_length > 0:
                    self._load_back_from_hicache(req)
                    req.extend_end = self._chunk_end(req, max_prefill_tokens)
                self._alloc_for_extend(req)
            except BaseException:
                cache.unlock(req.lock)
                req.lock = None
                raise
            self.live[req.rid] = req
            return req

    def checkpoint(self, req: OfflineReq) -> None:
        """Publish what the request has prefilled so far, ``[0, extend_end)`` (SGLang's
        ``checkpoint_kv_cache``, as ``Scheduler.stash_chunked_request`` runs it between the chunks of a
        chunked prefill). The tree then owns that prefix; the request keeps it locked."""
        with self.activated():
            self._require_live(req)
            checkpoint_kv_cache(req, self.cache)

    def prefill_next_chunk(self, req: OfflineReq, max_prefill_tokens: int | None = None) -> None:
        """Prefill the next chunk of a chunked request (after :meth:`checkpoint`, as the scheduler
        always stashes a chunk before scheduling the next); ``None`` takes the rest of the prompt."""
        with self.activated():
            self._require_live(req)
            if req.prefill_done:
                raise ValueError(f"request {req.rid!r} has no prompt chunk left")
            if req.prefix_len != req.extend_end:
                raise ValueError(f"checkpoint request {req.rid!r} before its next chunk")
            req.extend_end = self._chunk_end(req, max_prefill_tokens)
            self._alloc_for_extend(req)

    def extend(self, req: OfflineReq, output_ids: Sequence[int], *, batched_decode: bool = False) -> None:
        """Feed generated tokens, one forward step each.

        The first output token of a request is the result of its prefill forward: it is appended and
        the prompt is published with ``checkpoint_kv_cache`` (``process_batch_result_prefill``). Every
        later token is one decode step: a slot is allocated for the *previous* token (the decode
        input), written into the row, and the new token appended (``alloc_for_decode``). So, as on the
        server, the last output token never has KV: after ``n`` outputs the request holds
        ``len(prompt) + n - 1`` slots. Tokens are applied one by one; if a step cannot get a slot,
        :class:`OfflineOutOfMemory` is raised and the earlier tokens stay applied.

        ``batched_decode`` (page size 1; the replayer, where nothing else touches the cache between one
        request's decode steps): the decode slots are allocated in one call. The tree ends the same:
        eviction frees whole leaves in rank order until the demand is met, so one demand of ``n``
        slots evicts exactly the leaves ``n`` demands of one slot evict in turn.
        """
        with self.activated():
            self._require_live(req)
            if not req.prefill_done:
                raise ValueError(f"request {req.rid!r} is still prefilling; use prefill_next_chunk")
            tokens = list(output_ids)
            if batched_decode and self.page_size == 1 and tokens:
                if not req.output_ids:
                    req.output_ids.append(tokens.pop(0))
                    checkpoint_kv_cache(req, self.cache)
                    self._batch_done()
                if tokens:
                    self._alloc_for_decode(req, len(tokens))
                    req.output_ids.extend(tokens)
                    self._batch_done()
                return
            for token in tokens:
                if not req.output_ids:
                    req.output_ids.append(token)
                    checkpoint_kv_cache(req, self.cache)
                else:
                    self._alloc_for_decode(req)
                    req.output_ids.append(token)
                self._batch_done()

    def finish(self, req: OfflineReq) -> None:
        """Finish the request normally (a length finish at its current output) and release it with
        SGLang's ``release_kv_cache(req, tree_cache, checkpoint=True)``: its KV goes into the tree
        (prompt and outputs with KV), the lock is dropped, anything the tree does not keep is freed."""
        with self.activated():
            self._require_live(req)
            if not req.prefill_done:
                raise ValueError(f"request {req.rid!r} cannot finish in the middle of its prefill; abort it")
            # The FINISH_LENGTH branch of Req.update_finish_state, with max_new_tokens == len(output_ids).
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            req.finished_len = len(req.output_ids)
            self._release(req, checkpoint=True)

    def abort(self, req: OfflineReq, *, checkpoint: bool = False, message: str = "Aborted") -> None:
        """Abort the request and release it.

        Default (``checkpoint=False``): the scheduler's abort of a queued, chunked or not-yet-running
        request (``prepare_abort``, ``_release_aborted_request``, then
        ``release_kv_cache(..., checkpoint=False)``): whatever the request holds beyond the tree-owned
        prefix is freed; what an earlier checkpoint already published stays in the tree (the agent
        cache closes the request's branch on abort, which reclaims its own nodes).

        ``checkpoint=True`` mirrors SGLang's abort of a *running* (decoding) request instead: the
        scheduler sets ``to_finish = FINISH_ABORT()`` and the next step's result processing releases it
        with ``checkpoint=True``, publishing its KV first. (That path also runs one more decode step;
        call :meth:`extend` first to model it.)
        """
        with self.activated():
            self._require_live(req)
            if checkpoint:
                if not req.prefill_done:
                    raise ValueError("a request in the middle of its prefill is aborted without checkpoint")
                req.to_finish = FINISH_ABORT()
                req.update_finish_state(0)  # the to_finish branch: finished_reason = FINISH_ABORT
            else:
                req.finished_reason = FINISH_ABORT(message)  # prepare_abort
                req.release_mm_inputs_on_abort()  # Scheduler._release_aborted_request
                self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
            self._release(req, checkpoint=checkpoint)

    def step(self) -> None:
        """The per-batch tick (``tree_cache.flush_pending_backups()``, and HiCache's event poll) with no
        request work."""
        with self.activated():
            self._batch_done()

    # ---- radix-native sessions (--enable-session-radix-cache) ----

    def flush_cache(self) -> None:
        """``Scheduler.flush_cache``: with no live request, reset the tree and clear both pools."""
        if self.live:
            raise ValueError(f"cannot flush with {len(self.live)} live requests")
        with self.activated():
            self.cache.reset()
            self.req_to_token_pool.clear()
            self.allocator.clear()

    def open_session(self, session_id: str):
        """``tree_cache.open_radix_session`` as the scheduler runs it for ``OpenSessionReqInput``."""
        with self.activated():
            return self.cache.open_radix_session(session_id)

    def close_session(self, session_id: str) -> int:
        """``tree_cache.release_radix_session`` as the scheduler runs it on session close."""
        with self.activated():
            return self.cache.release_radix_session(session_id)

    # ---- internals ----

    def _require_live(self, req: OfflineReq) -> None:
        if self.live.get(req.rid) is not req:
            raise ValueError(f"request {req.rid!r} is not live in this driver")

    def _chunk_end(self, req: OfflineReq, max_prefill_tokens: int | None) -> int:
        """End of the next prefill extend: the whole remaining prompt, or a page-floored chunk of it."""
        total = len(req.full_untruncated_fill_ids)
        if max_prefill_tokens is None or total - req.prefix_len <= max_prefill_tokens:
            return total
        end = (req.prefix_len + max_prefill_tokens) // self.page_size * self.page_size
        if end <= req.prefix_len:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} is less than one page past the prefix")
        return end

    def _pages_ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _check_budget(self, req: OfflineReq, budget: int) -> None:
        """``PrefillAdder.add_one_req`` after ``_lock_node``: ``total_tokens >= rem_total_tokens`` is
        NO_TOKEN, where the total is the extend plus what must stay free for decoding and the room is
        free plus evictable slots (the matched prefix, now locked, no longer counts as evictable)."""
        extend = req.extend_end - req.prefix_len
        available, evictable = self.allocator.available_size(), self.cache.evictable_size()
        if extend + budget >= available + evictable:
            raise OfflineOutOfMemory(f"prefill of {req.rid!r}: {extend} new tokens + {budget} budget do not fit "
                                     f"{available} free + {evictable} evictable", needed=extend + budget,
                                     available=available, evictable=evictable)

    def _ensure_allocatable(self, needed: int, what: str) -> None:
        """Raise :class:`OfflineOutOfMemory` unless ``needed`` slots exist once every unlocked tree
        node is evicted. The eviction itself is left to SGLang's allocation path."""
        available = self.allocator.available_size()
        if available >= needed:
            return
        evictable = self.cache.evictable_size()
        if available + evictable < needed:
            raise OfflineOutOfMemory(
                f"{what}: needs {needed} KV slots; {available} free + {evictable} evictable "
                f"(pool {self.pool_tokens})", needed=needed, available=available, evictable=evictable)

    def _alloc_for_extend(self, req: OfflineReq) -> None:
        """``alloc_for_extend`` for a batch of one: request row, KV slots, row write, KV lengths."""
        cache, pool = self.cache, self.req_to_token_pool
        prefix_len, seq_len = req.prefix_len, req.extend_end
        extend_len = seq_len - prefix_len
        # _prefix_kv_indices: a held row already has its prefix; a new request reads its match.
        if req.kv.holds_kv:
            prefix = pool.req_to_token[req.kv.req_pool_idx][:prefix_len].to(torch.int64)
        elif prefix_len == 0:
            prefix = torch.empty((0,), dtype=torch.int64)
        else:
            prefix = cache.prefix_device_indices(req)
        if self.page_size == 1:
            needed = extend_len
        else:
            needed = self._pages_ceil(seq_len) - self._pages_ceil(prefix_len)
        self._ensure_allocatable(needed, f"prefill of {req.rid!r}")
        new_row = not req.kv.holds_kv
        if new_row and pool.available_size() < 1:
            raise OfflineOutOfMemory(f"prefill of {req.rid!r}: all {pool.size} request rows are in use")

        prefix_lens_cpu = torch.tensor([prefix_len], dtype=torch.int64)
        seq_lens_cpu = torch.tensor([seq_len], dtype=torch.int64)
        extend_lens_cpu = torch.tensor([extend_len], dtype=torch.int64)
        req_pool_indices_cpu = torch.tensor(alloc_req_slots(pool, [req], cache), dtype=torch.int64)
        try:
            if self.page_size == 1:
                out_cache_loc = alloc_token_slots(cache, extend_len)
            else:
                last_loc = prefix[-1:] if len(prefix) > 0 else torch.full((1,), -1, dtype=torch.int64)
                out_cache_loc = alloc_paged_token_slots_extend(
                    tree_cache=cache, prefix_lens=prefix_lens_cpu, prefix_lens_cpu=prefix_lens_cpu,
                    seq_lens=seq_lens_cpu, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc,
                    extend_num_tokens=extend_len,
                )
        except BaseException:
            if new_row:
                pool.free(req)
            raise
        write_cache_indices(
            out_cache_loc, req_pool_indices_cpu, req_pool_indices_cpu, prefix_lens_cpu, prefix_lens_cpu,
            seq_lens_cpu, seq_lens_cpu, extend_lens_cpu, extend_lens_cpu, [prefix], pool,
        )
        pool.alloc_aux_to_lengths(req_pool_indices_cpu=req_pool_indices_cpu, target_seq_lens_cpu=seq_lens_cpu)
        req.kv.kv_allocated_len = seq_len
        req.kv.kv_committed_len = seq_len
        cache.maybe_hand_to_session(req)
        # ScheduleBatch.prepare_for_extend bookkeeping.
        req.extend_batch_idx += 1
        if not req.retracted_stain:
            req.cached_tokens += prefix_len - req.already_computed
            req.already_computed = seq_len

    def _alloc_for_decode(self, req: OfflineReq, steps: int = 1) -> None:
        """``alloc_for_decode`` for a batch of one: a slot for the decode input token at ``seq_len``
        (``steps`` consecutive ones at once: page size 1 only, see ``extend``)."""
        cache, pool = self.cache, self.req_to_token_pool
        seq_len = req.kv.kv_committed_len
        if seq_len + steps > pool.max_context_len:
            raise ValueError(f"request {req.rid!r} would exceed the row length {pool.max_context_len}")
        if steps > 1:
            self._ensure_allocatable(steps, f"decode steps of {req.rid!r}")
            row = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
            positions = torch.arange(seq_len, seq_len + steps, dtype=torch.int64)
            out_cache_loc = alloc_token_slots(cache, steps)
            pool.write((row, positions), out_cache_loc.to(torch.int32))
            pool.alloc_aux_to_lengths(req_pool_indices_cpu=row,
                                      target_seq_lens_cpu=torch.tensor([seq_len + steps], dtype=torch.int64))
            req.kv.kv_allocated_len += steps
            req.kv.kv_committed_len += steps
            req.decode_batch_idx += steps
            return
        needed = 1 if self.page_size == 1 else (self.page_size if seq_len % self.page_size == 0 else 0)
        self._ensure_allocatable(needed, f"decode step of {req.rid!r}")
        row = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
        seq_lens = torch.tensor([seq_len], dtype=torch.int64)
        if self.page_size == 1:
            out_cache_loc = alloc_token_slots(cache, 1)
        else:
            last_loc = pool.req_to_token[row, seq_lens - 1].to(torch.int64)
            out_cache_loc = alloc_paged_token_slots_decode(
                tree_cache=cache, seq_lens=seq_lens + 1, seq_lens_cpu=seq_lens + 1, last_loc=last_loc,
            )
        pool.write((row, seq_lens), out_cache_loc.to(torch.int32))
        pool.alloc_aux_to_lengths(req_pool_indices_cpu=row, target_seq_lens_cpu=seq_lens + 1)
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1
        req.decode_batch_idx += 1

    def _release(self, req: OfflineReq, *, checkpoint: bool) -> None:
        release_kv_cache(req, self.cache, checkpoint=checkpoint)
        del self.live[req.rid]
        self._batch_done()

    @property
    def hicache(self) -> bool:
        """Whether SGLang's own HiCache is attached to the cache."""
        return getattr(self.cache, "cache_controller", None) is not None

    def idle_poll(self) -> None:
        """The scheduler's loop between batches: it acknowledges finished HiCache copies at the top of
        every iteration, busy or idle. A copy issued outside a batch (a prefetch's ``load_back``) holds
        its device slots locked until then; without this poll a replay whose queue waits on those slots
        would wait for a batch that never comes."""
        self._batch_done()

    def _batch_done(self) -> None:
        """After a batch result: pending backups go to the copy engine (``Scheduler.process_batch_result``)
        and, with HiCache, its finished backups and loads are acknowledged (``check_hicache_events``, which
        the scheduler runs at the top of its next step)."""
        self.cache.flush_pending_backups()
        if self.hicache:
            self.cache.check_hicache_events()

    def _load_back_from_hicache(self, req: OfflineReq) -> None:
        """``PrefillAdder.add_one_req`` once a request with a HiCache host hit passed the budget (its host
        tokens counted as new): under a host lock on the match, ``init_load_back`` allocates device slots
        (evicting, or writing back, as it must) and queues the copy; the prefix grows by what it loaded
        (none, if it could not), the request now pins the loaded node, and the copy starts
        (``ready_to_load_host_cache``) and is acknowledged at once (a CPU copy is done when issued)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.cache
        host_lock = cache.inc_host_lock_ref(req.best_match_node).to_dec_params()
        try:
            loaded, last_node = cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        finally:
            cache.dec_host_lock_ref(req.best_match_node, host_lock)
        req.host_loaded_length = loaded
        self.hicache_loaded_tokens += loaded
        if loaded:
            lock = cache.lock(last_node)  # before letting the old one go: a failure leaves req.lock valid
            cache.unlock(req.lock)
            req.lock, req.last_node = lock, last_node
            req.prefix_len += loaded
            if cache.load_back_is_cache_owned():
                req.kv.cache_protected_len = req.prefix_len
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()
