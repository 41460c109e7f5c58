"""Shared fixtures: a tiny model, one real SGLang HTTP server and one in-process ``sglang.Engine``.

Both run the ``agentcache`` backend on CPU and start once per test session, on free ports. The server
runs in its own process group and is killed as a group on teardown, so no process outlives the run.
Token ids sent by tests are always drawn below the model's vocabulary (an id >= vocab kills SGLang).
"""

from __future__ import annotations

import json
import os
import random
import zlib

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sgl_agentcache.cpu_server import CpuServer  # noqa: E402
from sgl_agentcache.tiny_model import TinyModel, make_tiny_model  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test reports the end of every running SGLang server's log: a CI run keeps no files,
    and a stuck or dead server says why only there."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in list(CpuServer.running.values()):
            tail = server.log_tail()
            if tail:
                report.sections.append((f"sglang log (port {server.port}, {server.log_path})", tail))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class TokenSource:
    """Deterministic random token ids, always in ``[3, vocab)`` (0-2 are pad/bos/eos)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(n)]


@pytest.fixture
def tokens(tiny_model, request) -> TokenSource:
    """Per-test token ids: seeded by the test's id, so tests never share prefixes by accident."""
    return TokenSource(tiny_model.vocab_size, seed=zlib.crc32(request.node.nodeid.encode()))


#: Operator priors of the shared test server: a fast tool (tens of ms) and a long-tailed one (minutes).
TOOL_PRIORS = {"grep": {"median_s": 0.02, "sigma": 0.5}, "ci_run": {"median_s": 60.0, "sigma": 1.5}}

#: Per-branch quota of the shared test server (the default would be a quarter of the 4096-token pool).
BRANCH_QUOTA_TOKENS = 512


#: HiCache flags of the eager server (as tests/test_agentcache_on_hicache_server.py starts it).
EAGER_HICACHE = ("--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-write-policy",
                 "write_back", "--hicache-ratio", "4")


def _shared_server(tiny_model, tmp_path_factory, name: str, env: dict, extra: tuple[str, ...] = ()):
    log = tmp_path_factory.mktemp(name) / "sglang.log"
    srv = CpuServer(str(tiny_model.path), log_path=log, max_total_tokens=4096,
                    extra_args=("--enable-cache-report", "--enable-metrics", *extra),
                    env={"AGENTCACHE_BRANCH_QUOTA_TOKENS": str(BRANCH_QUOTA_TOKENS),
                         # Pause decisions priced as the seed's 36 KiB/token deployment, with operator
                         # priors for two tool classes (see tests/test_pauses_server.py).
                         "AGENTCACHE_PROFILE": "seed",
                         "AGENTCACHE_TOOL_PRIORS": json.dumps(TOOL_PRIORS),
                         "AGENTCACHE_EVENT_LOG": str(log.parent / "events.jsonl"),
                         # Chat inference (on by default) closes idle conversations in the background, at
                         # times no test controls, inside this server's whole-stats "nothing changed"
                         # checks. It runs, in the defaults, on its own servers (test_chat_infer_server).
                         "AGENTCACHE_INFER": "off"} | env)
    srv.event_log = log.parent / "events.jsonl"
    return srv


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """The shared server, in the product's defaults (lazy pauses) but chat inference, device-only: no
    ``--enable-hierarchical-cache``, so no host tier (what eviction takes is gone, as in stock SGLang)."""
    with _shared_server(tiny_model, tmp_path_factory, "server-log", {}).start() as srv:
        yield srv


@pytest.fixture(scope="module")  # one module uses it: stop it after (an idle server busy-polls a core)
def eager_server(tiny_model, tmp_path_factory):
    """A server whose pause decisions are carried out at once (``AGENTCACHE_PAUSE_MODE=eager``: offload
    demotes the movable suffix into HiCache's host pool, discard frees it, keep pins it), on SGLang's
    HiCache (write-back, a host pool of 4x the device pool) so an offload has somewhere to go: where
    the eager mechanisms are tested."""
    env = {"AGENTCACHE_PAUSE_MODE": "eager"}
    with _shared_server(tiny_model, tmp_path_factory, "eager-server-log", env, EAGER_HICACHE).start() as srv:
        yield srv


@pytest.fixture(scope="session")
def engine(tiny_model):
    import sglang as sgl

    eng = sgl.Engine(
        model_path=str(tiny_model.path), load_format="dummy", device="cpu", attention_backend="torch_native",
        sampling_backend="pytorch", disable_cuda_graph=True, dtype="float32", context_length=1024,
        max_total_tokens=4096, max_running_requests=8, mem_fraction_static=0.05, log_level="warning",
        radix_cache_backend="agentcache",
    )
    try:
        yield eng
    finally:
        eng.shutdown()
