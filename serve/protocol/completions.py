"""Bodies of `POST /v1/completions` and flipjax's token-level `POST /generate`."""

from __future__ import annotations

from pydantic import Field

from flipjax.engine.requests import MAX_CACHE_SALT_CHARS
from flipjax.runtime.sampling import BOUNDS, DEFAULT_MAX_TOKENS
from serve.protocol.sampling import SamplingFields

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, **BOUNDS["max_tokens"].constraints())
    echo: bool = False  # the prompt comes back before the completion, with its logprobs
    logprobs: int | None = Field(default=None, **BOUNDS["logprobs"].constraints())
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None  # refused by name: there is no fill-in-the-middle model
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it
    # A tenant's salt: prefixes are reused only among requests with the same one (vLLM's).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        return list(p)


class GenerateRequest(SamplingFields):
    """flipjax's token-level route: ids in, ids out."""

    input_ids: list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, **BOUNDS["max_tokens"].constraints())
