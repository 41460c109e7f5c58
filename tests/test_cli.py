"""The command line as a user meets it: one-line errors with exit 2, help on every flag, shared defaults,
and each command naming the extra it needs before it starts any work."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from sgl_agentcache.cli import build_parser, main
from sgl_agentcache.cli_checks import DEFAULT_TRACE_SCALE
from sgl_agentcache.policy.profiles import PROFILES
from sgl_agentcache.trace.generators import generate
from sgl_agentcache.trace.schema import dumps_jsonl, load


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` -> (exit status, stdout, stderr); argparse's own errors exit via SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def files(tmp_path):
    """A missing path, a malformed trace (a valid one with its header line dropped), an output path."""
    good = dumps_jsonl(generate("short_tools", seed=1, scale=0.05))
    (tmp_path / "malformed.jsonl").write_bytes(good.split(b"\n", 1)[1])
    return {"missing": str(tmp_path / "missing.jsonl"), "malformed": str(tmp_path / "malformed.jsonl"),
            "out": str(tmp_path / "out.jsonl"), "dir": str(tmp_path)}


MISTAKES = [
    (["trace", "stats", "{missing}"], "missing.jsonl: No such file or directory"),
    (["trace", "stats", "{malformed}"], "malformed.jsonl: line 1: the first line must be the trace header"),
    (["trace", "stats", "{dir}"], "Is a directory"),
    (["trace", "import", "weka", "{missing}", "{out}"], "missing.jsonl: No such file or directory"),
    (["trace", "gen", "short_tools", "{out}", "--scale", "-1"], "argument --scale: must be a number > 0, got '-1'"),
    (["trace", "gen", "short_tools", "{out}", "--scale", "x"], "argument --scale: expected a number, got 'x'"),
    (["trace", "gen", "short_tools", "{out}", "--seed", "1.5"], "argument --seed: invalid int value"),
    (["trace", "gen", "nope", "{out}"], "invalid choice: 'nope'"),
    (["replay", "--suite", "--seeds", "a,b"], "argument --seeds: expected comma-separated integers (e.g. 1,2,3), "
                                             "got 'a,b'"),
    (["replay", "--suite", "--real-seeds", "1,,2"], "argument --real-seeds: expected comma-separated integers"),
    (["replay", "--scale", "-1"], "argument --scale: must be a number > 0"),
    (["replay", "--workload", "nope"], "argument --workload: unknown workload 'nope'; choose from short_tools"),
    (["replay", "--suite", "--workloads", "short_tools,nope"], "argument --workloads: unknown workload(s) 'nope'"),
    (["replay", "--profile", "nope"], "argument --profile: unknown profile 'nope'"),
    (["replay", "--trace", "{missing}"], "missing.jsonl: No such file or directory"),
    (["replay", "--trace", "{malformed}"], "malformed.jsonl: line 1: the first line must be the trace header"),
    (["demo", "--port", "70000"], "argument --port: must be a TCP port in 1-65535, got '70000'"),
    (["demo", "--workers", "0"], "argument --workers: must be an integer >= 1, got '0'"),
    (["soak", "--seconds", "-5"], "argument --seconds: must be a number > 0"),
    (["make-tiny-model", "{malformed}"], "malformed.jsonl: File exists"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
]


@pytest.mark.parametrize(("argv", "expected"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_ordinary_mistakes_print_one_line_and_exit_2(argv, expected, files, capsys):
    rc, out, err = run_cli([a.format(**files) for a in argv], capsys)
    assert rc == 2
    assert expected in err
    assert err.count("\n") == 1 and err.startswith("sgl-agentcache") and "Traceback" not in err, err
    assert out == ""
    assert not os.path.exists(files["out"])  # nothing was written


def test_a_busy_port_is_refused_before_anything_starts(capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        rc, out, err = run_cli(["demo", "--port", str(sock.getsockname()[1])], capsys)
    assert rc == 2 and "is already in use" in err and err.count("\n") == 1 and out == ""


def _subcommands(parser: argparse.ArgumentParser, path: str = ""):
    """Every (command path, parser), depth first, through nested subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{path} {name}".strip(), sub
                yield from _subcommands(sub, f"{path} {name}".strip())


def test_every_flag_and_command_has_help():
    parser = build_parser()
    seen = []
    for path, sub in _subcommands(parser):
        if path == "replay":
            continue  # replay's own options are declared and documented in sim/console.py
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            seen.append(f"{path} {action.dest}")
            assert action.help, f"`sgl-agentcache {path}`: {action.option_strings or action.dest} has no help"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(choice.help for choice in action._choices_actions)
    assert "demo port" in seen and "trace gen scale" in seen and "cpu-setup site" in seen


def test_profile_help_lists_the_built_in_profiles():
    replay = dict(_subcommands(build_parser()))["replay"]
    (profile,) = [a for a in replay._actions if "--profile" in a.option_strings]
    assert PROFILES and all(name in profile.help for name in PROFILES), profile.help


def test_trace_gen_and_replay_share_the_default_scale(tmp_path, capsys):
    parser = build_parser()
    out = tmp_path / "t.jsonl"
    gen_args = parser.parse_args(["trace", "gen", "branch_heavy", str(out)])
    assert gen_args.scale == parser.parse_args(["replay"]).scale == DEFAULT_TRACE_SCALE == 0.1
    assert main(["trace", "gen", "branch_heavy", str(out), "--seed", "2"]) == 0
    (scale,) = [a for a in dict(_subcommands(parser))["trace gen"]._actions if a.dest == "scale"]
    assert "default 0.1, as replay's" in scale.help
    assert load(out) == generate("branch_heavy", seed=2, scale=0.1)  # what `replay --workload --seed 2` replays


def test_shared_checks_keep_replays_text_flags_as_text():
    """The validators attached to replay's flags check them but hand sim/console.py the values it reads."""
    args = build_parser().parse_args(["replay", "--seeds", "1, 2", "--real-seeds", "3", "--workloads",
                                      "short_tools,real_cc_sessions", "--profile", "seed", "--workers", "3"])
    assert (args.seeds, args.real_seeds, args.workloads, args.profile, args.workers) == (
        "1, 2", "3", "short_tools,real_cc_sessions", "seed", 3)


@pytest.mark.parametrize(("argv", "hidden", "extra"), [
    (["replay", "--suite", "--quick"], "matplotlib", "'bench'"),
    (["replay", "--suite", "--quick"], "scipy", "'bench'"),
    (["replay", "--workload", "short_tools"], "sglang", "'serve'"),
    (["demo"], "sglang", "'serve'"),
    (["soak", "--seconds", "1"], "torch", "'serve'"),
    (["make-tiny-model", "{dir}/m"], "tokenizers", "'serve'"),
])
def test_a_command_names_the_missing_extra_before_it_starts(argv, hidden, extra, tmp_path, monkeypatch, capsys):
    """``sys.modules[name] = None`` makes the module unimportable in this process, as if not installed
    (the fresh-venv test in test_distribution.py checks the same with nothing installed)."""
    monkeypatch.setitem(sys.modules, hidden, None)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli([a.format(dir=tmp_path) for a in argv] + (["--out", "r"] if "--suite" in argv else []),
                           capsys)
    assert rc == 2 and out == ""
    assert f"needs the {extra} extra ({hidden} not installed)" in err and 'pip install ".[' in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no report, no model: it stopped up front


def test_make_tiny_model_without_tokenizer_needs_no_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    rc, out, _ = run_cli(["make-tiny-model", str(tmp_path / "m"), "--no-tokenizer"], capsys)
    assert rc == 0 and (tmp_path / "m" / "config.json").is_file() and "config only" in out
