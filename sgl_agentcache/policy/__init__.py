"""Pure policies: functions over plain data (stdlib and msgspec only; no SGLang, no torch).

A policy takes a read-only description of the world (token counts, measured bandwidths, a learned
latency distribution, the time already waited) and returns a decision with the numbers behind it.
It never reads a clock or an allocator itself: time and capacity are always inputs, so every
tensor-parallel rank, the replay driver and the tests get the same answer for the same inputs.

- :mod:`.distributions` -- the tool-latency protocol the policies read, plus closed-form families.
- :mod:`.latency` -- the learned per-(tenant, tool class) latency model and its bounded book.
- :mod:`.pause` -- keep / offload / discard / release of a paused request's KV.
- :mod:`.profiles` -- deployment cost profiles (KV bytes per token, prefill rate, bandwidths), read by
  the server's pause settings and by the replayer alike.
- :mod:`.worked_example` -- the seed article's keep / swap / recompute example through :mod:`.pause`.
"""
