"""The results quoted in README.md and bench/README.md are exactly what the committed JSON under bench/results/ says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_match_the_committed_json():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "readme_results.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
