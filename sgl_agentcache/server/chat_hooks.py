"""Chat inference wired into SGLang's OpenAI chat route (HTTP process; ``AGENTCACHE_INFER=chat``).

The rules live in :mod:`sgl_agentcache.chat_infer`; this module is the SGLang coupling:

- After ``OpenAIServingChat._convert_to_internal_request`` (the chat template is rendered there, so the
  prompt's token ids exist), a request without our hint header gets an inferred hint: session and
  branch from :class:`ChatInference`; ``stable_prefix_tokens`` = where the prompt stops matching the
  rendering of its system messages with the same ``tools`` (the template's own boundary, not a guess);
  for a fork, ``fork_point_tokens`` = where it stops matching the rendering of the shared messages.
  The hint is marked ``inferred`` (a client may not set that) and then takes the ordinary path:
  validation, tenant binding and clipping, admission.
- Around ``_handle_non_streaming_request`` and ``_generate_chat_stream``: when the response carries
  tool calls (``finish_reason`` ``tool_calls``, or calls parsed from a reply cut at ``max_tokens``),
  the branch pauses on the called function (several: the one whose learned latency
  is longest) before the response (or the stream's ``[DONE]``) goes out; the branch's next request
  resumes it, as with an explicit hint. The request is then done for the idle clock.
- A sweeper closes branches idle past ``AGENTCACHE_INFER_IDLE_S`` (never one paused on a tool: its
  deadline governs it).

With tenancy an inferred session lives in the caller's namespace and needs no session credential: the
server made it, and the namespace alone keeps tenants apart. Pinned SGLang internals:
:data:`CHAT_PINS` (checked when inference is switched on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from sgl_agentcache.chat_infer import ChatInference, ChatTurn, Inferred, idle_seconds, infer_mode, tool_names
from sgl_agentcache.hints import ID_REGEX, lifecycle_envelope
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.server.pins import Pin, check_pinned_internals

logger = logging.getLogger(__name__)

_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_PIN_AT = "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat"
#: The chat serving internals inference hooks or calls, with their parameters (SGLang 0.5.23).
CHAT_PINS = (
    Pin(f"{_PIN_AT}._convert_to_internal_request", ("self", "request", "raw_request"),
        "the hint is inferred once the prompt is rendered"),
    Pin(f"{_PIN_AT}._handle_non_streaming_request", ("self", "adapted_request", "request", "raw_request"),
        "a reply's tool calls pause the branch"),
    Pin(f"{_PIN_AT}._generate_chat_stream", ("self", "adapted_request", "request", "raw_request"),
        "a streamed reply's tool calls pause the branch"),
    Pin(f"{_PIN_AT}._process_messages", ("self", "request", "is_multimodal", "output_constrained"),
        "the stable prefix and fork point are where the template's own rendering stops matching"),
)
_MAX_PENDING = 4096  # requests between their conversion and their handler (normally microseconds apart)
_ID = re.compile(ID_REGEX)


@dataclass
class _Pending:
    namespace: str
    inferred: Inferred
    identity: object


state: ChatInference | None = None  # set by install() when inference is on
_pending: OrderedDict[int, _Pending] = OrderedDict()  # id(adapted request) -> its inference
_issued: OrderedDict[str, None] = OrderedDict()  # message ids of inferred envelopes not yet at the front door
_stable_cache: OrderedDict[bytes, int] = OrderedDict()  # system messages + tools -> stable prefix length
_sweeper: asyncio.Task | None = None
_render_warned = False
_to_close: list[tuple[str, str, str]] = []  # branches the bounds made inference forget, to close
# SGLang renders and converts chat requests in worker threads; the event loop reads the same state.
_lock = threading.Lock()


def enabled() -> bool:
    return state is not None


def claim_inferred(obj) -> bool:
    """True once for a request (``obj``: a GenerateReqInput) whose envelope this module made; the
    front door then accepts its ``inferred`` flag and needs no session credential for it. A client
    cannot forge it: the envelope's message id is a fresh random one, known only here."""
    envelope = getattr(obj, "kv_hints", None)
    message_id = envelope.get("message_id") if isinstance(envelope, dict) else None
    if not isinstance(message_id, str):
        return False
    with _lock:
        return _issued.pop(message_id, False) is None


def _identifier(raw_request, name: str) -> str | None:
    """``prompt_cache_key`` / ``safety_identifier`` from the request body: SGLang 0.5.23's chat request
    model has no such fields and drops them, so they are read from the body FastAPI already read."""
    body = getattr(raw_request, "_body", None)
    if not isinstance(body, (bytes, bytearray)) or name.encode() not in body:
        return None
    try:
        value = json.loads(body).get(name)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= 1024 else None


def _messages(request) -> list[dict]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in request.messages]


