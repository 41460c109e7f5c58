"""Zero-config lifecycle on a real CPU server: plain OpenAI chat traffic (the official ``openai``
client, no hint header) gets sessions, stable prefixes, tool pauses and forks inferred (on by default
with our backend; ``AGENTCACHE_INFER=off`` turns it off).

A random-weight model emits a real tool call here because SGLang constrains it: ``tool_choice`` names
the function, the ``qwen25`` tool-call parser's structural tag frames the call, ``strict`` puts the
argument schema (an enum) in the grammar, ``--constrained-json-disable-any-whitespace`` and a
``logit_bias`` against the tiny vocabulary's whitespace tokens keep the model from padding forever.
That is xgrammar's CPU path, the same constrained decoding a GPU server runs.

Two servers with the same pool and the same host tier (SGLang's HiCache, a host pool of half the
device pool), inference on (the default) and off, take the same client traffic: an agent pauses on a long tool while
one-shot chats churn both tiers; only with inference does its resume find its history.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sgl_agentcache.cpu_server import CpuServer

# Two servers start in the first test's setup, which the per-test timeout counts: a slow CI machine
# needs more than the default 600 s for that test's setup and its xgrammar-constrained calls.
pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
openai = pytest.importorskip("openai")

IDLE_S = 3.0
LEARN_AFTER = 8  # tool gaps before a namespace's tool bound is learned (default 16: half the calls here)
# One function: SGLang renders only the named tool's schema when ``tool_choice`` names it, all of
# them with "auto"; with one, every turn of a conversation renders the same prefix.
TOOLS = [{"type": "function", "function": {
    "name": "ci_run", "description": "run the project's test suite and report failures", "strict": True,
    "parameters": {"type": "object", "properties": {"target": {"type": "string", "enum": ["unit", "all"]}},
                   "required": ["target"], "additionalProperties": False}}}]
SYSTEM = {"role": "system", "content": ("you are a coding agent. read the file, run the tests, summarise the "
                                        "observation, then answer the user. ") * 4}
#: SGLang's HiCache as the host tier: write-back, a host pool of half the 2048-token device pool.
HICACHE = ("--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-write-policy", "write_back",
           "--hicache-ratio", "0.5")
#: Operator priors, as on the shared test server: ci_run is long-tailed (worth keeping on host).
PRIORS = {"grep": {"median_s": 0.02, "sigma": 0.5}, "ci_run": {"median_s": 60.0, "sigma": 1.5}}


def _server(tiny_model, tmp_path_factory, name: str, infer: bool) -> CpuServer:
    log = tmp_path_factory.mktemp(name) / "sglang.log"
    env = {"AGENTCACHE_TOOL_PRIORS": json.dumps(PRIORS), "AGENTCACHE_PROFILE": "seed",
           "AGENTCACHE_MAX_RETENTION_S": "90"}
    # Inference is on by default with our backend: the inferring server sets no AGENTCACHE_INFER.
    env |= ({"AGENTCACHE_INFER_IDLE_S": str(IDLE_S), "AGENTCACHE_INFER_LEARN_AFTER": str(LEARN_AFTER)} if infer
            else {"AGENTCACHE_INFER": "off"})
    return CpuServer(str(tiny_model.path), log_path=log, max_total_tokens=2048, context_length=2048,
                     extra_args=("--enable-cache-report", "--tool-call-parser", "qwen25",
                                 "--constrained-json-disable-any-whitespace", *HICACHE), env=env)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """(inferred, plain): same pool (2048 tokens), same HiCache host pool (1024 tokens); started one
    after the other, stopped after this module (an idle server busy-polls a core)."""
    with _server(tiny_model, tmp_path_factory, "infer-on", True).start() as on:
        with _server(tiny_model, tmp_path_factory, "infer-off", False).start() as off:
            yield on, off


class Chat:
    """The official client, plus the logit bias that keeps a random model from emitting only spaces."""

    def __init__(self, srv: CpuServer, tiny_model):
        from tokenizers import Tokenizer  # not transformers: importing torch here costs minutes on a busy CPU

        self.srv = srv
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=240)
        tok = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))
        blank = [i for i in range(tok.get_vocab_size()) if tok.decode([i]) and not tok.decode([i]).strip()]
        self.bias = {str(i): -100 for i in blank}

    def call_tool(self, messages, name="ci_run", stream=False, **kw):
        """A turn forced to call ``name``; returns (assistant message as a dict, tool call id, usage)."""
        args = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=120, temperature=0,
                    tool_choice={"type": "function", "function": {"name": name}}, parallel_tool_calls=False,
                    logit_bias=self.bias, **kw)
        if not stream:
            reply = self.client.chat.completions.create(**args)
            message = reply.choices[0].message
            assert message.tool_calls and message.tool_calls[0].function.name == name, reply
            return message.model_dump(exclude_none=True), message.tool_calls[0].id, reply.usage
        calls, call_id = [], None
        for chunk in self.client.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or ():
                    call_id = call.id or call_id
                    if call.function and call.function.name:
                        calls.append(call.function.name)
        assert calls == [name], calls
        return ({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}]}, call_id, None)

    def answer(self, messages, tools: bool = True, stream: bool = False, **kw):
        """A short free reply. With ``tools`` the schema is rendered as in the agent's other turns
        (``tool_choice="none"`` would drop it from the prompt and share nothing past the system text)."""
        if tools:
            kw |= {"tools": TOOLS, "tool_choice": "auto", "logit_bias": self.bias}
        if stream:
            chunks = list(self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                              temperature=0, stream=True, **kw))
            assert any(c.choices and c.choices[0].finish_reason for c in chunks), chunks
            return None
        reply = self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, **kw)
        return reply.usage

    def stats(self) -> dict:
        status, body = self.srv.request("GET", "/agentcache/stats")
        assert status == 200, body
        return body


def _result(call_id, text):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user(text):
    return {"role": "user", "content": text}


def _one_shot(i: int) -> list:
    words = "the quick brown fox jumps over the lazy dog search the repository read the file".split()
    text = " ".join(f"{words[(i * 7 + k) % len(words)]} {i}{k}" for k in range(160))
    return [{"role": "system", "content": f"helper number {i}"}, _user(text)]


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_react_loop_pauses_on_the_called_function_resumes_on_the_result_and_keeps_its_history(servers, tiny_model):
    """Same client traffic on both servers: an agent calls ci_run, one-shot chats churn the pool while
    the tool runs, the result comes back. Inferred: the stable prefix is STABLE, the pause happened at
    the tool call with the function's name as tool class, the resume hit the retained tokens."""
    results = {}
    for srv, name in zip(servers, ("inferred", "plain")):
        chat = Chat(srv, tiny_model)
        messages = [SYSTEM, _user("the build is red: find out why")]
        reply, call_id, first = chat.call_tool(messages)
        after_call = chat.stats()
        for i in range(8):  # other users' one-shot chats while the tool runs: more than the pool holds
            chat.answer(_one_shot(i + 100 * len(results)), tools=False)
        messages += [reply, _result(call_id, "3 failed: test_cache, test_spill, test_router")]
        resumed = chat.answer(messages)
        results[name] = (first, resumed, after_call, chat.stats())

    first, resumed, after_call, final = results["inferred"]
    prompt = first.prompt_tokens
    stable = after_call["resident_tokens"]["stable"]
    assert 0 < stable < prompt, after_call["resident_tokens"]  # system + tools, not the user turn
    coordinator = after_call["coordinator"]
    assert coordinator["active_pauses"] == 1 and coordinator["pauses"] == 1
    assert after_call["pauses"]["decisions"]["offload"] + after_call["pauses"]["decisions"]["keep"] == 1
    models = final["coordinator"]["latency_models"]
    assert any(key.endswith("/ci_run") and m["observations"] >= 1 for key, m in models.items()), models
    assert final["coordinator"]["resumes_by_request"] == 1
    assert final["chat_inference"]["continued"] >= 1
    inferred_hit = resumed.prompt_tokens_details.cached_tokens
    plain_hit = results["plain"][1].prompt_tokens_details.cached_tokens
    assert inferred_hit >= prompt - 2, (inferred_hit, prompt)  # the first prompt came back (BPE may re-merge its end)
    assert plain_hit < prompt // 2, (plain_hit, prompt)  # without inference the churn took it
    assert "chat_inference" not in results["plain"][3] or results["plain"][3]["chat_inference"]["mode"] == "off"


