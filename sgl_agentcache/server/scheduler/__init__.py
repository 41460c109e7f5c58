"""The scheduler processes' side of the backend: the agent radix tree and what it decides. Each TP rank
runs its own copy; nothing here reads a clock, so every rank decides the same."""
