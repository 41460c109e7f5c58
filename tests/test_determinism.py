"""Tree decisions are a function of the message sequence alone (what keeps TP ranks in step).

SGLang runs one tree per tensor-parallel rank and broadcasts every request and control message to all
of them, so ranks agree only if no tree decision depends on anything else (a clock, a hash seed, dict
or set iteration over unordered identity). Here one seeded stream of requests, forks, closes, context
edits, aborts and evictions under pool pressure is replayed into two independently built caches (two
"ranks"), and their trees are compared node for node after every step: keys, KV slots, lock counts,
classes, owners, terminated flags, and the branch charges.
"""

from __future__ import annotations

import random

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.lifecycle import BranchKey
from sgl_agentcache.server.scheduler.offline import OfflineDriver, OfflineOutOfMemory, OfflineRefused


def tree_signature(cache) -> list[tuple]:
    """Every node by token path (never by id), with everything a decision could have changed."""
    core, out = cache.tree_core, []

    def walk(node, path):
        for child_key in sorted(node.children, key=repr):
            child = node.children[child_key]
            key = path + tuple(child.key.token_ids)
            full = child.component_data[0]
            out.append((key, None if full.value is None else tuple(full.value.tolist()), full.lock_ref,
                        child.agent.cls, child.agent.owner, child.agent.terminated))
            walk(child, key)

    walk(core.root_node, ())
    charges = sorted((b.session, b.branch, core.owned_tokens(b)) for b in core.owner_index)
    return out + [("charges", tuple(charges)), ("free", cache.token_to_kv_pool_allocator.available_size())]


def operations(seed: int, steps: int):
    """A seeded stream of agent operations (the 'message log')."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 160))] for _ in range(4)]
    for step in range(steps):
        session = f"s{rng.randrange(3)}"
        kind = rng.choices(["root", "fork", "close", "evict", "plain", "edit"], [4, 6, 2, 1, 2, 1])[0]
        base = prefixes[rng.randrange(len(prefixes))]
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))]
        yield step, kind, session, base, tail, rng.randrange(4), rng.random() < 0.15, rng.randrange(1, 80)


def apply(driver: OfflineDriver, op) -> str:
    step, kind, session, base, tail, branch_no, abort, n = op
    cache = driver.cache
    if kind == "close":
        with driver.activated():
            return str(cache.close_branch(BranchKey("|", session, f"b{branch_no}")))
    if kind == "evict":
        with driver.activated():
            return str(cache.evict(EvictParams(num_tokens=n)))
    hint = None
    if kind == "root":
        hint = {"session": session, "stable_prefix_tokens": min(20, len(base))}
    elif kind == "fork":
        hint = {"session": session, "branch": f"b{branch_no}", "parent_branch": "main"}
    elif kind == "edit":
        hint = {"session": session, "edit_from_tokens": min(n, len(base))}
    envelope = lifecycle_envelope(hint, message_id=f"m{step}") if hint else None
    try:
        req = driver.admit(f"r{step}", base + tail, kv_hints=envelope)
    except (OfflineOutOfMemory, OfflineRefused) as exc:
        return type(exc).__name__
    driver.extend(req, [3 + (step % 400), 4 + (step % 400)])
    if abort:
        driver.abort(req)
    else:
        driver.finish(req)
    return f"ok cached={req.cached_tokens}"


def test_two_ranks_fed_the_same_messages_build_identical_trees():
    ranks = [OfflineDriver(pool_tokens=1024), OfflineDriver(pool_tokens=1024)]
    outcomes = {"ok": 0, "other": 0}
    for op in operations(seed=7, steps=400):
        results = [apply(driver, op) for driver in ranks]
        assert results[0] == results[1], f"step {op[0]} ({op[1]}): {results}"
        outcomes["ok" if results[0].startswith("ok") else "other"] += 1
        assert tree_signature(ranks[0].cache) == tree_signature(ranks[1].cache), f"diverged at step {op[0]}"
    for driver in ranks:
        report = driver.check()
        assert report.ok, report.errors
    assert outcomes["ok"] > 200  # the stream really exercised the tree, with pool pressure
