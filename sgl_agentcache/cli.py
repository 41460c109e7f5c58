"""``sgl-agentcache`` command line.

Ordinary mistakes -- a bad flag value, a missing or malformed input file, an extra that is not
installed -- are reported as one line on stderr with exit status 2, never as a traceback
(:func:`main`); flag validators and extras checks live in :mod:`sgl_agentcache.cli_checks`.
"""

from __future__ import annotations

import argparse
import sys

from sgl_agentcache.cli_checks import (
    DEFAULT_TRACE_SCALE,
    UsageError,
    attach_shared_checks,
    positive_float,
    positive_int,
    require_extras,
    tcp_port,
)


def _make_tiny_model(args: argparse.Namespace) -> int:
    if not args.no_tokenizer:
        require_extras("make-tiny-model", "serve", only=("tokenizers",))
    from sgl_agentcache.tiny_model import make_tiny_model

    model = make_tiny_model(args.dir, vocab_size=args.vocab_size, with_tokenizer=not args.no_tokenizer)
    tok = "with tokenizer" if model.has_tokenizer else "config only (use --skip-tokenizer-init)"
    print(f"wrote tiny Llama model to {model.path} ({tok}, vocab {model.vocab_size}); "
          "serve it with --load-format dummy")
    return 0


def _demo(args: argparse.Namespace) -> int:
    require_extras("demo", "serve")
    import os

    from sgl_agentcache.cpu_server import Terminated, port_is_free
    from sgl_agentcache.demo import run_demo

    if args.port is not None and not port_is_free(args.port):
        raise UsageError(f"port {args.port} is already in use on 127.0.0.1; pick another --port")
    try:
        return run_demo(workers=args.workers, port=args.port)
    except Terminated as exc:
        # The server and the temporary directory are gone by now. SGLang's frontend runs an
        # sgl.function program on worker threads that are not daemons: after an interruption, an idle
        # one waits for work forever (a normal exit would wait for it) and one with a request in
        # flight prints a traceback when the server goes away. Leave at once instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.code)


def _trace_gen(args: argparse.Namespace) -> int:
    from sgl_agentcache.trace.generators import generate
    from sgl_agentcache.trace.schema import save
    from sgl_agentcache.trace.stats import stats_line, trace_stats

    trace = generate(args.workload, seed=args.seed, scale=args.scale)
    save(trace, args.out)
    print(f"{args.out}: {stats_line(trace_stats(trace))}")
    return 0


def _trace_import(args: argparse.Namespace) -> int:
    from sgl_agentcache.trace.importers import import_mooncake, import_weka
    from sgl_agentcache.trace.schema import save
    from sgl_agentcache.trace.stats import stats_line, trace_stats

    if args.format == "weka":
        trace = import_weka(args.src)
    else:
        trace = import_mooncake(args.src, min_shared_blocks=args.min_shared_blocks)
    save(trace, args.out)
    print(f"{args.out}: {stats_line(trace_stats(trace))}")
    return 0


