"""The generating routes: `POST /v1/completions`, `POST /v1/chat/completions` (the checkpoint's
chat template) and flipjax's token-level `POST /generate`."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from flipjax.engine.engine import Output
from serve.auth import State, require_api_key
from serve.errors import bad_request
from serve.protocol.completions import ChatRequest, CompletionRequest, GenerateRequest
from serve.responses import chat_completion, text_completion, usage
from serve.submission import respond, submit

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["inference"])


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, state: State) -> Response:
    state.check_model(req.model)
    params = req.sampling_params()
    submitted = await submit(
        state, lambda e: e.add_request(req.prompt, params, session_id=req.session_id)
    )
    chunk, body = text_completion(f"cmpl-{submitted[0]}", state.engine.name)
    return await respond(state, submitted, params, req.stream, chunk, body)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatRequest, state: State) -> Response:
    state.check_model(req.model)
    messages = [m.model_dump() for m in req.messages]
    if req.session_id is not None:  # the session's conversation so far comes first
        session = await asyncio.to_thread(
            state.loop.call, lambda e: e.sessions.get(req.session_id)
        )
        messages = [*(session.chat or []), *messages] if session is not None else messages
    try:
        prompt = state.template.render(messages)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    params = req.sampling_params()
    submitted = await submit(
        state, lambda e: e.add_request(prompt, params, session_id=req.session_id, chat=messages)
    )
    chunk, body = chat_completion(f"chatcmpl-{submitted[0]}", state.engine.name)
    return await respond(state, submitted, params, req.stream, chunk, body)


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, state: State) -> Response:
    if req.stream:
        raise bad_request("stream: /generate answers once; use /v1/completions", "stream")
    params = req.sampling_params()
    submitted = await submit(state, lambda e: e.add_request(req.input_ids, params))

    def body(out: Output) -> dict[str, Any]:
        return {"request_id": out.request_id, "output_ids": out.token_ids, "text": out.text,
                "finish_reason": out.finish_reason, "usage": usage(out)}  # fmt: skip

    return await respond(state, submitted, params, False, lambda *a: {}, body)
