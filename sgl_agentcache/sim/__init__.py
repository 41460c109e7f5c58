"""Trace replay: the real cache code (offline, on SGLang's CPU pools) under a cost model."""
