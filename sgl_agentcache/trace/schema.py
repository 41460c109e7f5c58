"""Trace format v1: agent trajectories without payloads, for replay against the real cache.

A trace is a header plus records in arrival order. Token content is given as *block ids*: the prompt
of a request is ``blocks`` (each ``header.block_tokens`` tokens, the last possibly partial), so two
requests share a prefix exactly when their block lists share a prefix, and no text or token payload is
ever stored. A replayer expands a block id to concrete token ids deterministically (``block_token_ids``),
always below the model's vocabulary.

Records:

- :class:`Request` -- one model call of a branch of a session (trajectory): arrival time, tenant,
  session/branch/parent, the prompt's blocks and length, output length, the stable-prefix and fork-point
  lengths, ``edit_from_tokens`` when *this* prompt rewrote the branch's history from that offset (as
  in the lifecycle hint), and what follows the call: a tool call (class and duration) and/or think
  time before the branch's next call, or the branch's end (``close``). ``hints`` says where the
  lifecycle fields came from: ``explicit`` (the harness sent them: our header or ``kv_hints``) or
  ``inferred`` (the server inferred them from a plain chat request, ``AGENTCACHE_INFER=chat``; such a
  record carries no close, which the server never infers (its idle closes are its own), and a replay
  sends it marked inferred, so a fork of an unknown parent runs as a branch of its own instead of
  being refused).
- :class:`Event` -- a termination the harness signals without a model call: close of a branch or a
  session, or an abort.

Files: JSON Lines (``.jsonl``: header line, then one record per line) or msgpack (``.msgpack``: one
``Trace`` object). Both decode through msgspec into these types; :func:`validate` then checks what the
types cannot (time order, lineage, ranges) and names the offending record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

import msgspec

TRACE_VERSION = 1
#: Block ids are opaque 63-bit integers (hashes or synthetic ids).
MAX_BLOCK_ID = (1 << 63) - 1

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]{1,128}\Z")]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


class TraceError(ValueError):
    """A trace is malformed; the message names the record (index and id) and the field."""


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool the branch ran after a model call, before its next call. ``duration_s`` is None when the
    trace ends before the tool returns (the client knew it ran a tool, not how long it would take)."""

    tool_class: _Id
    duration_s: _Seconds | None


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="request"):
    """One model call."""

    id: _Id
    t: _Seconds  # arrival, seconds since trace start
    tenant: _Id = "default"
    session: _Id
    branch: _Id = "main"
    parent_branch: _Id | None = None
    blocks: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]]
    input_tokens: _NonNeg
    output_tokens: _NonNeg
    stable_prefix_tokens: _NonNeg = 0
    fork_point_tokens: _NonNeg | None = None  # a fork's prefix inherited from its parent
    tool: ToolCall | None = None
    think_s: _Seconds = 0.0
    edit_from_tokens: _NonNeg | None = None
    close: bool = False  # the branch ends after this call
    hints: Literal["explicit", "inferred"] = "explicit"


class Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="event"):
    """A termination without a model call."""

    t: _Seconds
    kind: Literal["close_branch", "close_session", "abort"]
    tenant: _Id = "default"
    session: _Id
    branch: _Id = "main"


Record = Union[Request, Event]


class TraceHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="header"):
    version: int = TRACE_VERSION
    name: str = ""
    block_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    source: str = ""  # generator parameters or the importer and file it came from