def test_concurrent_sub_conversations_are_forks_and_their_scratch_is_reclaimed_after_idle(servers, tiny_model):
    on, _ = servers
    chat = Chat(on, tiny_model)
    messages = [SYSTEM, _user("split the review into three parts")]
    reply, call_id, _ = chat.call_tool(messages)
    history = messages + [reply, _result(call_id, "three modules: cache, spill, router")]
    before = chat.stats()
    errors, scratch_seen = [], []
    # A sub-conversation is a fork only while another of them is in flight: all four are sent at once,
    # so a slow start of one thread (a loaded CI machine) cannot let the first finish before the rest.
    start = threading.Barrier(4)

    def sub(i: int):
        try:
            conversation = history + [_user(f"review part {i}: " + "read the file, run the tests. " * 6)]
            start.wait(timeout=60)
            chat.answer(conversation, stream=i == 0)  # one streams
            # Right away (a branch idle for IDLE_S is closed): a subagent's own tokens are its scratch.
            scratch_seen.append(chat.stats()["resident_tokens"]["scratch"])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=sub, args=(i,)) for i in range(4)]  # the lead goes on + 3 subagents
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    during = chat.stats()
    inference = during["chat_inference"]
    assert inference["forks"] - before["chat_inference"]["forks"] == 3, inference
    assert during["invalid_hints"] == 0 and during["inferred_orphans"] == 0
    assert max(scratch_seen) > 0, scratch_seen
    # Idle past AGENTCACHE_INFER_IDLE_S: every branch of the session closes; the close is a guess, so
    # the scratch is no longer scratch (nothing owns it) but stays as untagged cache.
    assert _wait(lambda: chat.stats()["resident_tokens"]["scratch"] == 0 and
                 chat.stats()["chat_inference"]["branches"] == 0, timeout=60), chat.stats()["chat_inference"]
    after = chat.stats()
    assert after["closed_branches"] >= before["closed_branches"] + 4
    assert after["kept_on_close_tokens"] > before["kept_on_close_tokens"]
    assert after["freed_on_close_tokens"] == before["freed_on_close_tokens"]


