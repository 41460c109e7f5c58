"""Sessions that start together share their stable prefix instead of each prefilling it.

The scheduler's hook on ``PrefillAdder.add_one_req`` (server/scheduler/admission.py) holds a hinted request back
a step when a request admitted in the same step computes the stable prefix it declared and lacks; at
its next match the prefix is in the tree and it hits it. On the real cache offline (SGLang's CPU pools);
the adder is a stand-in holding SGLang's own ``can_run_list`` of real requests, because only its list
of requests admitted this step is read. Token ids < 500.
"""

from __future__ import annotations

import random

from sglang.srt.managers.schedule_policy import AddReqResult

from sgl_agentcache.hints import lifecycle_envelope
from sgl_agentcache.server.scheduler.admission import MAX_WAIT_STEPS, MIN_SHARED_PREFILL_TOKENS, around_add_one_req
from sgl_agentcache.server.scheduler.offline import OfflineDriver, build_offline_cache


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


SYSTEM = ids(1, 256)  # the prompt every session of the agent starts with


class Step:
    """One scheduler step's PrefillAdder, as far as the hook reads it: the requests admitted so far."""

    def __init__(self, cache):
        self.tree_cache, self.can_run_list = cache, []
        self.rem_total_tokens = self.cur_rem_tokens = 10_000

    def offer(self, req) -> AddReqResult | None:
        """The hook, around an add_one_req that admits the request."""
        def admit(adder, r, *args, **kwargs):
            adder.can_run_list.append(r)
            return None
        return around_add_one_req(admit, self, req, False, None)


def _queued(driver, n: int, stable: int | None = len(SYSTEM), seed: int = 0, extra_key: str | None = None):
    hint = {"session": f"s{n}"} | ({"stable_prefix_tokens": stable} if stable is not None else {})
    req = driver.queue(f"r{n}", SYSTEM + ids(100 + n + seed, 60), lifecycle_envelope(hint, message_id=f"m{n}"),
                       extra_key=extra_key)
    with driver.activated():
        req.init_next_round_input(driver.cache)
    return req


def test_sessions_starting_together_compute_their_stable_prefix_once():
    cache = build_offline_cache(pool_tokens=4096)
    driver = OfflineDriver(cache)
    step = Step(cache)
    first, second, third = (_queued(driver, n) for n in range(3))
    assert step.offer(first) is None  # admitted: it computes the system prompt
    assert step.offer(second) is AddReqResult.CONTINUE and step.offer(third) is AddReqResult.CONTINUE
    assert cache.shared_prefill_waits == 2 and step.can_run_list == [first]
    run = driver.admit_queued(first)  # the step runs: the prompt's KV lands in the tree
    driver.extend(run, [7])
    driver.finish(run)
    for req in (second, third):  # the next step: they hit it
        with driver.activated():
            req.init_next_round_input(cache)
        assert req.prefix_len >= len(SYSTEM)
        assert Step(cache).offer(req) is None
        run = driver.admit_queued(req)
        assert run.cached_tokens >= len(SYSTEM)
        driver.extend(run, [7])
        driver.finish(run)
    assert cache.shared_prefill_waits == 2 and driver.check().ok


def test_no_wait_without_a_declared_prefix_for_another_namespace_or_for_a_few_tokens():
    cache = build_offline_cache(pool_tokens=4096)
    driver = OfflineDriver(cache)
    step = Step(cache)
    assert step.offer(_queued(driver, 0)) is None
    assert step.offer(_queued(driver, 1, stable=None)) is None  # no hint of a stable prefix: stock scheduling
    assert step.offer(_queued(driver, 2, extra_key="tenant-b")) is None  # another namespace shares nothing
    assert step.offer(_queued(driver, 3, stable=MIN_SHARED_PREFILL_TOKENS - 1)) is None  # not worth a step
    assert cache.shared_prefill_waits == 0


def test_a_request_waits_at_most_max_wait_steps():
    cache = build_offline_cache(pool_tokens=4096)
    driver = OfflineDriver(cache)
    blocker, waiter = _queued(driver, 0), _queued(driver, 1)
    results = []
    for _ in range(MAX_WAIT_STEPS + 1):  # the blocker never finishes its prefill (a long chunked prompt)
        step = Step(cache)
        step.can_run_list.append(blocker)
        results.append(step.offer(waiter))
    assert results[:MAX_WAIT_STEPS] == [AddReqResult.CONTINUE] * MAX_WAIT_STEPS and results[-1] is None
