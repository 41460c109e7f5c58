"""Agent-trajectory traces: schema, validation, generators and importers (pure; no SGLang, no torch)."""
