#!/usr/bin/env python3
"""Check the transfer worker's CUDA side-stream contract on a real GPU (torch only, no sglang).

Every asynchronous copy of the cache (copy-ahead spills, load-backs, eager offloads, restores and
prefetches) goes through :class:`sgl_agentcache.server.transfer_worker.TransferWorker`, which on a
CUDA pool runs the copy on a stream of its own. Its contract: the copy comes after everything the
submitting thread's stream queued before ``submit`` (an event it waits for), and a joined future's
bytes are visible to any stream. On CUDA those paths are off by default until this check has passed
on a GPU; this script is that check. It needs torch with CUDA and imports nothing of sglang (the
worker module imports only torch), so a bare checkout runs it:

    python bench/gpu/side_stream_check.py --out "$OUT"      # on the device tool

Checks, each on a KV-shaped tensor (``--tokens`` x ``--width`` fp16, default 256 MiB):

1. ``d2h_after_queued_writes``: the default stream queues ``--rounds`` in-place adds on the buffer,
   then the worker copies rows to host at once: every value must be the final one (a copy that
   did not wait for the event reads a stale buffer).
2. ``h2d_after_queued_reads``: the default stream queues reads of the target rows (a long reduction
   into another tensor), then the worker writes new rows from host; after the join the default
   stream must see the new rows, and the reduction the old ones.
3. ``overlap`` (informational): seconds of a device->host copy on the worker while matmuls run on
   the default stream, against the two one after the other.
4. ``sglang_pool_copies``: the host tier's own worker-side copies (``HostTier.copy_segments`` and
   ``HostTier.copy_back``, which the server submits to the worker) through **SGLang 0.5.23's own**
   ``MHATokenToKVPool.get_cpu_copy`` / ``load_cpu_copy``, on a Qwen2.5-3B-shaped pool (36 layers,
   2 KV heads x 128, bf16, per-layer k and v buffers as SGLang lays them out) and a non-contiguous
   slot list, as the radix tree hands out. sglang itself cannot be installed on a bare GPU machine
   (no registry), so the two methods are compiled from the source of ``memory_pool.py`` (given by
   ``--sglang-memory-pool``, else found in the installed sglang without importing it) with
   ``current_platform.synchronize`` bound to what SGLang's CUDA platform binds it to,
   ``torch.cuda.synchronize``. Checks: every value copied to host is the one the default stream's
   queued writes left; the restore into fresh slots does not race reads queued on them before and is
   byte-exact after the join; the scheduler thread keeps launching work while the worker copies.

Writes ``<out>/side_stream_check.json`` and exits 0 when checks 1, 2 and 4 pass, 1 otherwise.
``--dry-run`` runs the same code on the CPU (no streams: the worker runs the copy as is) with tiny
sizes, so the test suite keeps the script working.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import time
import types
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_agentcache.lifecycle import BranchKey, NodeState  # noqa: E402  (pure)
from sgl_agentcache.server.host_tier import HostEntry, HostTier  # noqa: E402  (imports no sglang)
from sgl_agentcache.server.transfer_worker import TransferWorker  # noqa: E402  (torch only)

#: SGLang 0.5.23's CPU-offload byte movers of an MHA pool (``sglang/srt/mem_cache/memory_pool.py``).
SGLANG_POOL_CLASS, SGLANG_POOL_METHODS = "MHATokenToKVPool", ("get_cpu_copy", "load_cpu_copy")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_after_queued_writes(worker: TransferWorker, device: torch.device, tokens: int, width: int,
                            rounds: int) -> dict:
    buf = torch.zeros(tokens, width, dtype=torch.float16, device=device)
    _sync(device)
    rows = torch.arange(0, tokens, 7, device=device)
    for _ in range(rounds):  # queued on the default stream; nothing waits for them here
        buf.add_(1)
    copied = worker.submit(lambda: buf[rows].to("cpu")).result(timeout=120)
    want = float(rounds)
    stale = int((copied != want).sum())
    return {"ok": stale == 0, "rows": len(rows), "stale_values": stale, "expected": want}


def h2d_after_queued_reads(worker: TransferWorker, device: torch.device, tokens: int, width: int,
                           rounds: int) -> dict:
    buf = torch.ones(tokens, width, dtype=torch.float16, device=device)
    _sync(device)
    rows = torch.arange(0, tokens, 5, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for _ in range(rounds):  # reads of the rows about to be overwritten, queued on the default stream
        total += buf[rows].float().sum()
    fresh = torch.full((len(rows), width), 3.0, dtype=torch.float16)

    def write():
        buf[rows] = fresh.to(device, non_blocking=False)

    worker.submit(write).result(timeout=120)
    seen = buf[rows].float()  # on the default stream, after the join
    old_sum = float(len(rows) * width) * rounds
    return {"ok": bool((seen == 3.0).all()) and float(total) == old_sum, "reads_saw": float(total),
            "reads_expected": old_sum, "rows_after_join_ok": bool((seen == 3.0).all())}


def overlap(worker: TransferWorker, device: torch.device, tokens: int, width: int, side: int) -> dict:
    buf = torch.randn(tokens, width, dtype=torch.float16, device=device)
    a = torch.randn(side, side, dtype=torch.float16 if device.type == "cuda" else torch.float32, device=device)
    _sync(device)

    def compute():
        out = a
        for _ in range(20):
            out = out @ a
        return out

    began = time.perf_counter()
    compute()
    _sync(device)
    compute_s = time.perf_counter() - began
    began = time.perf_counter()
    buf.to("cpu")
    copy_s = time.perf_counter() - began
    began = time.perf_counter()
    future = worker.submit(lambda: buf.to("cpu"))
    compute()
    future.result(timeout=120)
    _sync(device)
    both_s = time.perf_counter() - began
    return {"compute_s": compute_s, "copy_s": copy_s, "together_s": both_s,
            "overlapped": both_s < 0.9 * (compute_s + copy_s)}


def installed_memory_pool() -> Path | None:
    """``memory_pool.py`` of the installed sglang, located without importing sglang (None: not installed)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "mem_cache" / "memory_pool.py"
    return path if path.is_file() else None


