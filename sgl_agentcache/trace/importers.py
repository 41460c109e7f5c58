"""Importers from public agent traces to trace format v1 (pure: stdlib and msgspec only).

**Weka-style Claude Code traces** (SemiAnalysis ``cc-traces-weka``, the kv-cache-tester / aiperf
schema): one JSON object per trace, ``{id, block_size, hash_id_scope, system_tokens, tool_tokens,
requests[]}``. A call (``type`` ``"n"`` or ``"s"``) has ``t`` (its arrival), ``in``/``input_length``,
``out``/``output_length``, ``hash_ids``, ``api_time`` (server seconds), ``think_time`` (the whole gap
since the previous call ended, rounded), ``stop``, ``model``...; a ``type: "subagent"`` entry has
``agent_id, subagent_type, status, duration_ms, requests[]`` (nested to any depth).

Time basis (verified on the kv-cache-tester sample, ``bench/traces/kv-cache-tester/README.md``): every
``t`` counts from the start of the agent whose ``requests`` list holds it. A subagent entry's own ``t`` is
when it *finished*, in its parent's frame, and it starts ``duration_ms`` earlier: there its calls' ``t``
count from 0. (All seven subagents of the sample start 0.2-1.0 s after the parent call that stopped for
``tool_use`` -- the ``Task`` call -- their calls fit in ``[0, duration]``, the entry sits among the
parent's calls sorted by that ``t``, and the parent's next call comes after it; parallel subagents share
one start.) So a subagent's absolute start is ``parent start + t - duration_ms / 1000`` (clamped at the
parent's start), recursively; without ``duration_ms`` (an async launch) ``t`` is taken as its start.

Mapping:

- a trace is a session; the top level is branch ``main``; a subagent is branch ``sa-<agent_id>`` forked
  from the enclosing agent's branch (``parent_branch`` on all its calls), spawned by that branch's last
  call that arrived at or before the subagent's start;
- the gap between a call's end (``t + api_time``) and the branch's next call is split by what ended the
  call. After ``stop == "tool_use"`` the harness runs the tool and sends the result back on its own, so
  the whole gap is one tool call (class ``subagent`` if the call spawned one, else ``tool``). A call
  that stopped for a tool carries it whether or not the trace has a next call (the client knows it runs
  a tool, not whether the session goes on): the last one's duration is unknown (``None``). The
  client's own turnaround (0.2-1.0 s, the spawn delays above) is inside it, below the 1-s resolution of
  the calls' ``t``; a permission prompt a user answers also hides there and cannot be told apart. After
  any other stop (``end_turn``...) the model handed the turn to the user, so the whole gap is think time.
  ``think_time`` is not used to split: it is that same whole gap, which is why reading it as think time
  left every tool at 0 s;
- a subagent ends at its start plus ``duration_ms`` (at least its last call's end): a ``close_branch``
  event, or an ``abort`` event when its status is failed, cancelled, error, killed, interrupted or timed
  out (the harness knows its subagent returned). The session itself gets no end: a chat session's end is
  not something its client knows when it sends a call (``close_sessions=True`` adds a ``close_session``
  event when the last branch ends, for studies that want one, not for comparisons);
- ``system_tokens + tool_tokens`` (of the trace or of the subagent) is ``stable_prefix_tokens``;
- with ``detect_edits``, a call that keeps some but not all full blocks of the branch's previous call to
  the same model is a context edit (Claude Code's compaction): ``edit_from_tokens`` is the shared part.

**Mooncake FAST'25 traces**: JSON Lines rows ``{timestamp (ms), input_length, output_length,
hash_ids}`` (512-token blocks). The rows carry no sessions, so they are grouped by a heuristic: taken in
time order, a row *continues* the session whose latest request it extends, meaning its ``hash_ids`` begin
with all of that request's ids but the last (the last block may be partial and grow), at least
``min_shared_blocks`` of them, its prompt is longer, and it arrives within ``max_gap_s``; the longest
such match wins, and each session's latest request can be continued once. Anything else starts a new
session. Rows with a ``session_id`` keep it instead. The rows carry no tool calls and no session ends:
whether a row has a later row of its session is the trace's future, which a chat client cannot know when
it sends the row (the gap before the next turn stays in the arrivals).

Block ids: source ids are mapped into ``[0, 2**63)`` by a keyed hash (per trace and model for a
``local`` Weka scope, per model for ``global``), so equal ids stay equal and distinct ids stay distinct
with overwhelming probability. A prompt whose ``hash_ids`` are too few for its length is padded with
request-unique ids (too many: truncated); the header's ``source`` counts these fix-ups. ``block_tokens``
other than the source block size re-blocks: a target block's id hashes the chain of target ids before it
with the source ids it overlaps, so equal source prefixes still give equal target prefixes.

A file whose name ends in ``.gz`` is decompressed first (``trace.json.gz``, ``rows.jsonl.gz``).
Malformed input raises :class:`TraceError` naming the record (``requests[3].requests[0]``, ``row 17``).
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from sgl_agentcache.trace.schema import (
    MAX_BLOCK_ID,
    Event,
    Request,
    ToolCall,
    Trace,
    TraceError,
    TraceHeader,
    validate,
)

__all__ = ["ABORT_STATUSES", "import_mooncake", "import_weka"]

#: Subagent statuses that end the branch with an ``abort`` event rather than a ``close_branch``.
ABORT_STATUSES = frozenset({"failed", "failure", "error", "cancelled", "canceled", "aborted", "killed",
                            "interrupted", "timeout", "timed_out"})

_M64 = (1 << 64) - 1
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9._:\-]")


# ---- shared helpers ----

def _mix(h: int, x: int) -> int:
    """Fold ``x`` into hash state ``h`` (splitmix64 finaliser)."""
    z = (h ^ (x & _M64)) + 0x9E3779B97F4A7C15 & _M64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
    return z ^ (z >> 31)


def _key(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest(), "little")


def _ident(text: str, limit: int) -> str:
    return _BAD_ID_CHARS.sub("_", str(text))[:limit] or "x"


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}-{n}"
    taken.add(out)
    return out


class _Blocks:
    """Maps source ``hash_ids`` of ``source_tokens``-token blocks to v1 blocks of ``block_tokens``."""

    def __init__(self, source_tokens: int, block_tokens: int):
        self.source_tokens, self.block_tokens = source_tokens, block_tokens
        self.fixups = 0
        self._pads = 0
        self._memo: dict[tuple[int, int], int] = {}

    def convert(self, hash_ids: list[int], input_tokens: int, namespace: int) -> list[int]:
        need = -(-input_tokens // self.source_tokens)
        ids = [self._id(namespace, x) for x in hash_ids[:need]]
        if len(hash_ids) != need:  # pad (content unknown: unique to this request) or truncate
            self.fixups += 1
            for _ in range(need - len(ids)):
                self._pads += 1
                ids.append(_mix(_mix(namespace, 0x9AD), self._pads) & MAX_BLOCK_ID)
        if self.block_tokens == self.source_tokens:
            return ids
        out, h, src, dst = [], namespace, self.source_tokens, self.block_tokens
        for j in range(-(-input_tokens // dst)):
            first, last = j * dst // src, (min((j + 1) * dst, input_tokens) - 1) // src
            for x in ids[first:last + 1]:
                h = _mix(h, x)
            h = _mix(h, j)
            out.append(h & MAX_BLOCK_ID)
        return out

    def _id(self, namespace: int, x: int) -> int:
        out = self._memo.get((namespace, x))
        if out is None:
            out = self._memo[(namespace, x)] = _mix(namespace, x) & MAX_BLOCK_ID
        return out


def _number(obj: Mapping, keys: tuple[str, ...], where: str, *, integer: bool, required: bool = True,
            default: float | None = None) -> float | None:
    for key in keys:
        if key in obj and obj[key] is not None:
            value = obj[key]
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0:
                kind = "a non-negative integer" if integer else "a non-negative finite number"
                raise TraceError(f"{where}: field {key!r} must be {kind}, got {value!r}")
            return value
    if required:
        raise TraceError(f"{where}: missing field {' / '.join(repr(k) for k in keys)}")
    return default


def _hash_ids(obj: Mapping, where: str) -> list[int]:
    value = obj.get("hash_ids", [])
    if not isinstance(value, list) or any(type(x) is not int or x < 0 for x in value):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    return value


def _read(path: Path) -> tuple[bytes, str]:
    """A file's bytes (gunzipped for ``.gz``) and the suffix that tells its format (``.jsonl``...)."""
    data = path.read_bytes()
    if path.suffix != ".gz":
        return data, path.suffix
    try:
        return gzip.decompress(data), Path(path.stem).suffix
    except (OSError, EOFError) as exc:
        raise TraceError(f"{path}: not a readable gzip file: {exc}") from None