def test_a_task_style_subagent_is_closed_when_its_parent_resumes(servers, tiny_model):
    """The lead calls a Task-like tool and waits; a subagent starts from the lead's history (a fork)
    and answers; the lead's next request brings the tool's result: the subagent is done, and is closed
    then (its KV kept as untagged cache), not after the idle time."""
    on, _ = servers
    chat = Chat(on, tiny_model)
    messages = [SYSTEM, _user("delegate the router review to a subagent, then summarise it")]
    reply, call_id, _ = chat.call_tool(messages)  # the lead pauses on its tool
    before = chat.stats()
    chat.answer(messages + [reply, _user("subagent: review the router for races. " * 4)])
    answered = time.monotonic()
    chat.answer(messages + [reply, _result(call_id, "the subagent found two races")])  # the lead resumes
    if time.monotonic() - answered >= IDLE_S - 0.5:
        pytest.skip("too slow a machine: the idle sweep may have closed the subagent before its lead resumed")
    after = chat.stats()
    inference = after["chat_inference"]
    assert inference["forks"] == before["chat_inference"]["forks"] + 1, inference
    assert inference["subagent_closes"] == before["chat_inference"]["subagent_closes"] + 1, inference
    assert _wait(lambda: chat.stats()["kept_on_close_tokens"] > before["kept_on_close_tokens"], timeout=IDLE_S)
    assert chat.stats()["freed_on_close_tokens"] == before["freed_on_close_tokens"]


def test_a_compaction_is_an_edit_of_its_branch_that_frees_the_old_suffix_at_once(servers, tiny_model):
    """Claude Code style compaction: the next request keeps the system prompt and the task, then a
    summary replaces the rest. The branch is idle, so it is an edit, not a fork: the old suffix is
    freed when the request runs (exact reuse only), the shared head is a hit."""
    on, _ = servers
    chat = Chat(on, tiny_model)
    task = _user("fix the flaky router test. " * 3)
    messages = [SYSTEM, task]
    first = chat.answer(messages, tools=False)  # no tools: a random model's tool call would pause the branch
    messages += [{"role": "assistant", "content": "reading the logs"},
                 _user("the log: " + "shutdown raced the drain; " * 20)]
    chat.answer(messages, tools=False)
    before = chat.stats()
    compacted = chat.answer([SYSTEM, task, _user("summary so far: the router test races on shutdown.")],
                            tools=False)
    after = chat.stats()
    assert after["chat_inference"]["edits"] == before["chat_inference"]["edits"] + 1, after["chat_inference"]
    assert after["chat_inference"]["forks"] == before["chat_inference"]["forks"]
    assert after["context_edit_freed_tokens"] > before["context_edit_freed_tokens"]
    # The head it shares: system and task (their rendering, up to where "assistant" became "user").
    assert compacted.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 8
    status, check = on.request("GET", "/agentcache/check")
    assert status == 200 and check["ok"], check


