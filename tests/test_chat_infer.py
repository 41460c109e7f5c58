"""Chat inference rules (pure): session identity, continuation, forks, independent conversations,
idle closes and bounds. The server wiring is tested in test_chat_infer_server.py."""

from __future__ import annotations

import pytest

from sgl_agentcache.chat_infer import ChatInference, ChatTurn, canonical_message
from sgl_agentcache.settings import Settings

NS = "ns"
SYSTEM = {"role": "system", "content": "you are a coding agent"}


def user(text):
    return {"role": "user", "content": text}


def call(name, args='{"path": "src"}', call_id="c1"):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


def result(text, call_id="c1"):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def turn(messages, **ids):
    return ChatTurn.from_messages(messages, **ids)


def assign(inf, namespace, chat_turn, now):
    """An accepted request: assigned, then committed (what the server does once SGLang accepts it).
    Returns the inferred hint and the branches the bounds forgot."""
    inferred, assignment = inf.assign(namespace, chat_turn, now)
    return inferred, inf.commit(assignment)


def idle(inf, now, busy=()):
    """The branches the idle sweep closes now, as (namespace, session, branch)."""
    return [closing[:3] for closing in inf.idle(now=now, busy=busy)]


def test_session_identity_prefers_explicit_keys_and_otherwise_hashes_the_opening():
    msgs = [SYSTEM, user("fix the bug")]
    assert turn(msgs, prompt_cache_key="k1").session.startswith("k-")
    assert turn(msgs, safety_identifier="s1", user="u1").session.startswith("s-")
    assert turn(msgs, user="u1").session.startswith("u-")
    opened = turn(msgs)
    assert opened.source == "conversation" and opened.session.startswith("c-")
    assert turn(msgs + [call("grep"), result("found")]).session == opened.session  # same conversation
    assert turn([SYSTEM, user("another task")]).session != opened.session
    assert "k1" not in turn(msgs, prompt_cache_key="k1").session  # client strings never reach the tree


def test_canonical_form_ignores_how_a_client_serialized_arguments_and_empty_content():
    a = call("run", args='{"b": 1, "a": 2}')
    b = call("run", args={"a": 2, "b": 1})
    b["content"] = ""
    assert canonical_message(a) == canonical_message(b)
    assert canonical_message(call("run")) != canonical_message(call("build"))


def test_a_tool_result_continues_the_branch_and_the_next_turn_too():
    inf = ChatInference()
    first, _ = assign(inf, NS, turn([SYSTEM, user("go")]), now=0)
    assert first.branch.startswith("m") and first.parent is None and not first.continued
    inf.done(NS, first.session, first.branch, now=1)
    second, _ = assign(inf, NS, turn([SYSTEM, user("go"), call("grep"), result("x")]), now=2)
    assert (second.branch, second.continued) == (first.branch, True)
    inf.done(NS, second.session, second.branch, now=3)
    third, _ = assign(inf, NS, turn([SYSTEM, user("go"), call("grep"), result("x"), {"role": "assistant",
                                                                                  "content": "done"},
                                    user("thanks")]), now=4)
    assert third.branch == first.branch and inf.counters["forks"] == 0


def test_concurrent_requests_sharing_history_are_forks_of_the_lead():
    inf = ChatInference()
    history = [SYSTEM, user("plan"), call("spawn"), result("three tasks")]
    lead, _ = assign(inf, NS, turn(history), now=0)
    inf.done(NS, lead.session, lead.branch, now=1)
    # Three subagents start from the lead's history at once (each with its own task).
    subs = [assign(inf, NS, turn(history + [user(f"task {i}")]), now=2)[0] for i in range(3)]
    assert subs[0].branch == lead.branch and subs[0].continued  # the first simply continues the lead
    assert all(s.parent == lead.branch and s.shared_messages == len(history) for s in subs[1:])
    assert len({s.branch for s in subs}) == 3
    # A subagent's own next request continues its own branch.
    inf.done(NS, subs[1].session, subs[1].branch, now=3)
    again, _ = assign(inf, NS, turn(history + [user("task 1"), call("grep"), result("y")]), now=4)
    assert again.branch == subs[1].branch and again.continued


