"""``sgl-agentcache demo`` (``make demo-server``): a forked agent program against a real CPU server.

Starts SGLang 0.5.23 on CPU with ``--radix-cache-backend agentcache`` and a tiny random-weight model,
runs an ``sgl.function`` agent (through :class:`~sgl_agentcache.frontend.AgentRuntimeEndpoint`, so every
call carries session/branch hints) whose lead turn forks subagents from a shared system prompt and tool
schema, and prints, per model call, the prompt tokens, how many were served from the cache and how
many each subagent branch was charged; joining the subagents closes their branches, which frees their
scratch at once.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP stop the server's whole process group and remove the temporary
directory (model and server log) before the demo exits.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

SYSTEM = ("system: you are a coding agent. tools: search(query), read(file), run(cmd). "
          "answer with one tool call per turn. ") * 4


_BRANCH_STATS: dict = {}


def _branch_charges() -> dict[str, int]:
    """Tokens each branch of the demo session owns right now (read from /agentcache/stats)."""
    import json
    import urllib.request

    with urllib.request.urlopen(_BRANCH_STATS["url"] + "/agentcache/stats") as resp:
        stats = json.load(resp)
    return {b["branch"]: b["owned_tokens"] for b in stats["branches"] if b["session"] == "demo"}


def agent_program():
    import sglang as sgl

    @sgl.function
    def lead_agent(s, task, n_workers, report):
        s += SYSTEM + "user: " + task + "\n"
        s += "assistant: plan " + sgl.gen("plan", max_tokens=8, temperature=0)
        workers = s.fork(n_workers)
        for i, w in enumerate(workers):
            w += f"\nsubagent {i}: search the repository for part {i}. "
            w += sgl.gen("finding", max_tokens=8, temperature=0)
        for w in workers:
            w.sync()
        report["charged"] = _branch_charges()
        workers.join()  # closes the subagents' branches: their scratch is freed now
        s += "\ntool: results gathered.\nassistant: " + sgl.gen("answer", max_tokens=8, temperature=0)
        return workers

    return lead_agent


def run_demo(workers: int = 4, port: int | None = None) -> int:
    """Run the demo on a fresh CPU server at ``port`` (default: a free one); 0 if the tree checks out.

    Raises :class:`~sgl_agentcache.cpu_server.Terminated` on SIGTERM/SIGINT/SIGHUP, after the server's process
    group is gone and the temporary directory is removed.
    """
    from rich.console import Console

    from sgl_agentcache.cpu_server import exit_on_signals, free_port

    console = Console()

    def announce(signum: int) -> None:
        console.print(f"demo: got {signal.Signals(signum).name}: stopping the server, removing its temporary files")

    with exit_on_signals(announce):
        return _run(console, workers, port or free_port())


def _run(console, workers: int, port: int) -> int:
    from rich.table import Table

    from sgl_agentcache.cpu_server import CpuServer
    from sgl_agentcache.frontend import AgentRuntimeEndpoint
    from sgl_agentcache.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="agentcache-demo-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama")
        console.print("[bold]starting SGLang on CPU[/] (tiny random-weight Llama, backend agentcache) ...")
        t0 = time.monotonic()
        with CpuServer(str(model.path), port=port, log_path=Path(tmp) / "server.log") as server:
            console.print(f"server up in {time.monotonic() - t0:.0f}s at {server.url}")
            _BRANCH_STATS["url"] = server.url
            endpoint = AgentRuntimeEndpoint(server.url, session="demo")
            report: dict = {}
            state = agent_program().run(task="fix the failing cache test", n_workers=workers, report=report,
                                        backend=endpoint)
            branches = state.ret_value
            charged = report["charged"]
            rows = [("lead: plan", state.get_meta_info("plan"), charged.get("main"))]
            rows += [(f"subagent {i}", b.get_meta_info("finding"),
                      charged.get(b.stream_executor.agentcache_identity["branch"])) for i, b in enumerate(branches)]
            rows += [("lead: answer", state.get_meta_info("answer"), None)]
            table = Table(title="forked agent on the agentcache backend")
            for col in ("model call", "prompt tokens", "cached tokens", "cached %", "branch owns"):
                table.add_column(col, justify="right" if col != "model call" else "left")
            for name, meta, owns in rows:
                prompt, cached = meta["prompt_tokens"], meta["cached_tokens"]
                table.add_row(name, str(prompt), str(cached), f"{100 * cached / max(prompt, 1):.0f}%",
                              "" if owns is None else str(owns))
            console.print(table)
            _, stats = server.request("GET", "/agentcache/stats")
            console.print(f"tree: impl={stats['impl']} core={stats['tree_core']} "
                          f"resident tokens by class={stats['resident_tokens']}")
            console.print(f"subagent branches closed on join: {stats['closed_branches']}, "
                          f"their scratch freed at once: {stats['freed_on_close_tokens']} tokens")
            _, check = server.request("GET", "/agentcache/check")
            console.print(f"integrity check: {'ok' if check['ok'] else check['errors']}")
            return 0 if check["ok"] else 1
