"""Stateful property test: the real ``AgentRadixCache`` driven through :class:`OfflineDriver`.

A hypothesis ``RuleBasedStateMachine`` plays many interleaved agent workloads against one small cache
(1024-token pool; quotas: 256 tokens per fork, 512 per root branch) and, after *every* step,
re-derives the whole tree state token by token and checks it against an independent model of the
lifecycle contract. Two variants: page size 1 and page size 4.

Rules: root-branch requests (stable prefix, optional ``close`` hint), forks of an open branch of the
same session (a prefix of a prompt the parent used + new tokens, with or without
``fork_point_tokens``), forks that must be refused (closed or unknown parent), untagged requests,
prefix reuse of earlier token lists, decode steps, finish, abort (queued path and running path),
closing a known branch, closing an unknown branch, closing a session, explicit ``cache.evict``, and
releasing every live request at once (several requests are held live, i.e. locked, at a time).
Out-of-memory and refusals are legal outcomes and must leave the tree unchanged.

Invariants (after every step):

1. ``driver.check()`` is ok (SGLang's own sanity check, size counters, lock refs, links, unique KV
   slots, owner / terminated indexes).
2. Quota ledger: ``owned_tokens(b) == sum(len(node.key))`` over the nodes owned by ``b`` (own walk of
   the tree; also recounted per token). Quotas bound fairness, not inserts: an insert creates every
   token its plan asks for, and a branch over its quota ranks just above terminated nodes, so
   ``cache.evict`` takes it first (invariant 3's order).
3. Classes: every token a hinted insert creates has exactly the class / owner the hint's plan gives
   its offset (STABLE unowned / parent SESSION / own SESSION or SCRATCH), so every created node has
   one class; tokens that were already in the tree keep class, owner, depth and KV slot (they can only
   become terminated); an owned token is terminated exactly when its branch is closed; no terminated
   node is an unlocked device leaf once a step has completed (the one allowed lag: a parent exposed
   by an admission's own eviction, reclaimed at that request's next batch step); locked tokens are
   never evicted; ``cache.evict`` never evicts a leaf while a lower-valued one stays (terminated <
   over quota < scratch = untagged < session < stable, values taken before the eviction).
4. Idle (no live request): free slots + evictable == pool, protected == 0, every request row free.
   (A closed branch may still own terminated *internal* nodes when idle -- another branch's or an
   untagged node hangs below them -- by design; only terminated leaves are reclaimed.)

Product bugs this machine found are fixed; their minimal reproductions stay at the end of the file
as regression tests (``PAGE_ALIGN_HINT_BOUNDARIES`` / ``KNOWN_BUG_*`` are off: set them to steer the
machine around a bug while it is open).

Token ids stay below 512.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey, NodeClass
from sgl_agentcache.server.scheduler.offline import (
    OfflineDriver,
    OfflineOutOfMemory,
    OfflineRefused,
    build_offline_cache,
)

FULL = ComponentType.FULL
NS = "|"  # namespace_key(None, None)
POOL_TOKENS = 1024
MAX_REQS = 8
MAX_LIVE = 4
SESSIONS = ("s0", "s1")
ROOT_BRANCHES = ("main", "alt")
FORK_BRANCHES = ("f1", "f2", "f3")
TOKEN = st.integers(min_value=0, max_value=511)


def _tokens(length_and_seed) -> list[int]:
    length, seed = length_and_seed
    return random.Random(seed).choices(range(512), k=length)


#: A flag that is set about one time in eight (``close`` hints, refused forks).
RARELY = st.integers(0, 7).map(lambda i: i == 7)
#: New prompt tokens: a length (long enough to hit the quotas and the pool) and a seed for their ids.
FRESH = st.tuples(st.integers(1, 300), st.integers(0, 1 << 16)).map(_tokens)
#: Known bug: AgentRadixCache._settle splits created nodes at hint boundaries that are not multiples of
#: the page size, which SGLang's paged tree cannot represent (IndexError out of the release). Until it is
#: fixed the machine only sends page-aligned ``stable_prefix_tokens`` / ``fork_point_tokens``; the bug
#: itself is pinned by the strict xfail ``test_unaligned_hint_boundary_on_paged_pool``.
PAGE_ALIGN_HINT_BOUNDARIES = False
#: Known bug: a fork admitted while its parent was open, whose insert runs after the parent was closed,
#: stamps the parent range it creates as the parent's *live* SESSION (``terminated=False``): a closed
#: branch owns tokens again and they are never reclaimed as terminated. While it is open the machine
#: tolerates exactly those tokens; the bug is pinned by ``test_late_fork_insert_revives_closed_parent``.
KNOWN_BUG_LATE_FORK_REVIVES_CLOSED_PARENT = False

# ---- a token-level view of the tree ----------------------------------------------------------------


@dataclass(frozen=True)
class Tok:
    """One token in the tree, identified by the hash chain of its path from the root."""

    depth: int
    cls: NodeClass
    owner: BranchKey | None
    terminated: bool
    slot: int
    locked: bool


def chain(token_ids, page_size: int) -> list[tuple[int, int]]:
    """Identity keys of the tree positions of ``token_ids`` (whole pages only; see :func:`snapshot`)."""
    keys, h = [], 0
    for start in range(0, len(token_ids) // page_size * page_size, page_size):
        h = hash((h, tuple(int(t) for t in token_ids[start:start + page_size])))
        keys.extend((h, i) for i in range(page_size))
    return keys


def snapshot(core) -> dict[tuple[int, int], Tok]:
    """Every token in the tree, keyed by (hash chain of the path through its whole page, offset in page).

    Keyed by pages, not single tokens: in a paged tree two siblings may share a first token."""
    page = core.page_size
    tokens: dict[tuple[int, int], Tok] = {}
    stack = [(child, 0, 0) for child in core.root_node.children.values()]
    while stack:
        node, h, depth = stack.pop()
        n = len(node.key)
        ids = node.key.raw_token_ids()[:n]
        assert n % page == 0, f"node {node.id} holds {n} tokens, not whole {page}-token pages"
        data = node.component_data[FULL]
        slots = data.value.tolist() if data.value is not None else [None] * n
        state = node.agent
        for start in range(0, n, page):
            h = hash((h, tuple(int(t) for t in ids[start:start + page])))
            for i in range(page):
                tokens[(h, i)] = Tok(depth + start + i, state.cls, state.owner, state.terminated, slots[start + i],
                                     data.lock_ref > 0)
        stack.extend((child, h, depth + n) for child in node.children.values())
    return tokens


# ---- the model -------------------------------------------------------------------------------------


@dataclass
class Live:
    rid: str
    req: object
    own: BranchKey | None  # None: untagged
    parent: BranchKey | None
    stable: int
    fork_point: int
    close: bool

    @property
    def is_fork(self) -> bool:
        return self.parent is not None

    def expected(self, offset: int) -> tuple[NodeClass, BranchKey | None]:
        """(class, owner) the lifecycle plan gives the token at ``offset`` (hints.insert_plan, by spec)."""
        if self.own is None:
            return NodeClass.UNTAGGED, None
        if offset < self.stable:
            return NodeClass.STABLE, None
        if self.is_fork and offset < self.fork_point:
            return NodeClass.SESSION, self.parent
        return (NodeClass.SCRATCH if self.is_fork else NodeClass.SESSION), self.own

    def own_state(self) -> tuple[NodeClass, BranchKey | None]:
        """(class, owner) of the tokens past the fork point: the branch's own."""
        return self.expected(1 << 30)

    def fill_ids(self) -> list[int]:
        return list(self.req.origin_input_ids) + list(self.req.output_ids)


