"""What a cached token is worth keeping, on either tier: the one retention policy behind device
eviction, host eviction, pause decisions and prefetch (pure: plain data in, numbers and sort keys out;
no SGLang, no torch, no clock).

A *unit* is a radix node on the device or in HiCache's host pool. Keeping it is worth what losing it
would cost if it is used again, per token held::

    value per token = p_reuse * saved_s
    device: saved_s = recompute_s     (reload_s when its eviction keeps it on host: ``spills``)
    host:   saved_s = recompute_s - reload_s       (<= 0: a host copy saves nothing, so none is made)
    recompute_s = 1 / prefill_tokens_per_s,   reload_s = bytes_per_token / h2d_bytes_per_s

Costs are linear in tokens, so units are compared by value *per token*, never by size; size enters
where the question is how much to free (room for n tokens comes from the lowest-valued units first),
and in what an offload would displace (:func:`displaced_host_seconds`).

``p_reuse`` is a prior per lifecycle class on the device (stable > session > scratch = untagged:
nothing declared a future for untagged traffic) and one rate on host, learned from HiCache's own
outcomes (:func:`learned_rate`: tokens loaded back against tokens dropped for room). Why no finer
estimate: in prototype runs on the replay suite (tight pool, host = 1x pool, 10 seeds; not kept), a
device rank by learned per-class reuse rates recomputed 0.998x the priors' tokens on the real Claude
Code sessions (seeds 0.94-1.07x) and 0.996-1.002x on the other workloads, and ordering host entries
by class as well gave 0.988x on ``stable_prompts``, 1.017x on the real sessions (seeds 0.96-1.11x) and
1.000x elsewhere: noise both ways, so the simpler model stays. The tool latencies, deadlines and
resume probability enter through the pause policy (:mod:`~sgl_agentcache.policy.pause`), whose
advice sets a paused branch's band.

Hard rules come first, as *bands* (a band always beats value)::

    ENDED < TRIM < VALUED < PROTECTED < PINNED

- ``ENDED``: the owning branch ended; reclaimable now.
- ``TRIM``: a live branch over its quota (either tier), or a host entry of a branch advised DISCARD: a quota bounds fairness under pressure, it does not cap a branch while memory is
  free, so such units may fill free room but are the first trimmed.
- ``VALUED``: everything else, by value per token.
- ``PROTECTED``: host entries of a branch paused with OFFLOAD or KEEP advice (the pause policy judged
  them worth the host memory for its expected wait).
- ``PINNED``: device nodes of a branch paused with an applied KEEP (bounded by the pause caps).

Within equal band and value, recency decides (SGLang's logical access counter, on either tier), so traffic without hints is ranked exactly as stock SGLang ranks it. No input is a
wall clock: every tensor-parallel rank computes the same ranks from the same tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

from sgl_agentcache.lifecycle import NodeClass, NodeState

__all__ = ["Band", "DEFAULT_DEVICE_REUSE", "RetentionModel", "device_band", "device_rank", "displaced_host_seconds",
           "host_band", "learned_rate", "prefetch_worthwhile"]


class Band(IntEnum):
    """Hard-rule bands, lowest evicted first (see the module docstring)."""

    ENDED = 0
    TRIM = 1
    VALUED = 2
    PROTECTED = 3
    PINNED = 4


#: Prior reuse probability of a device unit by lifecycle class (only their order changes a rank).
DEFAULT_DEVICE_REUSE: Mapping[NodeClass, float] = {
    NodeClass.UNTAGGED: 0.3, NodeClass.SCRATCH: 0.3, NodeClass.SESSION: 0.6, NodeClass.STABLE: 0.9}

#: Prior of the learned host reuse rate, and its weight in tokens (how many observed tokens it counts as).
HOST_REUSE_PRIOR = 0.7
HOST_REUSE_PRIOR_TOKENS = 4096


def learned_rate(reused_tokens: int, lost_tokens: int, prior: float = HOST_REUSE_PRIOR,
                 prior_tokens: int = HOST_REUSE_PRIOR_TOKENS) -> float:
    """Share of host tokens that were used again, shrunk toward ``prior`` (a Beta posterior mean)."""
    if reused_tokens < 0 or lost_tokens < 0 or prior_tokens <= 0 or not 0.0 <= prior <= 1.0:
        raise ValueError("learned_rate needs non-negative counts, a positive prior weight and a prior in [0, 1]")
    return (reused_tokens + prior * prior_tokens) / (reused_tokens + lost_tokens + prior_tokens)


@dataclass(frozen=True, kw_only=True)
class RetentionModel:
    """The measured rates a value is computed from (the server's profile or its measurements)."""

    prefill_tokens_per_s: float
    h2d_bytes_per_s: float
    bytes_per_token: int
    device_reuse: Mapping[NodeClass, float] = field(default_factory=lambda: dict(DEFAULT_DEVICE_REUSE))
    host_reuse: float = HOST_REUSE_PRIOR

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.h2d_bytes_per_s > 0 and self.bytes_per_token > 0):
            raise ValueError("RetentionModel needs a positive prefill rate, bandwidth and bytes per token")
        if set(self.device_reuse) != set(NodeClass) or not all(0.0 <= p <= 1.0 for p in self.device_reuse.values()):
            raise ValueError("device_reuse needs a probability in [0, 1] for every NodeClass")
        if not 0.0 <= self.host_reuse <= 1.0:
            raise ValueError("host_reuse must be a probability in [0, 1]")

    @property
    def recompute_s(self) -> float:
        """Seconds to re-prefill one token."""
        return 1.0 / self.prefill_tokens_per_s

    @property
    def reload_s(self) -> float:
        """Seconds to load one token's KV back from host."""
        return self.bytes_per_token / self.h2d_bytes_per_s

    @property
    def host_saving_s(self) -> float:
        """What a host copy saves per token when it is used (recompute minus reload; may be <= 0)."""
        return self.recompute_s - self.reload_s

    def host_copies_pay(self) -> bool:
        """A host copy saves something when used: spilling and offloading are worth doing at all."""
        return self.host_saving_s > 0.0

    def device_value(self, cls: NodeClass, *, spills: bool = False) -> float:
        """Expected seconds saved per token by keeping a VALUED device unit of class ``cls`` (``spills``:
        what eviction takes is kept on host, so losing it costs a reload, not a recompute)."""
        p = self.device_reuse[cls]
        return p * (self.reload_s if spills and self.host_copies_pay() else self.recompute_s)

    def device_values(self, *, spills: bool = False) -> dict[NodeClass, float]:
        """:meth:`device_value` of every class (a table the cache looks values up in per candidate leaf)."""
        return {cls: self.device_value(cls, spills=spills) for cls in NodeClass}

    def host_value(self) -> float:
        """Expected seconds saved per token by keeping a VALUED host entry (0 when copies do not pay)."""
        return self.host_reuse * max(self.host_saving_s, 0.0)