class Trace(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    header: TraceHeader
    records: list[Record]

    @property
    def requests(self) -> list[Request]:
        return [r for r in self.records if isinstance(r, Request)]


def _where(index: int, record: Record) -> str:
    ident = record.id if isinstance(record, Request) else f"{record.kind} {record.session}/{record.branch}"
    return f"record {index} ({ident})"


def validate(trace: Trace) -> Trace:
    """Check the field constraints and what the types cannot; raise :class:`TraceError` naming the
    first bad record. Traces built in code get the same range checks as decoded files."""
    try:
        msgspec.convert(msgspec.to_builtins(trace), Trace)
    except msgspec.ValidationError as exc:
        raise TraceError(f"invalid trace: {exc}") from None
    if trace.header.version != TRACE_VERSION:
        raise TraceError(f"trace version {trace.header.version} is not supported (expected {TRACE_VERSION})")
    block = trace.header.block_tokens
    parents: dict[tuple[str, str, str], str | None] = {}
    seen_branches: set[tuple[str, str, str]] = set()
    closed: set[tuple[str, str, str]] = set()
    ids: set[str] = set()
    last_t = 0.0
    for index, record in enumerate(trace.records):
        where = _where(index, record)
        if record.t < last_t:
            raise TraceError(f"{where}: time goes backwards ({record.t} < {last_t})")
        last_t = record.t
        key = (record.tenant, record.session, record.branch)
        if isinstance(record, Event):
            if key not in seen_branches and record.kind != "close_session":
                raise TraceError(f"{where}: {record.kind} of unknown branch {record.session}/{record.branch}")
            if record.kind == "close_session":
                closed |= {b for b in seen_branches if b[:2] == key[:2]}
            else:
                closed.add(key)
            continue
        if record.id in ids:
            raise TraceError(f"{where}: duplicate request id")
        ids.add(record.id)
        if key in closed:
            raise TraceError(f"{where}: branch {record.session}/{record.branch} was already closed")
        if record.parent_branch is not None:
            parent = (record.tenant, record.session, record.parent_branch)
            if parent not in seen_branches:
                raise TraceError(f"{where}: unknown parent branch {record.parent_branch}")
            if parent == key:
                raise TraceError(f"{where}: a branch cannot be its own parent")
        if parents.setdefault(key, record.parent_branch) != record.parent_branch:
            raise TraceError(f"{where}: parent_branch changed from {parents[key]} to {record.parent_branch}")
        expected_blocks = -(-record.input_tokens // block)
        if len(record.blocks) != expected_blocks:
            raise TraceError(f"{where}: {len(record.blocks)} blocks for {record.input_tokens} input tokens "
                             f"(expected {expected_blocks} of {block} tokens)")
        if record.hints == "inferred" and record.close:
            raise TraceError(f"{where}: an inferred record carries no close")
        if record.fork_point_tokens is not None and record.parent_branch is None:
            raise TraceError(f"{where}: fork_point_tokens without parent_branch")
        for name in ("stable_prefix_tokens", "fork_point_tokens", "edit_from_tokens"):
            value = getattr(record, name)
            if value is not None and value > record.input_tokens:
                raise TraceError(f"{where}: {name}={value} is past the {record.input_tokens}-token prompt")
        seen_branches.add(key)
        if record.close:
            closed.add(key)
    return trace


# ---- files ----

_JSONL_LINE = msgspec.json.Decoder(Union[TraceHeader, Request, Event])


def dumps_jsonl(trace: Trace) -> bytes:
    enc = msgspec.json.Encoder()
    return b"".join(enc.encode(item) + b"\n" for item in [trace.header, *trace.records])


def loads_jsonl(data: bytes) -> Trace:
    lines = [line for line in data.splitlines() if line.strip()]
    if not lines:
        raise TraceError("empty trace")
    items = []
    for number, line in enumerate(lines, start=1):
        try:
            items.append(_JSONL_LINE.decode(line))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise TraceError(f"line {number}: {exc}") from None
    header, records = items[0], items[1:]
    if not isinstance(header, TraceHeader):
        raise TraceError("line 1: the first line must be the trace header")
    if any(isinstance(r, TraceHeader) for r in records):
        raise TraceError("a trace has exactly one header, on line 1")
    return validate(Trace(header=header, records=records))


def dumps_msgpack(trace: Trace) -> bytes:
    return msgspec.msgpack.encode(trace)


def loads_msgpack(data: bytes) -> Trace:
    try:
        return validate(msgspec.msgpack.decode(data, type=Trace))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TraceError(f"invalid msgpack trace: {exc}") from None


def save(trace: Trace, path: str | Path) -> None:
    path = Path(path)
    validate(trace)
    path.write_bytes(dumps_msgpack(trace) if path.suffix == ".msgpack" else dumps_jsonl(trace))


def load(path: str | Path) -> Trace:
    """Read and validate a trace file (``.msgpack``, else JSON lines).

    Raises :class:`TraceError` whose message starts with the path, or ``OSError`` when it cannot be read.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return loads_msgpack(data) if path.suffix == ".msgpack" else loads_jsonl(data)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def block_token_ids(block_id: int, block_tokens: int, vocab_size: int, *, reserved: int = 3) -> list[int]:
    """The token ids a block stands for: deterministic, and always in ``[reserved, vocab_size)``.

    Replays against a real server must never send an id at or above the vocabulary (SGLang 0.5.23
    does not range-check and dies); ids below ``reserved`` (pad/bos/eos) are never produced.
    """
    span = vocab_size - reserved
    if span <= 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no usable token ids")
    x = block_id & MAX_BLOCK_ID
    out = []
    for _ in range(block_tokens):
        x = (x * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)  # an LCG step (Knuth MMIX)
        out.append(reserved + (x >> 33) % span)
    return out
