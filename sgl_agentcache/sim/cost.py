"""Cost model constants: a model/hardware profile (pure).

The replayer moves no real KV and runs no model; it charges time from these constants. Profiles are
named; ``seed`` carries the figures of the tool-pause article (36 KiB of KV per token, 8 GiB/s
host<->device, 20,000 prefill tokens/s), ``qwen2.5-3b-h200`` is a Qwen2.5-3B-shaped model on an H200
(provisional, to be replaced by the calibration script's measured profile).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    decode_s_per_token: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES = {
    "seed": Profile("seed", 36 * 1024, 20_000.0, 0.02, 8 * 2**30, 8 * 2**30),
    "qwen2.5-3b-h200": Profile("qwen2.5-3b-h200", 36 * 1024, 60_000.0, 0.008, 40 * 2**30, 40 * 2**30),
}