def test_a_memory_message_injected_before_the_task_closes_the_conversation_it_rewrote(servers, tiny_model):
    """A harness inserts a memory message between the system prompt and the task: the conversation's
    opening changed, so it is a new session; the old one, idle with the same task and reply right
    after the system prompt, was rewritten and is closed as the new request is accepted (its KV kept
    as untagged cache: it is no prefix of anything now, and a wrong guess costs nothing)."""
    on, _ = servers
    chat = Chat(on, tiny_model)
    task = _user("rename the config loader and update its callers. " * 3)
    history = [SYSTEM, task, {"role": "assistant", "content": "listing the callers"},
               _user("callers: " + "cli.py server.py bench.py " * 10)]
    chat.answer(history[:2], tools=False)
    chat.answer(history, tools=False)
    answered, before = time.monotonic(), chat.stats()
    spliced = [SYSTEM, _user("memory: the user prefers small commits")] + history[1:] + [_user("go on")]
    chat.answer(spliced, tools=False)
    if time.monotonic() - answered >= 2.0 - 0.5:  # gap_bounds.FLOOR_S: the shortest learned idle bound
        pytest.skip("too slow a machine: the idle sweep may have closed the old conversation first")
    inference = chat.stats()["chat_inference"]
    assert inference["rewritten_closes"] == before["chat_inference"]["rewritten_closes"] + 1, inference
    assert inference["idle_closes"] == before["chat_inference"]["idle_closes"], inference
    assert _wait(lambda: chat.stats()["kept_on_close_tokens"] > before["kept_on_close_tokens"], timeout=10)
    status, check = on.request("GET", "/agentcache/check")
    assert status == 200 and check["ok"], check


def test_a_conversation_back_after_its_idle_close_still_hits_its_history(servers, tiny_model):
    """A human away for longer than the idle time: the sweeper closes the branch (a wrong guess). The
    close keeps the KV as untagged cache, so the next turn hits the whole first prompt (a close that
    freed it, as inference first did, left only the stable prefix)."""
    on, _ = servers
    chat = Chat(on, tiny_model)
    messages = [SYSTEM, _user("explain how the spill tier picks its victims. " * 5)]
    first = chat.answer(messages, tools=False)
    before = chat.stats()
    assert _wait(lambda: chat.stats()["chat_inference"]["branches"] == 0, timeout=60)
    closed = chat.stats()
    assert closed["chat_inference"]["idle_closes"] > before["chat_inference"]["idle_closes"]
    assert closed["kept_on_close_tokens"] >= before["kept_on_close_tokens"] + first.prompt_tokens // 2
    messages += [{"role": "assistant", "content": "by band, then by age"}, _user("and the host tier?")]
    second = chat.answer(messages, tools=False)
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 2


def test_a_never_returning_tool_is_released_by_its_deadline_then_closed(servers, tiny_model):
    on, _ = servers
    chat = Chat(on, tiny_model)
    before = chat.stats()["coordinator"]
    chat.call_tool([SYSTEM, _user("run everything, then wait")], stream=True)  # a streamed tool call pauses too
    paused = chat.stats()["coordinator"]
    assert paused["active_pauses"] >= 1 and paused["pauses"] == before["pauses"] + 1
    time.sleep(IDLE_S + 1)  # past the idle time: a paused branch is not idle-closed
    assert chat.stats()["coordinator"]["active_pauses"] >= 1
    assert _wait(lambda: chat.stats()["coordinator"]["deadline_expiries"] > paused["deadline_expiries"], timeout=200)
    assert _wait(lambda: chat.stats()["coordinator"]["active_pauses"] == 0 and
                 chat.stats()["chat_inference"]["branches"] == 0, timeout=60)


def test_bad_chat_input_gets_clear_behaviour_and_nothing_leaks(servers, tiny_model):
    on, _ = servers
    chat = Chat(on, tiny_model)
    before = chat.stats()["chat_inference"]
    # A tool result for a call nobody made, a tool result first, odd orders: SGLang 0.5.23 runs them
    # (its pairing check is model-specific); inference treats them as plain conversations.
    chat.answer([SYSTEM, _user("hi"), _result("call_nope", "orphan")])
    chat.answer([SYSTEM, _result("call_x", "first")])
    chat.answer([_user("no system"), {"role": "assistant", "content": "ok"}, _user("again")], tools=False)
    chat.answer([{"role": "assistant", "content": "speaking first"}, _user("fine")], tools=False)
    middle = chat.stats()["chat_inference"]
    assert middle["requests"] - before["requests"] == 4 and middle["forks"] == before["forks"]
    # One prompt_cache_key reused for unrelated conversations: one session, independent branches.
    before = middle
    for text in ("first unrelated chat", "second unrelated chat"):
        chat.answer([SYSTEM, _user(text)], tools=False, extra_body={"prompt_cache_key": "shared-key"})
    after = chat.stats()["chat_inference"]
    assert after["new_branches"] - before["new_branches"] == 2 and after["forks"] == before["forks"]
    # A client may not claim its own hint was inferred.
    status, body = on.request("POST", "/v1/chat/completions",
                              {"model": "tiny", "messages": [_user("x")], "max_tokens": 1},
                              headers={"x-sgl-agentcache-hint": json.dumps({"session": "s", "inferred": True})})
    assert status == 400 and "inferred" in json.dumps(body)
    status, body = on.request("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1},
                                                    "kv_hints": {"protocol_version": "1", "message_id": "m", "actions": [
                                                        {"action_id": "a", "action_type": "sgl_agentcache.lifecycle",
                                                         "action_version": "1",
                                                         "payload": {"session": "s", "inferred": True}}]}})
    assert status == 400 and "inferred" in json.dumps(body), body
    assert _wait(lambda: chat.stats()["chat_inference"]["branches"] == 0, timeout=60)
    status, check = on.request("GET", "/agentcache/check")
    assert status == 200 and check["ok"], check
    status, _ = on.request("GET", "/health")
    assert status == 200