def _rendered_common(serving, request, count: int, prompt_ids: list) -> int:
    """How many leading tokens of ``prompt_ids`` the chat template renders for the request's first
    ``count`` messages alone (same tools and template options); 0 if that rendering fails."""
    try:
        part = request.model_copy(update={"messages": list(request.messages[:count])})
        ids = serving._process_messages(part, False).prompt_ids
    except Exception:  # noqa: BLE001 - a template that cannot render a prefix: no boundary
        global _render_warned
        if not _render_warned:  # once: a template that cannot render a prefix fails every time
            _render_warned = True
            logger.warning("agentcache: the chat template cannot render the first %d messages alone; inferred "
                           "hints get no stable prefix or fork point", count, exc_info=True)
        return 0
    if not isinstance(ids, list):
        return 0
    n = min(len(ids), len(prompt_ids))
    i = 0
    while i < n and ids[i] == prompt_ids[i]:
        i += 1
    return i


def _stable_prefix(serving, request, turn: ChatTurn, prompt_ids: list) -> int:
    if turn.leading_system == 0 and not request.tools:
        return 0
    tools = json.dumps([t.model_dump() for t in request.tools or ()], sort_keys=True, default=str).encode()
    key = turn.fingerprints[turn.leading_system - 1] + tools if turn.leading_system else b"\0" + tools
    found = _stable_cache.get(key)
    if found is None:
        found = _rendered_common(serving, request, turn.leading_system, prompt_ids)
        _stable_cache[key] = found
        if len(_stable_cache) > 256:
            _stable_cache.popitem(last=False)
    _stable_cache.move_to_end(key)
    return min(found, len(prompt_ids))


def infer(adapted, serving, request, raw_request) -> None:
    """Attach an inferred hint to ``adapted`` (see the module docstring). Never raises: a request whose
    hint cannot be inferred runs untagged, as on stock SGLang."""
    from sgl_agentcache.server import auth

    inferred = namespace = None
    try:
        identity = auth.identity_of(raw_request)
        if auth.tenancy is not None:
            if identity is None or identity.tenant is None:
                return  # refused at the front door anyway
            namespace = namespace_key(None, auth.bound_salt(identity))
        else:
            single = lambda v: v if isinstance(v, str) else None  # noqa: E731
            namespace = namespace_key(single(request.extra_key), single(request.cache_salt))
        messages = _messages(request)
        turn = ChatTurn.from_messages(messages, prompt_cache_key=_identifier(raw_request, "prompt_cache_key"),
                                      safety_identifier=_identifier(raw_request, "safety_identifier"),
                                      user=request.user)
        with _lock:
            inferred, forgotten = state.assign(namespace, turn, time.monotonic())
        prompt_ids = adapted.input_ids if isinstance(adapted.input_ids, list) else None
        fields = {"session": inferred.session, "branch": inferred.branch, "inferred": True}
        if prompt_ids:
            stable = _stable_prefix(serving, request, turn, prompt_ids)
            fields["stable_prefix_tokens"] = stable
            if inferred.parent is not None:
                fork = _rendered_common(serving, request, inferred.shared_messages, prompt_ids)
                fields |= {"parent_branch": inferred.parent, "fork_point_tokens": max(fork, stable)}
        elif inferred.parent is not None:
            fields["parent_branch"] = inferred.parent
        message_id = uuid.uuid4().hex
        adapted.kv_hints = lifecycle_envelope(fields, message_id=message_id)
        with _lock:
            _issued[message_id] = None
            _pending[id(adapted)] = _Pending(namespace, inferred, identity)
            for table in (_pending, _issued):
                while len(table) > _MAX_PENDING:
                    table.popitem(last=False)
        _to_close.extend(forgotten)  # closed from the event loop (this may run in a worker thread)
    except Exception:  # noqa: BLE001 - inference is advice: the request runs untagged
        logger.warning("agentcache: chat inference failed; the request runs untagged", exc_info=True)
        adapted.kv_hints = None
        with _lock:
            _pending.pop(id(adapted), None)
            if inferred is not None:  # assigned, then failed: the branch is not in flight after all
                state.done(namespace, inferred.session, inferred.branch, time.monotonic())


def _slowest(namespace: str, names: list[str]) -> str:
    """Of the called functions, the one whose learned median latency is longest."""
    from sgl_agentcache.server.http import coordinator

    valid = [n for n in dict.fromkeys(names) if len(n) <= 64 and _ID.match(n)] or ["tool"]
    return max(valid, key=lambda n: coordinator.book.peek(namespace, n).quantile(0.5))


