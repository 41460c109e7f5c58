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
    Pin(f"{_TREE}.evict_device_leaf", ("self", "node_id", "is_write_back"), "branch reclaim frees exactly its nodes"),
    Pin(f"{_CACHE}._apply_eviction_result", ("self", "result"), "frees KV of reclaimed nodes"),
    Pin(f"{_CACHE}._accumulate_tracker", ("self", "tracker", "delta"), "counts reclaimed tokens"),
    Pin(f"{_CACHE}.release_radix_session", ("self", "session_id"), "session close terminates its branches"),
    Pin(f"{_CACHE}._apply_cache_actions", ("self", "actions"), "actions returned by boundary splits"),
    Pin(f"{_CACHE}.on_release", ("self", "req", "checkpointed"), "reclaim terminated nodes once unlocked"),
    Pin(f"{_CACHE}.flush_pending_backups", ("self",), "per-batch tick for pending reclaim"),
    Pin(f"{_CACHE}.reset", ("self",), "a flush drops pause state with the tree"),
    # HiCache attached (issue #36): the lifecycle decides what its host pool holds.
    Pin(f"{_CACHE}.init_hicache", ("self", "server_args", "params"),
        "the lifecycle takes over HiCache's backups, deletes and host eviction order when SGLang attaches it"),
    Pin(f"{_TREE}._evict_host_leaf", ("self", "node", "tracker", "device_frees", "host_frees", "cache_actions"),
        "a closed branch's host-only node is deleted from HiCache's host pool; host eviction's losses are "
        "counted for the learned host reuse rate"),
    Pin(f"{_TREE}.drive_host_eviction", ("self", "component_type", "num_tokens"),
        "host eviction is told its need, so that it takes only the tail of its last leaf (hicache_moves.host_tail)"),
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
        "a write-back leaf too long for the host room loses its tail only (server/scheduler/hicache_moves.py)"),
    Pin(f"{_CACHE}.backup_node_for_write_back", ("self", "node_id"), "the head of such a leaf is backed up"),
    Pin(f"{_TREE}._is_host_leaf", ("self", "node"),
        "host room counts the host-only nodes its eviction can take, by its test (hicache_moves.host_evictable_tokens)"),
    Pin("sglang.srt.mem_cache.unified_cache.components.full:FullComponent.drive_host_eviction",
        ("self", "num_tokens", "tracker", "device_frees", "host_frees", "cache_actions"),
        "its host eviction takes a leaf, then the parent that became one: a host-only chain is room whole"),
    Pin(f"{_CACHE}._demote", ("self", "node_id", "tracker"), "and then demoted, as SGLang demotes a leaf"),
    Pin("sglang.srt.mem_cache.unified_cache.components.full:FullComponent._evict_device_next_node",
        ("self", "tracker", "device_frees", "host_frees", "cache_actions"),
        "its walk pushes the last victim's parent (_evict_device_last_node): after a split that is the head"),
    Pin(f"{_CACHE}.has_free_load_back_slot", ("self",), "a prefetch is skipped while every HiCache load-back slot is busy"),
    Pin(f"{_CACHE}.prefetch_from_storage",
        ("self", "request", "last_host_node_id", "new_input_tokens", "last_hash", "prefix_keys",
         "matched_prefix_tokens", "extra_key", "cache_salt", "storage_hit_end"),
        "a prefetch starts HiCache's L3 -> host fetch of a paused branch under its own request handle "
        "(server/scheduler/hicache_moves.py: fetch_from_storage)"),
    Pin(f"{_CACHE}.has_ongoing_prefetch", ("self", "handle"), "whether that fetch was started"),
    Pin(f"{_CACHE}.release_aborted_request", ("self", "request"),
        "the fetch is stopped and its accounting dropped when the pause ends"),
    Pin(f"{_CACHE}.pop_prefetch_loaded_tokens", ("self", "request"), "what the fetch brought into the host pool"),
    Pin(f"{_CACHE}.is_backuped", ("self", "node_id"), "the fetch anchors on a node with a host copy (SGLang's gate)"),
    Pin(f"{_CACHE}.get_last_hash_value", ("self", "node_id"), "the anchor's page hash seeds the fetch's keys"),
    Pin(f"{_CACHE}.get_prefix_hash_values", ("self", "node_id"), "and its prefix keys, where the backend wants them"),
    Pin("sglang.srt.mem_cache.base_prefix_cache:CacheRequestHandle", ("rid", "attempt_id"),
        "the fetch's own request handle"),
    Pin("sglang.srt.mem_cache.hicache_storage:HiCacheFile.__init__", ("self", "storage_config", "file_path"),
        "DeletingFileStorage (server/scheduler/l3_store.py) is the file backend plus per-page deletes"),
    Pin("sglang.srt.mem_cache.hicache_storage:HiCacheFile._get_component_key", ("self", "key", "component_name"),
        "a deleted page's file name per pool"),
    Pin("sglang.srt.mem_cache.storage.file.lru_file_evictor:LRUFileEvictor.abort", ("self", "suffixed_key"),
        "a deleted page's bytes leave the store's LRU accounting"),
    Pin("sglang.srt.mem_cache.buffer_mode.storage_existence_cache:PoolExistenceBeliefs.invalidate_beyond",
        ("self", "hashes", "keep_pages"), "deleted pages leave HiCache's belief of what storage holds"),
    Pin(f"{_CACHE}._evict_components",
        ("self", "request_by_type", "tracker", "available_size_targets", "allocation_reclaim_satisfied"),
        "the device walk's need (requested count, or free-slot target) bounds the tail its last victim gives up"),
    Pin(f"{_CACHE}._component_available_size", ("self", "component_type"), "free slots the walk's target counts"),
    Pin(f"{_CACHE}._evict_device_leaf", ("self", "node_id", "tracker"),
        "a terminated leaf is deleted on both tiers instead of demoted; over-quota evictions are counted"),
    Pin("sglang.srt.mem_cache.unified_cache.components.full:FullComponent._session_ref_eviction_strategy",
        ("self", "node"), "lifecycle eviction rank wraps session-radix references"),
    Pin(f"{_CACHE}.match_prefix", ("self", "params"),
        "a prefetch matches a paused branch's path for its device prefix and host hit"),
    Pin("sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams", ("key", "cow_mamba", "req"),
        "a prefetch builds its own match of a paused branch's path"),
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
        "a request whose stable prefix a batch-mate computes waits a step (CONTINUE, nothing added)"),
    Pin("sglang.srt.managers.schedule_policy:PrefillAdder.__init__",
        ("self", "page_size", "tree_cache", "token_to_kv_pool_allocator", "running_batch", "new_token_ratio",
         "rem_input_tokens", "rem_chunk_tokens", "num_mixed_decode_tokens", "priority_scheduling_preemption_threshold",
         "max_prefill_bs", "max_running_requests", "prefill_max_requests", "prefill_delayer_single_pass",
         "dllm_config", "waiting_queue_len", "prefill_tile_block_m"),
        "the shared-prefill wait reads the adder's can_run_list"),
    Pin("sglang.srt.managers.schedule_batch:Req.set_finish_with_abort", ("self", "error_msg", "status_code", "err_type"),
        "refused forks finish with a 400"),
    Pin("sglang.srt.managers.tokenizer_control_mixin:TokenizerControlMixin.init_communicators", ("self",),
        "tokenizer-side reply routing for our control messages"),
)


class PinnedInternalsChanged(RuntimeError):
    """Raised at start-up when the installed SGLang does not match the internals we were written for."""


#: The chat hooks' internals (server/front/chat_hooks.py), checked when inference is switched on.
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
