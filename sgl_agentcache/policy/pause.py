"""Keep, offload, discard or release the KV of a request paused on a tool call (pure, no clocks).

The seed's trade-off: *a paused request exchanges resume latency and recomputation for memory capacity
that could serve other work*. Each option is priced in one unit, **cost-seconds** (seconds of resume
delay of a priority-0 request), and the cheapest expected cost wins, subject to hysteresis.

Notation (all from :class:`PauseInputs`; R is the remaining wait, T - elapsed given T > elapsed)::

    N tokens retained, B = N * bytes_per_token bytes (computed by the server, never by the client)
    D   time left to the deadline (inf without one); a tool returning after D finds its state released
    p   resume probability;  p_eff = p * P(R <= D)          (only resumes before the deadline count)
    t_out = B / d2h,  t_in = B / h2d,  t_rc = N / prefill_rate,  l = prefetch lead
    E_h = E[min(R, D, h)]                                    (expected device-holding time, capped)

Price of device memory, rising as headroom shrinks::

    h   = clip((free + g_e * evictable) / total, 0, 1)   evicting cached prefixes is not free (g_e < 1)
    phi = phi_0 + k (1 - h) / (h + k)                     phi_0 > 0 on an idle device, ~1 on a full one
    lam = phi / (N_ref * bytes_per_token)                 cost-seconds per byte-second

i.e. on a full device, holding the KV of one typical request (N_ref tokens) for one second keeps that
request out for about one second. Each option has device memory-time M (byte-seconds), transfer time
X (PCIe seconds), recompute time C (prefill seconds) and resume penalty P (seconds), all expected::

    cost = lam * M + a * X + b * C + w * P,   w = latency_price * 2^clip(priority / step, -2, 2)

    state on DEVICE        M                  X                  C           P
      KEEP                 B * E_inf          0                  0           0
      OFFLOAD              B * E_{t_out}      t_out + p_eff t_in H           p_eff max(0, t_in - l)
      DISCARD              0                  0                  p_eff t_rc  p_eff t_rc
    state on HOST (offloaded earlier: the swap-out is sunk)
      KEEP (restore now)   B * E_inf          t_in               0           0
      OFFLOAD (stay)       0                  p_eff t_in         0           p_eff max(0, t_in - l)
      DISCARD              0                  0                  p_eff t_rc  p_eff t_rc
    state NONE (discarded earlier): only DISCARD

Host memory is not free: ``H`` (``host_displaced_s``) is the expected re-prefill time of the host
entries an offload of N tokens would displace, valued by the retention policy
(:func:`~sgl_agentcache.policy.retention.displaced_host_seconds`: 0 while the copy fits in free room;
past it, the learned host reuse rate times what a host copy saves per token). It is recompute other
requests will pay, so it is priced like recompute (b); once the copy is on host it is sunk.

Swap-out overlaps the wait (the seed's assumption), so the resume sees only the restore, minus what a
"tool nearly done" prefetch hides (l). The HBM copy stays until the swap-out ends, hence B * E_{t_out}.
The restore is charged even when the tool returns before the swap-out finishes (the device copy would
still be there): this overstates OFFLOAD by at most w p t_in P(R <= t_out), and keeps the costs
monotone in the wait (below). OFFLOAD from the device needs host_free_bytes >= B; restoring from the
host needs room on the device (free + evictable >= N).

RELEASE (stop retaining anything, on every tier) when the deadline has passed, the pause was released
before, N < min_tokens (too small to be worth tracking or moving), or p_eff < min_resume_probability.

Hysteresis: the previous decision (:class:`Incumbent`) gets a bonus g = hysteresis * its cost when it
was made + min_switch_gain; another option must undercut the incumbent's current cost by more than g.
g is a constant fixed by history, never a function of the current inputs (and applies only while
the incumbent is feasible), which is what keeps:

Monotonicity (for fixed placement, previous decision and config), by construction:

1. More pressure never makes KEEP more likely. Pressure enters only lam, with M_KEEP >= M_OFFLOAD >=
   M_DISCARD = 0 in every placement, so cost_KEEP - cost_X is non-decreasing in lam; g shifts it by a
   constant; feasibility of KEEP only shrinks with pressure; RELEASE does not depend on pressure.
2. A longer wait (R' stochastically above R) never makes KEEP more likely: E_inf and
   E_inf - E_{t_out} = E[(min(R, D) - t_out)+] grow, p_eff shrinks, so again cost_KEEP - cost_X only
   grows, and RELEASE (p_eff below the bar) only becomes more likely.
3. Cheaper recompute never makes OFFLOAD more likely: prefill_rate enters only cost_DISCARD, which
   falls as the rate rises; DISCARD can only gain.
4. More valuable host state in the way (a larger H) never makes OFFLOAD more likely: H enters only
   cost_OFFLOAD from the device, and raises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import msgspec

from sgl_agentcache.policy.distributions import LatencyDistribution

__all__ = ["Incumbent", "InputsEcho", "OptionCost", "PauseAction", "PauseDecision", "PauseInputs",
           "Placement", "PolicyConfig", "decide", "memory_price"]


class PauseAction(str, Enum):
    KEEP = "keep"  # leave the KV in device memory
    OFFLOAD = "offload"  # swap it to host memory now, restore on resume
    DISCARD = "discard"  # free it now, re-prefill on resume
    RELEASE = "release"  # stop retaining anything for this pause, on every tier


class Placement(str, Enum):
    """Where the paused KV is now (a fact the server knows, not a wish)."""

    DEVICE = "device"
    HOST = "host"
    NONE = "none"


_OPTIONS = (PauseAction.KEEP, PauseAction.OFFLOAD, PauseAction.DISCARD)


class Incumbent(msgspec.Struct, frozen=True):
    """The previous decision and its expected cost when it was made (the hysteresis reference)."""

    action: PauseAction
    cost: float


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Knobs of the cost model (see the module docstring for where each enters)."""

    hysteresis: float = 0.2  # switching must save this fraction of the incumbent's cost...
    min_switch_gain: float = 1e-3  # ...plus this many cost-seconds
    min_tokens: int = 32  # below: RELEASE (not worth tracking or moving between tiers)
    min_resume_probability: float = 0.01  # p_eff below: RELEASE
    evictable_weight: float = 0.5  # g_e: an evictable token counts as this much headroom
    pressure_knee: float = 0.05  # k: headroom at which phi reaches about half its full-device value
    price_floor: float = 1e-3  # phi_0: memory is never free, even on an idle device
    reference_request_tokens: int = 4096  # N_ref: KV of one typical running request
    transfer_price: float = 0.1  # a: per PCIe second (mostly overlapped with compute, but contended)
    recompute_price: float = 1.0  # b: per prefill second (GPU time taken from other requests)
    latency_price: float = 1.0  # per second of resume delay at priority 0
    priority_step: int = 10  # each +step priority doubles the latency price, within 2^[-2, 2]