def test_a_divergent_rewrite_of_an_idle_branch_is_its_edit_and_an_unrelated_chat_is_its_own_branch():
    inf = ChatInference()
    a, _ = assign(inf, NS, turn([SYSTEM, user("task"), call("read"), result("big file")], prompt_cache_key="k"), 0)
    inf.done(NS, a.session, a.branch, 1)
    compacted = [SYSTEM, user("task"), user("summary of the file")]
    edited, _ = assign(inf, NS, turn(compacted, prompt_cache_key="k"), 2)
    assert edited.edit and edited.branch == a.branch and edited.parent is None and edited.shared_messages == 2
    assert not edited.continued and inf.stats()["edits"] == 1
    # The same rewrite while the branch's own request runs: a fork (parallel samples, a subagent).
    busy, _ = assign(inf, NS, turn(compacted[:2] + [user("another summary")], prompt_cache_key="k"), 3)
    assert not busy.edit and busy.parent == a.branch and busy.shared_messages == 2
    other, _ = assign(inf, NS, turn([SYSTEM, user("unrelated")], prompt_cache_key="k"), 3)
    assert other.session == a.session and other.parent is None and other.branch not in (a.branch, busy.branch)


def test_a_branch_waiting_on_its_tool_is_rewritten_only_by_a_request_bringing_a_tool_result():
    """The lead called a tool (a Task that starts a subagent): a request that shares its history and
    diverges without any tool result is the subagent (a fork); one that brings the tool's result past
    the shared history is the lead itself, rewritten (an edit)."""
    inf = ChatInference()
    history = [SYSTEM, user("task"), call("task_agent")]
    lead, _ = assign(inf, NS, turn(history), 0)
    inf.done(NS, lead.session, lead.branch, 1, called_tool=True)
    sub, _ = assign(inf, NS, turn(history[:2] + [user("subtask: read the router")]), 2)
    assert not sub.edit and sub.parent == lead.branch
    inf.done(NS, sub.session, sub.branch, 3)
    rewritten, _ = assign(inf, NS, turn(history[:2] + [user("summary"), call("task_agent"), result("done")]), 4)
    assert rewritten.edit and rewritten.branch == lead.branch and rewritten.shared_messages == 2


def test_with_edits_off_a_divergent_rewrite_is_a_fork_as_first_shipped():
    inf = ChatInference(infer_edits=False)
    a, _ = assign(inf, NS, turn([SYSTEM, user("task"), call("read"), result("big file")]), 0)
    inf.done(NS, a.session, a.branch, 1)
    edited, _ = assign(inf, NS, turn([SYSTEM, user("task"), user("summary of the file")]), 2)
    assert not edited.edit and edited.parent == a.branch and edited.shared_messages == 2


def test_a_branch_closed_by_other_means_is_forgotten():
    inf = ChatInference()
    a, _ = assign(inf, NS, turn([SYSTEM, user("task")]), 0)
    inf.done(NS, a.session, a.branch, 1)
    inf.forget_branch(NS, a.session, a.branch)
    inf.forget_branch(NS, a.session, "unknown")  # no-op
    assert not inf.sessions and inf.fingerprint_count == 0


def test_idle_branches_close_unless_busy_and_names_are_never_reused():
    inf = ChatInference(idle_s=10)
    a, _ = assign(inf, NS, turn([SYSTEM, user("a")]), now=0)
    b, _ = assign(inf, NS, turn([SYSTEM, user("b")]), now=0)
    inf.done(NS, a.session, a.branch, now=1)
    assert idle(inf, 5) == []
    assert idle(inf, 11) == [(NS, a.session, a.branch)]  # b is still in flight
    inf.done(NS, b.session, b.branch, now=12)
    assert idle(inf, 30, busy=[(NS, b.session, b.branch)]) == []  # paused on a tool
    assert idle(inf, 30) == [(NS, b.session, b.branch)]
    assert not inf.sessions and inf.fingerprint_count == 0
    again, _ = assign(inf, NS, turn([SYSTEM, user("a")]), now=40)
    assert again.branch not in (a.branch, b.branch)  # a closed branch never receives tokens again


