"""The package as a user installs it: ``python -m build`` makes an sdist and a wheel (built from the sdist),
the wheel installs into a fresh virtualenv with only its core dependencies, and there the CLI runs its
core commands and names the extra that each other command needs.

The fresh venv gets the core dependencies (msgspec, prometheus_client, rich) from the package index,
as a user's would; it has no torch, SGLang, matplotlib or scipy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                 ".hypothesis")


def _copy_source(dest: Path) -> Path:
    """This checkout's files as a clone would have them (tracked and new, not ignored), copied to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:  # not a git checkout (e.g. an unpacked sdist): copy minus build litter
        shutil.copytree(ROOT, dest, ignore=IGNORED)
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _clean_env() -> dict[str, str]:
    """The environment without anything that would make the test's own checkout importable."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dist")
    src = _copy_source(tmp / "src")
    out = tmp / "out"
    # --no-isolation: build with this environment's setuptools (pinned in requirements/cpu-lock.txt), offline.
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("sgl_agentcache-*-py3-none-any.whl")
    (sdist,) = out.glob("sgl_agentcache-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


def test_wheel_carries_licence_metadata_entry_points_and_cpu_shims(dist):
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        licence = whl.read(f"{info}/licenses/LICENSE")
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert licence == (ROOT / "LICENSE").read_bytes() and b"Apache License" in licence
    assert "sgl-agentcache = sgl_agentcache.cli:main" in entry_points
    assert "agentcache = sgl_agentcache.plugin:register" in entry_points
    assert {"sgl_agentcache/cpu_setup/shims/_tv_cpu_shim.py",
            "sgl_agentcache/cpu_setup/shims/sgl_kernel/__init__.py"} <= names
    for extra, requirement in (("serve", "sglang==0.5.23"), ("bench", "matplotlib"), ("bench", "scipy")):
        assert any(line.startswith(f"Requires-Dist: {requirement}") and f'extra == "{extra}"' in line
                   for line in metadata.splitlines()), (extra, requirement)


def test_sdist_holds_what_a_rebuild_needs(dist):
    import tarfile

    with tarfile.open(dist["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "sgl_agentcache/cli.py",
            "sgl_agentcache/cpu_setup/shims/sgl_kernel/__init__.py"} <= names


@pytest.fixture(scope="module")
def core_venv(dist) -> Path:
    venv = dist["tmp"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--disable-pip-version-check", "--no-input", str(dist["wheel"])],
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def run_in(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=_clean_env())


def test_core_install_imports_and_runs_the_core_commands(core_venv, tmp_path):
    probe = run_in(core_venv, "python", "-c",
                   "import importlib.util as u, sgl_agentcache, sgl_agentcache.lifecycle, sgl_agentcache.hints; "
                   "print(sgl_agentcache.__file__); "
                   "print([m for m in ('torch', 'sglang', 'matplotlib', 'scipy', 'numpy') if u.find_spec(m)])",
                   cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    where, heavy = probe.stdout.splitlines()
    assert where.startswith(str(core_venv)) and heavy == "[]"

    helped = run_in(core_venv, "sgl-agentcache", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "cpu-setup" in helped.stdout and "replay" in helped.stdout
    gen = run_in(core_venv, "sgl-agentcache", "trace", "gen", "short_tools", "t.jsonl", "--seed", "1", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    stats = run_in(core_venv, "sgl-agentcache", "trace", "stats", "t.jsonl", cwd=tmp_path)
    assert stats.returncode == 0 and json.loads(stats.stdout)["requests"] > 0
    key = run_in(core_venv, "sgl-agentcache", "tenant-key", cwd=tmp_path)
    assert key.returncode == 0 and "sha256:" in key.stdout


@pytest.mark.parametrize(("argv", "expected"), [
    (["demo"], "demo needs the 'serve' extra (sglang, torch, sgl_kernel, tokenizers not installed)"),
    (["soak"], "soak needs the 'serve' extra"),
    (["replay"], "replay needs the 'serve' extra"),
    (["replay", "--suite"], "replay --suite needs the 'bench' and 'serve' extras (matplotlib, scipy, sglang, "),
    (["make-tiny-model", "m"], "make-tiny-model needs the 'serve' extra (tokenizers not installed)"),
    (["cpu-setup"], "torch is not installed: install a CPU build of torch first"),
])
def test_core_install_names_the_missing_extra(core_venv, tmp_path, argv, expected):
    done = run_in(core_venv, "sgl-agentcache", *argv, cwd=tmp_path)
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # it stopped before doing anything