def sglang_pool_methods(memory_pool_py: Path, synchronize) -> dict:
    """SGLang's own ``MHATokenToKVPool.get_cpu_copy`` / ``load_cpu_copy``, compiled from its source with
    ``current_platform.synchronize`` bound to ``synchronize`` (the only other name they use is torch).
    Raises ``LookupError`` when the source has no such class or methods (another SGLang release)."""
    tree = ast.parse(memory_pool_py.read_text(), str(memory_pool_py))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == SGLANG_POOL_CLASS), None)
    fns = [n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef) and n.name in SGLANG_POOL_METHODS]
    if len(fns) != len(SGLANG_POOL_METHODS):
        raise LookupError(f"{memory_pool_py}: no {SGLANG_POOL_CLASS}.{'/'.join(SGLANG_POOL_METHODS)}")
    namespace = {"torch": torch, "current_platform": types.SimpleNamespace(synchronize=synchronize)}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(memory_pool_py), "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in SGLANG_POOL_METHODS}


class KVPoolStandIn:
    """The attributes SGLang's two methods read, laid out as ``MHATokenToKVPool`` lays them out: one
    ``[slots, kv_heads, head_dim]`` k and v buffer per layer (NHD), with SGLang's own methods bound."""

    use_hnd = False
    cpu_offloading_chunk_size = 8192  # KVCache's default in 0.5.23

    def __init__(self, methods: dict, layers: int, slots: int, heads: int, dim: int, device: torch.device):
        self.layer_num = layers
        self.k_buffer = [torch.zeros(slots, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        self.v_buffer = [torch.zeros(slots, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        for name, fn in methods.items():
            setattr(self, name, types.MethodType(fn, self))


def _stamp(slots: torch.Tensor, layer: int, sign: int) -> torch.Tensor:
    """A per-slot, per-layer value exact in bf16 (|x| <= 96 + rounds, integers below 256)."""
    return (sign * ((slots % 61) + layer)).to(torch.bfloat16)


def sglang_pool_copies(worker: TransferWorker, device: torch.device, memory_pool_py: Path, *, layers: int,
                       tokens: int, rounds: int, launches: int) -> dict:
    """Check 4 (see the module docstring)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else torch.cpu.synchronize
    pool = KVPoolStandIn(sglang_pool_methods(memory_pool_py, sync), layers, 4 * tokens, 2, 128, device)
    host = HostTier(pool, capacity_tokens=4 * tokens)
    src = torch.arange(1, 2 * tokens, 2, device=device)  # every other slot: not one contiguous run
    dst = torch.arange(2 * tokens, 3 * tokens, device=device)
    _sync(device)
    for layer in range(layers):  # queued on the default stream: the stamps, then rounds of +1
        pool.k_buffer[layer][src] = _stamp(src, layer, 1)[:, None, None].expand(-1, 2, 128)
        pool.v_buffer[layer][src] = _stamp(src, layer, -1)[:, None, None].expand(-1, 2, 128)
        pool.k_buffer[layer][dst] = 7
    for _ in range(rounds):
        for layer in range(layers):
            pool.k_buffer[layer][src] += 1
            pool.v_buffer[layer][src] -= 1
    owner = BranchKey("gpu-check", "s", "b")
    entry = HostEntry(owner, array("q", range(tokens)), None, None, 0,
                      [(0, NodeState(owner=owner)), (tokens // 3, NodeState(owner=owner))], [])
    bounds = HostTier.segment_bounds(entry, tokens)
    kv, copy_s = worker.submit(host.copy_segments, entry, src, bounds).result(timeout=300)
    stale = 0
    for seg, (a, b) in enumerate(zip(bounds, bounds[1:])):
        rows = src[a:b].cpu()
        for layer in range(layers):
            chunks = kv[seg][layer]
            k = torch.cat([c[0] for c in chunks]).float()
            v = torch.cat([c[1] for c in chunks]).float()
            want = _stamp(rows, layer, 1).float()[:, None, None] + rounds
            stale += int((k != want).sum()) + int((v != -want).sum())
    host.fill(entry, kv)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for _ in range(rounds):  # reads of the slots about to be restored into, queued on the default stream
        for layer in range(layers):
            total += pool.k_buffer[layer][dst].float().sum()
    launch = torch.randn(512, 512, device=device)
    launch @ launch  # the first product initializes the BLAS library: not part of either timing
    _sync(device)
    began = time.perf_counter()
    for _ in range(launches):
        launch @ launch
    alone_s = time.perf_counter() - began
    future = worker.submit(host.copy_back, entry, 0, dst)
    began = time.perf_counter()
    for _ in range(launches):  # the scheduler thread keeps launching while the worker copies
        launch @ launch
    during_s = time.perf_counter() - began
    restore_s = future.result(timeout=300)
    mismatched = sum(int((pool.k_buffer[layer][dst] != pool.k_buffer[layer][src]).sum())
                     + int((pool.v_buffer[layer][dst] != pool.v_buffer[layer][src]).sum()) for layer in range(layers))
    reads_expected = 7.0 * tokens * 2 * 128 * layers * rounds
    nbytes = sum(t.element_size() * t.numel() for seg in kv for layer in seg for c in layer for t in c)
    warm_d2h, warm_h2d = [], []  # the checked copies above were the first (pinned host buffers allocated)
    for _ in range(0 if device.type != "cuda" else 3):
        warm_d2h.append(worker.submit(host.copy_segments, entry, src, bounds).result(timeout=300)[1])
        warm_h2d.append(worker.submit(host.copy_back, entry, 0, dst).result(timeout=300))
    return {"ok": stale == 0 and mismatched == 0 and float(total) == reads_expected,
            "sglang_source": str(memory_pool_py), "layers": layers, "tokens": tokens, "segments": len(kv),
            "bytes": nbytes, "stale_values_on_host": stale, "restored_values_wrong": mismatched,
            "reads_saw": float(total), "reads_expected": reads_expected,
            "d2h_s": copy_s, "d2h_bytes_per_s": nbytes / copy_s if copy_s > 0 else None,
            "h2d_s": restore_s, "h2d_bytes_per_s": nbytes / restore_s if restore_s > 0 else None,
            "warm_d2h_bytes_per_s": [nbytes / t for t in warm_d2h], "warm_h2d_bytes_per_s": [nbytes / t for t in warm_h2d],
            "scheduler_launches": launches, "scheduler_launch_s_alone": alone_s,
            "scheduler_launch_s_during_restore": during_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/gpu/results")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--pool-tokens", type=int, default=4096, help="tokens per copy in check 4")
    parser.add_argument("--sglang-memory-pool", type=Path, default=None,
                        help="sglang 0.5.23's srt/mem_cache/memory_pool.py (default: the installed sglang's)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise the code only")
    args = parser.parse_args(argv)
    layers = 36
    if args.dry_run:
        device, args.tokens, args.width, args.rounds = torch.device("cpu"), 256, 16, 3
        layers, args.pool_tokens = 2, 48
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("side_stream_check: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 1
    worker = TransferWorker(device, "side-stream-check")
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dry_run": args.dry_run,
              "tokens": args.tokens, "width": args.width, "rounds": args.rounds}
    report["d2h_after_queued_writes"] = d2h_after_queued_writes(worker, device, args.tokens, args.width, args.rounds)
    report["h2d_after_queued_reads"] = h2d_after_queued_reads(worker, device, args.tokens, args.width, args.rounds)
    report["overlap"] = overlap(worker, device, args.tokens, args.width, 64 if args.dry_run else 8192)
    source = args.sglang_memory_pool or installed_memory_pool()
    if source is None:
        report["sglang_pool_copies"] = {"ok": False, "error": "no sglang memory_pool.py: pass --sglang-memory-pool"}
    else:
        report["sglang_pool_copies"] = sglang_pool_copies(worker, device, source, layers=layers,
                                                          tokens=args.pool_tokens, rounds=args.rounds,
                                                          launches=200 if not args.dry_run else 4)
    report["ok"] = all(report[k]["ok"] for k in ("d2h_after_queued_writes", "h2d_after_queued_reads",
                                                  "sglang_pool_copies"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_stream_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
