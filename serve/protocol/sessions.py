"""Bodies of the session checkpoint routes."""

from __future__ import annotations

from pydantic import Field

from flipjax.runtime.sampling import DEFAULT_MAX_TOKENS
from serve.protocol.sampling import SamplingFields, Strict, bounded


class CheckpointRequest(Strict):
    request_id: str | None = None
    session_id: str | None = None
    position: int | None = Field(default=None, gt=0)
    quiesce: bool = False


class BranchRequest(SamplingFields):
    """Continue from a checkpoint. Sampling fields left out keep the checkpoint's own (and its
    RNG state); `prompt`, when given, is a new turn after the checkpoint's tokens."""

    checkpoint_id: str
    max_tokens: int | None = bounded("max_tokens", DEFAULT_MAX_TOKENS)
    model: str | None = None
    prompt: str | list[int] | None = None
    session_id: str | None = Field(default=None, min_length=1)


class RewindRequest(Strict):
    session_id: str = Field(min_length=1)
    checkpoint_id: str
