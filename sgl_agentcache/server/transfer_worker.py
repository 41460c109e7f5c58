"""One worker thread for KV copies off the scheduler thread (copy-ahead spills, asynchronous load-backs,
eager pauses' offloads, restores and prefetches).

On a CPU pool the worker simply runs the copy. On a CUDA pool it runs it on a stream of its own (its
device set on the thread): that stream first waits for an event recorded on the submitting thread's
current stream at submit (so the copy reads what the forward passes queued before it wrote, and writes
slots only after the reads queued before it), and the worker waits for its stream before the future
completes, so whoever joins the future may use the copied bytes on any stream. The scheduler thread
never shares a tensor the worker is writing: callers hand it slots nobody else reads until they join.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch


#: Pool devices a worker-thread copy is on by default for: CPU (the copy runs as is) and CUDA (on the
#: worker's stream; ``bench/gpu/side_stream_check.py`` passed on an H200 with SGLang 0.5.23's own pool
#: copies, ``bench/gpu/results/side_stream_check.json``). Other devices have never run it.
CHECKED_DEVICE_TYPES = ("cpu", "cuda")


def wanted(env: str, kv_device, device_types: tuple[str, ...] = CHECKED_DEVICE_TYPES) -> bool:
    """An ``auto`` / ``1`` / ``0`` switch for a worker-thread feature: ``auto`` (the default) is on for
    pools on a device type in ``device_types`` (:data:`CHECKED_DEVICE_TYPES` unless the feature narrows
    it) and off for any other."""
    mode = os.environ.get(env, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{env} must be auto, 0 or 1, not {mode!r}")
    if mode != "auto":
        return mode == "1"
    return torch.device(kv_device or "cpu").type in device_types


class TransferWorker:
    """A lazily started single-thread executor, with a side stream on CUDA (see the module docstring)."""

    def __init__(self, device, name: str):
        self.device = torch.device(device or "cpu")
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker; on CUDA inside the worker's stream, synchronized at the end."""
        executor = self._start()
        ready = None
        if self._stream is not None:  # what the scheduler's stream queued so far comes first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return executor.submit(self._run, fn, args, ready)

    def _run(self, fn, args, ready):
        if self._stream is None:
            return fn(*args)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            result = fn(*args)
        self._stream.synchronize()
        return result

    def _start(self) -> ThreadPoolExecutor:
        if self._executor is None:
            initializer = None
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(device=self.device)
                device = self.device
                initializer = lambda: torch.cuda.set_device(device)  # noqa: E731
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name,
                                                initializer=initializer)
        return self._executor


__all__ = ["CHECKED_DEVICE_TYPES", "TransferWorker", "wanted"]
