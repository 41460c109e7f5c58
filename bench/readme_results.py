"""The README's "Results" tables, generated from the committed JSON under ``bench/results/``.

``python bench/readme_results.py`` prints the markdown; ``--write README.md`` replaces the block between
the ``<!-- results:begin -->`` / ``<!-- results:end -->`` markers; ``--check README.md`` exits 1 when the
README's block differs from what the JSON says (``tests/test_readme_results.py`` runs it), so a quoted
figure can never drift from its committed measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SHOWN = ("stock", "stock+host", "infercept", "continuum", "kvflow", "session-radix", "agentcache", "oracle")


def _replay(body: dict) -> list[str]:
    cfg = body["config"]
    out = [f"Replay suite (`make bench`; {len(cfg['seeds'])} seeds, trace scale {cfg['scale']}, profile "
           f"`{cfg['profile']}`): recomputed prefill tokens as a ratio to stock SGLang in the same run "
           "(lower is better), and the token hit rate.", ""]
    for pressure in cfg["pressures"]:
        rows = {(s["policy"], s["workload"]): s for s in body["summary"] if s["pressure"] == pressure}
        workloads = [w for w in cfg["workloads"]]
        out.append(f"**{pressure} pool** | " + " | ".join(workloads))
        out.append("---|" + "|".join("---:" for _ in workloads))
        for policy in SHOWN:
            if (policy, workloads[0]) not in rows:
                continue
            cells = [f"{rows[(policy, w)]['recompute_vs_stock']:.2f}x ({rows[(policy, w)]['hit_rate']:.2f})"
                     for w in workloads]
            out.append(f"{policy} | " + " | ".join(cells))
        out.append("infinite cache (hit rate) | " + " | ".join(f"({rows[('stock', w)]['ideal_hit_rate']:.2f})"
                                                             for w in workloads))
        out.append("")
    return out


def _server(body: dict) -> list[str]:
    stock, ours = body["backends"]["stock"], body["backends"]["agentcache"]
    cmp = body["comparison"]
    cfg = body["config"]
    return [
        f"Real CPU server (`bench/server_recompute.py`; `{cfg['workload']}` trace, {cfg['trace_stats']['requests']} "
        f"requests, {cfg['pool_tokens']}-token pool):",
        "",
        "backend | prefill tokens computed | failures | resume p50 / p99 (s)",
        "---|---:|---:|---:",
        f"stock | {stock['computed_tokens']} | {stock['failures']} | {stock['resume_latency_s']['p50']:.3f} / "
        f"{stock['resume_latency_s']['p99']:.3f}",
        f"agentcache | {ours['computed_tokens']} ({cmp['computed_ratio']:.2f}x) | {ours['failures']} | "
        f"{ours['resume_latency_s']['p50']:.3f} / {ours['resume_latency_s']['p99']:.3f}",
        "",
    ]


def _overhead(body: dict) -> list[str]:
    target = body["target"]
    names = [w["workload"] for w in body["workloads"]]
    rust = body["rust"]
    rust_cell = ", ".join(f"{x:.2f}x" for x in rust["total_ratio_vs_stock"]) if rust.get("available") \
        else f"unavailable ({rust.get('reason')})"

    def steps(w: dict) -> int:  # the nodes the insert visits, walked or skipped (= stock's walk)
        return w["insert_walk_steps"] + w.get("insert_skipped_nodes", 0)

    def work(wl: dict, key: str, which: str = "tree_work") -> str:
        w = wl[which]
        if key == "insert_walk_steps":
            return f"{steps(w['ours_hinted']) / max(steps(w['stock']), 1):.2f}x"
        return f"{w['ours_hinted'][key] / max(w['stock'][key], 1):.2f}x"

    def ratios(key: str) -> str:
        return ", ".join(f"{x:.2f}x" for x in target[key])

    skipped = ", ".join(
        f"{w['tree_work']['ours_untagged']['insert_skipped_nodes'] / max(steps(w['tree_work']['stock']), 1):.0%}"
        for w in body["workloads"])
    kept = ", ".join(work(w, "mean_nodes_at_admit") for w in body["workloads"])
    walked = ", ".join(work(w, "insert_walk_steps") for w in body["workloads"])
    roomy = ", ".join(work(w, "insert_walk_steps", "tree_work_roomy") for w in body["workloads"])
    return [
        f"Tree overhead (`bench/tree_overhead.py`; cache time for the same recorded operation stream, ours / "
        f"stock Python tree core, on {', '.join(names)}): untagged traffic {ratios('ours_untagged_ratios')}, "
        f"with lifecycle hints {ratios('ours_hinted_ratios')} (target {target['max_ratio']:.2f}x). Our inserts "
        f"start at the node the request holds locked, where stock's re-walk the request's prefix from the "
        f"root ({skipped} of the nodes stock's insert walks on untagged traffic are skipped; same tree, same "
        f"decisions). With stock's full walk the hinted cache reads {ratios('ours_hinted_full_walk_ratios')}: "
        f"our lifecycle bookkeeping alone, on a tree holding {kept} stock's nodes when a request arrives, "
        f"whose insert paths are {walked} as many nodes as stock's (in a pool neither cache evicts from, "
        f"{roomy}). SGLang's Rust tree core, for reference: {rust_cell}.",
        "",
    ]


def _soak(body: dict) -> list[str]:
    calls = {k: v for k, v in body["calls"].items() if k not in ("race_close_overtook", "abandoned_sessions")}
    faults = {k: calls.get(k, 0) for k in ("aborted_stream", "fault", "race_close", "branch_close")}
    host = body["host_tokens"]
    return [
        f"Soak (`make soak`; {body['workers']} concurrent agents for {body['seconds']:.0f} s on a fresh CPU server): "
        f"{sum(calls.values())} calls ({calls.get('generate', 0)} generations, {calls.get('session_close', 0)} "
        f"sessions, {calls.get('pause', 0)} pauses); faults injected: {faults['aborted_stream']} client "
        f"disconnects mid-stream, {faults['fault']} failed transfers armed, {faults['race_close']} closes racing "
        f"an in-flight request, {body['calls'].get('abandoned_sessions', 0)} tools that never return "
        f"({body.get('deadline_releases', 0)} deadline releases), duplicate closes; fallbacks to recompute: "
        f"{body['fallbacks']['offload']['host_full']} offloads to a full host tier, "
        f"{body['fallbacks']['offload']['transfer_failed'] + sum(body['fallbacks']['restore'].values())} failed or "
        f"impossible transfers. Unexplained "
        f"failures {len(body['unexpected_failures'])}, leaked tokens {body['leaked_tokens']}, terminated tokens "
        f"left {body['terminated_pending_tokens']}, host tier {host['before']} -> {host['after']} tokens, "
        f"integrity check {'passed' if body['check_ok'] else 'FAILED'}, server "
        f"{'healthy' if body['health'] == 200 else 'DOWN'}: {'pass' if body['passed'] else 'FAIL'}.",
        "",
    ]


def render() -> str:
    lines = [BEGIN, ""]
    replay = RESULTS / "replay" / "results.json"
    if replay.exists():
        lines += _replay(json.loads(replay.read_text()))
    server = RESULTS / "server_recompute.json"
    if server.exists():
        lines += _server(json.loads(server.read_text()))
    overhead = RESULTS / "tree_overhead.json"
    if overhead.exists():
        lines += _overhead(json.loads(overhead.read_text()))
    soak = RESULTS / "soak.json"
    if soak.exists():
        lines += _soak(json.loads(soak.read_text()))
    return "\n".join(lines + [END])


def _block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN): text.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="README")
    parser.add_argument("--check", metavar="README")
    args = parser.parse_args(argv)
    block = render()
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        old = _block(text)
        if old is None:
            raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
        path.write_text(text.replace(old, block))
        return 0
    if args.check:
        current = _block(Path(args.check).read_text())
        if current != block:
            print(f"{args.check}: the results block differs from bench/results (run: python bench/readme_results.py "
                  f"--write {args.check})", file=sys.stderr)
            return 1
        return 0
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
