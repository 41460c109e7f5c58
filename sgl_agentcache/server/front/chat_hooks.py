"""Chat inference wired into SGLang's OpenAI chat route (HTTP process; on by default with our backend,
``AGENTCACHE_INFER=off`` turns it off).

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
- A branch resuming with its tool's result closes its forks that answered and wait for nothing (a
  Task-style subagent is done when its tool returns).
- A sweeper closes branches idle past their namespace's learned idle bound (at most
  ``AGENTCACHE_INFER_IDLE_S``), and branches paused on a tool past its learned tool bound (before
  one is learned, a pause's deadline governs it). Such a close is a guess, so it keeps the branch's
  KV as untagged cache (``close_branch(keep_cached=True)``): a conversation back from a long human
  pause still finds what stock caching would have kept.

With tenancy an inferred session lives in the caller's namespace and needs no session credential: the
server made it, and the namespace alone keeps tenants apart. Pinned SGLang internals:
``pins.CHAT_PINS`` (checked when inference is switched on).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from sgl_agentcache.chat_infer import Assignment, ChatInference, ChatTurn, Inferred
from sgl_agentcache.hints import ID_REGEX, lifecycle_envelope
from sgl_agentcache.lifecycle import namespace_key
from sgl_agentcache.namespaced_lru import NamespacedLRU
from sgl_agentcache.policy.gap_bounds import FLOOR_S
from sgl_agentcache.server.front import shared
from sgl_agentcache.server.pins import CHAT_PINS, check_pinned_internals

logger = logging.getLogger(__name__)

_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_ID = re.compile(ID_REGEX)


@dataclass
class _Pending:
    """A request's inference, carried on the request object itself (``adapted.agentcache_inferred``)
    from its conversion to its handler: no table any client's traffic could fill or evict."""

    namespace: str
    inferred: Inferred
    identity: object
    assignment: Assignment
    message_id: str  # of the envelope this module made (what the front door's claim checks)
    claimed: bool = False  # the front door accepted its `inferred` flag (once)
    committed: bool = False  # SGLang accepted the request (see _after_validate_one_request)
    finished: bool = False  # its handler ended it (once)


state: ChatInference | None = None  # set by install() when inference is on
#: message id -> the inference of a request still alive (its request object holds the only strong
#: reference): how a parallel-sampling request's per-sample copies (``obj[i]``, which SGLang builds
#: without our attribute) find it at validation.
_live: weakref.WeakValueDictionary[str, _Pending] = weakref.WeakValueDictionary()
#: (namespace, what the rendering depends on) -> stable prefix length; bounded per namespace.
_stable_cache: NamespacedLRU[tuple[str, bytes], int] = NamespacedLRU(1024, 64)
_sweeper: asyncio.Task | None = None
_render_warned = False
_to_close: list = []  # Closings from commits (finished subagents, the bounds' forgotten), for the sweeper
# SGLang renders and converts chat requests in worker threads; the event loop reads the same state.
_lock = threading.Lock()


def enabled() -> bool:
    return state is not None


def claim_inferred(obj) -> bool:
    """True once for a request (``obj``: a GenerateReqInput) whose envelope this module made; the
    front door then accepts its ``inferred`` flag and needs no session credential for it. A client
    cannot forge it: the mark is an attribute this module set on the request object (a request body
    cannot set one), for the envelope it made."""
    pending = getattr(obj, "agentcache_inferred", None)
    envelope = getattr(obj, "kv_hints", None)
    if not isinstance(pending, _Pending) or pending.claimed or not isinstance(envelope, dict):
        return False
    pending.claimed = envelope.get("message_id") == pending.message_id
    return pending.claimed


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


def _rendering_key(request, turn: ChatTurn) -> bytes:
    """What the rendering of the request's system messages depends on: those messages, and every other
    field of the request (``tools``, ``tool_choice`` -- ``"none"`` renders no tools --, template
    options...). Fields that do not change the rendering only cost a cache miss."""
    rest = request.model_dump(exclude={"messages"}, mode="json") if hasattr(request, "model_dump") else {}
    head = turn.fingerprints[turn.leading_system - 1] if turn.leading_system else b"\0"
    return hashlib.blake2b(head + json.dumps(rest, sort_keys=True, default=str).encode(), digest_size=16).digest()


def _stable_prefix(serving, request, turn: ChatTurn, prompt_ids: list, namespace: str) -> int:
    """The stable prefix's length: where the prompt stops matching the rendering of its system
    messages alone (cached per namespace: a tenant never reads what another tenant's request rendered)."""
    if turn.leading_system == 0 and not request.tools:
        return 0
    key = (namespace, _rendering_key(request, turn))
    with _lock:
        found = _stable_cache.get(key)
    if found is None:
        found = _rendered_common(serving, request, turn.leading_system, prompt_ids)
    with _lock:
        _stable_cache.put(key, found)
    return min(found, len(prompt_ids))