@dataclass
class StepCtx:
    """What the last rule did, for the invariant's before/after comparison."""

    inserter: Live | None = None  # the request whose insert may have created tokens
    released: list[Live] = field(default_factory=list)
    closed_before: frozenset = frozenset()


class TreeMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1

    def __init__(self):
        super().__init__()
        # The lifecycle contract of the tree alone (no host tier: HiCache's has its own tests,
        # test_offline_hicache.py).
        self.cache = build_offline_cache(pool_tokens=POOL_TOKENS, page_size=self.PAGE_SIZE, max_reqs=MAX_REQS)
        self.driver = OfflineDriver(self.cache)
        self.core = self.cache.tree_core
        self.resurrected: set = set()  # keys excused by KNOWN_BUG_LATE_FORK_REVIVES_CLOSED_PARENT
        self.lagging: set = set()  # terminated leaves exposed by a stock eviction, not yet reclaimed
        self.prev_counters = self._counters()
        self.live: dict[str, Live] = {}
        self.seen: set[BranchKey] = set()
        self.closed: set[BranchKey] = set()
        self.fork_owners: set[BranchKey] = set()  # branches that were the own branch of a fork
        self.parents: set[BranchKey] = set()  # branches a fork named as parent
        self.prompts: dict[BranchKey, list[list[int]]] = {}
        self.corpus: list[list[int]] = []  # token lists seen so far, for prefix sharing
        self.counter = 0
        self.sessions = list(SESSIONS)
        self.session_counter = len(SESSIONS)
        self.prev = snapshot(self.core)
        self.prev_owned: dict[BranchKey, int] = {}
        self.ctx = StepCtx(closed_before=frozenset())

    # ---- helpers ----

    def quota(self, branch: BranchKey) -> int:
        """The server-side ceiling of ``branch``: root branches hold a session's history (session quota
        where the cache has one), forks the branch quota (``AgentRadixCache.quota_for``)."""
        if branch.branch in ROOT_BRANCHES:
            return getattr(self.cache, "session_quota_tokens", self.cache.branch_quota_tokens)
        return self.cache.branch_quota_tokens

    def _counters(self) -> tuple[int]:
        return (self.cache.quota_trimmed_tokens,)

    def _terminated_leaves(self) -> set:
        return {n for n in self.core.terminated if self.core.is_device_leaf(n)}

    def _rid(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _begin(self, **kw) -> None:
        self.ctx = StepCtx(closed_before=frozenset(self.closed), **kw)
        # A session whose root branches are all closed is over: a fresh session takes its slot.
        for i, session in enumerate(self.sessions):
            if all(BranchKey(NS, session, b) in self.closed for b in ROOT_BRANCHES):
                self.session_counter += 1
                self.sessions[i] = f"s{self.session_counter}"

    def _prefix_from_corpus(self, pick: int, frac: float) -> list[int]:
        if not self.corpus or pick < 0:
            return []
        src = self.corpus[pick % len(self.corpus)]
        return list(src[: int(len(src) * frac)])

    def _frozen_state(self):
        """Everything a no-op must leave unchanged."""
        with self.driver.activated():
            stats = self.cache.agent_stats()
        return (snapshot(self.core), stats, self.driver.free_tokens(), self.cache.req_to_token_pool.available_size(),
                frozenset(self.cache.closed), frozenset(self.cache.seen))

    def _admit(self, live_fields: dict, prompt: list[int], hint: dict | None):
        """Admit, or check that an OOM / refusal changed nothing. Returns the request or None."""
        before = self._frozen_state()
        rid = self._rid()
        envelope = lifecycle_envelope(hint, message_id=rid) if hint is not None else None
        own = live_fields["own"]
        parent = live_fields["parent"]
        # Only a new fork needs a live parent; a running subagent outlives its lead's close.
        refused = parent is not None and own not in self.seen and (parent in self.closed or parent not in self.seen)
        kind = "untagged" if own is None else "fork" if parent is not None else "root"
        leaves_before = self._terminated_leaves()
        try:
            req = self.driver.admit(rid, prompt, kv_hints=envelope)
        except OfflineRefused:
            event(f"admit {kind}: refused")
            assert refused, f"{rid}: refused although parent {parent} is open and known"
            assert self._frozen_state() == before, "a refused admission changed the cache"
            return None
        except OfflineOutOfMemory:
            event(f"admit {kind}: out of memory")
            assert not refused, f"{rid}: fork of {parent} should have been refused"
            after = self._frozen_state()
            # Admission registers the branch as seen before allocating (as the scheduler hook does).
            expected_seen = before[5] | ({own} if own is not None else set())
            assert after[:5] == before[:5], "an out-of-memory admission changed the cache"
            assert after[5] == expected_seen
            if own is not None:
                self.seen.add(own)
            return None
        assert not refused, f"{rid}: fork of {parent} (closed or unknown) was admitted"
        event(f"admit {kind}: ok" + (" (branch already closed)" if own in self.closed else ""))
        event(f"live requests after admit: {len(self.live) + 1}")
        # Allocation may evict a leaf and expose a terminated parent; the server reclaims it at the
        # batch's flush_pending_backups (here: the request's next extend / finish / abort).
        self.lagging |= self._terminated_leaves() - leaves_before
        if own is not None:
            self.seen.add(own)
            self.prompts.setdefault(own, []).append(list(prompt))
        self.corpus.append(list(prompt))
        if parent is not None:
            self.parents.add(parent)
            self.fork_owners.add(own)
        self.live[rid] = Live(rid=rid, req=req, **live_fields)
        return req

    def _boundary(self, n: int) -> int:
        """A hint boundary; page-aligned while the paged-split bug is open (see
        ``test_unaligned_hint_boundary_on_paged_pool``)."""
        if PAGE_ALIGN_HINT_BOUNDARIES:
            return n // self.PAGE_SIZE * self.PAGE_SIZE
        return n

    def _pick_live(self, idx: int) -> Live:
        return self.live[sorted(self.live)[idx % len(self.live)]]

    def _released(self, live: Live) -> None:
        del self.live[live.rid]
        self.corpus.append(live.fill_ids())
        # on_release closes the branch on a ``close`` hint, and a fork on abort (either path).
        aborted = isinstance(live.req.finished_reason, FINISH_ABORT)
        if live.own is not None and (live.close or (live.is_fork and aborted)):
            self.closed.add(live.own)

    # ---- rules: admission ----

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(which=st.integers(0, len(SESSIONS) - 1), branch=st.sampled_from(ROOT_BRANCHES),
          pick=st.integers(-1, 1000), frac=st.floats(0, 1), fresh=FRESH, stable_frac=st.floats(0, 1),
          close=RARELY)
    def root_request(self, which, branch, pick, frac, fresh, stable_frac, close):
        self._begin()
        session = self.sessions[which]
        prompt = self._prefix_from_corpus(pick, frac) + fresh
        stable = self._boundary(int(len(prompt) * stable_frac))
        own = BranchKey(NS, session, branch)
        hint = {"session": session, "branch": branch, "stable_prefix_tokens": stable, "close": close}
        self._admit(dict(own=own, parent=None, stable=stable, fork_point=stable, close=close), prompt, hint)

    @precondition(lambda self: len(self.live) < MAX_LIVE and any(b not in self.closed for b in self.seen))
    @rule(pick_parent=st.integers(0, 1000), child=st.sampled_from(FORK_BRANCHES), pick=st.integers(0, 1000),
          frac=st.floats(0, 1), fresh=FRESH, use_fork_point=st.booleans(), stable_frac=st.floats(0, 1),
          close=RARELY, bad_parent=RARELY, bad_name=st.sampled_from(ROOT_BRANCHES + FORK_BRANCHES + ("ghost",)))
    def fork_request(self, pick_parent, child, pick, frac, fresh, use_fork_point, stable_frac, close, bad_parent,
                     bad_name):
        """A fork of an open branch: a prefix of a prompt the parent used (maybe not, or no longer, in
        the tree) + new tokens, with or without ``fork_point_tokens``. With ``bad_parent`` the parent is
        closed or unknown instead: the fork is refused and nothing changes."""
        self._begin()
        open_branches = sorted((b for b in self.seen if b not in self.closed), key=lambda b: (b.session, b.branch))
        if bad_parent:
            sessions = sorted({b.session for b in self.closed} | set(self.sessions))
            parent = BranchKey(NS, sessions[pick_parent % len(sessions)], bad_name)
            if parent in self.seen and parent not in self.closed:
                parent = BranchKey(NS, parent.session, "ghost")
        else:
            parent = open_branches[pick_parent % len(open_branches)]
        if parent.branch == child:
            child = next(f for f in FORK_BRANCHES if f != parent.branch)
        # Half the time a prompt of one of the parent's live requests (often not in the tree yet: the
        # fork then re-creates the parent's range itself), else any prompt the parent used.
        in_flight = [list(x.req.origin_input_ids) for x in self.live.values() if x.own == parent]
        used = in_flight if in_flight and pick % 2 else self.prompts.get(parent, [])
        base = used[pick // 2 % len(used)] if used else []
        prefix = list(base[: self._boundary(int(len(base) * frac))])
        prompt = prefix + fresh
        fork_point = len(prefix) if use_fork_point else None
        stable = self._boundary(int((fork_point if fork_point is not None else len(prompt)) * stable_frac))
        own = BranchKey(NS, parent.session, child)
        hint = {"session": parent.session, "branch": child, "parent_branch": parent.branch,
                "stable_prefix_tokens": stable, "close": close}
        if fork_point is not None:
            hint["fork_point_tokens"] = fork_point
        plan_fork_point = max(stable, fork_point or 0)
        self._admit(dict(own=own, parent=parent, stable=stable, fork_point=plan_fork_point, close=close),
                    prompt, hint)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(pick=st.integers(-1, 1000), frac=st.floats(0, 1), fresh=FRESH)
    def untagged_request(self, pick, frac, fresh):
        self._begin()
        prompt = self._prefix_from_corpus(pick, frac) + fresh
        self._admit(dict(own=None, parent=None, stable=0, fork_point=0, close=False), prompt, None)

    # ---- rules: request progress ----

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 100), outputs=st.lists(TOKEN, min_size=1, max_size=6))
    def extend(self, idx, outputs):
        live = self._pick_live(idx)
        self._begin(inserter=live)
        for token in outputs:  # one forward step each; a step that cannot get a slot changes nothing
            before = self._frozen_state() if live.req.output_ids else None
            try:
                self.driver.extend(live.req, [token])
            except OfflineOutOfMemory:
                event("extend: out of memory")
                assert before is not None and self._frozen_state() == before, "a failed decode step changed the cache"
                break

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 100))
    def finish(self, idx):
        live = self._pick_live(idx)
        self._begin(inserter=live, released=[live])
        self.driver.finish(live.req)
        self._released(live)

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 100), checkpoint=st.booleans())
    def abort(self, idx, checkpoint):
        live = self._pick_live(idx)
        self._begin(inserter=live if checkpoint else None, released=[live])
        self.driver.abort(live.req, checkpoint=checkpoint)
        self._released(live)

    @precondition(lambda self: len(self.live) >= 2)
    @rule(how=st.lists(st.sampled_from(["finish", "abort", "abort_running"]), min_size=MAX_LIVE, max_size=MAX_LIVE))
    def release_all(self, how):
        """Release every live request in one step (several were held locked at once)."""
        lives = [self.live[rid] for rid in sorted(self.live)]
        for i, (live, mode) in enumerate(zip(lives, how)):
            if i:
                self.tree_is_consistent()  # every release is checked on its own
            self._begin(inserter=None if mode == "abort" else live, released=[live])
            if mode == "finish":
                self.driver.finish(live.req)
            else:
                self.driver.abort(live.req, checkpoint=mode == "abort_running")
            self._released(live)

    # ---- rules: control ----

    @precondition(lambda self: self.seen)
    @rule(idx=st.integers(0, 1000), open_one=st.booleans(), unknown=RARELY,
          name=st.sampled_from(ROOT_BRANCHES + FORK_BRANCHES + ("ghost",)), other_namespace=st.booleans())
    def close_branch(self, idx, open_one, unknown, name, other_namespace):
        """``cache.close_branch`` of a known branch (an open one, or any), or of an unknown one."""
        if unknown:
            return self._close_unknown_branch(idx, name, other_namespace)
        self._begin()
        known = sorted(self.seen | self.closed, key=lambda b: (b.session, b.branch))
        still_open = [b for b in known if b not in self.closed]
        pool = still_open if open_one and still_open else known
        branch = pool[idx % len(pool)]
        before_owned = self.core.owned_tokens(branch)
        newly_terminated = sum(len(n.key) for n in self.core.owner_index.get(branch, ()) if not n.agent.terminated)
        pending_before = sum(len(n.key) for n in self.core.terminated)
        with self.driver.activated():
            result = self.cache.close_branch(branch)
        assert result["closed"] is True, result
        assert result["already_closed"] == (branch in self.closed), result
        if not result["already_closed"]:
            assert newly_terminated == before_owned  # an open branch owned no terminated token
        self.closed.add(branch)
        assert result["pending_tokens"] == self.core.owned_tokens(branch) <= before_owned
        event("close branch: " + ("already closed" if result["already_closed"] else "closed")
              + (", tokens pending" if result["pending_tokens"] else "")
              + (", freed" if result["freed_tokens"] else ""))
        if any(x.parent == branch for x in self.live.values()):
            event("close branch: a live fork names it as parent")
        pending_after = sum(len(n.key) for n in self.core.terminated)
        # Freed: every terminated token that went (this branch's, and any closed ancestor they exposed).
        assert result["freed_tokens"] == pending_before + newly_terminated - pending_after, result
        assert all(n.agent.terminated for n in self.core.owner_index.get(branch, ()))

    def _close_unknown_branch(self, idx, name, other_namespace):
        """Closing a branch the cache never saw answers ``closed: False`` and changes nothing."""
        self._begin()
        session = (self.sessions + ["nobody"])[idx % (len(self.sessions) + 1)]
        branch = BranchKey("other|" if other_namespace else NS, session, name)
        if branch in self.seen or branch in self.closed:
            branch = BranchKey(NS, "nobody", name)
        before = self._frozen_state()
        with self.driver.activated():
            result = self.cache.close_branch(branch)
        assert result == {"closed": False, "reason": "unknown branch"}
        assert self._frozen_state() == before, "closing an unknown branch changed the cache"
        event("close branch: unknown")

    @precondition(lambda self: any(b.session in self.sessions for b in self.seen - self.closed))
    @rule(which=st.integers(0, len(SESSIONS) - 1))
    def close_session(self, which):
        """Close every branch of a session; the session is retired and a fresh one takes its slot."""
        self._begin()
        session = self.sessions[which]
        expected = {b for b in self.seen | set(self.core.owner_index) if b.session == session and b.namespace == NS}
        with self.driver.activated():
            result = self.cache.close_session(NS, session)
        assert result["branches"] == len(expected)
        self.closed |= expected
        event(f"close session with {len(expected)} branches")
        self.session_counter += 1
        self.sessions[which] = f"s{self.session_counter}"

    @precondition(lambda self: self.cache.evictable_size() > 0)
    @rule(n=st.integers(1, POOL_TOKENS))
    def evict(self, n):
        self._begin()
        evictable, free, protected = self.cache.evictable_size(), self.driver.free_tokens(), self.cache.protected_size()
        leaves_before = {node: (node.agent, node.agent.owner is not None and self.cache.over_quota(node.agent.owner))
                         for node in list(self.core.evictable_device_leaves)}
        with self.driver.activated():
            result = self.cache.evict(EvictParams(num_tokens=n))
        got = result.num_tokens_evicted
        assert got >= min(n, evictable), (n, evictable, got)
        assert self.cache.evictable_size() == evictable - got
        assert self.driver.free_tokens() == free + got
        assert self.cache.protected_size() == protected
        exposed = self._terminated_leaves()
        assert exposed <= self.lagging | (exposed - set(leaves_before)), "a terminated leaf survived an eviction"
        if exposed:
            # Known gap (see test_evict_exposes_terminated_parent_until_next_tick): the stock eviction
            # stops at its target and leaves a terminated parent it exposed. On a server the batch's
            # flush_pending_backups follows every eviction; run that tick here.
            event("evict exposed a terminated parent")
            self.driver.step()
        event("evict: " + ("none" if not got else "some" if got < evictable else "all"))
        # Lifecycle order: a leaf that was evictable before and is still there ranks no lower than any
        # leaf that was evicted (terminated < scratch = untagged < session < stable).
        leaves_after = self.core.evictable_device_leaves
        evicted_values = [_value(*s) for node, s in leaves_before.items() if node not in leaves_after]
        kept_values = [_value(*s) for node, s in leaves_before.items() if node in leaves_after]
        if any(over for _, over in leaves_before.values()):
            event("evict: a branch over its quota had leaves")
        if evicted_values and kept_values:
            assert min(kept_values) >= max(evicted_values), (evicted_values, kept_values)

    # ---- invariants ----

    @invariant()
    def tree_is_consistent(self):
        report = self.driver.check()
        assert report.ok, report.errors
        snap = snapshot(self.core)
        nodes = [n for n in self.core.all_nodes() if n is not self.core.root_node]

        # 2. quota ledger, from our own walk of the nodes.
        by_node: dict[BranchKey, int] = {}
        for node in nodes:
            if node.agent.owner is not None:
                by_node[node.agent.owner] = by_node.get(node.agent.owner, 0) + len(node.key)
        assert set(by_node) == set(self.core.owner_index)
        for branch, tokens in by_node.items():
            assert self.core.owned_tokens(branch) == tokens, branch
        by_token: dict[BranchKey, int] = {}
        for tok in snap.values():
            if tok.owner is not None:
                by_token[tok.owner] = by_token.get(tok.owner, 0) + 1
        assert by_token == by_node

        # 3. classes: what this step created and removed, then every token's state.
        self._check_delta(snap, by_node)
        assert set(self.cache.closed) == self.closed, (set(self.cache.closed) ^ self.closed)
        self.resurrected &= snap.keys()
        for key, tok in snap.items():
            if tok.owner is None:
                assert tok.cls in (NodeClass.UNTAGGED, NodeClass.STABLE) and not tok.terminated, tok
            else:
                assert tok.cls in (NodeClass.SESSION, NodeClass.SCRATCH), tok
                assert key in self.resurrected or tok.terminated == (tok.owner in self.closed), (
                    f"token at depth {tok.depth} owned by {tok.owner}: terminated={tok.terminated} but the "
                    f"branch is {'closed' if tok.owner in self.closed else 'open'}")
                if tok.cls is NodeClass.SCRATCH:
                    assert tok.owner in self.fork_owners, tok
                else:
                    assert tok.owner.branch in ROOT_BRANCHES or tok.owner in self.parents, tok
        lagging = self._terminated_leaves()
        assert lagging <= self.lagging, f"terminated unlocked leaves: {[n.id for n in lagging - self.lagging]}"
        self.lagging = lagging
        if any(t.terminated for t in snap.values()):
            event("terminated tokens resident (locked or internal)")

        # 4. idle conservation.
        if not self.live:
            if any(self.core.owned_tokens(b) for b in self.closed):
                # By design: a terminated node with a live descendant (another branch's, untagged) stays
                # until that descendant goes; only terminated *leaves* are reclaimed.
                event("idle: a closed branch still owns internal terminated nodes")
            assert self.cache.protected_size() == 0
            assert self.driver.free_tokens() + self.cache.evictable_size() == POOL_TOKENS
            assert self.cache.req_to_token_pool.available_size() == MAX_REQS
            assert not any(t.locked for t in snap.values())

        counters = self._counters()
        if counters[0] > self.prev_counters[0]:
            event("eviction trimmed a branch over its quota first")
        self.prev, self.prev_owned, self.prev_counters = snap, by_node, counters
        self.ctx = StepCtx(closed_before=frozenset(self.closed))

    def _check_delta(self, snap: dict[int, Tok], owned: dict[BranchKey, int]) -> None:
        prev, ctx = self.prev, self.ctx
        inserters = [ctx.inserter] if ctx.inserter else []
        # Tokens that stayed keep class, owner and slot; they can only become terminated -- or, reused
        # by a request of the same session, another branch's live scratch becomes that request's
        # lead's history (AgentRadixCache._adopt_shared_context).
        for key in prev.keys() & snap.keys():
            a, b = prev[key], snap[key]
            if (a.cls, a.owner) != (b.cls, b.owner) and _adopted(a, b, ctx):
                event("a request adopted another branch's scratch as its lead's history")
                assert (a.slot, a.depth) == (b.slot, b.depth), (a, b)
                continue
            assert (a.cls, a.owner, a.slot, a.depth) == (b.cls, b.owner, b.slot, b.depth), (a, b)
            assert b.terminated or not a.terminated, (a, b)
        # Tokens that left were unlocked, or locked only by a request released in this step.
        released_keys = set()
        for live in ctx.released:
            released_keys.update(chain(live.fill_ids(), self.PAGE_SIZE))
        for key in prev.keys() - snap.keys():
            assert not prev[key].locked or key in released_keys, f"locked token evicted: {prev[key]}"
        # Tokens that arrived were created by an insert of this step's request(s), each stamped by plan.
        new = snap.keys() - prev.keys()
        expected: dict[int, tuple] = {}
        for live in inserters:
            for offset, key in enumerate(chain(live.fill_ids(), self.PAGE_SIZE)):
                # The tree is split at page boundaries only: a page takes its first token's state.
                expected[key] = (live.expected(offset - offset % self.PAGE_SIZE), live.own_state())
        for key in new:
            assert key in expected, f"token {snap[key]} appeared without an insert in this step"
            tok = snap[key]
            planned, own = expected[key]
            # Tokens a fork assigns to its parent fall back to the fork itself when the parent is at
            # its quota (AgentRadixCache._stamp); the parent's quota bound is checked separately.
            allowed = {planned, own} if planned[1] is not None and planned[1] != own[1] else {planned}
            assert (tok.cls, tok.owner) in allowed, (
                f"token at depth {tok.depth}: class/owner {(tok.cls.name, tok.owner)} != plan {planned}")
            if (KNOWN_BUG_LATE_FORK_REVIVES_CLOSED_PARENT and ctx.inserter is not None
                    and tok.owner is not None and tok.owner == ctx.inserter.parent
                    and tok.owner in ctx.closed_before and not tok.terminated):
                self.resurrected.add(key)
        for live in inserters:
            keys = set(chain(live.fill_ids(), self.PAGE_SIZE))
            created = [k for k in new if k in keys]
            if live.parent is not None and any(snap[k].owner == live.parent for k in created):
                event("fork re-created (and was not charged for) its parent's range")
        for branch, tokens in owned.items():
            if tokens > self.quota(branch):
                event("a branch owns more than its quota")


