"""Let stock SGLang 0.5.23's HiCache (``--enable-hierarchical-cache``) run on a CPU-only torch.

HiCache's host tier needs three things a CPU build lacks; each is filled in right after the SGLang
module that looks for it is imported (SGLang's files are not changed):

- unpinned host memory: host pools default to ``pin_memory=True``, which on CPU ends in
  ``cudaHostRegister`` (allocation) and ``torch.zeros(pin_memory=True)`` (L3 page staging), both of
  which fail without an accelerator. ``HostKVCache.pin_memory`` reads False here, so each pool allocates
  with its own allocator (mmap, shm, or a storage backend's) and pins nothing: with no device there is
  nothing to pin for.
- the ``--hicache-io-backend direct`` copies: ``pool_host.mha`` and ``memory_pool_host`` import
  ``transfer_kv_direct`` and the ``page_first_direct`` pair from ``sgl_kernel.kvcacheio`` only on CUDA,
  ROCm and XPU. They are written here in torch with the kernels' contract: token ``src_indices[i]`` of
  every source layer is copied to token ``dst_indices[i]`` of the matching destination layer.
- ``torch.cpu.Stream.synchronize``: the CPU stand-in stream lacks it. CPU copies finish before the call
  that makes them returns, so waiting on a stream has nothing to wait for.
- a smaller host-memory reserve: SGLang keeps 10 GiB of host RAM out of every HiCache pool's budget
  (``HICACHE_HOST_MEMORY_RESERVE_BYTES``), sized for GPU hosts. A CPU dev or CI machine running several
  small servers side by side (the benchmarks start up to nine) drops under that and the next server
  refuses a pool of a few MB. On a CPU torch the reserve is 1 GiB.

The ``kernel`` io backend (CUDA kernels over pointer tables) stays unavailable: launch with
``--hicache-io-backend direct`` and ``--hicache-mem-layout layer_first`` or ``page_first_direct``.

Installed by ``sgl-agentcache cpu-setup`` (sgl_agentcache/cpu_setup) and loaded by its ``.pth`` start-up
hook. Inert with a CUDA or ROCm build of torch, where the real kernels load and must not be shadowed.
"""
import sys

_PATCHED_MODULES = (
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.memory_pool_host",
)


def _cpu_torch():
    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return None
    return torch


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``dst_layers[j][dst_indices] = src_layers[j][src_indices]`` for every layer ``j`` (token rows)."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: source and destination index counts differ")
    src = src_indices.long().cpu()
    dst = dst_indices.long().cpu()
    for source, dest in zip(src_layers, dst_layers):
        dest[dst] = source[src]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Load one layer from a ``page_first_direct`` host buffer into layer-first device buffers.

    A host buffer is ``[page, layer, offset in page, head, dim]``; host token ``t`` of layer ``l`` is
    ``buffer[t // page_size, l, t % page_size]``.
    """
    src = src_indices.long().cpu()
    dst = dst_indices.long().cpu()
    pages, offsets = src // page_size, src % page_size
    for host, dest in zip(src_ptrs, dst_ptrs):
        dest[dst] = host[pages, layer_id, offsets]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Back every layer up from layer-first device buffers into ``page_first_direct`` host buffers.

    ``src_ptrs`` holds the device layers of each component in turn (all K layers, then all V layers);
    ``dst_ptrs`` one host buffer per component.
    """
    layers = len(src_ptrs) // len(dst_ptrs)
    src = src_indices.long().cpu()
    dst = dst_indices.long().cpu()
    pages, offsets = dst // page_size, dst % page_size
    for component, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[pages, layer, offsets] = src_ptrs[component * layers + layer][src]


#: ``HostKVCache.pin_memory`` on a CPU-only torch: always False, whatever a pool's constructor is given.
_NEVER_PINNED = property(lambda self: False, lambda self, value: None,
                         doc="False: a CPU-only torch has no device to pin host memory for")


def _stream_synchronize(self):
    """CPU copies finish before the call that issues them returns: nothing to wait for."""


#: Host RAM kept out of HiCache pool budgets on a CPU-only torch (SGLang's default is 10 GiB).
CPU_HOST_MEMORY_RESERVE_BYTES = 1024**3

_TRANSFERS = {fn.__name__: fn for fn in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
                                         transfer_kv_all_layer_direct_lf_pf)}


def _patch(module):
    torch = _cpu_torch()
    if torch is None:
        return
    if module.__name__.endswith(".base"):
        module.HostKVCache.pin_memory = _NEVER_PINNED
        reserve = getattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES", None)
        if reserve is not None:  # read at each pool's allocation (host_memory_budget_bytes)
            module.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(reserve, CPU_HOST_MEMORY_RESERVE_BYTES)
        if not hasattr(torch.cpu.Stream, "synchronize"):
            torch.cpu.Stream.synchronize = _stream_synchronize
        return
    for name, fn in _TRANSFERS.items():
        if not hasattr(module, name):  # a real kernel build defines them: leave those alone
            setattr(module, name, fn)


class _PatchingLoader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _HiCacheFinder:
    """Wraps the loader of each module in :data:`_PATCHED_MODULES` so that it is patched once executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


if not any(type(f).__name__ == "_HiCacheFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _HiCacheFinder())
