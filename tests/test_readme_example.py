"""The README's quick-start examples run as written against real CPU servers (official ``openai``
client): the zero-config block on a server in the defaults (chat inference on: the second turn finds
the first's prefix, and ``/agentcache/stats`` shows the inferred continuation), the hinted block on the
shared server (the hint header, the pause route, the resumed turn's cached tokens)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_agentcache.cpu_server import CpuServer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.server
README_URL = "http://127.0.0.1:30000"


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run(code: str, url: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code.replace(README_URL, url)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def default_server(tiny_model, tmp_path_factory):
    """Our backend with no AGENTCACHE_* setting at all (what an operator who reads only Install runs)."""
    log = tmp_path_factory.mktemp("readme-defaults") / "sglang.log"
    with CpuServer(str(tiny_model.path), log_path=log, extra_args=("--enable-cache-report",)).start() as srv:
        yield srv


def test_the_readme_zero_config_quick_start_runs_against_a_server_in_the_defaults(default_server):
    code = _quick_start()[0]
    assert README_URL in code and "x-sgl-agentcache-hint" not in code
    cached, inference = _run(code, default_server.url)[-2:]
    assert int(cached.split()[-1]) > 0, cached  # the second turn reused the first turn's prefix
    inference = ast.literal_eval(inference)
    assert inference["mode"] == "chat" and inference["requests"] == 2 and inference["continued"] == 1, inference


def test_the_readme_hinted_quick_start_runs_against_a_real_server(server):
    code = _quick_start()[1]
    assert README_URL in code and "x-sgl-agentcache-hint" in code
    paused, cached = _run(code, server.url)[-2:]
    assert "'paused': True" in paused and "'tool_class': 'pytest'" in paused, paused
    assert int(cached.split()[-1]) > 0, cached  # the resumed turn reused the first turn's prefix