def _adopted(a, b, ctx) -> bool:
    """``a`` -> ``b`` is an adoption: a live SCRATCH token of another branch of the inserting request's
    session took the class and owner of that request's lead (its parent for a fork, else itself)."""
    live = ctx.inserter
    if live is None or live.own is None or a.cls is not NodeClass.SCRATCH or a.terminated or b.terminated:
        return False
    lead = live.parent if live.is_fork else live.own
    heir = (NodeClass.SESSION, lead) if live.is_fork else live.own_state()
    return (b.cls, b.owner) == heir and a.owner not in (None, live.own, lead) \
        and (a.owner.namespace, a.owner.session) == (lead.namespace, lead.session)


#: The lifecycle order eviction must respect, written out here independently of the retention policy:
#: ended < over quota < scratch = untagged < session < stable.
_ORDER = {NodeClass.UNTAGGED: 1, NodeClass.SCRATCH: 1, NodeClass.SESSION: 2, NodeClass.STABLE: 3}


def _value(state, over_quota: bool) -> float:
    return 0 if state.terminated else 0.5 if over_quota else _ORDER[state.cls]


TreeMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=75, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


class PagedTreeMachine(TreeMachine):
    PAGE_SIZE = 4


PagedTreeMachine.TestCase.settings = TreeMachine.TestCase.settings