def _decode(data: bytes, where: str):
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{where}: invalid JSON: {exc}") from None


class _Records:
    """Imported records with their sort keys: time, then creation order (causal within an agent)."""

    def __init__(self) -> None:
        self.items: list[tuple[float, int, Request | Event]] = []

    def add(self, record: Request | Event, order: int | None = None) -> None:
        self.items.append((record.t, len(self.items) if order is None else order, record))

    def trace(self, header: TraceHeader) -> Trace:
        """Sort; a fork whose parent has no call before the fork's first call is imported as an
        independent branch (``parent_branch`` dropped on all its calls); validate."""
        if not 1 <= header.block_tokens <= 4096:
            raise TraceError(f"block_tokens={header.block_tokens} is outside [1, 4096]; pass block_tokens")
        self.items.sort(key=lambda item: (item[0], item[1]))
        parents: dict[tuple[str, str, str], str | None] = {}
        records = []
        for _, _, record in self.items:
            if isinstance(record, Request):
                key = (record.tenant, record.session, record.branch)
                if key not in parents:
                    known = (record.tenant, record.session, record.parent_branch) in parents
                    parents[key] = record.parent_branch if known else None
                if record.parent_branch != parents[key]:
                    record = msgspec.structs.replace(record, parent_branch=parents[key])
            records.append(record)
        return validate(Trace(header=header, records=records))


