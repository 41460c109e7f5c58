"""The committed real-trace samples (bench/traces/): integrity, import, time basis on real data, the
Mooncake session grouping, the loader API, the token-scale transform and ``trace fetch-free``.

Everything here is pure (no SGLang process): the real files, the real importers and the real CLI."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from sgl_agentcache.cli import main
from sgl_agentcache.trace.importers import import_mooncake
from sgl_agentcache.trace.samples import (
    KV_CACHE_TESTER_FILES,
    ROOT_ENV,
    SAMPLES,
    default_root,
    load_sample,
    real_trace_samples,
    summary_table,
)
from sgl_agentcache.trace.schema import Event, Request, TraceError, load, validate
from sgl_agentcache.trace.stats import ideal_reuse, trace_stats
from sgl_agentcache.trace.transforms import scale_tokens

ROOT = Path(__file__).resolve().parents[1] / "bench" / "traces"


def _weka_source(stem: str) -> dict:
    return json.loads(gzip.decompress((ROOT / "kv-cache-tester" / f"{stem}.json.gz").read_bytes()))


def _calls(entries: list) -> int:
    return sum(_calls(e["requests"]) if e.get("type") == "subagent" else 1 for e in entries)


def test_committed_files_match_their_checksums():
    lines = (ROOT / "SHA256SUMS").read_text().splitlines()
    listed = {name: digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}
    on_disk = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.gz")}
    assert set(listed) == on_disk
    for name, digest in listed.items():
        assert hashlib.sha256((ROOT / name).read_bytes()).hexdigest() == digest, name
    for folder in ("kv-cache-tester", "mooncake"):
        assert "Apache License" in (ROOT / folder / "LICENSE").read_text()[:200]


def test_default_root_is_this_checkout(monkeypatch):
    monkeypatch.delenv(ROOT_ENV, raising=False)
    assert default_root() == ROOT


def test_every_sample_imports_and_validates():
    traces = real_trace_samples()
    assert list(traces) == list(SAMPLES)
    for name, trace in traces.items():
        assert validate(trace) is trace and trace.header.name == name
        assert trace.requests and all(len(r.blocks) > 0 for r in trace.requests)
    for stem in KV_CACHE_TESTER_FILES:  # nothing dropped: one request per call, nested ones included
        assert len(traces[f"weka_{stem}"].requests) == _calls(_weka_source(stem)["requests"])
    assert len(traces["weka_mix"].requests) == sum(len(traces[f"weka_{s}"].requests) for s in KV_CACHE_TESTER_FILES)
    assert len(traces["mooncake_conversation"].requests) == 1013
    assert load_sample("weka_trace_0010") is traces["weka_trace_0010"]  # cached


def test_weka_samples_report_real_tool_times():
    """The issue-18 symptom: tool p50 was 0 because tool time was read as think time."""
    for stem in KV_CACHE_TESTER_FILES:
        stats = trace_stats(load_sample(f"weka_{stem}"))
        tools = stats["tools"]["all"]
        assert tools["count"] >= 0.8 * stats["requests"] - 2  # nearly every call stops for a tool
        assert 1.0 < tools["p50_s"] < 60.0 and tools["p50_s"] <= tools["p99_s"], stem


def test_weka_subagents_run_inside_their_spawning_calls_tool_gap():
    """The time basis on real data: each subagent starts after the parent call that spawned it and
    ends before the parent's next call -- true only with nested times read relative to their agent."""
    forks = 0
    for stem in KV_CACHE_TESTER_FILES:
        trace = load_sample(f"weka_{stem}")
        calls: dict[str, list[Request]] = defaultdict(list)
        for r in trace.requests:
            calls[r.branch].append(r)
        ends = {e.branch: e.t for e in trace.records if isinstance(e, Event) and e.kind == "close_branch"}
        for branch, mine in calls.items():
            if mine[0].parent_branch is None:
                continue
            forks += 1
            parent = calls[mine[0].parent_branch]
            k = max(i for i, p in enumerate(parent) if p.t <= mine[0].t)
            spawner, resume = parent[k], parent[k + 1]
            assert spawner.tool is not None and spawner.tool.tool_class == "subagent", (stem, branch)
            assert spawner.t < mine[0].t <= mine[-1].t <= ends[branch] < resume.t, (stem, branch)
            assert spawner.tool.duration_s < resume.t - spawner.t
    assert forks == 7


