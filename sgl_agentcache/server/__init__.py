"""The SGLang adapter: the only modules that import SGLang internals, laid out by the process they run in.

``front/`` -- the HTTP server process (one per deployment):

- ``shared``          -- the process's one control channel, pause coordinator and settings.
- ``routes``          -- the ``/agentcache/*`` routes on SGLang's FastAPI app.
- ``ingress``         -- lifecycle hints validated at the front door (``kv_hints``, our header, ``tracestate``).
- ``chat_hooks``      -- chat inference on SGLang's OpenAI chat route (on by default; ``AGENTCACHE_INFER``).
- ``auth``            -- tenants: who a request is, which namespace it may touch.
- ``coordinator``     -- tool pauses' clocks, learned latencies and deadlines (the scheduler reads no clock).
- ``control_channel`` -- control ops batched to the schedulers, namespaces served in turn.
- ``event_log``       -- append-only JSONL event and audit logs.

``scheduler/`` -- every scheduler process (one per TP rank, each with its own tree):

- ``cache``             -- ``AgentRadixCache(UnifiedRadixCache)`` and the radix-cache backend factory.
- ``tree_core``         -- ``AgentTreeCore(UnifiedTreeCore)``: Python tree core whose nodes carry agent state.
- ``control_ops``       -- the handler of each control op (``stats``, ``pause``, ``branch_close``, ...).
- ``pauses``            -- tool-call pause decisions, records, pins and prefetch (``PauseBook``).
- ``admission``         -- admission of hinted requests (plans, refused forks).
- ``program_admission`` -- the waiting queue reordered by program (``AGENTCACHE_ADMISSION=program``).
- ``request_state``     -- the one typed record the backend keeps on SGLang's ``Req``.
- ``branch_walks``      -- one branch's tip, movable suffix and path (pure tree reads).
- ``hicache_moves``     -- backups, demotions and storage fetches on HiCache that stock eviction lacks.
- ``l3_store``          -- SGLang's ``file`` L3 store with per-page deletes (closed branches, purged tenants).
- ``integrity``         -- a read-only tree-integrity check (tests, ``/agentcache/check``).
- ``offline``           -- the real cache on CPU pools without a model or scheduler (the replay, tests).

Both processes, or the launcher:

- ``control``  -- the boundary: IPC message types between the two sides and their wiring on each.
- ``pins``     -- the SGLang internals we override or call, checked at start-up.
- ``metrics``  -- Prometheus metrics in SGLang's multiprocess setup (scheduler and HTTP collectors).
- ``topology`` -- deployments we do not support, refused in the launcher before anything starts.

Nothing in ``front/`` imports ``scheduler/`` or the reverse (``tests/test_layout.py``). Everything
outside this package is SGLang-free and importable without torch.
"""
