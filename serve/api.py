"""The OpenAI-compatible HTTP API, over one engine loop that batches every client together.

Served today: `GET /health`, `GET /v1/models`, `POST /v1/completions` (streaming as server-sent
events, or not, with the usual sampling fields and `usage.prompt_tokens_details.cached_tokens`),
and phase control: `GET /phase` and `POST /phase_flip {"to": layout}`, which flips between two
engine steps while requests in flight carry over. Bad input gets a 4xx in the OpenAI error
shape naming the field. The engine runs on its own thread (`serve.engine_loop`), so a long
generation never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flipjax.engine import Engine, Output
from flipjax.sampling import SamplingParams
from flipjax.tiny import TINY_DESCRIPTION, TINY_NAME
from serve.detokenize import IncrementalText
from serve.engine_loop import EngineLoop, Update


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


def create_app(engine: Engine, host: str = "127.0.0.1", admin_key: str | None = None) -> FastAPI:
    """The app over `engine`, driven by one `EngineLoop`. Admin routes (phase control) need
    `admin_key` as a Bearer token, or, with no key, a server bound to a loopback address."""
    app = FastAPI(title="flipjax")
    loop = EngineLoop(engine)
    app.state.loop = loop
    app.router.on_shutdown.append(loop.close)
    created = int(time.time())

    def admin_refusal(request: Request) -> JSONResponse | None:
        if admin_key is not None:
            if request.headers.get("authorization") != f"Bearer {admin_key}":
                return _error(401, "admin route: missing or wrong admin API key", None,
                              "authentication_error")  # fmt: skip
            return None
        if not ipaddress.ip_address(_resolve(host)).is_loopback:
            return _error(403, "admin route: set --admin-api-key to use it off loopback", None,
                          "permission_error")  # fmt: skip
        return None

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
            "max_model_len": engine.max_model_len,
        }
        if engine.name == TINY_NAME:
            card["description"] = TINY_DESCRIPTION
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        req = await _parse(request, CompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        if req.model != engine.name:
            return _error(404, f"model: {req.model!r} is not served here", "model", "not_found")
        updates: asyncio.Queue[Update] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        try:
            rid = await asyncio.to_thread(
                loop.submit, req.prompt, req.sampling_params(),
                lambda u: aio.call_soon_threadsafe(updates.put_nowait, u),
            )  # fmt: skip
        except ValueError as e:
            return _bad_request(str(e), str(e).split(":", 1)[0])
        cid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            text = IncrementalText(engine.tokenizer, req.sampling_params().stop)
            return StreamingResponse(
                _stream(loop, rid, updates, text, cid, engine.name), media_type="text/event-stream"
            )
        while (update := await updates.get()).output is None and update.error is None:
            pass
        if update.error is not None:
            return _error(500, update.error, None, "internal_error")
        out = update.output
        return JSONResponse(
            {
                "id": cid,
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
                "usage": _usage(out),
            }
        )

    @app.get("/phase")
    async def phase(request: Request) -> JSONResponse:
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        return JSONResponse(await asyncio.to_thread(loop.call, _phase))

    @app.post("/phase_flip")
    async def phase_flip(request: Request) -> JSONResponse:
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        req = await _parse(request, FlipRequest)
        if isinstance(req, JSONResponse):
            return req
        try:
            await asyncio.to_thread(loop.call, lambda e: e.flip(req.to))
        except ValueError as e:  # LayoutError: the layout cannot hold this model here
            return _bad_request(f"to: {e}", "to")
        except RuntimeError as e:  # FlipError: failed before the swap; the old layout serves
            return _error(500, str(e), "to", "internal_error")
        return JSONResponse(await asyncio.to_thread(loop.call, _phase))

    return app


class FlipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The validated body, or the 400 that names what is wrong with it."""
    try:
        body = await request.json()
    except ValueError:
        return _bad_request("request body is not valid JSON", None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        return _bad_request(f"{field}: {first['msg']}", field)


def _phase(engine: Engine) -> dict[str, Any]:
    flips = engine.runner.flips
    return {
        "layout": engine.layout,
        "generation": engine.runner.generation,
        "last_flip": None if not flips else {**asdict(flips[-1]), "direction": flips[-1].direction},
    }


def _usage(out: Output) -> dict[str, Any]:
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


async def _stream(
    loop: EngineLoop,
    rid: str,
    updates: asyncio.Queue[Update],
    text: IncrementalText,
    cid: str,
    model: str,
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step that released text, a final chunk with the finish
    reason and usage, then [DONE]. A client that goes away aborts the request at once."""

    def chunk(delta: str, finish: str | None, usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}],
        }  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    finished = False
    try:
        while True:
            update = await updates.get()
            if update.error is not None:
                finished = True
                error = {"message": update.error, "type": "internal_error", "code": 500}
                yield f"data: {json.dumps({'error': error})}\n\n"
                break
            if update.output is not None:
                finished = True
                out = update.output
                yield chunk(text.finish(out.text), out.finish_reason, _usage(out))
                break
            delta = text.update(update.token_ids)
            if delta:
                yield chunk(delta, None)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            loop.abort(rid)


def _resolve(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)
