"""Deployment cost profiles: KV bytes per token, prefill and decode rates, transfer bandwidths (pure).

The server's pause decisions price a deployment with one of these (``AGENTCACHE_PROFILE``); the
replayer, which moves no real KV and runs no model, charges time from the same constants. Profiles are
named; ``seed`` carries the figures of the tool-pause article (36 KiB of KV per token, 8 GiB/s
host<->device, 20,000 prefill tokens/s), ``qwen2.5-3b-h200`` is a Qwen2.5-3B-shaped model on an H200,
measured there on 2026-12-04 (``bench/gpu/results/``): the prefill rate at 4096 tokens from
``bench/gpu/calibrate.py`` (69,466 tokens/s), the transfer rates of SGLang 0.5.23's own pool copies
(``get_cpu_copy`` / ``load_cpu_copy``, per-layer gathers of a 4096-token copy) through the transfer
worker from ``bench/gpu/side_stream_check.py`` once warm (26.2 GB/s device->host, 27.4 GB/s
host->device; contiguous pinned copies reach 54 GB/s, the calibration's ``h200.json``). Its decode
step stays provisional (8 ms): the calibration's decode is HF eager mode at batch 1 (86 ms), no
stand-in for SGLang's.

Measured profiles are JSON files written by ``bench/gpu/calibrate.py`` (schema
``sgl-agentcache-profile/1``); :func:`load_profile` reads one, :func:`resolve_profile` accepts either a
built-in name or such a path. This module imports no torch: it must stay cheap for the replayer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

#: The only profile file schema this module reads; bump it when a field changes meaning.
PROFILE_SCHEMA = "sgl-agentcache-profile/1"


@dataclass(frozen=True)
class Profile:
    """A deployment's costs per token. ``token_scale``: how many tokens of the original trace one token
    stands for (the replayer's scaled traces, ``sim/suite.py:scaled_profile``; 1 for a deployment and
    in every profile file): the per-token figures are per scaled token."""

    name: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    decode_s_per_token: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    token_scale: int = 1

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def forward_step_s(self) -> float:
        """Seconds of one decode step (one token per running request) of the unscaled deployment: the
        interval between the scheduler's passes over its waiting queue."""
        return self.decode_s_per_token / self.token_scale

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES = {
    "seed": Profile("seed", 36 * 1024, 20_000.0, 0.02, 8 * 2**30, 8 * 2**30),
    "qwen2.5-3b-h200": Profile("qwen2.5-3b-h200", 36 * 1024, 69_466.0, 0.008, 27.4e9, 26.2e9),
}


class ProfileError(ValueError):
    """A profile file or name is invalid; the message names the file and the offending field."""


_Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class _ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """On-disk shape of a profile (``sgl-agentcache-profile/1``); ``measured`` is free-form provenance."""

    schema: Literal["sgl-agentcache-profile/1"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    kv_bytes_per_token: Annotated[int, msgspec.Meta(gt=0)]
    prefill_tokens_per_s: _Positive
    decode_s_per_token: _Positive
    h2d_bytes_per_s: _Positive
    d2h_bytes_per_s: _Positive
    measured: dict[str, Any] = {}


#: The :class:`Profile` fields a profile file carries (all but ``token_scale``, the replayer's own).
_FILE_FIELDS = tuple(f for f in _ProfileFile.__struct_fields__ if f not in ("schema", "measured"))


def profile_file(profile: Profile, measured: dict[str, Any]) -> dict[str, Any]:
    """The on-disk form of ``profile`` (``sgl-agentcache-profile/1``) with ``measured`` provenance, which
    :func:`load_profile` reads back equal (for a profile of a deployment: ``token_scale`` 1)."""
    return {"schema": PROFILE_SCHEMA, **{f: getattr(profile, f) for f in _FILE_FIELDS}, "measured": measured}


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON file into a :class:`Profile`.

    Raises :class:`ProfileError` (a ``ValueError``) naming the file and the field when the file is not
    JSON, has the wrong ``schema`` string, misses a field, carries an unknown one, or has a size or rate
    that is zero or negative (msgspec also refuses non-finite numbers: ``NaN``, ``Infinity``, ``1e999``);
    ``FileNotFoundError`` when there is no file.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        raw = msgspec.json.decode(data, type=_ProfileFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProfileError(f"{path}: invalid profile ({PROFILE_SCHEMA}): {exc}") from None
    return Profile(**{f: getattr(raw, f) for f in _FILE_FIELDS})


def resolve_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name (a key of :data:`PROFILES`), else the profile file at that path.

    Names win over paths, so a file called ``seed`` in the working directory cannot shadow the built-in.
    Raises :class:`ProfileError` when it is neither a known name nor an existing file.
    """
    key = str(name_or_path)
    if key in PROFILES:
        return PROFILES[key]
    path = Path(name_or_path)
    if path.is_file():
        return load_profile(path)
    raise ProfileError(f"unknown profile {key!r}: not one of {sorted(PROFILES)} and no such file")
