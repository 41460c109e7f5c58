"""Lifecycle hints at the front door (HTTP/main process): validate early, reject with a clear 400.

- ``/generate`` and ``Engine.generate``: the hint rides in SGLang's ``kv_hints`` envelope. A BEFORE
  hook on ``TokenizerManager.generate_request`` validates it before anything reaches a scheduler; a
  ``ValueError`` there becomes HTTP 400 in SGLang's own handlers, and nothing changes in any tree.
- OpenAI-compatible routes drop unknown body fields, so the hint comes as JSON in the
  ``x-sgl-agentcache-hint`` header; an AFTER hook on ``_convert_to_internal_request`` turns it into the
  same envelope (and rejects a malformed header with 400).
- Through SGLang's router, which forwards neither, the hint rides in a W3C ``tracestate`` member
  (:mod:`sgl_agentcache.gateway`), on every generation route. Precedence: a ``kv_hints`` envelope,
  then our header, then ``tracestate``; whichever carries the hint is validated the same way.

The scheduler parses the hint again from ``req.kv_hints`` (cheap) and falls back to untagged state if
it were ever invalid there, so no request can crash a scheduler through a hint.

Prompts are checked here too, because SGLang 0.5.23 lets through prompts that kill its scheduler (and
with it every tenant's requests): a token id outside ``[0, vocab)`` (IndexError in the embedding), an
empty prompt inside a batch (an assertion when its KV is released), a text prompt that tokenizes to no
token (a reshape error). The client's token ids are checked before anything else, naming the field
(``input_ids[1]``, ``prompt[0][7]``); every prompt is checked again once tokenized, whatever route it
came by. Either is a 400 that nothing reaches a scheduler through. So is a request for more top
log-probabilities per token than the vocabulary has (a ``topk`` past the vocabulary in the scheduler).
"""

from __future__ import annotations

import logging
import uuid
from array import array

from sgl_agentcache.hints import HINT_HEADER, HintError, find_lifecycle_hint, lifecycle_envelope, parse_header
from sgl_agentcache.server.front import shared

logger = logging.getLogger(__name__)

_CONVERTERS = (
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request",
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request",
)


