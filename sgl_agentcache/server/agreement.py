"""Rank agreement on the outcome of a host<->device copy, so every TP rank takes the same fallback.

Every tree decision is computed from data all ranks share (tree state, messages), except one: whether a
copy between the device pool and the host tier worked. Each rank copies its own shard of the KV, and a
copy can fail on one rank only (a CUDA error, an injected fault). If that rank fell back alone -- an
offload becoming a discard, a restore becoming a recompute, a spill or a load-back skipped -- its tree
would differ from the others' from then on, and so would every later decision.

So each copy is followed by one agreement step: every rank contributes "my copy worked", and all of
them act on "it worked on every rank". A failed copy on any rank makes every rank take the fallback
(the ranks whose copy worked throw theirs away). The step is called at the same point on every rank,
whatever the local outcome, because copies are attempted only where shared state says so.

The step is pluggable (``AgentRadixCache.agreement``): one rank needs none; with TP > 1 it is a MIN
all-reduce of one integer over the cache's CPU TP group through SGLang's own ``_all_reduce`` (the
helper ``UnifiedRadixCache`` uses for its HiCache verdicts); tests plug in their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``agreement(ok_here) -> ok_everywhere``.
Agreement = Callable[[bool], bool]


def local_agreement(ok: bool) -> bool:
    """One rank: its own outcome is everyone's."""
    return ok


def tp_agreement(cache) -> Agreement:
    """MIN over every TP rank of ``cache`` (SGLang's ``UnifiedRadixCache._all_reduce`` on its CPU group)."""

    def agree(ok: bool) -> bool:
        verdict = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cpu")
        cache._all_reduce(verdict, torch.distributed.ReduceOp.MIN)
        return bool(verdict.item())

    return agree


def default_agreement(cache) -> Agreement:
    """The agreement a cache with ``tp_world_size`` ranks needs."""
    return tp_agreement(cache) if getattr(cache, "tp_world_size", 1) > 1 else local_agreement


__all__ = ["Agreement", "default_agreement", "local_agreement", "tp_agreement"]