def infer(adapted, serving, request, raw_request) -> None:
    """Attach an inferred hint to ``adapted`` (see the module docstring). Never raises: a request whose
    hint cannot be inferred runs untagged, as on stock SGLang."""
    from sgl_agentcache.server.front import auth

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
            inferred, assignment = state.assign(namespace, turn, time.monotonic())
        prompt_ids = adapted.input_ids if isinstance(adapted.input_ids, list) else None
        fields = {"session": inferred.session, "branch": inferred.branch, "inferred": True}
        if prompt_ids:
            stable = _stable_prefix(serving, request, turn, prompt_ids, namespace)
            fields["stable_prefix_tokens"] = stable
            shared = inferred.shared_messages
            if inferred.edit:  # the branch goes on, its history rewritten past the shared messages
                fields["edit_from_tokens"] = max(_rendered_common(serving, request, shared, prompt_ids), stable)
                shared = 0  # and, for a fork's branch, its fork point is what it was
            if inferred.parent is not None:
                fork = _rendered_common(serving, request, shared, prompt_ids)
                fields |= {"parent_branch": inferred.parent, "fork_point_tokens": max(fork, stable)}
        elif inferred.parent is not None:
            fields["parent_branch"] = inferred.parent
        message_id = uuid.uuid4().hex
        adapted.kv_hints = lifecycle_envelope(fields, message_id=message_id)
        adapted.agentcache_inferred = _live[message_id] = _Pending(namespace, inferred, identity, assignment,
                                                                   message_id)
    except Exception:  # noqa: BLE001 - inference is advice: the request runs untagged
        logger.warning("agentcache: chat inference failed; the request runs untagged", exc_info=True)
        adapted.kv_hints = None
        adapted.agentcache_inferred = None
        if inferred is not None:  # assigned, then failed: inference keeps nothing of it
            with _lock:
                state.rollback(assignment, time.monotonic())


def _after_validate_one_request(result, tokenizer_manager, obj, *args, **kwargs):
    """SGLang accepted the request (its last check before the scheduler: the prompt fits the context):
    its inferred branch counts now. A request refused before this point (too long, a bad field, a
    refused credential) is taken back when it ends, and inference keeps nothing of it."""
    pending = getattr(obj, "agentcache_inferred", None)
    if pending is None and getattr(obj, "kv_hints", None) is not None:  # a sample of an n > 1 request
        hints = obj.kv_hints  # by then SGLang has decoded the envelope (a KvHintsEnvelope), or a dict
        message_id = hints.get("message_id") if isinstance(hints, dict) else getattr(hints, "message_id", None)
        pending = _live.get(message_id) if isinstance(message_id, str) else None
    if isinstance(pending, _Pending) and not pending.committed:
        with _lock:
            pending.committed = True
            _to_close.extend(state.commit(pending.assignment))  # closed from the event loop by the sweeper
    return result


def _slowest(namespace: str, names: list[str]) -> str:
    """Of the called functions, the one whose learned median latency is longest."""

    valid = [n for n in dict.fromkeys(names) if len(n) <= 64 and _ID.match(n)] or ["tool"]
    return max(valid, key=lambda n: shared.coordinator.book.peek(namespace, n).quantile(0.5))


async def _finish(pending: _Pending, called: list[str] | None) -> None:
    """The request ended; ``called``: its tool calls' function names when it finished with tool calls."""
    from sgl_agentcache.server.front import auth

    if pending.finished:
        return
    pending.finished = True
    inferred = pending.inferred
    if not pending.committed:  # refused before it ran: nothing of it is kept, nothing pauses
        with _lock:
            state.rollback(pending.assignment, time.monotonic())
        return
    try:
        if called:  # in the background: the response (or its [DONE]) is not held back for it
            shared.coordinator.pause_soon(pending.namespace, inferred.session, inferred.branch,
                                   tool_class=_slowest(pending.namespace, called), deadline_ms=None, priority=0,
                                   resume_required=True, ceilings=auth.ceilings_for(pending.identity))
    except Exception:  # noqa: BLE001 - a pause must never fail the call it follows
        logger.warning("agentcache: inferred pause of %s failed", inferred.branch, exc_info=True)
    finally:
        with _lock:
            state.done(pending.namespace, inferred.session, inferred.branch, time.monotonic(), called_tool=bool(called))


def _response_tool_calls(response) -> list[str] | None:
    choices = getattr(response, "choices", None) or ()
    names = []
    for choice in choices:  # calls parsed from a reply cut at max_tokens are still calls the client runs
        for call in getattr(getattr(choice, "message", None), "tool_calls", None) or ():
            names.append(call.function.name)
    return names or None


def _pending_of(adapted) -> _Pending | None:
    pending = getattr(adapted, "agentcache_inferred", None)
    return pending if isinstance(pending, _Pending) else None