def device_band(state: NodeState, *, kept: bool = False, over_quota: bool = False) -> Band:
    if state.terminated:
        return Band.ENDED
    if over_quota:
        return Band.TRIM
    return Band.PINNED if kept else Band.VALUED


def device_rank(values: Mapping[NodeClass, float], state: NodeState, session_ref: int, last_access,
                kept: bool = False, over_quota: bool = False) -> tuple:
    """Eviction sort key of a device leaf; the smallest goes first. ``values`` is
    :meth:`RetentionModel.device_values`; ``last_access`` is SGLang's configured priority (its logical
    LRU counter by default). Band, then value per token, then SGLang's session-radix references
    (unreferenced before referenced, fewer before more; all 0 without ``--enable-session-radix-cache``),
    then recency."""
    band = device_band(state, kept=kept, over_quota=over_quota)
    value = values[state.cls] if band is Band.VALUED else 0.0
    return (band, value, session_ref > 0, session_ref, last_access)


def host_band(*, low_value: bool, protected: bool) -> Band:
    """Band of a host entry (a low-value entry is never protected)."""
    return Band.TRIM if low_value else Band.PROTECTED if protected else Band.VALUED


def displaced_host_seconds(model: RetentionModel, tokens: int, host_free_tokens: int) -> float:
    """Expected re-prefill seconds lost by dropping the host entries a ``tokens``-token copy would
    displace (the room it needs past the free room, taken from VALUED entries): what host memory costs
    a pause that chooses OFFLOAD. 0 while the copy fits in free room."""
    if tokens < 0 or host_free_tokens < 0:
        raise ValueError("displaced_host_seconds needs non-negative token counts")
    return max(tokens - host_free_tokens, 0) * model.host_value()


def prefetch_worthwhile(model: RetentionModel, tokens: int, device_free_tokens: int) -> bool:
    """A speculative restore of ``tokens`` is worth issuing: a host copy saves time when used, and it
    fits in free device memory (a prefetch displaces nothing: every resident unit is worth more than
    a guess, which is only right when the tool returns)."""
    return tokens > 0 and model.host_copies_pay() and tokens <= device_free_tokens