def _require(name: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"PauseInputs.{name} is out of range")


@dataclass(frozen=True, kw_only=True, slots=True)
class PauseInputs:
    """One pause decision's inputs: server-measured facts plus the tool class's learned distribution."""

    retained_tokens: int
    bytes_per_token: int
    latency: LatencyDistribution
    device_free_tokens: int
    device_evictable_tokens: int
    device_total_tokens: int
    host_free_bytes: int  # 0 when there is no host tier
    h2d_bandwidth_Bps: float  # measured effective bandwidths, not link peaks
    d2h_bandwidth_Bps: float
    prefill_tokens_per_s: float  # measured effective prefill rate
    elapsed_s: float = 0.0  # time already waited on the tool
    deadline_s: float | None = None  # time left until the deadline; <= 0: passed
    priority: int = 0
    resume_probability: float = 1.0
    prefetch_lead_s: float = 0.0  # how early a "tool nearly done" hint lets a restore start
    placement: Placement = Placement.DEVICE
    previous: Incumbent | None = None
    host_displaced_s: float = 0.0  # H: expected re-prefill seconds of the host entries an offload displaces

    def __post_init__(self) -> None:
        for name in ("retained_tokens", "device_free_tokens", "device_evictable_tokens", "host_free_bytes"):
            _require(name, getattr(self, name) >= 0)
        _require("bytes_per_token", self.bytes_per_token > 0)
        _require("device_total_tokens", self.device_total_tokens > 0)
        for name in ("h2d_bandwidth_Bps", "d2h_bandwidth_Bps", "prefill_tokens_per_s"):
            _require(name, 0.0 < getattr(self, name) < math.inf)
        for name in ("elapsed_s", "prefetch_lead_s", "host_displaced_s"):
            _require(name, 0.0 <= getattr(self, name) < math.inf)
        _require("deadline_s", self.deadline_s is None or not math.isnan(self.deadline_s))
        _require("resume_probability", 0.0 <= self.resume_probability <= 1.0)
        _require("previous", self.previous is None or 0.0 <= self.previous.cost < math.inf)

    @property
    def retained_bytes(self) -> int:
        return self.retained_tokens * self.bytes_per_token


