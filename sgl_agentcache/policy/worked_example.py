"""The seed article's worked example, computed by :func:`~sgl_agentcache.policy.pause.decide` itself.

Seed ("When an Agent Calls a Tool, What Happens to Its KV Cache?"): two paused requests of 4096
tokens, one waiting 50 ms and one 5000 ms; Qwen2.5-3B-style f16 KV, 36 layers x 2 (K, V) x 2 KV heads
x 128 dims x 2 bytes = 36 KiB per token, so 144 MiB per cache; 8 GiB/s effective transfer bandwidth;
20,000 effective prefill tokens/s; swap-out overlaps the tool wait. Its figures:

- keep: 144 MiB x 0.05 s = 7.2 MiB-seconds, and 720 MiB-seconds for the 5 s pause; no resume delay;
- swap: 144 MiB out and back (288 MiB moved); resume delay = 144 MiB / 8 GiB/s = 17.58 ms;
- recompute: 4096 tokens again; resume delay = 4096 / 20,000 = 204.8 ms.

The seed declares no device state, so this example declares one (a 36 GiB KV pool, 25% free and 25%
evictable, 64 GiB of host memory free) to let the policy choose: keep the 50 ms pause, swap the 5 s
one. Our memory-time for swap also counts the HBM held while the swap-out runs (144 MiB x 17.6 ms).
"""

from __future__ import annotations

import msgspec

from sgl_agentcache.policy.distributions import PointMass
from sgl_agentcache.policy.pause import PauseAction, PauseDecision, PauseInputs, PolicyConfig, decide

MiB = 1 << 20
GiB = 1 << 30

SEED_TOKENS = 4096
SEED_BYTES_PER_TOKEN = 36 * 2 * 2 * 128 * 2  # layers x (K, V) x KV heads x head dim x f16 bytes = 36 KiB
SEED_BANDWIDTH_BPS = 8 * GiB
SEED_PREFILL_TOKENS_PER_S = 20_000
SEED_PAUSES_S = (0.05, 5.0)

#: Device state declared for this example (the seed gives none).
EXAMPLE_DEVICE_TOTAL_TOKENS = 1 << 20  # 36 GiB of KV at 36 KiB per token
EXAMPLE_HOST_FREE_BYTES = 64 * GiB

_SEED_NAMES = {PauseAction.KEEP: "keep", PauseAction.OFFLOAD: "swap", PauseAction.DISCARD: "recompute"}


class WorkedExampleRow(msgspec.Struct, frozen=True):
    pause_s: float
    policy: str  # the seed's names: keep / swap / recompute
    device_mib_s: float
    moved_mib: float
    transfer_ms: float
    recomputed_tokens: int
    recompute_ms: float
    resume_delay_ms: float
    cost: float
    chosen: bool


class WorkedExample(msgspec.Struct, frozen=True):
    cache_mib: float
    rows: list[WorkedExampleRow]
    decisions: list[PauseDecision]
    text: str


def seed_inputs(pause_s: float, host_free_bytes: int = EXAMPLE_HOST_FREE_BYTES) -> PauseInputs:
    """One of the seed's pauses, with this example's declared device state."""
    return PauseInputs(
        retained_tokens=SEED_TOKENS, bytes_per_token=SEED_BYTES_PER_TOKEN, latency=PointMass(pause_s),
        device_total_tokens=EXAMPLE_DEVICE_TOTAL_TOKENS, device_free_tokens=EXAMPLE_DEVICE_TOTAL_TOKENS // 4,
        device_evictable_tokens=EXAMPLE_DEVICE_TOTAL_TOKENS // 4, host_free_bytes=host_free_bytes,
        h2d_bandwidth_Bps=SEED_BANDWIDTH_BPS, d2h_bandwidth_Bps=SEED_BANDWIDTH_BPS,
        prefill_tokens_per_s=SEED_PREFILL_TOKENS_PER_S)


def seed_worked_example(config: PolicyConfig | None = None) -> WorkedExample:
    """The keep / swap / recompute table of the seed, with the policy's costs and choices."""
    rows, decisions = [], []
    for pause in SEED_PAUSES_S:
        decision = decide(seed_inputs(pause), config)
        decisions.append(decision)
        for o in decision.options:
            swapped = o.action is PauseAction.OFFLOAD
            rows.append(WorkedExampleRow(
                pause_s=pause, policy=_SEED_NAMES[o.action], device_mib_s=o.device_byte_seconds / MiB,
                moved_mib=2 * decision.retained_bytes / MiB if swapped else 0.0, transfer_ms=o.transfer_s * 1e3,
                recomputed_tokens=SEED_TOKENS if o.action is PauseAction.DISCARD else 0,
                recompute_ms=o.recompute_s * 1e3, resume_delay_ms=o.resume_penalty_s * 1e3, cost=o.cost,
                chosen=o.action is decision.action))
    cache_mib = SEED_TOKENS * SEED_BYTES_PER_TOKEN / MiB
    return WorkedExample(cache_mib, rows, decisions, _format(cache_mib, rows, decisions))


def _format(cache_mib: float, rows: list[WorkedExampleRow], decisions: list[PauseDecision]) -> str:
    head = (f"seed worked example: {SEED_TOKENS} tokens x {SEED_BYTES_PER_TOKEN // 1024} KiB = {cache_mib:g} MiB"
            f" per cache; {SEED_BANDWIDTH_BPS // GiB} GiB/s each way; {SEED_PREFILL_TOKENS_PER_S} prefill"
            " tokens/s; swap-out overlaps the wait")
    cols = (f"{'pause':>7}  {'policy':<9} {'device MiB*s':>12} {'moved MiB':>9} {'PCIe ms':>8} "
            f"{'recomputed':>10} {'prefill ms':>10} {'resume ms':>9} {'cost':>8}")
    lines = [head, cols]
    for r in rows:
        lines.append(f"{r.pause_s * 1e3:>5g}ms  {r.policy:<9} {r.device_mib_s:>12.2f} {r.moved_mib:>9g} "
                     f"{r.transfer_ms:>8.2f} {r.recomputed_tokens:>10} {r.recompute_ms:>10.1f} "
                     f"{r.resume_delay_ms:>9.2f} {r.cost:>8.4f}{'  <- chosen' if r.chosen else ''}")
    d = decisions[0]
    lines.append(f"(declared device: {d.inputs.device_total_tokens} tokens, 25% free + 25% evictable -> memory "
                 f"pressure {d.pressure:.3g}; host {EXAMPLE_HOST_FREE_BYTES // GiB} GiB free; cost in seconds)")
    lines += [f"{r.inputs.latency_p50_s * 1e3:g} ms pause -> {r.reason}" for r in decisions]
    return "\n".join(lines)


if __name__ == "__main__":
    print(seed_worked_example().text)
