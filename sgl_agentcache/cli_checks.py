"""What every ``sgl-agentcache`` subcommand shares: flag validators, the user-error type, extras checks.

Contracts:

- The validators are argparse ``type=`` callables: they return the parsed value or raise
  :class:`argparse.ArgumentTypeError` with a message that names what was expected and what was given,
  so argparse reports ``argument --scale: must be a number > 0, got '-1'`` and exits 2.
- :class:`UsageError` is a mistake the user can fix (a missing extra, a busy port, ...): the CLI prints
  its message as one line on stderr and exits 2, without a traceback.
- :func:`require_extras` checks, before a command does any work, that the optional packages it needs are
  installed, and otherwise raises :class:`MissingExtra` naming the extra to install.

Only the standard library is imported at module level (the CLI must start without torch or SGLang).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable

#: Optional extras (pyproject ``[project.optional-dependencies]``) -> the modules a command imports from them.
#: ``sgl_kernel`` is SGLang's kernel package (``sglang-kernel`` on GPU; a placeholder from ``cpu-setup`` on CPU).
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("sglang", "torch", "sgl_kernel", "tokenizers"),
    "bench": ("matplotlib", "scipy"),
}
#: Size of generated traces (a multiple of each workload's default session count) for ``trace gen`` and
#: ``replay``: the same default for both, so a generated file replays like ``replay --workload``.
DEFAULT_TRACE_SCALE = 0.1

INSTALL_HINT = ('in a source checkout: pip install ".[{extras}]" (or pip install "sgl-agentcache[{extras}] @ '
                'git+<repository URL>"); on a machine without a GPU: make setup (or, next to a CPU torch '
                'and SGLang, sgl-agentcache cpu-setup)')


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported as one line on stderr, exit status 2."""


class MissingExtra(UsageError):
    """A command needs an optional extra that is not installed."""


def missing_modules(*extras: str) -> dict[str, list[str]]:
    """For each extra, the modules of it that cannot be found (without importing anything)."""
    out = {}
    for extra in extras:
        missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
        if missing:
            out[extra] = missing
    return out


def require_extras(command: str, *extras: str, only: tuple[str, ...] | None = None) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extras`` (or of them, those in ``only``) is installed.

    Call it before the command does any work. The message names the command, the missing modules and
    the extras to install, e.g. ``replay --suite needs the 'bench' extra (matplotlib, scipy not
    installed): in a source checkout: pip install ".[bench]" ...``.
    """
    missing = {e: [m for m in ms if only is None or m in only] for e, ms in missing_modules(*extras).items()}
    missing = {e: ms for e, ms in missing.items() if ms}
    if not missing:
        return
    names = sorted(missing)
    modules = ", ".join(m for e in names for m in missing[e])
    what = " and ".join(f"'{e}'" for e in names)
    raise MissingExtra(f"{command} needs the {what} extra{'s' if len(names) > 1 else ''} ({modules} not installed): "
                       + INSTALL_HINT.format(extras=",".join(names)))


# ---- argparse type= validators ----

def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def tcp_port(text: str) -> int:
    value = _number(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1-65535, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> ``(1, 2, 3)``; anything else (``"a,b"``, ``"1,,2"``, ``""``) is refused."""
    items = [s.strip() for s in text.split(",")]
    try:
        if not all(items):
            raise ValueError
        return tuple(int(s) for s in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 1,2,3), got {text!r}") from None


def workload_name(text: str) -> str:
    """A generated workload class (a key of :data:`sgl_agentcache.trace.generators.WORKLOADS`)."""
    from sgl_agentcache.trace.generators import WORKLOADS

    if text not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {text!r}; choose from {', '.join(WORKLOADS)}")
    return text


def suite_workload_list(text: str) -> tuple[str, ...]:
    """Comma-separated workloads of the replay suite: generated classes and real-trace workloads."""
    from sgl_agentcache.sim.suite import REAL_WORKLOADS
    from sgl_agentcache.trace.generators import WORKLOADS

    known = [*WORKLOADS, *REAL_WORKLOADS]
    names = tuple(s.strip() for s in text.split(","))
    unknown = [n for n in names if n not in known]
    if unknown or not all(names):
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(map(repr, unknown)) or repr(text)}; "
                                         f"choose from {', '.join(known)}")
    return names


def builtin_profiles() -> list[str]:
    from sgl_agentcache.policy.profiles import PROFILES

    return list(PROFILES)


def profile_name(text: str) -> str:
    """A built-in profile name or a valid profile file; returns the text (load it with ``resolve_profile``)."""
    from sgl_agentcache.policy.profiles import ProfileError, resolve_profile

    try:
        resolve_profile(text)
    except (ProfileError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def keep_text(check: Callable[[str], object]) -> Callable[[str], str]:
    """A validator that checks ``text`` with ``check`` and returns the text unchanged."""

    def validate(text: str) -> str:
        check(text)
        return text

    validate.__name__ = check.__name__
    return validate


#: Validators the CLI attaches to these flags wherever a subcommand declares them without one
#: (see :func:`attach_shared_checks`). A flag whose value stays text keeps its text (:func:`keep_text`).
SHARED_FLAG_CHECKS: dict[str, Callable[[str], object]] = {
    "--seeds": int_list,
    "--real-seeds": int_list,
    "--scale": positive_float,
    "--workload": workload_name,
    "--workloads": suite_workload_list,
    "--profile": profile_name,
    "--workers": positive_int,
    "--pool-tokens": positive_int,
    "--host": non_negative_float,
    "--port": tcp_port,
}


def attach_shared_checks(parser: argparse.ArgumentParser) -> None:
    """Give ``parser``'s flags named in :data:`SHARED_FLAG_CHECKS` their validator, where they have none.

    For subcommands whose arguments are declared elsewhere (``replay``): a flag declared with its own
    validator keeps it; a plain-text flag (no ``type``) is validated but keeps its text, so the code that
    reads it is unaffected; a plain ``int``/``float`` flag gets the checked number. A ``--profile`` flag's
    help gains the list of built-in profiles if it does not name them.
    """
    for action in parser._actions:  # argparse has no public accessor for a parser's actions
        for flag in action.option_strings:
            check = SHARED_FLAG_CHECKS.get(flag)
            if check is None:
                continue
            if action.type in (None, str):
                action.type = keep_text(check)
            elif action.type in (int, float):
                action.type = check
            if flag == "--profile" and action.help and not all(p in action.help for p in builtin_profiles()):
                action.help = f"{action.help} (built-ins: {', '.join(builtin_profiles())})"