def test_anthropic_messages_route_is_inferred_too(servers, tiny_model):
    """SGLang's /v1/messages converts to the same chat serving: a second turn continues the branch and
    hits the first turn's tokens."""
    on, _ = servers
    chat = Chat(on, tiny_model)
    before = chat.stats()["chat_inference"]
    first_turn = [{"role": "user", "content": "summarise the failing tests. " * 8}]
    body = {"model": "tiny", "max_tokens": 4, "system": SYSTEM["content"], "messages": first_turn}
    status, first = on.request("POST", "/v1/messages", body)
    assert status == 200, first
    text = "".join(part.get("text", "") for part in first["content"]) or "ok"
    second_turn = first_turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "and now?"}]
    status, second = on.request("POST", "/v1/messages", body | {"messages": second_turn})
    assert status == 200, second
    after = chat.stats()["chat_inference"]
    assert after["requests"] - before["requests"] == 2 and after["continued"] - before["continued"] == 1, after
    assert second["usage"].get("cache_read_input_tokens", 0) >= first["usage"]["input_tokens"] // 2, second["usage"]


def test_a_conversation_abandoned_on_its_tool_closes_at_the_learned_tool_bound(servers, tiny_model):
    """Claude Code rewrites a conversation from its first user message: the old branch stays paused on
    its tool and the result never comes. Once its namespace has seen LEARN_AFTER tool results come
    back (within milliseconds here), such a branch is closed at the learned bound (the floor, 2 s), not
    at the 90 s retention; the close keeps its KV cached. Its own namespace (``extra_key``), so the
    other tests' pauses keep the fixed rule."""
    from sgl_agentcache.policy.gap_bounds import FLOOR_S

    on, _ = servers
    chat = Chat(on, tiny_model)
    ns = {"extra_body": {"extra_key": "learns-its-tools"}}
    messages = [SYSTEM, _user("fix the failing build, one step at a time")]
    for _ in range(LEARN_AFTER):
        reply, call_id, _ = chat.call_tool(messages, **ns)
        messages += [reply, _result(call_id, "ok")]
    before = chat.stats()
    chat.answer(messages, tools=False, **ns)  # brings the last result: the namespace's LEARN_AFTER-th tool gap
    learned = chat.stats()["chat_inference"]
    assert learned["continued"] - before["chat_inference"]["continued"] == 1, learned
    before = chat.stats()
    chat.call_tool([SYSTEM, _user("start over: the build is green, now update the docs")], **ns)
    paused = chat.stats()
    assert paused["coordinator"]["active_pauses"] == before["coordinator"]["active_pauses"] + 1
    started = time.monotonic()
    assert _wait(lambda: chat.stats()["chat_inference"]["tool_bound_closes"] ==
                 before["chat_inference"]["tool_bound_closes"] + 1, timeout=30), chat.stats()["chat_inference"]
    assert FLOOR_S - 0.5 <= time.monotonic() - started < 20  # the learned bound, not the 90 s retention
    after = chat.stats()
    assert after["coordinator"]["active_pauses"] == before["coordinator"]["active_pauses"]
    assert after["coordinator"]["deadline_expiries"] == before["coordinator"]["deadline_expiries"]
    assert after["kept_on_close_tokens"] > before["kept_on_close_tokens"]
    assert after["freed_on_close_tokens"] == before["freed_on_close_tokens"]
    status, check = on.request("GET", "/agentcache/check")
    assert status == 200 and check["ok"], check
