"""``make demo`` (until the trace replayer lands): a forked agent program against a real CPU server.

Starts SGLang 0.5.23 on CPU with ``--radix-cache-backend agentcache`` and a tiny random-weight model,
runs an ``sgl.function`` agent whose lead turn forks subagents from a shared system prompt and tool
schema, and prints, per model call, the prompt tokens and how many of them were served from the cache.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

SYSTEM = ("system: you are a coding agent. tools: search(query), read(file), run(cmd). "
          "answer with one tool call per turn. ") * 4


def agent_program():
    import sglang as sgl

    @sgl.function
    def lead_agent(s, task, n_workers):
        s += SYSTEM + "user: " + task + "\n"
        s += "assistant: plan " + sgl.gen("plan", max_tokens=8, temperature=0)
        workers = s.fork(n_workers)
        for i, w in enumerate(workers):
            w += f"\nsubagent {i}: search the repository for part {i}. "
            w += sgl.gen("finding", max_tokens=8, temperature=0)
        workers.join()
        s += "\ntool: results gathered.\nassistant: " + sgl.gen("answer", max_tokens=8, temperature=0)
        return workers

    return lead_agent


def run_demo(workers: int = 4) -> int:
    import sglang as sgl
    from rich.console import Console
    from rich.table import Table

    from sgl_agentcache.cpu_server import CpuServer
    from sgl_agentcache.tiny_model import make_tiny_model

    console = Console()
    with tempfile.TemporaryDirectory(prefix="agentcache-demo-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama")
        console.print(f"[bold]starting SGLang on CPU[/] (tiny random-weight Llama, backend agentcache) ...")
        t0 = time.monotonic()
        with CpuServer(str(model.path), log_path=Path(tmp) / "server.log") as server:
            console.print(f"server up in {time.monotonic() - t0:.0f}s at {server.url}")
            sgl.set_default_backend(sgl.RuntimeEndpoint(server.url))
            state = agent_program().run(task="fix the failing cache test", n_workers=workers)
            branches = state.ret_value
            rows = [("lead: plan", state.get_meta_info("plan"))]
            rows += [(f"subagent {i}", b.get_meta_info("finding")) for i, b in enumerate(branches)]
            rows += [("lead: answer", state.get_meta_info("answer"))]
            table = Table(title="forked agent on the agentcache backend")
            for col in ("model call", "prompt tokens", "cached tokens", "cached %"):
                table.add_column(col, justify="right" if col != "model call" else "left")
            for name, meta in rows:
                prompt, cached = meta["prompt_tokens"], meta["cached_tokens"]
                table.add_row(name, str(prompt), str(cached), f"{100 * cached / max(prompt, 1):.0f}%")
            console.print(table)
            _, stats = server.request("GET", "/agentcache/stats")
            console.print(f"tree: impl={stats['impl']} core={stats['tree_core']} "
                          f"resident tokens by class={stats['resident_tokens']}")
            _, check = server.request("GET", "/agentcache/check")
            console.print(f"integrity check: {'ok' if check['ok'] else check['errors']}")
            return 0 if check["ok"] else 1