class InputsEcho(msgspec.Struct, frozen=True):
    """The inputs as logged with a decision (the distribution as its tail quantiles)."""

    retained_tokens: int
    bytes_per_token: int
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    elapsed_s: float
    deadline_s: float | None
    device_free_tokens: int
    device_evictable_tokens: int
    device_total_tokens: int
    host_free_bytes: int
    h2d_bandwidth_Bps: float
    d2h_bandwidth_Bps: float
    prefill_tokens_per_s: float
    priority: int
    resume_probability: float
    prefetch_lead_s: float
    placement: Placement
    previous: Incumbent | None
    host_displaced_s: float = 0.0


class OptionCost(msgspec.Struct, frozen=True):
    """Expected resources of one option, in the seed's terms, and their total in cost-seconds."""

    action: PauseAction
    feasible: bool
    device_byte_seconds: float  # HBM held: bytes x seconds
    transfer_s: float  # PCIe time, out and (expected) back
    recompute_s: float  # expected prefill time (for OFFLOAD: of the host entries it displaces)
    resume_penalty_s: float  # expected delay the resume sees
    cost: float


class PauseDecision(msgspec.Struct, frozen=True):
    action: PauseAction
    reason: str
    cost: float  # expected cost of the chosen action (0 for RELEASE)
    options: list[OptionCost]  # KEEP, OFFLOAD, DISCARD, feasible or not
    retained_bytes: int
    headroom: float  # h
    pressure: float  # phi
    memory_price: float  # lam, cost-seconds per byte-second
    expected_wait_s: float  # E[min(R, D)]
    effective_resume_probability: float  # p_eff
    held_by_hysteresis: bool  # the cheapest option was not cheaper by enough to switch
    inputs: InputsEcho

    def option(self, action: PauseAction) -> OptionCost:
        return next(o for o in self.options if o.action is action)

    def incumbent(self) -> Incumbent:
        """Pass as the next evaluation's ``previous``."""
        return Incumbent(self.action, self.cost)


def memory_price(inputs: PauseInputs, config: PolicyConfig) -> tuple[float, float, float]:
    """(headroom h, pressure phi, price lam per byte-second); phi is non-increasing in h."""
    avail = inputs.device_free_tokens + config.evictable_weight * inputs.device_evictable_tokens
    h = min(max(avail / inputs.device_total_tokens, 0.0), 1.0)
    k = config.pressure_knee
    phi = config.price_floor + k * (1.0 - h) / (h + k)
    return h, phi, phi / (config.reference_request_tokens * inputs.bytes_per_token)


def _echo(i: PauseInputs) -> InputsEcho:
    q = i.latency.quantile
    return InputsEcho(
        i.retained_tokens, i.bytes_per_token, q(0.5), q(0.95), q(0.99), i.elapsed_s, i.deadline_s,
        i.device_free_tokens, i.device_evictable_tokens, i.device_total_tokens, i.host_free_bytes,
        i.h2d_bandwidth_Bps, i.d2h_bandwidth_Bps, i.prefill_tokens_per_s, i.priority, i.resume_probability,
        i.prefetch_lead_s, i.placement, i.previous, i.host_displaced_s)