# ---- Weka ----

@dataclass
class _Leaf:
    t: float  # absolute: seconds from the trace start
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]
    api_s: float
    model: str
    tool_use: bool  # stopped for a tool
    spawns: bool = False  # the tool it stopped for started a subagent


@dataclass
class _Branch:
    name: str
    parent: _Branch | None
    stable: int
    status: str = "completed"
    end_t: float = 0.0  # absolute, from duration_ms (0 for the top level)
    leaves: list[_Leaf] = field(default_factory=list)
    spawn_starts: list[float] = field(default_factory=list)  # absolute starts of its subagents


def import_weka(source, *, tenant: str = "default", block_tokens: int | None = None, stagger_s: float = 0.0,
                detect_edits: bool = True, close_sessions: bool = False, name: str | None = None) -> Trace:
    """Import Weka-style trace(s): a dict, a ``.json`` / ``.jsonl`` file of them (``.gz`` too), or a list
    of dicts and files. ``close_sessions``: end each session with a ``close_session`` event (off: no
    client knows its session's end when it sends a call; see the module doc).

    Several traces become several sessions, the k-th shifted by ``k * stagger_s`` seconds; all must
    share one ``block_size``, which is the header's ``block_tokens`` unless ``block_tokens`` re-blocks.
    """
    where = str(source) if isinstance(source, (str, Path)) else "<weka>"
    if isinstance(source, (list, tuple)) and source and all(isinstance(x, (str, Path)) for x in source):
        where = ", ".join(str(x) for x in source)
    traces = _weka_objects(source)
    if not traces:
        raise TraceError(f"{where}: no traces")
    sizes = [t.get("block_size") if isinstance(t, Mapping) else None for t in traces]
    size = sizes[0]
    if any(s != size for s in sizes) or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise TraceError(f"{where}: every trace needs one positive integer 'block_size', got {sizes[:5]}")
    importer = _WekaImporter(tenant, _Blocks(size, block_tokens or size), detect_edits, close_sessions)
    for index, obj in enumerate(traces):
        importer.session(obj, index, index * stagger_s)
    src = {"importer": "weka", "file": where, "traces": len(traces), "source_block_size": size,
           "hash_fixups": importer.blocks.fixups}
    header = TraceHeader(name=name or (str(traces[0]["id"]) if len(traces) == 1 else "weka"),
                         block_tokens=importer.blocks.block_tokens, source=json.dumps(src, sort_keys=True))
    return importer.out.trace(header)


