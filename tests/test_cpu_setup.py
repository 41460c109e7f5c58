"""``sgl-agentcache cpu-setup``: the CPU shims install into a CPU environment, come out again, and are
refused -- or stay inert -- wherever torch is a GPU build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sgl_agentcache.cpu_setup import PTH_NAME, PTH_TEXT, SHIMS, STUB_MARKER

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: str, pythonpath: list[Path] = (), **kw) -> subprocess.CompletedProcess:
    """``python -m sgl_agentcache.cli ARGV`` with this checkout (and ``pythonpath`` first) importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*pythonpath, ROOT])))
    return subprocess.run([sys.executable, "-m", "sgl_agentcache.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


def python(code: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*pythonpath, ROOT])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_install_then_remove_on_this_cpu_torch(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    done = cli("cpu-setup", "--site", str(site))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in site.iterdir()) == sorted(["_tv_cpu_shim.py", "_hicache_cpu_shim.py", PTH_NAME,
                                                              "sgl_kernel"])
    assert (site / PTH_NAME).read_text() == PTH_TEXT == "import _tv_cpu_shim\nimport _hicache_cpu_shim\n"
    for shim in ("_tv_cpu_shim.py", "_hicache_cpu_shim.py"):
        assert (site / shim).read_bytes() == (SHIMS / shim).read_bytes()
    assert STUB_MARKER in (site / "sgl_kernel" / "__init__.py").read_text()
    # The installed placeholder imports on this CPU torch and is the one found first.
    out = python("import sgl_kernel; print(sgl_kernel.__version__, sgl_kernel.__file__)", [site])
    assert out.returncode == 0 and out.stdout.split() == ["0.0.0+cpustub", str(site / "sgl_kernel" / "__init__.py")]

    again = cli("cpu-setup", "--site", str(site))  # idempotent: replaces its own copy
    assert again.returncode == 0, again.stderr
    removed = cli("cpu-setup", "--remove", "--site", str(site))
    assert removed.returncode == 0 and list(site.iterdir()) == []


def test_a_real_sgl_kernel_is_never_shadowed_or_removed(tmp_path):
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    real = site / "sgl_kernel" / "__init__.py"
    real.write_text("__version__ = '0.3.21'  # stands for the real CUDA kernels\n")
    done = cli("cpu-setup", "--site", str(site))
    assert done.returncode == 2 and "a real sgl_kernel is installed" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert sorted(p.name for p in site.iterdir()) == ["sgl_kernel"]
    removed = cli("cpu-setup", "--remove", "--site", str(site))
    assert removed.returncode == 0 and real.read_text().startswith("__version__ = '0.3.21'")


@pytest.fixture
def cuda_torch(tmp_path) -> Path:
    """A directory whose ``torch`` looks like a CUDA build that sees a GPU.

    A stand-in because no GPU or CUDA torch can run here; it has exactly what the shims and
    ``cpu-setup`` read (``torch.version``, ``torch.cuda.is_available``) and records any use of
    ``torch.library`` (which the torchvision shim must not touch next to a GPU torch).
    """
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(textwrap.dedent("""
        __version__ = "2.13.0+cu128"

        class version:
            cuda = "12.8"
            hip = None

        class cuda:
            @staticmethod
            def is_available():
                return True

        class library:
            used = []

            class Library:
                def __init__(self, *args):
                    library.used.append(args)
        """))
    (fake / "torchvision").mkdir()
    (fake / "torchvision" / "__init__.py").write_text("")
    return fake


def test_refused_next_to_a_cuda_torch(tmp_path, cuda_torch):
    site = tmp_path / "site"
    site.mkdir()
    done = cli("cpu-setup", "--site", str(site), pythonpath=[cuda_torch])
    assert done.returncode == 2, done.stderr
    assert "refusing to install the CPU shims: torch 2.13.0+cu128 is a CUDA build" in done.stderr
    assert done.stderr.count("\n") == 1 and list(site.iterdir()) == []


def test_shims_stay_inert_next_to_a_cuda_torch(cuda_torch):
    """Installed by hand anyway, neither shim takes effect on a GPU torch."""
    stub = python("import sgl_kernel", [cuda_torch, SHIMS])
    assert stub.returncode != 0 and "ImportError: sgl_kernel here is sgl_agentcache's CPU placeholder" in stub.stderr
    hook = python("import _tv_cpu_shim, torchvision, torch; print(torch.library.used)", [cuda_torch, SHIMS])
    assert hook.returncode == 0 and hook.stdout.strip() == "[]", hook.stderr


def test_torchvision_shim_defines_the_op_schemas_on_cpu_torch(tmp_path):
    """The control case on this machine's real CPU torch: the hook registers torchvision::nms before
    torchvision loads, so importing it works (in this venv the hook is installed by make setup)."""
    out = python("import _tv_cpu_shim, torch, torchvision; print(torch.version.cuda, "
                 "torch.ops.torchvision.nms.default._schema.name)", [SHIMS])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "torchvision::nms"]