def test_bounds_forget_least_recently_used_idle_state():
    inf = ChatInference(max_sessions=2, max_branches=2, max_fingerprints=100, max_sessions_per_namespace=2,
                        max_fingerprints_per_namespace=100)
    first, _ = assign(inf, NS, turn([SYSTEM, user("1")]), 0)
    inf.done(NS, first.session, first.branch, 1)
    assign(inf, NS, turn([SYSTEM, user("2")]), 2)
    _, forgotten = assign(inf, NS, turn([SYSTEM, user("3")]), 3)
    assert [f[:3] for f in forgotten] == [(NS, first.session, first.branch)] and len(inf.sessions) == 2
    assert forgotten[0].reason == "bounds"
    lead, _ = assign(inf, "other", turn([SYSTEM, user("x")], user="u"), 4)
    inf.done("other", lead.session, lead.branch, 5)
    assign(inf, "other", turn([SYSTEM, user("y")], user="u"), 6)
    inf.done("other", lead.session, lead.branch, 7)
    branches = inf.sessions.get(("other", lead.session)).branches
    assert len(branches) <= 2
    before = inf.fingerprint_count
    assert before == sum(len(b.fingerprints) for _, s in inf.sessions.items() for b in s.branches.values())


def test_namespaces_never_share_inferred_state():
    inf = ChatInference()
    msgs = [SYSTEM, user("same chat")]
    a, _ = assign(inf, "tenant-a", turn(msgs), 0)
    b, _ = assign(inf, "tenant-b", turn(msgs), 0)
    assert a.session == b.session and a.parent is None and b.parent is None  # same id, separate namespaces
    assert ("tenant-a", a.session) in inf.sessions and ("tenant-b", b.session) in inf.sessions
    inf.forget_namespace("tenant-a")
    assert ("tenant-a", a.session) not in inf.sessions and ("tenant-b", b.session) in inf.sessions


def test_odd_inputs_are_handled(monkeypatch):
    inf = ChatInference()
    for messages in ([], [{"role": "tool", "content": "orphan result", "tool_call_id": "nope"}],
                     [{"role": "assistant"}], [user([{"type": "text", "text": "parts"}, {"type": "image_url"}])],
                     [call("x", args="not json")]):
        got, _ = assign(inf, NS, turn(messages), 0)
        assert got.branch and got.session
        inf.done(NS, got.session, got.branch, 1)
    inf.done(NS, "unknown", "m0", 2)  # nothing to do, no error
    monkeypatch.setenv("AGENTCACHE_INFER", "bogus")
    with pytest.raises(ValueError, match="AGENTCACHE_INFER"):
        Settings.from_env().infer_mode()
    monkeypatch.setenv("AGENTCACHE_INFER", "chat")
    monkeypatch.setenv("AGENTCACHE_INFER_IDLE_S", "-1")
    with pytest.raises(ValueError, match="AGENTCACHE_INFER_IDLE_S"):
        Settings.from_env()


def test_a_parent_closes_only_after_the_branches_forked_from_it():
    inf = ChatInference(idle_s=10)
    history = [SYSTEM, user("plan"), call("spawn"), result("tasks")]
    lead, _ = assign(inf, NS, turn(history), 0)
    fork, _ = assign(inf, NS, turn(history + [user("sub")]), 0)  # the lead is still running: a fork
    assert fork.parent == lead.branch
    inf.done(NS, lead.session, lead.branch, 1)
    assert idle(inf, 20) == []  # the fork is in flight: its parent stays
    inf.done(NS, fork.session, fork.branch, 21)
    assert idle(inf, 40) == [(NS, fork.session, fork.branch), (NS, lead.session, lead.branch)]