def _weka_objects(source) -> list:
    if isinstance(source, Mapping):
        return [source]
    if isinstance(source, (str, Path)):
        path = Path(source)
        data, suffix = _read(path)
        if suffix == ".jsonl":
            lines = enumerate(data.splitlines(), 1)
            return [_decode(line, f"{path} line {n}") for n, line in lines if line.strip()]
        obj = _decode(data, str(path))
        return obj if isinstance(obj, list) else [obj]
    return [obj for item in source for obj in (_weka_objects(item) if isinstance(item, (str, Path)) else [item])]


def _stable_tokens(obj: Mapping, where: str) -> int:
    return sum(int(_number(obj, (key,), where, integer=True, required=False, default=0))
               for key in ("system_tokens", "tool_tokens"))


class _WekaImporter:
    def __init__(self, tenant: str, blocks: _Blocks, detect_edits: bool, close_sessions: bool):
        self.tenant, self.blocks, self.detect_edits = tenant, blocks, detect_edits
        self.close_sessions = close_sessions
        self.out = _Records()
        self.sessions: set[str] = set()

    def session(self, obj, index: int, offset: float) -> None:
        """One trace: walk it into branches, then emit each branch and the session's end."""
        if not isinstance(obj, Mapping):
            raise TraceError(f"weka trace {index}: expected a JSON object")
        if not isinstance(obj.get("id"), str) or not isinstance(obj.get("requests"), list):
            raise TraceError(f"weka trace {index}: needs a string 'id' and a 'requests' list")
        where = f"weka trace {obj['id']!r}"
        scope = obj.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceError(f"{where}: hash_id_scope must be 'local' or 'global', got {scope!r}")
        branches = [_Branch("main", None, _stable_tokens(obj, where))]
        self._walk(obj["requests"], branches[0], f"{where} requests", branches, {"main"}, base=0.0)
        session = _unique(_ident(obj["id"], 64), self.sessions)
        scope_key = f"{index}:{obj['id']}" if scope == "local" else ""
        ends = [self._branch(b, session, offset, scope_key) for b in branches if b.leaves]
        if ends and self.close_sessions:
            self.out.add(Event(t=max(ends), kind="close_session", tenant=self.tenant, session=session))

    def _walk(self, entries: list, branch: _Branch, where: str, branches: list[_Branch],
              names: set[str], base: float) -> None:
        """Collect ``entries`` into ``branch`` (subagents into new branches); ``base`` is when the agent
        that owns ``entries`` started, in seconds from the trace start: its entries' ``t`` count from it."""
        for i, entry in enumerate(entries):
            at = f"{where}[{i}]"
            if not isinstance(entry, Mapping):
                raise TraceError(f"{at}: expected an object")
            t = _number(entry, ("t",), at, integer=False)
            if entry.get("type") == "subagent":
                agent = entry.get("agent_id")
                if not isinstance(agent, (str, int)) or not isinstance(entry.get("requests"), list):
                    raise TraceError(f"{at}: a subagent needs 'agent_id' and a 'requests' list")
                duration_s = _number(entry, ("duration_ms",), at, integer=False, required=False,
                                     default=0.0) / 1000.0
                # t is when it finished (module doc); microseconds: the sources give ms, sums must not drift
                start = round(base + max(0.0, t - duration_s), 6)
                child = _Branch(_unique(f"sa-{_ident(agent, 40)}", names), branch, _stable_tokens(entry, at),
                                status=str(entry.get("status") or "completed").lower(),
                                end_t=round(start + duration_s, 6))
                branch.spawn_starts.append(start)
                branches.append(child)
                self._walk(entry["requests"], child, f"{at}.requests", branches, names, base=start)
            elif entry.get("type", "n") in ("n", "s"):
                _number(entry, ("think_time",), at, integer=False, required=False)  # checked, not used
                branch.leaves.append(_Leaf(
                    t=round(base + t, 6), input_tokens=int(_number(entry, ("in", "input_length"), at, integer=True)),
                    output_tokens=int(_number(entry, ("out", "output_length"), at, integer=True)),
                    hash_ids=_hash_ids(entry, at),
                    api_s=_number(entry, ("api_time",), at, integer=False, required=False, default=0.0),
                    model=str(entry.get("model", "")), tool_use=entry.get("stop") == "tool_use"))
            else:
                raise TraceError(f"{at}: unknown entry type {entry.get('type')!r}")

    def _branch(self, branch: _Branch, session: str, offset: float, scope_key: str) -> float:
        """Emit the branch's calls and, for a subagent, its end event; return when the branch ended."""
        leaves = sorted(branch.leaves, key=lambda leaf: leaf.t)  # stable: recorded order on ties
        arrivals = [leaf.t for leaf in leaves]
        for start in branch.spawn_starts:  # the spawning call: the last one that arrived by the start
            k = bisect.bisect_right(arrivals, start) - 1
            if k >= 0:
                leaves[k].spawns = True
        parent = branch.parent
        while parent is not None and not parent.leaves:
            parent = parent.parent
        previous: dict[str, _Leaf] = {}
        end = 0.0
        for k, leaf in enumerate(leaves):
            tool, think = _gap(leaf, leaves[k + 1] if k + 1 < len(leaves) else None)
            edit_from = _edit_from(previous.get(leaf.model), leaf, self.blocks.source_tokens)
            previous[leaf.model] = leaf
            blocks = self.blocks.convert(leaf.hash_ids, leaf.input_tokens, _key(scope_key, leaf.model))
            self.out.add(Request(
                id=f"{session}.{branch.name}.{k}", t=offset + leaf.t, tenant=self.tenant, session=session,
                branch=branch.name, parent_branch=None if parent is None else parent.name, blocks=blocks,
                input_tokens=leaf.input_tokens, output_tokens=leaf.output_tokens,
                stable_prefix_tokens=min(branch.stable, leaf.input_tokens), tool=tool, think_s=think,
                edit_from_tokens=edit_from if self.detect_edits else None))
            end = max(end, offset + leaf.t + leaf.api_s)
        if branch.parent is not None:
            end = max(end, offset + branch.end_t)
            kind = "abort" if branch.status in ABORT_STATUSES else "close_branch"
            self.out.add(Event(t=end, kind=kind, tenant=self.tenant, session=session, branch=branch.name))
        return end


