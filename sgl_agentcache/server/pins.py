"""The SGLang internals this adapter overrides or calls, and the start-up check that they still exist.

We run on an *unmodified* SGLang through its plugin points, but the tree-core hooks we need are private
methods (``_add_new_node``, ``_split_node``, ...). A silent rename in a later SGLang would make our
lifecycle accounting wrong without any error, so every such internal is pinned here by its parameter
names, and :func:`check_pinned_internals` runs inside each scheduler before the tree is built: if any pin
fails, the server refuses to start with one message naming the SGLang version we need.

To support a new SGLang release: re-read each target there, update this table, run ``make test``.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass

from sgl_agentcache import SGLANG_VERSION

_TREE = "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore"
_CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
_REGISTRY = "sglang.srt.mem_cache.registry"


@dataclass(frozen=True)
class Pin:
    """``target`` (``module:qualname``) must resolve to a callable with exactly ``params``."""

    target: str
    params: tuple[str, ...]
    why: str


PINS: tuple[Pin, ...] = (
    Pin(f"{_TREE}.__init__", ("self", "params", "components"), "AgentTreeCore subclasses it"),
    Pin(f"{_TREE}.reset", ("self",), "ownership indexes are rebuilt with the tree"),
    Pin(f"{_TREE}._new_node", ("self", "priority"), "every node gets agent state here"),
    Pin(f"{_TREE}._add_new_node", ("self", "parent", "key", "value", "priority", "session_id", "rotation_base"),
        "new leaves are charged to their branch here"),
    Pin(f"{_TREE}._split_node", ("self", "key", "child", "split_len"), "splits carry agent state to the new parent"),
    Pin(f"{_TREE}._unregister_node", ("self", "node"), "deleted nodes are refunded to their branch here"),
    Pin(f"{_TREE}._update_evictable_leaf_sets", ("self", "node"),
        "every node that becomes an evictable device leaf passes here (a terminated one is due for reclaim)"),
    Pin(f"{_TREE}._insert_walk_step", ("self", "state"),
        "an insert starts at its request's locked node; what the step does to a matched node is replayed"),
    Pin(f"{_TREE}._touch_node", ("self", "node"), "a skipped locked node gets the LRU stamp the walk gives it"),
    Pin(f"{_TREE}._inc_hit_count_and_check", ("self", "node"), "a skipped locked node is counted as the walk does"),
    Pin("sglang.srt.mem_cache.unified_cache.unified_tree_core:_InsertWalkState",
        ("phase", "node", "key", "value", "params", "priority", "result", "total_prefix_length", "is_new_leaf",
         "target_node", "overlap_node", "overlap_prefix_len", "pending_actions"),
        "the locked-prefix skip moves a fresh walk's node, offset, key and value"),
    Pin(f"{_TREE}._collect_all_nodes", ("self",), "integrity check walks the tree"),
    Pin(f"{_TREE}.match_full_device_prefix", ("self", "key"),
        "the quota check's walk must not split nodes or re-stamp LRU times (SGLang's read-only match)"),
    Pin(f"{_TREE}.sanity_check", ("self", "ongoing_write_through", "ongoing_load_back"), "integrity check"),
    Pin(f"{_CACHE}.__init__", ("self", "params"), "AgentRadixCache subclasses it"),
    Pin(f"{_CACHE}.checkpoint_into_tree", ("self", "req", "up_to", "kwargs"), "inserts carry request context"),
    Pin(f"{_CACHE}.evict", ("self", "params"), "stock eviction path"),
    Pin(f"{_CACHE}.protected_size", ("self",),
        "slots of host->device copies in flight count as protected in SGLang's idle pool-leak check"),
    Pin(f"{_TREE}.evict_device_leaf", ("self", "node_id", "is_write_back"), "branch reclaim frees exactly its nodes"),
    Pin(f"{_CACHE}._apply_eviction_result", ("self", "result"), "frees KV of reclaimed nodes"),
    Pin(f"{_CACHE}._accumulate_tracker", ("self", "tracker", "delta"), "counts reclaimed tokens"),
    Pin(f"{_CACHE}.release_radix_session", ("self", "session_id"), "session close terminates its branches"),
    Pin(f"{_CACHE}._apply_cache_actions", ("self", "actions"), "actions returned by boundary splits"),
    Pin(f"{_CACHE}.on_release", ("self", "req", "checkpointed"), "reclaim terminated nodes once unlocked"),
    Pin(f"{_CACHE}.flush_pending_backups", ("self",), "per-batch tick for pending reclaim"),
    Pin(f"{_CACHE}.reset", ("self",), "a flush drops pause state and host copies with the tree"),
    # HiCache attached (issue #36): the lifecycle decides what its host pool holds.
    Pin(f"{_CACHE}.init_hicache", ("self", "server_args", "params"),
        "our own host tier retires when SGLang attaches HiCache to the cache"),
    Pin(f"{_TREE}._evict_host_leaf", ("self", "node", "tracker", "device_frees", "host_frees", "cache_actions"),
        "a closed branch's host-only node is deleted from HiCache's host pool; host eviction's losses are "
        "counted for the learned host reuse rate"),
    Pin(f"{_TREE}._delete_unbacked_device_leaf",
        ("self", "node", "tracker", "device_frees", "host_frees", "cache_actions"),
        "a closed branch's node is deleted on the device and in the host pool at once (never demoted)"),
    Pin(f"{_TREE}._can_reclaim_full_host_duplicate", ("self", "node"),
        "a pause prices HiCache's host room with the write-back duplicates its host eviction releases first"),
    Pin(f"{_CACHE}.load_back", ("self", "node_id", "mem_quota", "req"),
        "a prefetch loads a paused branch back through HiCache's own load path; every load-back is counted "
        "for the learned host reuse rate"),
    Pin(f"{_CACHE}.ready_to_load_host_cache", ("self",), "a prefetch's copy starts at once"),
    Pin(f"{_CACHE}.write_backup_storage", ("self", "node_id"),
        "a salted node's L3 pages go into its salt's purge manifest as HiCache writes them"),
    Pin(f"{_CACHE}._drop_subtree_no_host", ("self", "node_id", "tracker"),
        "a write-back leaf too long for the host room loses its tail only (server/hicache_moves.py)"),
    Pin(f"{_CACHE}.backup_node_for_write_back", ("self", "node_id"), "the head of such a leaf is backed up"),
    Pin(f"{_CACHE}._demote", ("self", "node_id", "tracker"), "and then demoted, as SGLang demotes a leaf"),
    Pin("sglang.srt.mem_cache.unified_cache.components.full:FullComponent._evict_device_next_node",
        ("self", "tracker", "device_frees", "host_frees", "cache_actions"),
        "its walk pushes the last victim's parent (_evict_device_last_node): after a split that is the head"),
    Pin(f"{_CACHE}.has_free_load_back_slot", ("self",), "a prefetch is skipped while every HiCache load-back slot is busy"),
    Pin("sglang.srt.mem_cache.hicache_storage:HiCacheFile.__init__", ("self", "storage_config", "file_path"),
        "DeletingFileStorage (server/l3_store.py) is the file backend plus per-page deletes"),
    Pin("sglang.srt.mem_cache.hicache_storage:HiCacheFile._get_component_key", ("self", "key", "component_name"),
        "a deleted page's file name per pool"),
    Pin("sglang.srt.mem_cache.storage.file.lru_file_evictor:LRUFileEvictor.abort", ("self", "suffixed_key"),
        "a deleted page's bytes leave the store's LRU accounting"),
    Pin("sglang.srt.mem_cache.buffer_mode.storage_existence_cache:PoolExistenceBeliefs.invalidate_beyond",
        ("self", "hashes", "keep_pages"), "deleted pages leave HiCache's belief of what storage holds"),
    Pin(f"{_CACHE}._evict_device_leaf", ("self", "node_id", "tracker"),
        "a node host copies hang from is spilled into them before stock eviction takes it"),
    Pin("sglang.srt.mem_cache.unified_cache.components.full:FullComponent._session_ref_eviction_strategy",
        ("self", "node"), "lifecycle eviction rank wraps session-radix references"),
    Pin(f"{_CACHE}.match_prefix", ("self", "params"),
        "a restore finds the prefix a host copy hangs from; a request's deferred restores run before its match"),
    Pin(f"{_CACHE}.insert", ("self", "params"), "a restore re-inserts the offloaded nodes"),
    Pin(f"{_CACHE}._all_reduce", ("self", "data", "tp_reduce_op"),
        "every TP rank agrees on a host<->device copy's outcome before acting on it (server/agreement.py)"),
    Pin(f"{_CACHE}.path_device_indices", ("self", "node"), "a restore reuses the resident prefix's slots"),
    Pin(f"{_CACHE}.lock", ("self", "node_id", "skip_lock_components"), "a restore locks its prefix while evicting"),
    Pin(f"{_CACHE}.unlock", ("self", "lock"), "a restore locks its prefix while evicting"),
    Pin("sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams", ("key", "cow_mamba", "req"),
        "the scheduler's match names its request (deferred restores run then)"),
    Pin("sglang.srt.mem_cache.base_prefix_cache:InsertParams",
        ("key", "value", "mamba_value", "mamba_keep_idx", "c128_value", "prev_prefix_len", "swa_branching_seqlen",
         "inserted_len", "priority", "session_id", "track_adopted_ranges", "rotation_base",
         "component_evicted_seqlens"), "a restore inserts with prev_prefix_len (no duplicate frees)"),
    Pin("sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.get_cpu_copy",
        ("self", "indices", "mamba_indices", "req_pool_index"), "the host tier's device->host copy"),
    Pin("sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.load_cpu_copy",
        ("self", "kv_cache_cpu", "indices", "mamba_indices", "req_pool_index"), "the host tier's host->device copy"),
    Pin(f"{_REGISTRY}:create_unified_radix_cache", ("ctx", "cache_class"), "builds our cache with HiCache wiring"),
    Pin(f"{_REGISTRY}:default_radix_cache_factory", ("ctx",), "--disable-radix-cache defers to it"),
    Pin(f"{_REGISTRY}:register_radix_cache_backend", ("name", "factory"), "backend registration"),
    Pin("sglang.srt.mem_cache.unified_cache.tree_core_registry:register_tree_core_backend", ("name", "factory"),
        "tree-core registration"),
    Pin("sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request", ("self", "obj", "request"),
        "lifecycle hints and token ids are validated before they reach a scheduler"),
    Pin("sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request", ("self", "obj", "input_ids"),
        "every prompt is checked once tokenized (an empty one kills SGLang 0.5.23's scheduler)"),
    Pin("sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat._convert_to_internal_request",
        ("self", "request", "raw_request"), "hint header on /v1/chat/completions"),
    Pin("sglang.srt.entrypoints.openai.serving_completions:OpenAIServingCompletion._convert_to_internal_request",
        ("self", "request", "raw_request"), "hint header on /v1/completions"),
    Pin("sglang.srt.entrypoints.http_server:launch_server",
        ("server_args", "init_tokenizer_manager_func", "run_scheduler_process_func", "run_detokenizer_process_func",
         "execute_warmup_func", "launch_callback"), "routes, tenants and the tenancy middleware are installed here"),
    Pin("sglang.srt.entrypoints.http_server:_wait_and_warmup",
        ("server_args", "launch_callback", "execute_warmup_func", "post_warmup_callback"),
        "with tenancy, SGLang's keyless start-up warmup is admitted only while it runs"),
    Pin("sglang.srt.entrypoints.engine:Engine._launch_subprocesses",
        ("server_args", "init_tokenizer_manager_func", "run_scheduler_process_func", "run_detokenizer_process_func",
         "port_args", "placement_group"), "unsupported deployments (DP > 1, several tokenizer workers) stop here"),
    Pin("sglang.srt.managers.io_struct:hook_custom_types", ("new_types",), "our IPC message types"),
    Pin("sglang.srt.managers.scheduler:Scheduler.init_request_dispatcher", ("self",),
        "scheduler handler for our control messages"),
    Pin("sglang.srt.managers.scheduler:Scheduler._create_generation_req", ("self", "recv_req", "args", "kwargs"),
        "hints are attached and checked as each request is created"),
    Pin("sglang.srt.managers.schedule_policy:SchedulePolicy.calc_priority",
        ("self", "waiting_queue", "running_batch", "processed_tokens"),
        "its matches only rank the waiting queue: no restore runs there (the admission match follows); "
        "program-aware admission reorders the queue it sorted"),
    Pin("sglang.srt.managers.schedule_policy:SchedulePolicy.__init__",
        ("self", "policy", "tree_cache", "enable_hierarchical_cache", "enable_priority_scheduling",
         "schedule_low_priority_values_first"),
        "program-aware admission keeps SGLang's priority (enable_priority_scheduling, priority_sign) as its first key"),
    Pin("sglang.srt.managers.schedule_policy:SchedulePolicy.waiting_queue_prefix_matched", ("self", "waiting_queue"),
        "program-aware admission matches returning requests itself only when SGLang's pass did not"),
    Pin("sglang.srt.mem_cache.common:match_kv_cache", ("req", "tree_cache", "token_ids", "cow_mamba", "max_prefix_len"),
        "program-aware admission reads a returning request's device match (a ranking match)"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
        ("self", "req", "has_chunked_req", "truncation_align_size"),
        "a request whose load-back is in flight is skipped for the step (CONTINUE, nothing added)"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder.__init__",
        ("self", "page_size", "tree_cache", "token_to_kv_pool_allocator", "running_batch", "new_token_ratio",
         "rem_input_tokens", "rem_chunk_tokens", "num_mixed_decode_tokens", "priority_scheduling_preemption_threshold",
         "max_prefill_bs", "max_running_requests", "prefill_max_requests", "prefill_delayer_single_pass",
         "dllm_config", "waiting_queue_len", "prefill_tile_block_m"),
        "the host-load budget check reads the adder's prefill_max_requests, can_run_list and per_req_token_overhead"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder.rem_total_tokens.fget", ("self",),
        "a host hit is loaded only if its request's tokens fit the adder's remaining total, as add_one_req checks"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder._lock_node", ("self", "last_node", "lock_host"),
        "a host hit is loaded only if the request passes the budget with its match locked, as add_one_req checks it"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder._mamba_gap_budget_for_req",
        ("self", "req", "include_host_hit"), "part of add_one_req's budget, checked before a host hit loads"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder._request_slot_reserve_for_req",
        ("self", "req", "extend_input_len"), "part of add_one_req's budget, checked before a host hit loads"),
    Pin("sglang.srt.managers.scheduler:Scheduler.on_idle", ("self",),
        "an idle scheduler lands eager offloads and prefetches whose copy a worker made (no flush_pending_backups)"),
    Pin("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.release_aborted_request", ("self", "request"),
        "a queued request's abort drops its load-back in flight"),
    Pin("sglang.srt.managers.schedule_batch:Req.init_next_round_input", ("self", "tree_cache", "cow_mamba"),
        "the admission match (right before PrefillAdder.add_one_req) is where a request's copies come back"),
    Pin("sglang.srt.managers.schedule_batch:Req.set_finish_with_abort", ("self", "error_msg", "status_code", "err_type"),
        "refused forks finish with a 400"),
    Pin("sglang.srt.managers.tokenizer_control_mixin:TokenizerControlMixin.init_communicators", ("self",),
        "tokenizer-side reply routing for our control messages"),
)


class PinnedInternalsChanged(RuntimeError):
    """Raised at start-up when the installed SGLang does not match the internals we were written for."""


#: The chat hooks' internals (server/chat_hooks.py), checked when inference is switched on.
_CHAT = "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat"
#: The chat serving internals inference hooks or calls, with their parameters (SGLang 0.5.23).
CHAT_PINS = (
    Pin(f"{_CHAT}._convert_to_internal_request", ("self", "request", "raw_request"),
        "the hint is inferred once the prompt is rendered"),
    Pin(f"{_CHAT}._handle_non_streaming_request", ("self", "adapted_request", "request", "raw_request"),
        "a reply's tool calls pause the branch"),
    Pin(f"{_CHAT}._generate_chat_stream", ("self", "adapted_request", "request", "raw_request"),
        "a streamed reply's tool calls pause the branch"),
    Pin(f"{_CHAT}._process_messages", ("self", "request", "is_multimodal", "output_constrained"),
        "the stable prefix and fork point are where the template's own rendering stops matching"),
)


def check_pinned_internals(pins: tuple[Pin, ...] = PINS) -> None:
    """Raise :class:`PinnedInternalsChanged` naming every failed pin, or return silently."""
    problems = []
    for pin in pins:
        try:
            obj = pkgutil.resolve_name(pin.target)
            found = tuple(inspect.signature(obj).parameters)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            problems.append(f"{pin.target}: missing ({type(exc).__name__}: {exc}); needed because {pin.why}")
            continue
        if found != pin.params:
            problems.append(f"{pin.target}: parameters {found} != expected {pin.params}; needed because {pin.why}")
    if problems:
        installed = _installed_sglang_version()
        raise PinnedInternalsChanged(
            f"sgl_agentcache needs sglang=={SGLANG_VERSION} (installed: {installed}); "
            f"{len(problems)} SGLang internal(s) it relies on changed:\n  " + "\n  ".join(problems)
        )


def _installed_sglang_version() -> str:
    try:
        import sglang

        return getattr(sglang, "__version__", "unknown")
    except ImportError:
        return "not installed"
