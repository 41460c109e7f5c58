"""The committed real-trace samples, how each is imported, and where the full public traces come from.

The sample files live in ``bench/traces/`` of a source checkout (they are not part of the Python
package, so a wheel does not carry them): seven Claude Code sessions from the kv-cache-tester corpus
(Weka format, Apache-2.0) and the first 1,013 rows of the Mooncake FAST'25 conversation trace
(Apache-2.0). ``bench/traces/README.md`` and the READMEs next to the files give provenance, licences
and statistics. :func:`real_trace_samples` imports them all; ``root`` (or the environment variable
``SGL_AGENTCACHE_TRACES``) points elsewhere, e.g. at a copy shipped with an installed package.

Import parameters, per source:

- **kv-cache-tester** (``weka_*``): :func:`import_weka` with its defaults. Blocks stay at the source's
  64 tokens (``block_tokens`` 64: one v1 block per source hash id, so reuse is exactly the source's);
  the hash scope is ``local``, so sessions share nothing with each other, not even the system prompt.
  ``weka_mix`` is all seven as sessions of one trace, started :data:`WEKA_MIX_STAGGER_S` seconds apart
  so that they overlap (the shortest lasts 517 s): a multi-session workload built from real sessions.
- **Mooncake** (``mooncake_conversation``): :func:`import_mooncake` with 512-token blocks (the source's)
  and ``min_shared_blocks=2``: every row of this trace starts with hash id 0 (a shared 512-token system
  prompt), so a row that shares only that block with an earlier one is not its continuation.

Imports are cached per (root, name, token scale): the first call takes about a second, later ones
nothing; the returned traces are immutable and may be shared.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sgl_agentcache.trace.importers import import_mooncake, import_weka
from sgl_agentcache.trace.schema import Trace
from sgl_agentcache.trace.stats import trace_stats
from sgl_agentcache.trace.transforms import scale_tokens

__all__ = ["PUBLIC_SOURCES", "SAMPLES", "Sample", "default_root", "load_sample", "real_trace_samples",
           "sources_text", "summary_table"]

ROOT_ENV = "SGL_AGENTCACHE_TRACES"
WEKA_MIX_STAGGER_S = 60.0
KV_CACHE_TESTER_FILES = ("trace_0010", "trace_0014", "trace_0019", "trace_0021", "trace_0023", "trace_0024",
                         "trace_0279")


@dataclass(frozen=True)
class Sample:
    """One committed sample: its files (relative to the samples root) and how to import them."""

    name: str
    files: tuple[str, ...]
    format: str  # "weka" or "mooncake"
    options: Mapping = field(default_factory=dict)  # importer keyword arguments
    about: str = ""


def _weka_sample(stem: str) -> Sample:
    return Sample(f"weka_{stem}", (f"kv-cache-tester/{stem}.json.gz",), "weka",
                  about=f"kv-cache-tester traces/{stem}.json: one Claude Code session")


SAMPLES: dict[str, Sample] = {s.name: s for s in (
    *(_weka_sample(stem) for stem in KV_CACHE_TESTER_FILES),
    Sample("weka_mix", tuple(f"kv-cache-tester/{stem}.json.gz" for stem in KV_CACHE_TESTER_FILES), "weka",
           {"stagger_s": WEKA_MIX_STAGGER_S},
           about=f"the seven kv-cache-tester sessions, started {WEKA_MIX_STAGGER_S:g} s apart"),
    Sample("mooncake_conversation", ("mooncake/conversation_trace.first1013.jsonl.gz",), "mooncake",
           {"min_shared_blocks": 2},
           about="Mooncake FAST'25 conversation_trace.jsonl, rows 0-1012 (0-333 s)"),
)}


def default_root() -> Path:
    """``$SGL_AGENTCACHE_TRACES`` if set, else ``bench/traces`` of the source checkout this module is in."""
    env = os.environ.get(ROOT_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "bench" / "traces"


def _import(sample: Sample, root: Path) -> Trace:
    paths = [root / f for f in sample.files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"trace sample {sample.name!r}: missing {', '.join(missing)}. The samples are committed under "
            f"bench/traces/ of the source repository (not in the wheel); pass root= or set ${ROOT_ENV}.")
    importer = import_mooncake if sample.format == "mooncake" else import_weka
    return importer(paths[0] if len(paths) == 1 else paths, name=sample.name, **sample.options)


@functools.lru_cache(maxsize=None)
def _cached(name: str, root: str, token_scale: int) -> Trace:
    trace = _import(SAMPLES[name], Path(root))
    return scale_tokens(trace, token_scale)


def load_sample(name: str, root: str | Path | None = None, *, token_scale: int = 1) -> Trace:
    """One sample, imported and validated (cached). ``token_scale`` divides every token count (see
    :func:`~sgl_agentcache.trace.transforms.scale_tokens`; it must divide the sample's block size: 64
    for ``weka_*``, 512 for ``mooncake_*``)."""
    if name not in SAMPLES:
        raise KeyError(f"unknown trace sample {name!r}; known: {', '.join(SAMPLES)}")
    return _cached(name, str(Path(root or default_root()).resolve()), token_scale)


def real_trace_samples(root: str | Path | None = None, *, names: Iterable[str] | None = None,
                       token_scale: int = 1) -> dict[str, Trace]:
    """Every committed sample (or those in ``names``), by name, in :data:`SAMPLES` order."""
    return {name: load_sample(name, root, token_scale=token_scale) for name in (names or SAMPLES)}


def summary_table(traces: Mapping[str, Trace]) -> str:
    """A Markdown table of the samples: size, lineage, tool-time quantiles, prompt size and reuse."""
    lines = ["| sample | requests | sessions | branches (forks) | tool calls | tool p50 s | tool p99 s "
             "| mean input tokens | ideal reuse |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, trace in traces.items():
        s = trace_stats(trace)
        tools = s["tools"].get("all")
        p50, p99 = (f"{tools['p50_s']:.1f}", f"{tools['p99_s']:.0f}") if tools else ("-", "-")
        lines.append(f"| `{name}` | {s['requests']:,} | {s['sessions']:,} | {s['branches']:,} ({s['forks']}) "
                     f"| {s['tool_calls']:,} | {p50} | {p99} "
                     f"| {s['mean_input_tokens']:,.0f} | {s['ideal_reuse']:.3f} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class PublicSource:
    name: str
    where: str
    licence: str
    what: str
    how: str


PUBLIC_SOURCES = (
    PublicSource(
        "kv-cache-tester corpus (Weka format)", "https://github.com/callanjfox/kv-cache-tester, folder traces/",
        "Apache-2.0",
        "real Claude Code sessions with subagents, tool stops, api/think times and 64-token block hashes "
        "(739 traces, 59,204 requests at commit 94f6046d)",
        "git clone https://github.com/callanjfox/kv-cache-tester; then "
        "sgl-agentcache trace import weka kv-cache-tester/traces/trace_0001.json out.jsonl"),
    PublicSource(
        "Mooncake FAST'25 traces", "https://github.com/kvcache-ai/Mooncake, FAST25-release/traces/",
        "Apache-2.0",
        "conversation, toolagent and synthetic traces: rows {timestamp ms, input_length, output_length, "
        "hash_ids} with 512-token blocks, no session ids",
        "download FAST25-release/traces/*.jsonl; then sgl-agentcache trace import mooncake "
        "conversation_trace.jsonl out.jsonl --min-shared-blocks 2"),
    PublicSource(
        "Qwen-Bailian usage traces", "https://github.com/alibaba-edu/qwen-bailian-usagetraces-anon",
        "Apache-2.0", "anonymised production usage; sessions via parent_chat_id; stored as Git LFS",
        "git clone, then git lfs pull; no importer here yet"),
    PublicSource(
        "TraceLab", "https://github.com/uw-syfi/TraceLab", "CC-BY-4.0",
        "one row per LLM round of frontier coding agents, with per-round tool latencies; a release asset",
        "download the release asset; no importer here yet (aiperf converts TraceLab to the Weka format)"),
)


def sources_text() -> str:
    """Where to obtain the public traces (printed by ``sgl-agentcache trace fetch-free``)."""
    out = []
    for s in PUBLIC_SOURCES:
        out += [f"- {s.name} [{s.licence}]", f"    where: {s.where}", f"    what:  {s.what}",
                f"    how:   {s.how}"]
    return "\n".join(out)
