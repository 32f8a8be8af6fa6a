"""Request bodies and error responses of the HTTP API (the OpenAI shapes, plus flipjax's own).

Bodies are validated strictly: an unknown field is a 400 naming it, as are out-of-range values.
Every error is `{"error": {"message", "type", "param", "code"}}`, the OpenAI shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flipjax.engine.engine import Output
from flipjax.runtime.sampling import SamplingParams


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=16, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
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


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[int]
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        if self.max_completion_tokens is not None:
            params = dataclasses.replace(params, max_tokens=self.max_completion_tokens)
        return params


class GenerateRequest(SamplingFields):
    """flipjax's token-level route: ids in, ids out."""

    input_ids: list[int] = Field(min_length=1)


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = None
    session_id: str | None = None
    position: int | None = Field(default=None, gt=0)
    quiesce: bool = False


class BranchRequest(SamplingFields):
    """Continue from a checkpoint. Sampling fields left out keep the checkpoint's own (and its
    RNG state); `prompt`, when given, is a new turn after the checkpoint's tokens."""

    checkpoint_id: str
    model: str | None = None
    prompt: str | list[int] | None = None
    session_id: str | None = Field(default=None, min_length=1)


class RewindRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    checkpoint_id: str


class FlipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str


def error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(status_code=status, content=body)


def bad_request(message: str, param: str | None) -> JSONResponse:
    return error(400, message, param, "invalid_request_error")


async def parse(request: Request, model: type[BaseModel]) -> Any:
    """The validated body, or the 400 that names what is wrong with it."""
    try:
        body = await request.json()
    except ValueError:
        return bad_request("request body is not valid JSON", None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        return bad_request(f"{field}: {first['msg']}", field)


def usage(out: Output) -> dict[str, Any]:
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }
