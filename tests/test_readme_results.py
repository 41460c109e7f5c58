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


def test_a_prose_figure_no_generated_block_shows_is_stale():
    from bench_module import load_bench

    results = load_bench("readme_results")
    generated = "ours 0.92x [0.90, 0.93] better; stock 0.37"
    text = (f"intro\n{results.BEGIN}\n{generated}\n{results.END}\n"
            "ours computes 0.92x [0.90, 0.93] of write-back's, 0.37x of stock's;\n"
            "it was 0.93x [0.92, 0.94] before;\n"
            "<!-- history -->an earlier release measured 1.75x [1.01, 2.02]<!-- /history -->; target 90%.\n")
    assert results.stale_prose_figures(text, generated) == ["line 6: 0.93x", "line 6: [0.92, 0.94]"]
    # An interval counts only as a whole: each of its numbers shown elsewhere is not enough.
    assert results.stale_prose_figures("[0.37, 0.92]", generated) == ["line 1: [0.37, 0.92]"]