def _trace_fetch_free(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sgl_agentcache.trace.samples import SAMPLES, default_root, real_trace_samples, sources_text, summary_table
    from sgl_agentcache.trace.schema import save
    from sgl_agentcache.trace.stats import stats_line, trace_stats

    root = Path(args.root) if args.root else default_root()
    if not (args.list or args.out):
        print("Public agent traces. This command downloads nothing (it assumes no network, as in CI):")
        print("fetch them yourself from these sources, then convert them with `sgl-agentcache trace import`.\n")
        print(sources_text())
        print(f"\nSamples committed in this repository ({root}), imported by sgl_agentcache.trace.samples:")
        for sample in SAMPLES.values():
            print(f"- {sample.name}: {sample.about}")
        print("\n`--list` imports them and prints their statistics; `--out DIR` writes them as v1 traces.")
        return 0
    traces = real_trace_samples(root)
    if args.list:
        print(summary_table(traces))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, trace in traces.items():
            path = out / f"{name}.{args.format}"
            save(trace, path)
            print(f"{path}: {stats_line(trace_stats(trace))}")
    return 0


def _trace_stats(args: argparse.Namespace) -> int:
    import json

    from sgl_agentcache.trace.schema import load
    from sgl_agentcache.trace.stats import trace_stats

    print(json.dumps(trace_stats(load(args.file)), indent=1))
    return 0


def _replay(args: argparse.Namespace) -> int:
    # Up front: without these the suite would fail at its last step (plots), after the whole run.
    if getattr(args, "suite", False):
        require_extras("replay --suite", "serve", "bench")
    else:
        require_extras("replay", "serve")
    from sgl_agentcache.sim.console import run

    return run(args)


def _soak(args: argparse.Namespace) -> int:
    import json
    import os

    require_extras("soak", "serve")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sgl_agentcache.soak import run_standalone

    report = run_standalone(args.seconds, args.workers, args.out, seed=args.seed)
    brief = {phase: {k: v for k, v in run.items() if k != "resident_tokens"} if isinstance(run, dict) else run
             for phase, run in report.items()}
    print(json.dumps(brief, indent=1))
    return 0 if report["passed"] else 1


def _tenant_key(args: argparse.Namespace) -> int:
    from sgl_agentcache.tenancy import new_key

    key, digest = new_key()
    print(f"API key (give to the tenant, store nowhere else): {key}")
    print(f'tenants file entry:                              keys = ["{digest}"]')
    return 0


def _cpu_setup(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sgl_agentcache.cpu_setup import CpuSetupError, install, remove

    site = Path(args.site) if args.site else None
    try:
        if args.remove:
            removed = remove(site)
            print(f"removed {', '.join(map(str, removed))}" if removed else "no CPU shims installed there")
            return 0
        written = install(site)
    except CpuSetupError as exc:
        raise UsageError(str(exc)) from None
    print(f"installed the CPU shims: {', '.join(map(str, written))} (undo: sgl-agentcache cpu-setup --remove)")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    import json

    from sgl_agentcache.cluster import Cluster, ClusterError

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        cluster = (Cluster.from_router(args.router, headers=headers) if args.router
                   else Cluster(args.worker, headers=headers))
        if args.action == "stats":
            reply = cluster.stats()
            status = 200 if reply["workers"] else 502
        else:
            try:
                body = json.loads(args.body)
            except ValueError as exc:
                raise UsageError(f"BODY is not JSON: {exc}") from None
            status, reply = cluster.call("/agentcache/" + args.route.strip("/"), body)
    except ClusterError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(reply, indent=2, sort_keys=True))
    return 0 if status == 200 else 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``PROG: error: MESSAGE (see PROG --help)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sgl-agentcache", description="sgl_agentcache: an agent-lifecycle-aware prefix cache "
                     "for SGLang. Commands: a CPU demo server, trace tools, the trace replayer, a soak test.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight Llama (config + local tokenizer)")
    tiny.add_argument("dir", help="output directory (created; files in it are overwritten)")
    tiny.add_argument("--vocab-size", type=positive_int, default=512, help="tokenizer/model vocabulary size")
    tiny.add_argument("--no-tokenizer", action="store_true",
                      help="write only the model config (serve it with --skip-tokenizer-init)")
    tiny.set_defaults(func=_make_tiny_model)
    demo = sub.add_parser("demo", help="run a forked agent program against a real CPU server")
    demo.add_argument("--workers", type=positive_int, default=4, help="subagents the lead agent forks (default 4)")
    demo.add_argument("--port", type=tcp_port, help="port of the SGLang server on 127.0.0.1 (default: a free one)")
    demo.set_defaults(func=_demo)

    rp = sub.add_parser("replay", help="replay traces through the real cache code: ours vs baselines B0-B6")
    from sgl_agentcache.sim.console import add_arguments  # argparse only: cheap at parse time

    add_arguments(rp)
    attach_shared_checks(rp)
    rp.set_defaults(func=_replay)

    soak = sub.add_parser("soak", help="soak fresh CPU servers (lazy pauses, eager pauses, two tenants with a "
                                       "flood) with concurrent agents and faults, then check")
    soak.add_argument("--seconds", type=positive_float, default=160,
                      help="how long the agents run in each of the three phases (default 160)")
    soak.add_argument("--workers", type=positive_int, default=6, help="concurrent agent threads (default 6)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the agents' random choices (default 0)")
    soak.add_argument("--out", help="write the report (JSON) here")
    soak.set_defaults(func=_soak)

    cpu = sub.add_parser("cpu-setup", help="CPU-only machines: install the shims SGLang needs on a CPU torch "
                                           "(refused where torch is a GPU build or sees a GPU)")
    cpu.add_argument("--remove", action="store_true", help="remove the shims instead")
    cpu.add_argument("--site", metavar="DIR", help="site-packages to install into (default: this environment's)")
    cpu.set_defaults(func=_cpu_setup)

    cl = sub.add_parser("cluster", help="the /agentcache routes of every worker behind SGLang's router: summed "
                                        "stats, closes and pauses sent to the worker that holds the branch")
    where = cl.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", metavar="URL", help="the router: its workers are read from GET /workers")
    where.add_argument("--worker", metavar="URL", action="append", help="a worker's base URL (repeat for each)")
    cl.add_argument("--api-key", help="a tenant's (or the operator's) key, sent as Authorization: Bearer")
    actions = cl.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("stats", help="every worker's /agentcache/stats and their sum, as JSON")
    post = actions.add_parser("call", help="POST one route to every worker and combine the answers "
                                           "(exit 1 unless 200)")
    post.add_argument("route", choices=["branch/close", "session/close", "pause", "resume", "prefetch", "admin/purge"],
                      help="the route under /agentcache/ (its body as on one server: see README, Routes)")
    post.add_argument("body", help='the route\'s JSON body, e.g. \'{"session": "s1", "branch": "sub-2"}\'')
    cl.set_defaults(func=_cluster)

    key = sub.add_parser("tenant-key", help="print a new tenant API key and the hashed line for the tenants file")
    key.set_defaults(func=_tenant_key)
    trace = sub.add_parser("trace", help="agent-trajectory traces: generate, import, inspect").add_subparsers(
        dest="trace_command", required=True)
    gen = trace.add_parser("gen", help="write a seeded synthetic trace of one workload class")
    from sgl_agentcache.trace.generators import WORKLOADS  # pure and cheap: fine at parse time

    gen.add_argument("workload", choices=sorted(WORKLOADS), metavar="WORKLOAD", help=f"workload class: {', '.join(sorted(WORKLOADS))}")
    gen.add_argument("out", help="output file (.jsonl or .msgpack)")
    gen.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same trace (default 0)")
    gen.add_argument("--scale", type=positive_float, default=DEFAULT_TRACE_SCALE,
                     help=f"multiply the workload's default number of sessions (default {DEFAULT_TRACE_SCALE:g}, "
                          "as replay's; 1.0: full size)")
    gen.set_defaults(func=_trace_gen)
    imp = trace.add_parser("import", help="convert a public agent trace (Weka-style or Mooncake) to ours")
    imp.add_argument("format", choices=["weka", "mooncake"], help="source format: weka (Weka-style agent traces, "
                                                                  "kv-cache-tester) or mooncake (Mooncake rows)")
    imp.add_argument("src", help="source file (.json/.jsonl, optionally .gz)")
    imp.add_argument("out", help="output file (.jsonl or .msgpack)")
    imp.add_argument("--min-shared-blocks", type=positive_int, default=1,
                     help="mooncake: blocks a row must share with a session's latest request to continue it "
                          "(2 for FAST'25 conversation_trace, whose rows all start with one shared block)")
    imp.set_defaults(func=_trace_import)
    free = trace.add_parser(
        "fetch-free", help="where to get public agent traces (no download); list or write the committed samples")
    free.add_argument("--list", action="store_true", help="import the committed samples and print their statistics")
    free.add_argument("--out", help="write each committed sample, imported, as a v1 trace into this directory")
    free.add_argument("--format", choices=["jsonl", "msgpack"], default="jsonl", help="file format for --out")
    free.add_argument("--root", help="where the samples are (default: bench/traces of this source checkout, "
                                     "or $SGL_AGENTCACHE_TRACES)")
    free.set_defaults(func=_trace_fetch_free)
    st = trace.add_parser("stats", help="print a trace's statistics as JSON")
    st.add_argument("file", help="a trace file (.jsonl or .msgpack)")
    st.set_defaults(func=_trace_stats)
    return parser


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error (see :func:`user_errors`) prints one line on stderr and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except user_errors() as exc:
        command = " ".join(filter(None, ("sgl-agentcache", args.command, getattr(args, "trace_command", None))))
        print(f"{command}: error: {_describe(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user's input is wrong, not the program: reported without a traceback.

    A path that does not exist or cannot be read, a malformed trace or profile file, a
    :class:`~sgl_agentcache.cli_checks.UsageError` (e.g. a missing extra).
    """
    from sgl_agentcache.policy.profiles import ProfileError
    from sgl_agentcache.trace.schema import TraceError

    return (UsageError, TraceError, ProfileError, FileNotFoundError, FileExistsError, IsADirectoryError,
            NotADirectoryError, PermissionError)


if __name__ == "__main__":
    sys.exit(main())