async def _around_non_streaming(original, serving, adapted, request, raw_request=None, *args, **kwargs):
    pending = _pending_of(adapted)
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
    pending = _pending_of(adapted)
    _start_sweeper()
    return gen if pending is None else _watch_stream(gen, pending)


async def _close(namespace: str, session: str, branch: str, reason: str) -> None:
    """Close an inferred branch, keeping its KV as untagged cache. ``reason`` (a
    :class:`~sgl_agentcache.chat_infer.Closing`'s): ``"idle"`` (not if it was paused on a tool
    meanwhile), ``"tool_bound"`` (paused on its tool far past the namespace's learned tool gaps: the
    pause ends with it), ``"subagent"`` (a finished fork of a branch resuming from its tool),
    ``"rewritten"`` (its conversation came back as a new one with a message inserted before its first
    user message) or ``"bounds"`` (inference's memory bounds)."""

    await shared.coordinator.settle([(namespace, session, branch)])
    if reason == "idle" and (namespace, session, branch) in shared.coordinator.on_tools():
        return  # paused on a tool meanwhile: not idle after all
    # A guess, not the client's word: the branch ends, its KV stays as untagged cache (keep_cached).
    status, result = await shared.send_to_scheduler("branch_close", {"namespace": namespace, "session": session,
                                                                     "branch": branch, "keep_cached": True})
    if status == 200:
        shared.coordinator.finished(namespace, session, branch, reason=reason)
    elif status != 404:  # 404: the scheduler never saw it (a request refused before admission)
        logger.info("agentcache: closing inferred branch %s (%s) failed: %s %s", branch, reason, status, result)


async def _sweep_forever() -> None:

    # Sweeping at a quarter of the shortest possible bound closes a branch within 25% of its bound;
    # learned bounds are never under FLOOR_S, fixed ones are idle_s.
    shortest = state.idle_s if state.learned is None else min(state.idle_s, FLOOR_S)
    period = min(max(shortest / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(period)
        try:
            with _lock:
                closing = state.idle(time.monotonic(), busy=shared.coordinator.on_tools())
                bounded, _to_close[:] = list(_to_close), []
            for item in bounded + closing:
                await _close(item.namespace, item.session, item.branch, reason=item.reason)
        except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
            logger.warning("agentcache: idle sweep failed", exc_info=True)


def _start_sweeper() -> None:
    global _sweeper
    if state is None:  # switched off at launch (bind_backend): the hooks stay registered, inert
        return
    if _sweeper is None or _sweeper.done():
        _sweeper = asyncio.get_running_loop().create_task(_sweep_forever())


def forget_namespace(namespace: str) -> None:
    """A tenant was purged: its inferred sessions and cached renderings go (its branches went with the purge)."""
    with _lock:
        _stable_cache.pop_namespace(namespace)
        if state is not None:
            state.forget_namespace(namespace)


def stats(namespace: str | None = None) -> dict:
    """Everything (operators), or one namespace's own state and learned bounds (a tenant)."""
    if state is None:
        return {"mode": "off"}
    with _lock:
        return {"mode": "chat"} | state.stats(namespace)


def install() -> None:
    """Register the chat hooks unless ``AGENTCACHE_INFER=off`` (HTTP process); :func:`bind_backend`
    switches them off again at launch where the server does not run our backend and the operator did
    not ask for inference (``AGENTCACHE_INFER=chat``). An unknown mode or a changed SGLang (a pinned
    method gone or changed) raises, naming what changed."""
    global state
    settings = shared.settings
    if settings.infer_mode() != "chat":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_pinned_internals(CHAT_PINS)
    state = ChatInference(idle_s=settings.infer_idle_s, learn_after=settings.infer_learn_after)
    HookRegistry.register(f"{_CHAT}._handle_non_streaming_request", _around_non_streaming, HookType.AROUND)
    HookRegistry.register(f"{_CHAT}._generate_chat_stream", _around_stream_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          _after_validate_one_request, HookType.AFTER)
    logger.info("agentcache: chat inference on (idle close after %.0f s)", state.idle_s)


def bind_backend(radix_cache_backend: str | None) -> None:
    """At launch, once the server's ``--radix-cache-backend`` is known: inference on by default serves
    our backend only (a stock cache would not read its hints), so elsewhere it is switched off unless
    ``AGENTCACHE_INFER=chat`` asked for it."""
    global state
    from sgl_agentcache import BACKEND_NAME

    if state is not None and shared.settings.infer_mode(radix_cache_backend == BACKEND_NAME) != "chat":
        state = None
        logger.info("agentcache: chat inference off (--radix-cache-backend %s is not %s)",
                    radix_cache_backend, BACKEND_NAME)


__all__ = ["bind_backend", "claim_inferred", "enabled", "infer", "install", "stats"]