def test_mooncake_slice_groups_rows_into_sessions():
    trace = load_sample("mooncake_conversation")
    stats = trace_stats(trace)
    assert stats["requests"] == 1013 and stats["sessions"] == 834 and stats["forks"] == 0
    sessions: dict[str, list[Request]] = defaultdict(list)
    for r in trace.requests:
        sessions[r.session].append(r)
    assert Counter(len(v) for v in sessions.values()) == {1: 703, 2: 95, 3: 28, 4: 6, 5: 1, 7: 1}
    for turns in sessions.values():
        for prev, nxt in zip(turns, turns[1:]):  # a continuation extends the previous turn's prompt
            assert nxt.t > prev.t and nxt.input_tokens > prev.input_tokens
            assert nxt.blocks[: len(prev.blocks) - 1] == prev.blocks[:-1] and len(prev.blocks) >= 3
        # A chat client cannot know whether its session goes on: no row pauses or closes (issue #39).
        assert not any(r.tool is not None or r.close for r in turns)
    # Every row of this trace starts with the same block: linking on it alone merges unrelated chats.
    loose = import_mooncake(ROOT / "mooncake" / "conversation_trace.first1013.jsonl.gz")
    assert trace_stats(loose)["sessions"] < 834
    assert len({r.blocks[0] for r in trace.requests}) == 1


def test_summary_table_in_readme_is_current():
    readme = (ROOT / "README.md").read_text()
    assert summary_table(real_trace_samples()) in readme


def test_load_sample_errors(tmp_path, monkeypatch):
    with pytest.raises(KeyError, match="unknown trace sample 'nope'"):
        load_sample("nope")
    with pytest.raises(FileNotFoundError, match="bench/traces/ of the source repository"):
        load_sample("weka_trace_0019", tmp_path)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    assert default_root() == tmp_path
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        real_trace_samples(names=["mooncake_conversation"])


def test_scale_tokens_keeps_the_reuse_structure():
    trace = load_sample("weka_trace_0279")
    small = scale_tokens(trace, 16)
    assert load_sample("weka_trace_0279", token_scale=16) == small
    assert small.header.block_tokens == 4 and json.loads(small.header.source)["token_scale"] == 16
    for a, b in zip(trace.records, small.records, strict=True):
        assert a.t == b.t and type(a) is type(b)
        if isinstance(a, Request):
            assert b.blocks == a.blocks and b.tool == a.tool and b.parent_branch == a.parent_branch
            assert b.input_tokens == -(-a.input_tokens // 16) and b.output_tokens == -(-a.output_tokens // 16)
            assert (b.edit_from_tokens is None) == (a.edit_from_tokens is None)
            assert b.stable_prefix_tokens <= b.input_tokens
    assert ideal_reuse(small) == pytest.approx(ideal_reuse(trace), abs=0.01)
    assert scale_tokens(trace, 1) is trace
    with pytest.raises(TraceError, match="does not divide"):
        scale_tokens(trace, 3)
    with pytest.raises(TraceError, match="positive integer"):
        scale_tokens(trace, 0)


def test_cli_fetch_free_documents_sources_without_downloading(capsys):
    assert main(["trace", "fetch-free"]) == 0
    out = capsys.readouterr().out
    assert "downloads nothing" in out
    for needle in ("github.com/callanjfox/kv-cache-tester", "github.com/kvcache-ai/Mooncake",
                   "qwen-bailian-usagetraces-anon", "uw-syfi/TraceLab", "CC-BY-4.0", *SAMPLES):
        assert needle in out
    assert main(["trace", "fetch-free", "--list"]) == 0
    assert summary_table(real_trace_samples()) in capsys.readouterr().out


def test_cli_fetch_free_writes_v1_traces(tmp_path, capsys):
    assert main(["trace", "fetch-free", "--out", str(tmp_path), "--format", "msgpack"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.msgpack" for n in SAMPLES)
    assert load(tmp_path / "mooncake_conversation.msgpack") == load_sample("mooncake_conversation")
    capsys.readouterr()
    assert main(["trace", "stats", str(tmp_path / "weka_trace_0010.msgpack")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tools"]["all"]["p50_s"] > 1.0 and stats["forks"] == 4


def test_cli_import_reads_gzip_and_min_shared_blocks(tmp_path, capsys):
    src = ROOT / "mooncake" / "conversation_trace.first1013.jsonl.gz"
    assert main(["trace", "import", "mooncake", str(src), str(tmp_path / "m.jsonl"), "--min-shared-blocks", "2"]) == 0
    assert "834 sess" in capsys.readouterr().out
    assert load(tmp_path / "m.jsonl").records == load_sample("mooncake_conversation").records
    assert main(["trace", "import", "weka", str(ROOT / "kv-cache-tester" / "trace_0014.json.gz"),
                 str(tmp_path / "w.msgpack")]) == 0
    assert load(tmp_path / "w.msgpack").records == load_sample("weka_trace_0014").records
