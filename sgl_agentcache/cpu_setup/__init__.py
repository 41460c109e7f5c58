"""``sgl-agentcache cpu-setup``: the shims that let SGLang 0.5.23 run on a CPU-only torch.

SGLang on CPU (``SGLANG_USE_CPU_ENGINE=1``) needs, next to a CPU build of torch:

- ``sgl_kernel``: a placeholder for SGLang's native kernel package, which PyPI ships only for CUDA
  (see ``shims/sgl_kernel``);
- ``_tv_cpu_shim`` and a ``.pth`` start-up hook that loads it: PyPI's torchvision is a CUDA build whose
  op registration crashes on CPU torch (see ``shims/_tv_cpu_shim.py``);
- ``_hicache_cpu_shim``, loaded by the same hook: host allocation, the ``direct`` io backend's copies
  and a stream stand-in, so that HiCache (``--enable-hierarchical-cache``) serves on CPU
  (see ``shims/_hicache_cpu_shim.py``).

:func:`install` copies them into an environment's site-packages (``tools/setup_cpu_env.sh``, i.e.
``make setup``, runs it for the test environment). It refuses a GPU environment -- a CUDA or ROCm build
of torch, a visible GPU, or a real ``sgl_kernel`` -- and both shims also stay inert there if installed
anyway (the placeholder refuses to import, the hook does nothing). :func:`remove` takes them out again.
"""

from __future__ import annotations

import importlib.util
import shutil
import sysconfig
from pathlib import Path

SHIMS = Path(__file__).resolve().parent / "shims"
PTH_NAME = "zz_sgl_agentcache_tv_cpu_shim.pth"
TV_SHIM = "_tv_cpu_shim.py"
HICACHE_SHIM = "_hicache_cpu_shim.py"
#: What the start-up hook runs: one import per shim module.
PTH_TEXT = "import _tv_cpu_shim\nimport _hicache_cpu_shim\n"
KERNEL_STUB = "sgl_kernel"
#: Text that identifies our placeholder ``sgl_kernel`` (anything else there is a real kernel package).
STUB_MARKER = '__version__ = "0.0.0+cpustub"'


class CpuSetupError(RuntimeError):
    """The environment is not one the CPU shims may be installed into (the message says why)."""


def default_site() -> Path:
    """Site-packages of the running interpreter's environment."""
    return Path(sysconfig.get_paths()["purelib"])


def gpu_reasons() -> list[str]:
    """Why this environment is a GPU one (empty for a CPU-only torch); raises if torch is missing."""
    try:
        import torch
    except ImportError:
        raise CpuSetupError("torch is not installed: install a CPU build of torch first (make setup does)") from None
    reasons = []
    if torch.version.cuda is not None:
        reasons.append(f"torch {torch.__version__} is a CUDA build")
    if getattr(torch.version, "hip", None) is not None:
        reasons.append(f"torch {torch.__version__} is a ROCm build")
    if not reasons and torch.cuda.is_available():
        reasons.append("torch sees a GPU")
    return reasons


def _is_stub(package_dir: Path) -> bool:
    init = package_dir / "__init__.py"
    return init.is_file() and STUB_MARKER in init.read_text(errors="replace")


def _foreign_kernel(site: Path) -> str | None:
    """Where a real (non-placeholder) ``sgl_kernel`` is installed, if anywhere."""
    target = site / KERNEL_STUB
    if target.exists() and not _is_stub(target):
        return str(target)
    spec = importlib.util.find_spec(KERNEL_STUB)
    if spec is not None and spec.origin and not _is_stub(Path(spec.origin).parent):
        return spec.origin
    return None


def install(site: Path | None = None) -> list[Path]:
    """Copy the shims into ``site`` (default: this environment's site-packages); returns what it wrote.

    Raises :class:`CpuSetupError`, writing nothing, when torch is missing or a GPU build, a GPU is
    visible, or a real ``sgl_kernel`` is installed. Re-running replaces an earlier copy of the shims.
    """
    site = site or default_site()
    reasons = gpu_reasons()
    if reasons:
        raise CpuSetupError(f"refusing to install the CPU shims: {'; '.join(reasons)}. They are for CPU-only "
                            "machines; on a GPU install sglang with its own kernels (pip install \".[serve]\")")
    foreign = _foreign_kernel(site)
    if foreign:
        raise CpuSetupError(f"refusing to install the CPU shims: a real sgl_kernel is installed ({foreign}); "
                            "the placeholder would shadow it")
    if not site.is_dir():
        raise CpuSetupError(f"{site}: no such site-packages directory")
    for shim in (TV_SHIM, HICACHE_SHIM):
        shutil.copyfile(SHIMS / shim, site / shim)
    (site / PTH_NAME).write_text(PTH_TEXT)
    shutil.rmtree(site / KERNEL_STUB, ignore_errors=True)
    shutil.copytree(SHIMS / KERNEL_STUB, site / KERNEL_STUB, ignore=shutil.ignore_patterns("__pycache__"))
    return [site / TV_SHIM, site / HICACHE_SHIM, site / PTH_NAME, site / KERNEL_STUB]


def remove(site: Path | None = None) -> list[Path]:
    """Delete the shims from ``site`` (default: this environment's); a real ``sgl_kernel`` is left alone."""
    site = site or default_site()
    removed = []
    for path in (site / PTH_NAME, site / TV_SHIM, site / HICACHE_SHIM):
        if path.exists():
            path.unlink()
            removed.append(path)
    if _is_stub(site / KERNEL_STUB):
        shutil.rmtree(site / KERNEL_STUB)
        removed.append(site / KERNEL_STUB)
    return removed