TestTreeStateMachine = TreeMachine.TestCase
TestPagedTreeStateMachine = PagedTreeMachine.TestCase


# ---- regression tests: minimal reproductions of bugs this machine found (fixed) --------------------


def test_unaligned_hint_boundary_on_paged_pool():
    driver = OfflineDriver(pool_tokens=1024, page_size=4, max_reqs=8)
    hint = lifecycle_envelope({"session": "s0", "branch": "main", "stable_prefix_tokens": 2}, message_id="m")
    req = driver.admit("r1", [0, 0, 0, 0], kv_hints=hint)
    driver.finish(req)  # used to raise IndexError: a split inside a page
    report = driver.check()
    assert report.ok, report.errors


def test_late_fork_insert_revives_closed_parent():
    driver = OfflineDriver(pool_tokens=1024, page_size=1, max_reqs=8)
    cache = driver.cache
    main = BranchKey(NS, "s", "main")
    prompt = list(range(10, 50))
    lead = driver.admit("lead", prompt, kv_hints=lifecycle_envelope({"session": "s"}, message_id="a"))
    # Admitted while main is open; main's prompt is not in the tree yet, so the fork creates [0, 30).
    fork = driver.admit("fork", prompt[:30] + [400, 401], kv_hints=lifecycle_envelope(
        {"session": "s", "branch": "f1", "parent_branch": "main", "fork_point_tokens": 30}, message_id="b"))
    with driver.activated():
        assert cache.close_branch(main)["closed"]
    driver.abort(lead)
    driver.finish(fork)
    assert not driver.live
    # main is closed and none of its requests is live: it must own nothing that is not terminated.
    live_owned = [n for n in cache.tree_core.owner_index.get(main, ()) if not n.agent.terminated]
    assert live_owned == [], [(n.id, len(n.key), n.agent) for n in live_owned]