def test_a_bad_setting_stops_the_scheduler_at_start_and_the_chat_pins_hold(monkeypatch):
    """The HTTP process can only log a plugin error, so the backend factory checks the settings too;
    the chat serving internals inference hooks match the installed SGLang."""
    from sgl_agentcache.server.scheduler.cache import _check_settings
    from sgl_agentcache.server.pins import CHAT_PINS
    from sgl_agentcache.server.pins import check_pinned_internals

    check_pinned_internals(CHAT_PINS)
    monkeypatch.setenv("AGENTCACHE_INFER", "chat")
    _check_settings()
    monkeypatch.setenv("AGENTCACHE_INFER_IDLE_S", "soon")
    with pytest.raises(ValueError, match="AGENTCACHE_INFER_IDLE_S"):
        _check_settings()
    monkeypatch.setenv("AGENTCACHE_INFER", "chats")
    with pytest.raises(ValueError, match="AGENTCACHE_INFER"):
        _check_settings()


def test_one_namespaces_flood_forgets_only_its_own_conversations():
    """Issue #38 item 4: one LRU for all tenants let tenant A's flood of chats forget tenant B's
    conversation (its next turn lost its history). Each namespace is bounded on its own now, in
    sessions and in fingerprints, and the total bound takes from the namespace over its share."""
    inf = ChatInference(max_sessions=8, max_fingerprints=400)  # per namespace: 2 sessions, 100 fingerprints
    b, _ = assign(inf, "tenant-b", turn([SYSTEM, user("b's task")]), 0)
    inf.done("tenant-b", b.session, b.branch, 1)
    forgotten = []
    for i in range(50):  # many chats, some very long
        a, gone = assign(inf, "tenant-a", turn([SYSTEM] + [user(f"a{i}.{j}") for j in range(1 + 40 * (i % 3))]), 2 + i)
        inf.done("tenant-a", a.session, a.branch, 2 + i)
        forgotten += gone
    assert forgotten and all(f.namespace == "tenant-a" for f in forgotten)
    assert inf.sessions.namespace_size("tenant-a") <= 2 and inf.fingerprints_by_namespace["tenant-a"] <= 100
    assert ("tenant-b", b.session) in inf.sessions
    again, _ = assign(inf, "tenant-b", turn([SYSTEM, user("b's task"), call("grep"), result("x")]), 99)
    assert again.branch == b.branch and again.continued  # B's conversation goes on where it was
    assert inf.fingerprint_count == sum(inf.fingerprints_by_namespace.values())


def test_a_refused_request_leaves_nothing_behind():
    """Issue #38 item 4: a chat refused at the front door (longer than the context) had already been
    recorded. assign records it for the requests that arrive meanwhile; a refusal rolls it back."""
    inf = ChatInference()
    kept, _ = assign(inf, NS, turn([SYSTEM, user("go")]), 0)
    inf.done(NS, kept.session, kept.branch, 1)
    before = (len(inf.sessions), inf.fingerprint_count, dict(inf.counters))
    huge = [SYSTEM] + [user("") for _ in range(5000)]
    refused, assignment = inf.assign(NS, turn(huge), 2)  # a new conversation: a new session
    assert inf.fingerprint_count > before[1]
    inf.rollback(assignment, 3)
    assert (len(inf.sessions), inf.fingerprint_count) == before[:2]
    assert inf.counters["refused"] == 1 and inf.counters["requests"] == before[2]["requests"]
    # A refused continuation of a live branch: its branch is as it was, and it continues as before.
    refused, assignment = inf.assign(NS, turn([SYSTEM, user("go"), call("grep"), result("x" * 10)]), 4)
    assert refused.branch == kept.branch
    inf.rollback(assignment, 5)
    branch = inf.sessions.get((NS, kept.session)).branches[kept.branch]
    assert branch.fingerprints == turn([SYSTEM, user("go")]).fingerprints
    again, _ = assign(inf, NS, turn([SYSTEM, user("go"), call("read"), result("y")]), 6)
    assert again.branch == kept.branch and again.continued


