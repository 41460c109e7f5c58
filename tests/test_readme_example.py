"""The README's quick-start example runs as written against a real CPU server (official ``openai``
client, the hint header, the pause route, the resumed turn's cached tokens)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.server
README_URL = "http://127.0.0.1:30000"


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_quick_start_runs_against_a_real_server(server):
    code = _quick_start()
    assert README_URL in code and "x-sgl-agentcache-hint" in code
    done = subprocess.run([sys.executable, "-c", code.replace(README_URL, server.url)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    paused, cached = done.stdout.strip().splitlines()[-2:]
    assert "'paused': True" in paused and "'tool_class': 'pytest'" in paused, paused
    assert int(cached.split()[-1]) > 0, cached  # the resumed turn reused the first turn's prefix