def test_evict_exposes_terminated_parent_until_next_tick():
    driver = OfflineDriver(pool_tokens=1024, page_size=1, max_reqs=8)
    cache = driver.cache
    shared, tail = list(range(10, 20)), list(range(30, 35))
    req = driver.admit("main", shared, kv_hints=lifecycle_envelope({"session": "s"}, message_id="a"))
    driver.finish(req)
    req = driver.admit("plain", shared + tail)  # an untagged child under main's (soon terminated) node
    driver.finish(req)
    with driver.activated():
        assert cache.close_branch(BranchKey(NS, "s", "main"))["pending_tokens"] == 10  # internal: kept
        # The stock walk evicts the untagged child (5); the terminated parent it exposes is reclaimed in
        # the same call (10) and counted in the result.
        assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 15
    report = driver.check()  # used to report 'terminated nodes still resident as unlocked leaves'
    assert report.ok, report.errors


def test_fork_charges_parent_beyond_quota():
    driver = OfflineDriver(pool_tokens=1024, page_size=1, max_reqs=8)
    cache = driver.cache
    main = BranchKey(NS, "s", "main")
    req = driver.admit("lead", list(range(10)), kv_hints=lifecycle_envelope({"session": "s"}, message_id="a"))
    driver.finish(req)
    for i, name in enumerate(FORK_BRANCHES):
        # Each fork declares 200 new tokens to be main's history: they are created, stamped main's
        # SESSION and charged to main; the fork's own clip (branch quota) is the only bound applied.
        prompt = random.Random(i).choices(range(512), k=200) + [1]
        req = driver.admit(name, prompt, kv_hints=lifecycle_envelope(
            {"session": "s", "branch": name, "parent_branch": "main", "fork_point_tokens": 200}, message_id=name))
        driver.finish(req)
    assert cache.tree_core.owned_tokens(main) <= cache.session_quota_tokens  # used to be 610 > 512