def _gap(leaf: _Leaf, nxt: _Leaf | None) -> tuple[ToolCall | None, float]:
    """The gap from ``leaf``'s end to the branch's next call: all tool time if ``leaf`` stopped for a tool
    (or spawned a subagent), else all think time (why: the module doc). A tool is there whether or not
    a next call is (its duration is then unknown): the client knows it runs one, not what follows."""
    tool_class = "subagent" if leaf.spawns else "tool" if leaf.tool_use else None
    if nxt is None:
        return (None if tool_class is None else ToolCall(tool_class=tool_class, duration_s=None)), 0.0
    gap = max(0.0, nxt.t - leaf.t - leaf.api_s)  # 0 when rounding of t makes the next call look early
    if tool_class is not None:
        return ToolCall(tool_class=tool_class, duration_s=gap), 0.0
    return None, gap


def _edit_from(prev: _Leaf | None, leaf: _Leaf, source_tokens: int) -> int | None:
    """Tokens kept by a context edit: some, but not all, of the previous call's full blocks."""
    if prev is None:
        return None
    full = min(len(prev.hash_ids), prev.input_tokens // source_tokens)
    common = 0
    for a, b in zip(prev.hash_ids, leaf.hash_ids):
        if a != b:
            break
        common += 1
    return min(common * source_tokens, leaf.input_tokens) if 0 < common < full else None


# ---- Mooncake ----

@dataclass
class _Row:
    index: int
    t_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]
    session: str | None


