"""The GPU calibration script runs end to end (dry run, CPU) and its profile loads; the loader rejects bad files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_agentcache.policy.profiles import PROFILES, Profile, ProfileError, load_profile, resolve_profile

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "calibrate.py"

_DROP = object()  # a field value meaning "leave the field out"
GOOD = {"schema": "sgl-agentcache-profile/1", "name": "test", "kv_bytes_per_token": 36864,
        "prefill_tokens_per_s": 50_000.0, "decode_s_per_token": 0.01, "h2d_bytes_per_s": 5e10,
        "d2h_bytes_per_s": 4e10, "measured": {"device": "test"}}


def _run(*args: str) -> subprocess.CompletedProcess:
    # --device cpu: the assertions below describe the CPU path (no pinned memory, no streams) on any machine.
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120)


def test_dry_run_writes_a_loadable_profile_and_raw_measurements(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profile = load_profile(tmp_path / "dryrun.json")
    assert profile.name == "dryrun-tiny-cpu"
    # Tiny model: 2 layers x 2 (k,v) x 2 kv heads x 16 head dim x 4 B (fp32 on CPU).
    assert profile.kv_bytes_per_token == 512
    for field in ("prefill_tokens_per_s", "decode_s_per_token", "h2d_bytes_per_s", "d2h_bytes_per_s"):
        assert getattr(profile, field) > 0, field
    assert profile.prefill_s(1000) == pytest.approx(1000 / profile.prefill_tokens_per_s)

    written = json.loads((tmp_path / "dryrun.json").read_text())
    assert written["measured"]["raw_file"] == "dryrun.raw.json" and written["measured"]["dry_run"] is True
    assert set(written["measured"]["sources"]) == {"prefill_tokens_per_s", "decode_s_per_token",
                                                   "h2d_bytes_per_s", "d2h_bytes_per_s"}

    raw = json.loads((tmp_path / "dryrun.raw.json").read_text())
    assert raw["schema"] == "sgl-agentcache-calibration-raw/1"
    cells = raw["bandwidth"]["cells"]
    # Without CUDA, pinned memory is skipped (and said so); pageable runs alone and "sequential".
    assert {(c["direction"], c["memory"], c["compute"]) for c in cells} == {
        (d, "pageable", k) for d in ("h2d", "d2h") for k in ("alone", "sequential")}
    assert {c["tokens"] for c in cells} == {1, 4}
    assert any(s["what"] == "bandwidth/pinned" for s in raw["skipped"])
    for c in cells:
        assert c["bytes"] == c["tokens"] * 512 and c["seconds"]["n"] >= 1
        assert c["bytes_per_s"]["p10"] <= c["bytes_per_s"]["median"] <= c["bytes_per_s"]["p90"]
    assert [r["context_tokens"] for r in raw["prefill"]] == [16, 64]
    assert all(r["tokens_per_s"] > 0 for r in raw["prefill"])
    assert raw["decode"]["context_tokens"] == 64 and raw["decode"]["s_per_token"]["median"] > 0
    # The profile's constants are the documented picks from the raw numbers.
    assert profile.prefill_tokens_per_s == raw["prefill"][1]["tokens_per_s"]
    assert profile.decode_s_per_token == raw["decode"]["s_per_token"]["median"]
    h2d = [c for c in cells if (c["direction"], c["compute"], c["tokens"]) == ("h2d", "sequential", 4)]
    assert profile.h2d_bytes_per_s == h2d[0]["bytes_per_s"]["median"]
    assert "dryrun.json" in proc.stdout and "decode @ 64 tokens" in proc.stdout


def test_exhausted_budget_writes_raw_only_and_fails(tmp_path):
    proc = _run("--out", str(tmp_path), "--budget-s", "0.01", "--tag", "late")
    assert proc.returncode == 2
    assert not (tmp_path / "late.json").exists()
    raw = json.loads((tmp_path / "late.raw.json").read_text())
    assert raw["bandwidth"]["cells"] == [] and raw["prefill"] is None and raw["decode"] is None
    assert any(s["why"] == "time budget" for s in raw["skipped"])
    assert "not measured" in proc.stderr


def _write(tmp_path, obj) -> Path:
    path = tmp_path / "p.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_load_profile_accepts_a_valid_file(tmp_path):
    assert load_profile(_write(tmp_path, GOOD)) == Profile("test", 36864, 50_000.0, 0.01, 5e10, 4e10)


def test_a_profile_the_server_check_writes_loads_back(tmp_path):
    """bench/replay_vs_server.py writes its measured profile for the server (AGENTCACHE_PROFILE) from
    ``profiles.profile_file``; the file must load back to the same profile (no replay-only field in it)."""
    from bench_module import load_bench

    profile = Profile("cpu-measured", 4096, 1_000.0, 0.05, 2e9, 2e9)
    load_bench("replay_vs_server").write_profile(profile, {"points": [1, 2]}, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


@pytest.mark.parametrize("change, needle", [
    ({"schema": "sgl-agentcache-profile/2"}, "$.schema"),
    ({"prefill_tokens_per_s": 0}, "$.prefill_tokens_per_s"),
    ({"h2d_bytes_per_s": -1.0}, "$.h2d_bytes_per_s"),
    ({"kv_bytes_per_token": 0}, "$.kv_bytes_per_token"),
    ({"decode_s_per_token": "fast"}, "$.decode_s_per_token"),
    ({"d2h_bytes_per_s": _DROP}, "missing required field `d2h_bytes_per_s`"),
    ({"prefill_rate": 1.0}, "unknown field `prefill_rate`"),
    ({"token_scale": 64}, "unknown field `token_scale`"),  # the replayer's scale is never a file's
])
def test_load_profile_rejects_bad_fields_naming_them(tmp_path, change, needle):
    path = _write(tmp_path, {k: v for k, v in {**GOOD, **change}.items() if v is not _DROP})
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_load_profile_rejects_non_json_and_non_finite(tmp_path):
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(_write(tmp_path, "{not json"))
    with pytest.raises(ProfileError, match=r"\$\.h2d_bytes_per_s"):
        load_profile(_write(tmp_path, json.dumps(GOOD).replace("50000000000.0", "1e999")))


def test_resolve_profile_by_name_or_path(tmp_path):
    assert resolve_profile("seed") is PROFILES["seed"]
    assert resolve_profile(_write(tmp_path, GOOD)).name == "test"
    assert resolve_profile(str(tmp_path / "p.json")).h2d_bytes_per_s == 5e10
    with pytest.raises(ProfileError, match="unknown profile 'no-such'"):
        resolve_profile("no-such")