def test_branch_names_are_unique_and_say_nothing_of_other_tenants():
    """Issue #38 item 7: names came from one server-wide counter (``m<n>``), so a tenant's own branch
    names told it how many chats every tenant had started. They are a keyed hash of it now."""
    inf = ChatInference()
    names = set()
    for i in range(200):
        got, _ = assign(inf, f"tenant-{i % 3}", turn([SYSTEM, user(f"task {i}")]), i)
        names.add(got.branch)
        assert got.branch[0] == "m" and len(got.branch) == 13 and got.branch != f"m{i + 1}"  # not the counter
    assert len(names) == 200
    first = [assign(ChatInference(name_key=b"k"), NS, turn([SYSTEM, user("x")]), 0)[0].branch for _ in range(2)]
    assert first[0] == first[1]  # the same key names alike: a replay is deterministic


def test_a_branch_resuming_from_its_tool_closes_its_finished_subagents_only():
    """Task-style: the lead calls a tool, subagents start from its history while it waits (each a fork
    of the one before: they share the lead's tool call, which the lead's own request did not carry);
    the lead's next request brings the tool's result. Forks that answered and wait for nothing are
    done: closed, forks before parents, reason "subagent". A fork still running, or waiting on a tool
    of its own, keeps itself and the forks it came from."""
    history = [SYSTEM, user("review the modules"), call("task")]

    def start(inf):
        lead, _ = assign(inf, NS, turn(history[:2]), 0)
        inf.done(NS, lead.session, lead.branch, 1, called_tool=True)
        first, _ = assign(inf, NS, turn(history + [user("review cache")]), 1.1)
        second, _ = assign(inf, NS, turn(history + [user("review spill")]), 1.1)
        assert first.parent == lead.branch and second.parent == first.branch
        return lead, first, second

    inf = ChatInference(idle_s=300)
    lead, first, second = start(inf)
    inf.done(NS, first.session, first.branch, 2)
    inf.done(NS, second.session, second.branch, 2)
    _, closed = assign(inf, NS, turn(history + [result("two reviews")]), 3)  # the lead resumes
    assert [(c.branch, c.reason) for c in closed] == [(second.branch, "subagent"), (first.branch, "subagent")]
    assert inf.counters["subagent_closes"] == 2
    assert set(inf.sessions.get((NS, lead.session)).branches) == {lead.branch}
    # The lead's next user turn brings no tool result: it closes nothing.
    inf.done(NS, lead.session, lead.branch, 4)
    _, closed = assign(inf, NS, turn(history + [result("two reviews"), {"role": "assistant", "content": "ok"},
                                                user("thanks")]), 5)
    assert closed == []

    for still_busy in ("running", "on its own tool"):
        inf = ChatInference(idle_s=300)
        lead, first, second = start(inf)
        inf.done(NS, first.session, first.branch, 2)
        if still_busy == "on its own tool":
            inf.done(NS, second.session, second.branch, 2, called_tool=True)
        _, closed = assign(inf, NS, turn(history + [result("partial")]), 3)
        assert closed == [] and inf.counters["subagent_closes"] == 0, still_busy


