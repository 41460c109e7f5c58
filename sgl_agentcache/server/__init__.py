"""The SGLang adapter: the only modules that import SGLang internals.

- ``pins``      -- the SGLang internals we override or call, checked at start-up.
- ``tree_core`` -- ``AgentTreeCore(UnifiedTreeCore)``: Python tree core whose nodes carry agent state.
- ``cache``     -- ``AgentRadixCache(UnifiedRadixCache)`` and the radix-cache backend factory.
- ``integrity`` -- a read-only tree-integrity check used by tests and ``/agentcache/check``.
- ``control``   -- the IPC message types between the HTTP process and every scheduler rank.
- ``http``      -- the ``/agentcache/*`` routes on SGLang's HTTP server.
- ``ingress``   -- lifecycle hints validated at the front door (``kv_hints``, our header, ``tracestate``).
- ``pauses``    -- tool-call pause decisions, records, pins and prefetch (``PauseBook``).
- ``host_copies`` -- paused branches' copies between device and host, and their anchors (``HostCopies``).
- ``admission`` -- scheduler-side admission of hinted requests (plans, refused forks).
- ``offline``   -- the real cache on CPU pools without a model, driven through SGLang's own calls.

Everything outside this package is SGLang-free and importable without torch.
"""
