"""Known KV bytes for offline tests (``OfflineDriver``): stamp a request's prompt KV with values
derived from its positions, and read a cached path's KV back, to check that what a host tier copied
out comes back byte for byte."""

from __future__ import annotations

from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey


def stamp_prompt_kv(driver, req, prompt, stamp: int, start: int = 0) -> None:
    """Write ``stamp + position`` into every layer's K and V at the prompt's positions ``[start, len)``
    (``start``: the cached prefix, whose slots belong to the tree and keep their bytes)."""
    kv = driver.cache.token_to_kv_pool_allocator.get_kvcache()
    idx = driver.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(prompt)]
    for buf in kv.k_buffer + kv.v_buffer:
        buf[idx[start:]] = (torch.arange(start, len(prompt), dtype=buf.dtype) + stamp).view(-1, 1, 1)


def path_kv(driver, prompt) -> tuple[int, list[torch.Tensor]]:
    """How much of ``prompt`` is on the device, and that prefix's K and V bytes per layer."""
    cache = driver.cache
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    with driver.activated():
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), None)))
        slots = cache.path_device_indices(match.last_device_node)[: match.device_prefix_len]
    return match.device_prefix_len, [buf[slots].flatten().clone() for buf in kv.k_buffer + kv.v_buffer]
