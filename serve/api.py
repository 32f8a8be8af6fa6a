"""The OpenAI-compatible HTTP API, over one engine loop that batches every client together.

Routes: `GET /health`; `GET /v1/models`; `POST /v1/completions` and `POST /v1/chat/completions`
(streamed as server-sent events or not, with the usual sampling fields and
`usage.prompt_tokens_details.cached_tokens`); `POST /generate` (token ids in and out);
`GET /metrics` (Prometheus); and the admin routes `GET /phase` (with the phase policy's state),
`POST /phase_flip {"to": ...}`
(a flip between two engine steps; requests in flight carry over), `POST /abort_request`,
`POST /flush_cache` (the device prefix cache), and the store's disk-tier control
(`serve/store_routes.py`).
`--api-key` guards the inference routes; `--admin-api-key` guards the admin routes, which
without a key answer only when the server is bound to loopback. Bad input gets a 4xx in the
OpenAI error shape naming the field; an engine failure fails its requests with a 500 and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from flipjax.engine.engine import Engine, Output
from flipjax.engine.pilot import Autopilot
from flipjax.model.tiny import TINY_DESCRIPTION, TINY_NAME
from flipjax.runtime.sampling import SamplingParams
from serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from serve.detokenize import IncrementalText
from serve.engine_loop import EngineLoop, Update
from serve.metrics import Metrics
from serve.protocol import (
    AbortRequest,
    ChatRequest,
    CompletionRequest,
    FlipRequest,
    GenerateRequest,
    bad_request,
    error,
    parse,
    usage,
)
from serve.responses import text_completion
from serve.session_routes import add_session_routes
from serve.store_routes import StoreControl, add_store_routes
from serve.streaming import ChunkBuilder, collect, stream

Submitted = tuple[str, asyncio.Queue[Update]]


def create_app(
    engine: Engine,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    admin_key: str | None = None,
    chat_template: str = DEFAULT_TEMPLATE,
    store_control: StoreControl | None = None,
    autopilot: Autopilot | None = None,
) -> FastAPI:
    app = FastAPI(title="flipjax")
    loop = EngineLoop(engine, autopilot)
    metrics = Metrics()
    template = ChatTemplate(chat_template)
    app.state.loop = loop
    app.router.on_shutdown.append(loop.close)
    created = int(time.time())
    loopback = ipaddress.ip_address(_resolve(host)).is_loopback

    def refusal(request: Request, admin: bool) -> JSONResponse | None:
        key = admin_key if admin else api_key
        if key is not None:
            if request.headers.get("authorization") != f"Bearer {key}":
                what = "admin API key" if admin else "API key"
                return error(401, f"missing or wrong {what}", None, "authentication_error")
            return None
        if admin and not loopback:
            return error(403, "admin routes need --admin-api-key off loopback", None,
                         "permission_error")  # fmt: skip
        return None

    async def accept(request: Request, model: type[BaseModel], admin: bool = False) -> Any:
        """The validated body of an authorised request, or the response refusing it."""
        if (refused := refusal(request, admin)) is not None:
            return refused
        req = await parse(request, model)
        if isinstance(req, JSONResponse):
            return req
        if getattr(req, "model", None) not in (None, engine.name):
            return error(404, f"model: {req.model!r} is not served here", "model", "not_found")
        return req

    async def submit(start: Callable[[Engine], str]) -> Submitted | JSONResponse:
        """Queue a request with `start(engine)`; its id and update queue, or the refusal."""
        updates: asyncio.Queue[Update] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        try:
            rid = await asyncio.to_thread(
                loop.submit, start, lambda u: aio.call_soon_threadsafe(updates.put_nowait, u)
            )
        except ValueError as e:
            return bad_request(str(e), str(e).split(":", 1)[0])
        except KeyError as e:
            message = e.args[0] if e.args else str(e)
            return error(404, message, message.split(":", 1)[0], "not_found")
        return rid, updates

    async def respond(
        submitted: Submitted, params: SamplingParams, streamed: bool, build: ChunkBuilder,
        body: Any,
    ) -> Response:  # fmt: skip
        rid, updates = submitted
        if streamed:
            text = IncrementalText(engine.tokenizer, params.stop)
            events = stream(loop, rid, updates, text, build, metrics.request_finished)
            return StreamingResponse(events, media_type="text/event-stream")
        update = await collect(updates)
        if update.error is not None:
            return error(500, update.error, None, "internal_error")
        metrics.request_finished(update.output)
        return JSONResponse(body(update.output))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (refused := refusal(request, admin=False)) is not None:
            return refused
        card: dict[str, Any] = {
            "id": engine.name, "object": "model", "created": created, "owned_by": "flipjax",
            "max_model_len": engine.max_model_len,
        }  # fmt: skip
        if engine.name == TINY_NAME:
            card["description"] = TINY_DESCRIPTION
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req = await accept(request, CompletionRequest)
        if isinstance(req, Response):
            return req
        params = req.sampling_params()
        submitted = await submit(
            lambda e: e.add_request(req.prompt, params, session_id=req.session_id)
        )
        if isinstance(submitted, JSONResponse):
            return submitted
        chunk, body = text_completion(f"cmpl-{submitted[0]}", engine.name)
        return await respond(submitted, params, req.stream, chunk, body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        req = await accept(request, ChatRequest)
        if isinstance(req, Response):
            return req
        messages = [m.model_dump() for m in req.messages]
        if req.session_id is not None:  # the session's conversation so far comes first
            session = await asyncio.to_thread(loop.call, lambda e: e.sessions.get(req.session_id))
            messages = [*(session.chat or []), *messages] if session is not None else messages
        try:
            prompt = template.render(messages)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            return bad_request(f"messages: the chat template failed: {e}", "messages")
        params = req.sampling_params()
        submitted = await submit(
            lambda e: e.add_request(prompt, params, session_id=req.session_id, chat=messages)
        )
        if isinstance(submitted, JSONResponse):
            return submitted
        cid = f"chatcmpl-{submitted[0]}"
        first = [True]

        def chunk(delta: str, finish: str | None, use: dict[str, Any] | None) -> dict[str, Any]:
            message: dict[str, Any] = {"content": delta}
            if first[0]:
                message["role"] = "assistant"
                first[0] = False
            body: dict[str, Any] = {
                "id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": engine.name,
                "choices": [{"index": 0, "delta": message, "finish_reason": finish}],
            }  # fmt: skip
            return body if use is None else {**body, "usage": use}

        def body(out: Output) -> dict[str, Any]:
            return {
                "id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": engine.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason}],
                "usage": usage(out),
            }  # fmt: skip

        return await respond(submitted, params, req.stream, chunk, body)

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> Response:
        req = await accept(request, GenerateRequest)
        if isinstance(req, Response):
            return req
        if req.stream:
            return bad_request("stream: /generate answers once; use /v1/completions", "stream")
        params = req.sampling_params()
        submitted = await submit(lambda e: e.add_request(req.input_ids, params))
        if isinstance(submitted, JSONResponse):
            return submitted

        def body(out: Output) -> dict[str, Any]:
            return {"request_id": out.request_id, "output_ids": out.token_ids, "text": out.text,
                    "finish_reason": out.finish_reason, "usage": usage(out)}  # fmt: skip

        return await respond(submitted, params, False, lambda *a: {}, body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        await asyncio.to_thread(loop.call, metrics.read_engine)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def phase_state(e: Engine) -> dict[str, Any]:
        return _phase(e, autopilot)

    @app.get("/phase")
    async def phase(request: Request) -> Response:
        if (refused := refusal(request, admin=True)) is not None:
            return refused
        return JSONResponse(await asyncio.to_thread(loop.call, phase_state))

    @app.post("/phase_flip")
    async def phase_flip(request: Request) -> Response:
        req = await accept(request, FlipRequest, admin=True)
        if isinstance(req, Response):
            return req
        try:
            await asyncio.to_thread(loop.call, lambda e: e.flip(req.to))
        except ValueError as e:  # LayoutError: the layout cannot hold this model here
            return bad_request(f"to: {e}", "to")
        except RuntimeError as e:  # FlipError: failed before the swap; the old layout serves
            return error(500, str(e), "to", "internal_error")
        return JSONResponse(await asyncio.to_thread(loop.call, phase_state))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await accept(request, AbortRequest, admin=True)
        if isinstance(req, Response):
            return req
        rid = req.request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        if not await asyncio.to_thread(loop.cancel, rid):
            return error(404, f"request_id: {req.request_id!r} is not in flight", "request_id",
                         "not_found")  # fmt: skip
        return JSONResponse({"aborted": req.request_id})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Drop the device prefix cache; the store's host and disk tiers keep their entries."""
        if (refused := refusal(request, admin=True)) is not None:
            return refused
        flushed = await asyncio.to_thread(loop.call, lambda e: e.flush_prefix_cache())
        return JSONResponse({"flushed": flushed})

    add_store_routes(app, engine, loop, store_control, lambda r: refusal(r, admin=True))
    add_session_routes(
        app, loop, engine.name, accept, submit, respond, lambda r: refusal(r, admin=False)
    )
    return app


def _phase(engine: Engine, autopilot: Autopilot | None) -> dict[str, Any]:
    flips = engine.layouts.flips
    last = None if not flips else {**asdict(flips[-1]), "direction": flips[-1].direction}
    policy = autopilot.describe() if autopilot is not None else {"policy": "manual"}
    return {
        "layout": engine.layout, "generation": engine.layouts.generation, "last_flip": last,
        "policy": policy,
    }  # fmt: skip


def _resolve(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)