def import_mooncake(source, *, block_size: int = 512, block_tokens: int | None = None,
                    tenant: str = "default", max_gap_s: float = 600.0, min_shared_blocks: int = 1,
                    name: str = "mooncake") -> Trace:
    """Import Mooncake rows (a ``.jsonl`` path or an iterable of dicts), grouping them into sessions.

    Rows are numbered from 0 in source order (in a file: the 0-based line). Times become seconds from
    the first row. No row carries a tool call or a close (see the module doc): a client cannot know
    whether its session goes on.
    """
    where = str(source) if isinstance(source, (str, Path)) else "<rows>"
    rows = sorted(_mooncake_rows(source), key=lambda r: (r.t_ms, r.index))
    if not rows:
        raise TraceError(f"{where}: no rows")
    sessions = _group(rows, max_gap_s * 1000.0, min_shared_blocks)
    blocks = _Blocks(block_size, block_tokens or block_size)
    namespace, t0, out = _key("mooncake"), rows[0].t_ms, _Records()
    for session, members in sessions.items():
        for row in members:
            out.add(Request(
                id=f"r{row.index}", t=(row.t_ms - t0) / 1000.0, tenant=tenant, session=session,
                blocks=blocks.convert(row.hash_ids, row.input_tokens, namespace),
                input_tokens=row.input_tokens, output_tokens=row.output_tokens), order=row.index)
    src = {"importer": "mooncake", "file": where, "rows": len(rows), "sessions": len(sessions),
           "source_block_size": block_size, "max_gap_s": max_gap_s, "min_shared_blocks": min_shared_blocks,
           "hash_fixups": blocks.fixups}
    header = TraceHeader(name=name, block_tokens=blocks.block_tokens, source=json.dumps(src, sort_keys=True))
    return out.trace(header)


def _mooncake_rows(source) -> Iterable[_Row]:
    if isinstance(source, (str, Path)):
        lines = enumerate(_read(Path(source))[0].splitlines())
        objs = ((n, _decode(line, f"mooncake row {n} ({source} line {n + 1})")) for n, line in lines
                if line.strip())
    else:
        objs = enumerate(source)
    for index, obj in objs:
        where = f"mooncake row {index}"
        if not isinstance(obj, Mapping):
            raise TraceError(f"{where}: expected a JSON object")
        session = obj.get("session_id")
        if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
            raise TraceError(f"{where}: field 'session_id' must be a string or an integer")
        yield _Row(index=index, t_ms=_number(obj, ("timestamp",), where, integer=False),
                   input_tokens=int(_number(obj, ("input_length",), where, integer=True)),
                   output_tokens=int(_number(obj, ("output_length",), where, integer=True)),
                   hash_ids=_hash_ids(obj, where), session=None if session is None else str(session))


def _group(rows: list[_Row], max_gap_ms: float, min_shared_blocks: int) -> dict[str, list[_Row]]:
    """Sessions by the continuation heuristic of the module doc (``session_id`` wins where present)."""
    sessions: dict[str, list[_Row]] = {}
    names: set[str] = set()
    explicit: dict[str, str] = {}
    tails: dict[int, list[str]] = {}  # chain hash of a latest request's continuable prefix -> sessions
    for row in rows:
        if row.session is not None:
            if row.session not in explicit:
                explicit[row.session] = _unique(_ident(f"m-{row.session}", 64), names)
            sessions.setdefault(explicit[row.session], []).append(row)
            continue
        chain, h = [], 0
        for x in row.hash_ids:
            h = _mix(h, x)
            chain.append(h)
        name = _continued(row, chain, tails, sessions, max_gap_ms, min_shared_blocks)
        if name is None:
            name = _unique(f"m{row.index}", names)
            sessions[name] = []
        sessions[name].append(row)
        keep = max(len(row.hash_ids) - 1, 1)
        if len(row.hash_ids) >= max(keep, min_shared_blocks):
            tails.setdefault(chain[keep - 1], []).append(name)
    return sessions


def _continued(row: _Row, chain: list[int], tails: dict[int, list[str]], sessions: dict[str, list[_Row]],
               max_gap_ms: float, min_shared_blocks: int) -> str | None:
    """The session this row continues (taking that session's tail entry), or None for a new session."""
    for length in range(len(chain), max(min_shared_blocks, 1) - 1, -1):
        for name in reversed(tails.get(chain[length - 1], ())):
            last = sessions[name][-1]
            if (max(len(last.hash_ids) - 1, 1) == length and row.input_tokens > last.input_tokens
                    and row.t_ms - last.t_ms <= max_gap_ms
                    and last.hash_ids[:length] == row.hash_ids[:length]):
                tails[chain[length - 1]].remove(name)
                return name
    return None
