"""Lifecycle hints at the front door (HTTP/main process): validate early, reject with a clear 400.

- ``/generate`` and ``Engine.generate``: the hint rides in SGLang's ``kv_hints`` envelope. A BEFORE
  hook on ``TokenizerManager.generate_request`` validates it before anything reaches a scheduler; a
  ``ValueError`` there becomes HTTP 400 in SGLang's own handlers, and nothing changes in any tree.
- OpenAI-compatible routes drop unknown body fields, so the hint comes as JSON in the
  ``x-sgl-agentcache-hint`` header; an AFTER hook on ``_convert_to_internal_request`` turns it into the
  same envelope (and rejects a malformed header with 400).

The scheduler parses the hint again from ``req.kv_hints`` (cheap) and falls back to untagged state if
it were ever invalid there, so no request can crash a scheduler through a hint.
"""

from __future__ import annotations

import uuid

from sgl_agentcache.hints import HINT_HEADER, HintError, find_lifecycle_hint, lifecycle_envelope, parse_header

_CONVERTERS = (
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request",
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request",
)


def validate_request_hints(obj) -> None:
    """Raise ``ValueError`` (-> HTTP 400) if a lifecycle hint of ``obj`` is malformed or out of range."""
    envelopes = obj.kv_hints if isinstance(obj.kv_hints, list) else [obj.kv_hints]
    input_ids = getattr(obj, "input_ids", None)
    id_lists = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids] * len(envelopes)
    for envelope, ids in zip(envelopes, id_lists):
        try:
            hint = find_lifecycle_hint(envelope)
        except HintError as exc:
            raise ValueError(f"invalid kv_hints: {exc}") from None
        if hint is None or ids is None:
            continue  # text prompts: boundaries past the prompt are clipped by the scheduler
        for name in ("stable_prefix_tokens", "fork_point_tokens", "edit_from_tokens"):
            value = getattr(hint, name)
            if value is not None and value > len(ids):
                raise ValueError(f"invalid kv_hints: `{name}`={value} is past the end of the "
                                 f"{len(ids)}-token prompt")


def _before_generate_request(tokenizer_manager, obj, *args, **kwargs):
    if getattr(obj, "kv_hints", None):
        validate_request_hints(obj)
        _note_resumes(obj)
    return None


def _note_resumes(obj) -> None:
    """A request of a paused branch means its tool returned: tell the pause coordinator (its clock)."""
    from sgl_agentcache.lifecycle import namespace_key
    from sgl_agentcache.server.http import coordinator

    if not coordinator.active:
        return
    envelopes = obj.kv_hints if isinstance(obj.kv_hints, list) else [obj.kv_hints]
    for i, envelope in enumerate(envelopes):
        hint = find_lifecycle_hint(envelope)
        if hint is None:
            continue
        pick = lambda v: v[i] if isinstance(v, list) else v  # noqa: E731 - batched requests carry lists
        namespace = namespace_key(pick(getattr(obj, "extra_key", None)), pick(getattr(obj, "cache_salt", None)))
        coordinator.note_request(namespace, hint.session, hint.branch)


def _after_convert_to_internal_request(result, serving, request, raw_request=None, *args, **kwargs):
    value = raw_request.headers.get(HINT_HEADER) if raw_request is not None else None
    if value is None:
        return result
    adapted, original = result
    try:
        hint = parse_header(value)
    except HintError as exc:
        raise ValueError(f"invalid {HINT_HEADER} header: {exc}") from None
    fields = {f: getattr(hint, f) for f in hint.__struct_fields__}
    adapted.kv_hints = lifecycle_envelope(fields, message_id=uuid.uuid4().hex)
    return adapted, original


def install() -> None:
    """Register the front-door hooks. Call only in the main (HTTP/Engine) process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
                          _before_generate_request, HookType.BEFORE)
    for target in _CONVERTERS:
        HookRegistry.register(target, _after_convert_to_internal_request, HookType.AFTER)
