"""Packaging contracts: light import, entry point, idempotent registration, tiny model, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

from sgl_agentcache import BACKEND_NAME
from sgl_agentcache.cli import main as cli_main


def test_import_is_light():
    code = ("import sys, sgl_agentcache, sgl_agentcache.lifecycle, sgl_agentcache.cli, sgl_agentcache.cpu_server; "
            "print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_entry_point_declared():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == BACKEND_NAME]
    assert len(eps) == 1 and eps[0].value == "sgl_agentcache.plugin:register"


def test_register_is_idempotent_and_registers_backends():
    code = """
from sglang.srt.plugins import load_plugins
from sgl_agentcache.plugin import register
load_plugins(); register(); register()
from sglang.srt.mem_cache.registry import get_radix_cache_factory
from sglang.srt.mem_cache.unified_cache.tree_core_registry import get_tree_core_factory
from sgl_agentcache.server.scheduler.cache import agentcache_factory, agent_tree_core_factory
assert get_radix_cache_factory('agentcache') is agentcache_factory
assert get_tree_core_factory('agentcache') is agent_tree_core_factory
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_make_tiny_model_cli(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    tok = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tok["model"]["vocab"]) + len(
        [t for t in tok["added_tokens"] if t["content"] not in tok["model"]["vocab"]])
    assert "chat_template" in json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert "vocab" in capsys.readouterr().out


def test_tiny_model_is_deterministic(tmp_path):
    from sgl_agentcache.tiny_model import make_tiny_model

    a = make_tiny_model(tmp_path / "a")
    b = make_tiny_model(tmp_path / "b")
    assert (a.path / "tokenizer.json").read_text() == (b.path / "tokenizer.json").read_text()
    assert a.vocab_size == b.vocab_size <= 512


def test_trace_cli_generates_and_reads_back(tmp_path, capsys):
    out = tmp_path / "t.msgpack"
    assert cli_main(["trace", "gen", "branch_heavy", str(out), "--seed", "3", "--scale", "0.1"]) == 0
    assert "branch_heavy" in capsys.readouterr().out
    assert cli_main(["trace", "stats", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["forks"] > 0 and stats["requests"] > 0
