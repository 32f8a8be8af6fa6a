"""A minimal OpenAI-compatible HTTP API over the offline engine.

What it serves today: `GET /health`, `GET /v1/models`, and non-streaming `POST /v1/completions`
with the usual sampling fields. Anything it cannot honour yet (streaming) is refused with a 400
naming the field rather than silently ignored. Engine calls are serialised by a lock and run off
the event loop, so a long generation never blocks `/health`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flipjax.engine import Engine
from flipjax.sampling import SamplingParams
from flipjax.tiny import TINY_DESCRIPTION, TINY_NAME


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int]
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


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(status_code=status, content=body)


def _bad_request(message: str, param: str | None) -> JSONResponse:
    return _error(400, message, param, "invalid_request_error")


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="flipjax")
    lock = threading.Lock()
    created = int(time.time())

    def run_generate(prompt: str | list[int], params: SamplingParams) -> Any:
        with lock:
            return engine.generate([prompt], sampling=params)[0]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": engine.name,
            "object": "model",
            "created": created,
            "owned_by": "flipjax",
            "max_model_len": engine.config.max_position_embeddings,
        }
        if engine.name == TINY_NAME:
            card["description"] = TINY_DESCRIPTION
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("request body is not valid JSON", None)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            return _bad_request(f"{field}: {first['msg']}", field)
        if req.model != engine.name:
            return _error(404, f"model: {req.model!r} is not served here", "model", "not_found")
        if req.stream:
            return _bad_request("stream: streaming is not supported by this server yet", "stream")
        try:
            out = await asyncio.to_thread(run_generate, req.prompt, req.sampling_params())
        except ValueError as e:
            return _bad_request(str(e), str(e).split(":", 1)[0])
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": engine.name,
                "choices": [
                    {
                        "index": 0,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "logprobs": None,
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": len(out.token_ids),
                    "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
                },
            }
        )

    return app
