"""The sampling fields every generating route takes (the OpenAI ones and vLLM's extras)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flipjax.runtime.sampling import BOUNDS, DEFAULT_MAX_TOKENS, SamplingParams


def bounded(name: str, default: Any) -> Any:
    """A pydantic field for the sampling field `name`, constrained by the engine's own limits."""
    return Field(default=default, **BOUNDS[name].constraints())


class Strict(BaseModel):
    """A body that refuses fields it does not know, naming them."""

    model_config = ConfigDict(extra="forbid")


class SamplingFields(Strict):
    max_tokens: int = bounded("max_tokens", DEFAULT_MAX_TOKENS)
    temperature: float = bounded("temperature", 1.0)
    top_p: float = bounded("top_p", 1.0)
    top_k: int = bounded("top_k", 0)
    min_p: float = bounded("min_p", 0.0)
    presence_penalty: float = bounded("presence_penalty", 0.0)
    frequency_penalty: float = bounded("frequency_penalty", 0.0)
    repetition_penalty: float = bounded("repetition_penalty", 1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    user: str | None = None

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )  # fmt: skip