def test_a_conversation_rewritten_before_its_first_user_message_closes_the_old_session():
    """A harness injects a memory message after the system prompt: the conversation's opening changes,
    so it is a new session by its hash; the old one, idle and holding the same messages right after the
    system prompt, was rewritten and is closed at once (forks first, reason "rewritten") -- unless a
    request of it is in flight, or only one message matches (too little evidence)."""
    history = [SYSTEM, user("fix the bug"), call("read"), result("the file")]
    spliced = [SYSTEM, user("memory: prefers small diffs")] + history[1:] + [user("go on")]

    inf = ChatInference()
    old, _ = assign(inf, NS, turn(history), 0)
    inf.done(NS, old.session, old.branch, 1, called_tool=True)
    sub, _ = assign(inf, NS, turn(history + [call("task"), user("subtask")]), 1.5)  # its tool's subagent
    assert sub.parent == old.branch
    inf.done(NS, sub.session, sub.branch, 2)
    new, closed = assign(inf, NS, turn(spliced), 3)
    assert new.session != old.session and new.parent is None
    assert [(c.session, c.branch, c.reason) for c in closed] == [(old.session, sub.branch, "rewritten"),
                                                                 (old.session, old.branch, "rewritten")]
    assert inf.sessions.get((NS, old.session)) is None and inf.counters["rewritten_closes"] == 2
    # Rolled back (refused before it ran): the old session was not touched.
    inf = ChatInference()
    old, _ = assign(inf, NS, turn(history), 0)
    inf.done(NS, old.session, old.branch, 1)
    _, assignment = inf.assign(NS, turn(spliced), 2)
    inf.rollback(assignment, 2)
    assert set(inf.sessions.get((NS, old.session)).branches) == {old.branch}

    for case in ("in flight", "one message only", "edits off", "keyed"):
        inf = ChatInference(infer_edits=case != "edits off")
        keyed = {"prompt_cache_key": "k"} if case == "keyed" else {}  # one session whatever its opening
        old, _ = assign(inf, NS, turn(history[:2] if case == "one message only" else history), 0)
        if case != "in flight":
            inf.done(NS, old.session, old.branch, 1)
        second = [SYSTEM, user("memory")] + (history[1:2] + [user("other")] if case == "one message only" else history[1:])
        assert turn(second, **keyed).reopenings == () or not keyed
        _, closed = assign(inf, NS, turn(second, **keyed), 2)
        assert closed == [] and inf.counters["rewritten_closes"] == 0, case


def test_default_inference_switches_off_at_launch_unless_our_backend_serves(monkeypatch):
    """On by default serves our backend only (a stock cache would not read the hints): the launch hook
    (``topology``, which sees ``--radix-cache-backend``) switches it off for another backend, unless the
    operator asked for it with ``AGENTCACHE_INFER=chat``."""
    from sgl_agentcache.server.front import chat_hooks, shared

    monkeypatch.setattr(chat_hooks, "state", ChatInference())
    chat_hooks.bind_backend("agentcache")
    assert chat_hooks.enabled()
    monkeypatch.setattr(shared, "settings", Settings.from_env({"AGENTCACHE_INFER": "chat"}))
    chat_hooks.bind_backend(None)
    assert chat_hooks.enabled()
    monkeypatch.setattr(shared, "settings", Settings())
    from types import SimpleNamespace

    from sgl_agentcache.server import topology

    # What SGLang calls before it starts any process, for stock SGLang's radix cache (no backend flag).
    topology._before_launch_subprocesses(object, server_args=SimpleNamespace(radix_cache_backend=None))
    assert not chat_hooks.enabled() and chat_hooks.stats() == {"mode": "off"}


def test_hooks_switched_off_at_launch_start_no_sweeper(monkeypatch):
    """With inference switched off by ``bind_backend`` the chat hooks stay registered but inert: a chat
    request passes through and no idle sweeper (which reads the inference state) is started."""
    import asyncio

    from sgl_agentcache.server.front import chat_hooks

    monkeypatch.setattr(chat_hooks, "state", None)
    monkeypatch.setattr(chat_hooks, "_sweeper", None)

    async def handler(serving, adapted, request, raw_request):
        return "reply"

    reply = asyncio.run(chat_hooks._around_non_streaming(handler, object(), object(), object()))
    assert reply == "reply" and chat_hooks._sweeper is None