def decide(inputs: PauseInputs, config: PolicyConfig | None = None) -> PauseDecision:
    """Choose what to do with a paused request's KV (see the module docstring for the model)."""
    cfg = config or PolicyConfig()
    i, n, b = inputs, inputs.retained_tokens, inputs.retained_bytes
    deadline = math.inf if i.deadline_s is None else i.deadline_s
    h, phi, lam = memory_price(i, cfg)
    steps = min(max(i.priority / cfg.priority_step, -2.0), 2.0)
    w = cfg.latency_price * 2.0**steps

    t_out, t_in, t_rc = b / i.d2h_bandwidth_Bps, b / i.h2d_bandwidth_Bps, n / i.prefill_tokens_per_s
    if deadline > 0.0:
        wait = i.latency.remaining_wait(i.elapsed_s, deadline)
        wait_out = i.latency.remaining_wait(i.elapsed_s, min(deadline, t_out))
        reach = 1.0 if math.isinf(deadline) else i.latency.resume_within(i.elapsed_s, deadline)
    else:
        wait = wait_out = reach = 0.0
    p = i.resume_probability * reach
    restore_wait = max(0.0, t_in - i.prefetch_lead_s)

    on_host, on_device = i.placement is Placement.HOST, i.placement is Placement.DEVICE
    room_on_device = i.device_free_tokens + i.device_evictable_tokens >= n
    rows = {  # action: (M, X, C, P, feasible), per the table in the module docstring
        PauseAction.KEEP: (b * wait, t_in if on_host else 0.0, 0.0, 0.0,
                           on_device or (on_host and room_on_device)),
        PauseAction.OFFLOAD: (0.0 if on_host else b * wait_out, p * t_in + (0.0 if on_host else t_out),
                              0.0 if on_host else i.host_displaced_s, p * restore_wait,
                              on_host or (on_device and i.host_free_bytes >= b)),
        PauseAction.DISCARD: (0.0, 0.0, p * t_rc, p * t_rc, True),
    }
    price = (lam, cfg.transfer_price, cfg.recompute_price, w)
    options = [OptionCost(a, ok, m, x, c, pen, sum(k * v for k, v in zip(price, (m, x, c, pen))))
               for a, (m, x, c, pen, ok) in rows.items()]

    def done(action: PauseAction, reason: str, cost: float = 0.0, held: bool = False) -> PauseDecision:
        return PauseDecision(action, reason, cost, options, b, h, phi, lam, wait, p, held, _echo(i))

    prev = i.previous
    if prev is not None and prev.action is PauseAction.RELEASE:
        return done(PauseAction.RELEASE, "release: this pause was already released")
    if deadline <= 0.0:
        return done(PauseAction.RELEASE, f"release: deadline passed ({deadline:.3g} s left)")
    if n < cfg.min_tokens:
        return done(PauseAction.RELEASE, f"release: {n} retained tokens < min_tokens {cfg.min_tokens}")
    if p < cfg.min_resume_probability:
        return done(PauseAction.RELEASE, f"release: resume probability {p:.3g} before the deadline "
                                         f"< {cfg.min_resume_probability:.3g}")

    feasible = [o for o in options if o.feasible]
    incumbent = prev.action if prev is not None and any(o.action is prev.action for o in feasible) else None
    bonus = cfg.hysteresis * prev.cost + cfg.min_switch_gain if incumbent is not None else 0.0

    def rank(o: OptionCost) -> tuple:  # ties go to the incumbent, then to KEEP, OFFLOAD, DISCARD
        held = o.action is incumbent
        return (o.cost - (bonus if held else 0.0), not held, _OPTIONS.index(o.action))

    best = min(feasible, key=rank)
    cheapest = min(feasible, key=lambda o: (o.cost, _OPTIONS.index(o.action)))
    held = best is not cheapest and best.cost > cheapest.cost
    others = ", ".join(f"{o.action.value} {o.cost:.3g}" for o in options if o.feasible and o is not best)
    reason = (f"{best.action.value}: expected cost {best.cost:.3g} (vs {others or 'nothing'}); "
              f"E[wait] {wait:.3g} s, resume p {p:.3g}, memory pressure {phi:.3g}")
    if held:
        reason += f"; held by hysteresis ({cheapest.action.value} saves only {best.cost - cheapest.cost:.3g})"
    if on_device and not rows[PauseAction.OFFLOAD][4]:
        reason += f"; offload impossible: host has {i.host_free_bytes} of {b} bytes free"
    return done(best.action, reason, best.cost, held)
