"""Calibration of a predictive duration model by its PIT values (probability integral transform).

Before an observation t updates a model with CDF F, record u = F(t). If the model is calibrated, u is
uniform on [0, 1]: mean u = 0.5, mean |u - 0.5| = 0.25, a tenth of the values in each tenth of [0, 1],
10% above the predicted p90 (u > 0.9) and 1% above the predicted p99. Values drift from these ideals
in telling ways: a mean u above 0.5 means tools run longer than predicted, a mean |u - 0.5| above 0.25
means the model is overconfident (too narrow), below 0.25 that it is too wide.

Records decay by the same per-observation factor as the model, so the statistics describe how well
the model predicts *now*, after it has adapted, rather than averaging over its whole history.
"""

from __future__ import annotations

import msgspec

PIT_BINS = 10


class CalibrationStats(msgspec.Struct, frozen=True):
    """How well predicted CDFs matched later observations (ideal values in brackets)."""

    count: int  # observations recorded since the last reset
    weight: float  # their decayed weight: the effective sample size behind the fractions
    pit_histogram: list[float]  # fraction of PIT values in each tenth of [0, 1] [0.1 each]
    mean_pit: float  # [0.5]
    mean_abs_pit_dev: float  # mean |u - 0.5| [0.25]
    frac_above_p90: float  # [0.10]
    frac_above_p99: float  # [0.01]
    max_bin_dev: float  # max |fraction - 0.1| over the tenths [0]


class CalibrationState(msgspec.Struct, forbid_unknown_fields=True):
    """Decayed sums of PIT values (serialisable as part of a latency snapshot)."""

    pit: list[float] = msgspec.field(default_factory=lambda: [0.0] * PIT_BINS)
    weight: float = 0.0
    sum_pit: float = 0.0
    sum_abs_dev: float = 0.0
    above_p90: float = 0.0
    above_p99: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if len(self.pit) != PIT_BINS:
            raise ValueError(f"CalibrationState.pit must have {PIT_BINS} entries")

    def record(self, u: float, decay: float) -> None:
        """Age every record by ``decay``, then add the PIT value ``u``."""
        u = min(max(u, 0.0), 1.0)
        self.pit = [w * decay for w in self.pit]
        self.pit[min(int(u * PIT_BINS), PIT_BINS - 1)] += 1.0
        self.weight = self.weight * decay + 1.0
        self.sum_pit = self.sum_pit * decay + u
        self.sum_abs_dev = self.sum_abs_dev * decay + abs(u - 0.5)
        self.above_p90 = self.above_p90 * decay + (u > 0.9)
        self.above_p99 = self.above_p99 * decay + (u > 0.99)
        self.count += 1

    def stats(self) -> CalibrationStats:
        w = self.weight or 1.0  # every sum is 0 when nothing was recorded
        hist = [x / w for x in self.pit]
        return CalibrationStats(
            count=self.count, weight=self.weight, pit_histogram=hist, mean_pit=self.sum_pit / w,
            mean_abs_pit_dev=self.sum_abs_dev / w, frac_above_p90=self.above_p90 / w,
            frac_above_p99=self.above_p99 / w,
            max_bin_dev=max(abs(h - 1.0 / PIT_BINS) for h in hist) if self.count else 0.0,
        )

    def copy(self) -> "CalibrationState":
        return msgspec.structs.replace(self, pit=list(self.pit))
