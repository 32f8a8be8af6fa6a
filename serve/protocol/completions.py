"""Bodies of the text routes: OpenAI completions and chat, and flipjax's token-level route."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flipjax.runtime.sampling import BOUNDS, SamplingParams
from serve.protocol.sampling import SamplingFields, Strict


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[int]
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, **BOUNDS["max_tokens"].constraints())
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        if self.max_completion_tokens is not None:
            params = params.replace(max_tokens=self.max_completion_tokens)
        return params


class GenerateRequest(SamplingFields):
    """flipjax's token-level route: ids in, ids out."""

    input_ids: list[int] = Field(min_length=1)
