"""The fields every generating route takes: OpenAI's sampling fields, vLLM's extras, and the
structured-output fields (OpenAI's `response_format`, vLLM's `guided_*` and `structured_outputs`).

Bodies are lenient the way vLLM's are: a field the server does not know is ignored, logged once
per name and counted (`flipjax:unknown_request_fields_total`), while a known field with a wrong
type or range is a 400 naming it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flipjax.runtime.sampling import BOUNDS, SamplingParams
from serve.errors import refusal

log = logging.getLogger("flipjax.serve")
UNKNOWN_FIELDS: Counter[str] = Counter()  # field name -> requests that sent it
# Names come from clients, so only this many get a label (and a log line) of their own; the
# rest count under OTHER_FIELDS, which keeps /metrics and this counter bounded.
MAX_UNKNOWN_FIELD_NAMES = 32
OTHER_FIELDS = "(other)"


def bounded(name: str, default: Any) -> Any:
    """A pydantic field for the sampling field `name`, constrained by the engine's own limits."""
    return Field(default=default, **BOUNDS[name].constraints())


class Strict(BaseModel):
    """A flipjax body (admin, sessions): a field it does not know is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """An OpenAI-style body: unknown fields are ignored, logged once and counted."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _count_unknown(self) -> Lenient:
        for name in self.model_extra or {}:
            if name not in UNKNOWN_FIELDS:
                if len(UNKNOWN_FIELDS) >= MAX_UNKNOWN_FIELD_NAMES:
                    name = OTHER_FIELDS
                else:
                    log.warning("ignoring request field %r, which flipjax does not know", name[:64])
            UNKNOWN_FIELDS[name] += 1
        return self


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, as vLLM sends it


class JSONSchema(Lenient):
    name: str = "schema"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, so the field is named otherwise and aliased.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StructuredOutputs(Lenient):
    """vLLM's newer form of the guided fields: exactly one of them."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Lenient):
    max_tokens: int | None = bounded("max_tokens", None)
    temperature: float = bounded("temperature", 1.0)
    top_p: float = bounded("top_p", 1.0)
    top_k: int = bounded("top_k", 0)
    min_p: float = bounded("min_p", 0.0)
    presence_penalty: float = bounded("presence_penalty", 0.0)
    frequency_penalty: float = bounded("frequency_penalty", 0.0)
    repetition_penalty: float = bounded("repetition_penalty", 1.0)
    min_tokens: int = bounded("min_tokens", 0)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The engine's parameters; a cross-field refusal (for example max_tokens 0 without
        logprobs to compute) is a 400 naming the field."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        fields = dict(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias or {},
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )
        try:
            return SamplingParams(**{**fields, **overrides})
        except ValueError as err:
            raise refusal(err) from None