async def _finish(pending: _Pending, called: list[str] | None) -> None:
    """The request ended; ``called``: its tool calls' function names when it finished with tool calls."""
    from sgl_agentcache.server import auth
    from sgl_agentcache.server.http import coordinator

    inferred = pending.inferred
    try:
        if called:  # in the background: the response (or its [DONE]) is not held back for it
            coordinator.pause_soon(pending.namespace, inferred.session, inferred.branch,
                                   tool_class=_slowest(pending.namespace, called), deadline_ms=None, priority=0,
                                   resume_required=True, ceilings=auth.ceilings_for(pending.identity))
    except Exception:  # noqa: BLE001 - a pause must never fail the call it follows
        logger.warning("agentcache: inferred pause of %s failed", inferred.branch, exc_info=True)
    finally:
        with _lock:
            state.done(pending.namespace, inferred.session, inferred.branch, time.monotonic())


def _response_tool_calls(response) -> list[str] | None:
    choices = getattr(response, "choices", None) or ()
    names = []
    for choice in choices:  # calls parsed from a reply cut at max_tokens are still calls the client runs
        for call in getattr(getattr(choice, "message", None), "tool_calls", None) or ():
            names.append(call.function.name)
    return names or None


async def _around_non_streaming(original, serving, adapted, request, raw_request=None, *args, **kwargs):
    with _lock:
        pending = _pending.pop(id(adapted), None)
    _start_sweeper()
    if pending is None:
        return await original(serving, adapted, request, raw_request, *args, **kwargs)
    called = None
    try:
        response = await original(serving, adapted, request, raw_request, *args, **kwargs)
        called = _response_tool_calls(response)
        return response
    finally:
        await _finish(pending, called)


async def _watch_stream(gen, pending: _Pending):
    """Pass the SSE chunks through; note tool calls; pause before ``[DONE]`` when there were any."""
    names: list[str] = []
    finished = False
    try:
        async for chunk in gen:
            if isinstance(chunk, str) and "tool_calls" in chunk and chunk.startswith("data: {"):
                try:
                    data = json.loads(chunk[6:])
                except ValueError:
                    data = {}
                for choice in data.get("choices") or ():
                    for call in (choice.get("delta") or {}).get("tool_calls") or ():
                        name = (call.get("function") or {}).get("name")
                        if name:
                            names.append(name)
            if isinstance(chunk, str) and chunk.startswith("data: [DONE]") and not finished:
                finished = True
                await _finish(pending, names or None)
            yield chunk
    finally:
        if not finished:
            await _finish(pending, None)


def _around_stream_hook(original, serving, adapted, request, raw_request=None, *args, **kwargs):
    gen = original(serving, adapted, request, raw_request, *args, **kwargs)
    with _lock:
        pending = _pending.pop(id(adapted), None)
    _start_sweeper()
    return gen if pending is None else _watch_stream(gen, pending)


async def _close(namespace: str, session: str, branch: str, reason: str) -> None:
    from sgl_agentcache.server.http import _send, coordinator

    await coordinator.settle([(namespace, session, branch)])
    if (namespace, session, branch) in coordinator.on_tools():  # paused on a tool meanwhile: not idle after all
        return
    status, result = await _send("branch_close", {"namespace": namespace, "session": session, "branch": branch})
    if status == 200:
        coordinator.finished(namespace, session, branch, reason=reason)
    elif status != 404:  # 404: the scheduler never saw it (a request refused before admission)
        logger.info("agentcache: closing inferred branch %s (%s) failed: %s %s", branch, reason, status, result)


async def _sweep_forever() -> None:
    from sgl_agentcache.server.http import coordinator

    period = min(max(state.idle_s / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(period)
        try:
            with _lock:
                closing = state.idle(time.monotonic(), busy=coordinator.on_tools())
                bounded, _to_close[:] = list(_to_close), []
            for item in bounded:
                await _close(*item, reason="bounds")
            for item in closing:
                await _close(*item, reason="idle")
        except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
            logger.warning("agentcache: idle sweep failed", exc_info=True)


def _start_sweeper() -> None:
    global _sweeper
    if _sweeper is None or _sweeper.done():
        _sweeper = asyncio.get_running_loop().create_task(_sweep_forever())


def forget_namespace(namespace: str) -> None:
    """A tenant was purged: its inferred sessions go (their branches went with the purge)."""
    if state is not None:
        state.forget_namespace(namespace)


def stats() -> dict:
    return {"mode": "chat" if state is not None else "off"} | (state.stats() if state is not None else {})


def install() -> None:
    """Register the chat hooks when ``AGENTCACHE_INFER=chat`` (HTTP process). An unknown mode or a
    changed SGLang (a pinned method gone or changed) raises, naming what changed."""
    global state
    if infer_mode() != "chat":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_pinned_internals(CHAT_PINS)
    state = ChatInference(idle_s=idle_seconds())
    HookRegistry.register(f"{_CHAT}._handle_non_streaming_request", _around_non_streaming, HookType.AROUND)
    HookRegistry.register(f"{_CHAT}._generate_chat_stream", _around_stream_hook, HookType.AROUND)
    logger.info("agentcache: chat inference on (idle close after %.0f s)", state.idle_s)


__all__ = ["CHAT_PINS", "claim_inferred", "enabled", "infer", "install", "stats"]