#: Deepest nesting accepted anywhere in a ``kv_hints`` envelope (ours or another consumer's action):
#: SGLang pickles the request for the scheduler, and a very deep payload fails there with a 500.
MAX_ENVELOPE_DEPTH = 128


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON-like value, counting stops past ``limit`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def validate_request_hints(obj, inferred: bool = False) -> None:
    """Raise ``ValueError`` (-> HTTP 400) if a lifecycle hint of ``obj`` is malformed or out of range,
    or claims to be ``inferred`` when the server did not infer it (``inferred``).

    A batch either carries one envelope per prompt or one envelope for all of them; in the second case
    the hint is checked against every prompt.
    """
    input_ids = getattr(obj, "input_ids", None)
    id_lists = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
    if isinstance(obj.kv_hints, list):
        pairs = zip(obj.kv_hints, id_lists if len(id_lists) == len(obj.kv_hints) else id_lists * len(obj.kv_hints))
    else:
        pairs = ((obj.kv_hints, ids) for ids in id_lists)
    for envelope, ids in pairs:
        try:
            hint = find_lifecycle_hint(envelope)
        except HintError as exc:
            raise ValueError(f"invalid kv_hints: {exc}") from None
        if hint is not None and hint.inferred and not inferred:
            raise ValueError("invalid kv_hints: `inferred` is set by the server only")
        if hint is None or ids is None:
            continue  # text prompts: boundaries past the prompt are clipped by the scheduler
        for name in ("stable_prefix_tokens", "fork_point_tokens", "edit_from_tokens"):
            value = getattr(hint, name)
            if value is not None and value > len(ids):
                raise ValueError(f"invalid kv_hints: `{name}`={value} is past the end of the "
                                 f"{len(ids)}-token prompt")
    # Checked last, so that a malformed hint of ours is reported by the field it got wrong.
    if _depth(obj.kv_hints, MAX_ENVELOPE_DEPTH) > MAX_ENVELOPE_DEPTH:
        raise ValueError(f"invalid kv_hints: nested deeper than {MAX_ENVELOPE_DEPTH} levels")


#: The request field a route's token ids came from (for the error message); others say ``input_ids``.
_IDS_FIELD = {"/v1/completions": "prompt", "/v1/embeddings": "input", "/v1/score": "items", "/v1/rerank": "documents"}


def check_prompt_ids(ids, vocab_size: int, field: str = "input_ids") -> None:
    """Raise ``ValueError`` (-> HTTP 400) naming the field unless ``ids`` is a non-empty list of token
    ids in ``[0, vocab_size)``, or a non-empty batch of such lists. ``None`` (a text prompt) passes."""
    if ids is None:
        return
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"`{field}` must be a list of token ids")
    if ids and isinstance(ids[0], (list, tuple)):
        rows = [(f"{field}[{i}]", row) for i, row in enumerate(ids)]
    else:
        rows = [(field, ids)]
    for name, row in rows:
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"`{name}` must be a list of token ids")
        if not row:
            raise ValueError(f"`{name}` is empty: a prompt needs at least one token")
        try:
            tokens = array("q", row)  # C speed; refuses floats, strings and nested lists
        except (TypeError, OverflowError):
            raise ValueError(f"`{name}` must hold integer token ids") from None
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            at = next(i for i, t in enumerate(tokens) if not 0 <= t < vocab_size)
            raise ValueError(f"`{name}[{at}]` = {tokens[at]} is not a token id of this model "
                             f"(its vocabulary is [0, {vocab_size}))")


def _vocab_size(tokenizer_manager) -> int | None:
    return getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)


def check_top_logprobs(obj, vocab_size: int) -> None:
    """Raise ``ValueError`` (-> HTTP 400) when ``obj`` (one request, batches already split) asks for
    more top log-probabilities per token than the vocabulary has, or fewer than none: SGLang 0.5.23's
    scheduler dies on it (``selected index k out of range`` in ``get_top_logprobs_raw``). The field is
    ``top_logprobs_num`` on ``/generate``, ``logprobs`` on ``/v1/completions`` and ``top_logprobs`` on
    ``/v1/chat/completions``. Without ``return_logprob`` the number is never used, so it is not checked."""
    wanted = getattr(obj, "top_logprobs_num", None)
    if not getattr(obj, "return_logprob", False) or not isinstance(wanted, int) or 0 <= wanted <= vocab_size:
        return
    raise ValueError(f"top log-probabilities asked for: {wanted} per token (`top_logprobs_num`, or `logprobs` / "
                     f"`top_logprobs` on the OpenAI routes); this model's vocabulary has {vocab_size} tokens")


def _before_validate_one_request(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """Every request once tokenized (text, chat templates, any route; a batch's one by one): its top
    log-probabilities within the vocabulary (:func:`check_top_logprobs`), and its prompt never empty,
    never past the vocab. Prompts given as token ids were checked at :func:`_before_generate_request`
    already; multimodal prompts carry image pad values past the vocabulary on purpose, so only their
    length is checked."""
    vocab = _vocab_size(tokenizer_manager)
    if vocab is not None:
        check_top_logprobs(obj, vocab)
    if input_ids is None or getattr(obj, "input_ids", None) is not None:
        return None
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty once tokenized: a prompt needs at least one token")
    contains_mm = getattr(obj, "contains_mm_input", None)
    if vocab is not None and not (contains_mm is not None and contains_mm()):
        check_prompt_ids(input_ids, vocab, "prompt (tokenized)")
    return None


def _before_generate_request(tokenizer_manager, obj, *args, **kwargs):
    from sgl_agentcache.server.front import auth

    request = args[0] if args else kwargs.get("request")
    vocab = _vocab_size(tokenizer_manager)
    if vocab is not None:
        path = getattr(getattr(request, "url", None), "path", None)
        check_prompt_ids(getattr(obj, "input_ids", None), vocab, _IDS_FIELD.get(path, "input_ids"))
    inferred = False
    if not getattr(obj, "kv_hints", None) and request is not None and hasattr(obj, "kv_hints"):
        hint = _header_hint(request)  # /generate through SGLang's router: the hint rides in tracestate
        if hint is not None:
            obj.kv_hints = lifecycle_envelope(_fields(hint), message_id=uuid.uuid4().hex)
    if getattr(obj, "kv_hints", None):
        from sgl_agentcache.server.front import chat_hooks

        inferred = chat_hooks.claim_inferred(obj)
        validate_request_hints(obj, inferred)
    # With tenancy: the tenant's namespace replaces the client's, credentials are checked, hints clipped.
    auth.bind_generate(obj, request, inferred=inferred)
    queue_priority(tokenizer_manager, obj, request)
    if getattr(obj, "kv_hints", None):
        _note_arrivals(obj)
    return None


def queue_priority(tokenizer_manager, obj, request=None) -> None:
    """Priority is queue order, never memory: with SGLang's ``--enable-priority-scheduling`` a hint's
    ``priority`` (already clipped to the tenant's ``max_priority``) becomes the request's SGLang priority
    when the request sets none, so an urgent turn jumps the waiting queue; quotas and pins are unchanged.
    With tenancy, a request's own SGLang ``priority`` is clipped to the same ceiling."""
    from sgl_agentcache.server.front import auth

    if not getattr(tokenizer_manager, "enable_priority_scheduling", False) or not hasattr(obj, "priority"):
        return
    from sglang.srt.runtime_context import get_schedule

    sign = -1 if get_schedule().schedule_low_priority_values_first else 1  # SGLang's order vs. ours
    if obj.priority is None and getattr(obj, "kv_hints", None) and not isinstance(obj.kv_hints, list):
        hint = find_lifecycle_hint(obj.kv_hints)
        if hint is not None and hint.priority is not None:
            obj.priority = sign * hint.priority
    if isinstance(obj.priority, int) and auth.tenancy is not None:
        asked = {"priority": sign * obj.priority}
        if auth.clip(auth.identity_of(request), asked, "/generate"):
            obj.priority = sign * asked["priority"]


def _hinted(obj) -> list[tuple[str, object]]:
    """(namespace, lifecycle hint) of every hinted prompt of a (validated, bound) request."""
    from sgl_agentcache.lifecycle import namespace_key

    envelopes = obj.kv_hints if isinstance(obj.kv_hints, list) else [obj.kv_hints]
    out = []
    for i, envelope in enumerate(envelopes):
        hint = find_lifecycle_hint(envelope)
        if hint is None:
            continue
        pick = lambda v: v[i] if isinstance(v, list) else v  # noqa: E731 - batched requests carry lists
        out.append((namespace_key(pick(getattr(obj, "extra_key", None)), pick(getattr(obj, "cache_salt", None))),
                    hint))
    return out


def _branch_keys(obj, parents: bool = False) -> list[tuple[str, str, str]]:
    """(namespace, session, branch) of every lifecycle hint of a (validated, bound) request; with
    ``parents``, of the branches its forks fork from too."""
    keys = []
    for namespace, hint in _hinted(obj):
        keys.append((namespace, hint.session, hint.branch))
        if parents and hint.parent_branch is not None:
            keys.append((namespace, hint.session, hint.parent_branch))
    return keys


def _note_arrivals(obj) -> None:
    """Tell the pause coordinator (its clock) what a request's arrival means: a paused branch's tool
    returned, or an idle branch's gap ended; a subagent's first call starts its lifetime (what its
    paused lead waits on)."""

    for namespace, hint in _hinted(obj):
        if hint.is_fork:
            shared.coordinator.note_fork(namespace, hint.session, hint.branch, hint.parent_branch)
        shared.coordinator.note_request(namespace, hint.session, hint.branch)


def _watched(obj) -> tuple | None:
    """(namespace, hint) of a single hinted request, whose end the coordinator acts on: it pauses on a
    tool (``tool_class``), it closes its branch (``close``), it is a fork whose abort cancels the
    branch (the abort itself is handled by the scheduler; the coordinator learns the subagent's
    lifetime), or it leaves its branch idle."""
    from sgl_agentcache.lifecycle import namespace_key

    if not getattr(obj, "kv_hints", None) or isinstance(obj.kv_hints, list):
        return None
    try:
        hint = find_lifecycle_hint(obj.kv_hints)
    except HintError:
        return None  # the validation hook rejects it
    if hint is None:
        return None
    single = lambda v: v if not isinstance(v, list) else None  # noqa: E731
    return namespace_key(single(getattr(obj, "extra_key", None)), single(getattr(obj, "cache_salt", None))), hint


def _around_generate_request(original, tokenizer_manager, obj, *args, **kwargs):
    """Act on how a call ends: a hint with ``tool_class`` pauses the branch on that tool when the call
    finishes normally (in the background: the final chunk is not held back for it); ``close`` completes
    the branch; an aborted fork is cancelled (event log). A request of a branch (or a fork of a
    branch) whose pause is still being applied waits for it before it reaches the scheduler: a pause
    never lands after the turn that ends it, nor after a fork the agent made once it had the reply."""

    watched = _watched(obj)
    gen = original(tokenizer_manager, obj, *args, **kwargs)
    if watched is not None:
        gen = _on_finish(gen, *watched)
    if shared.coordinator.pending and getattr(obj, "kv_hints", None):
        keys = _branch_keys(obj, parents=True)  # a fork, too, starts after its parent's pause
        if shared.coordinator.has_pending(keys):
            gen = _after_pending(gen, keys)
    return gen


async def _after_pending(gen, keys):
    """``gen``, started once the pending pauses of ``keys`` are applied."""

    await shared.coordinator.settle(keys)
    async for item in gen:
        yield item


async def _on_finish(gen, namespace: str, hint):
    from sgl_agentcache.server.front import auth

    ceilings = auth.ceilings_for(auth.identity_of())  # the hint itself was clipped at the front door
    async for item in gen:
        finish = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
        aborted = isinstance(finish, dict) and finish.get("type") == "abort"
        refused = aborted and finish.get("status_code") == 400  # never started (e.g. unknown parent)
        if finish is not None and aborted and hint.is_fork and not refused:
            shared.coordinator.finished(namespace, hint.session, hint.branch, state="cancelled", reason="abort")
        elif finish is not None and not aborted and hint.close:
            shared.coordinator.finished(namespace, hint.session, hint.branch, state="completed", reason="hint")
        elif finish is not None and not aborted and hint.tool_class:
            shared.coordinator.pause_soon(namespace, hint.session, hint.branch, tool_class=hint.tool_class,
                                   deadline_ms=hint.deadline_ms, priority=hint.priority or 0,
                                   resume_required=True, ceilings=ceilings)
        elif finish is not None and not aborted:
            shared.coordinator.note_answered(namespace, hint.session, hint.branch)
        yield item


def _after_convert_to_internal_request(result, serving, request, raw_request=None, *args, **kwargs):
    _refuse_admin_generation(raw_request)
    hint = _header_hint(raw_request)
    if hint is None:
        from sgl_agentcache.server.front import chat_hooks

        if chat_hooks.enabled() and type(serving).__name__ == "OpenAIServingChat":
            chat_hooks.infer(result[0], serving, request, raw_request)  # an explicit hint always wins
        return result
    _check_header_credential(hint, raw_request)
    adapted, original = result
    adapted.kv_hints = lifecycle_envelope(_fields(hint), message_id=uuid.uuid4().hex)
    return adapted, original


def _fields(hint) -> dict:
    return {f: getattr(hint, f) for f in hint.__struct_fields__}


def _header_hint(raw_request):
    """The hint a request carries in a header: ours (``x-sgl-agentcache-hint``), else a member of its
    W3C ``tracestate`` (what SGLang's router forwards; see :mod:`sgl_agentcache.gateway`). ``ValueError``
    (-> 400) naming the header when the one that carries it is malformed; None when neither does."""
    from sgl_agentcache.gateway import TRACESTATE_HEADER, hint_from_tracestate

    if raw_request is None:
        return None
    values = raw_request.headers.getlist(HINT_HEADER)
    if len(values) > 1:
        raise ValueError(f"invalid {HINT_HEADER} header: sent {len(values)} times; send one hint")
    try:
        traced = raw_request.headers.getlist(TRACESTATE_HEADER)
        hint = parse_header(values[0]) if values else hint_from_tracestate(traced)
    except HintError as exc:
        raise ValueError(f"invalid {HINT_HEADER if values else TRACESTATE_HEADER} header: {exc}") from None
    if hint is not None and hint.inferred:
        raise ValueError(f"invalid {HINT_HEADER if values else TRACESTATE_HEADER} header: "
                         f"`inferred` is set by the server only")
    return hint


def _refuse_admin_generation(raw_request) -> None:
    """The admin rule of ``auth.bind_generate``, checked early on the OpenAI-style routes (chat,
    completions, and the Anthropic and SageMaker routes built on them) so that it is a 403 there too:
    their handlers keep an ``HTTPException``'s status, a ``ValueError`` would become a 400."""
    from sgl_agentcache.server.front import auth
    from sgl_agentcache.tenancy import CredentialError

    if auth.tenancy is None or raw_request is None:
        return
    try:
        auth.refuse_admin_generation(auth.identity_of(raw_request), raw_request.url.path)
    except CredentialError as exc:
        from fastapi import HTTPException

        raise HTTPException(status_code=exc.status, detail=str(exc)) from None


def _check_header_credential(hint, raw_request) -> None:
    """With tenancy, a refused session credential in the header is a 401/403 on the OpenAI routes
    (their handlers keep an ``HTTPException``'s status; a ``ValueError`` would become a 400)."""
    from sgl_agentcache.server.front import auth
    from sgl_agentcache.tenancy import CredentialError

    if auth.tenancy is None:
        return
    try:
        auth.check_session(auth.identity_of(raw_request), hint.session, raw_request.url.path)
    except CredentialError as exc:
        from fastapi import HTTPException

        raise HTTPException(status_code=exc.status, detail=str(exc)) from None


def install() -> None:
    """Register the front-door hooks. Call only in the main (HTTP/Engine) process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
                          _around_generate_request, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
                          _before_generate_request, HookType.BEFORE)
    for target in _CONVERTERS:
        HookRegistry.register(target, _after_convert_to_internal_request, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          _before_validate_one_request, HookType.BEFORE)
