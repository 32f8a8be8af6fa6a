"""HTTP serving: the OpenAI-compatible API over the engine."""
