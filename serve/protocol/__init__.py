"""Typed request bodies of the HTTP API (pydantic models), so `openapi.json` documents each one.

Numeric sampling limits come from `flipjax.runtime.sampling.BOUNDS`, the same limits
`SamplingParams` checks, so the server and the engine can never disagree about a range.
"""
