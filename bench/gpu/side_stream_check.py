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

Writes ``<out>/side_stream_check.json`` and exits 0 when checks 1 and 2 pass, 1 otherwise.
``--dry-run`` runs the same code on the CPU (no streams: the worker runs the copy as is) with tiny
sizes, so the test suite keeps the script working.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_agentcache.server.transfer_worker import TransferWorker  # noqa: E402  (torch only)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/gpu/results")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise the code only")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, args.tokens, args.width, args.rounds = torch.device("cpu"), 256, 16, 3
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
    report["ok"] = report["d2h_after_queued_writes"]["ok"] and report["h2d_after_queued_reads"]["ok"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_stream_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
