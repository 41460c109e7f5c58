"""Load a script under ``bench/`` as a module (the benchmarks are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """Import ``bench/<name>.py`` fresh, registered as ``<name>_bench``."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
