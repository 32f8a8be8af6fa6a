"""`POST /v1/chat/completions`: the checkpoint's chat template, tools, structured output,
logprobs, `n` choices and sessions.

The conversation (a session's earlier turns first) renders through the template with the
tools and `chat_template_kwargs`; the answer is parsed for reasoning and tool calls
(`serve.render_chat`). Without `max_completion_tokens` (or `max_tokens`) a chat answer runs
until it stops or fills what the context and the page pool leave, as vLLM's does.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.auth import State, require_api_key
from serve.errors import bad_request
from serve.limits import check_choices
from serve.messages import NewRequest, ReadSession
from serve.protocol.chat import ChatRequest
from serve.render_chat import ChatRenderer
from serve.streaming import sse
from serve.structured import grammar_for
from serve.submission import collect, submit
from serve.text_parsers import THINK_OPEN
from serve.tools import plan

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["inference"])


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatRequest, state: State) -> Response:
    state.check_model(req.model)
    messages = [m.for_template() for m in req.messages]
    if req.session_id is not None:  # the session's conversation so far comes first
        session = await asyncio.to_thread(state.loop.call, ReadSession(req.session_id))
        messages = [*(session.chat or []), *messages] if session is not None else messages
    tools = plan(req)
    try:
        prompt = state.template.render(
            messages,
            tools=tools.tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    k = req.top_logprobs if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs to be true", "top_logprobs")
    check_choices(req.n, "n", state.config.max_n)
    params = req.sampling_params(max_tokens=req.output_tokens, logprobs=k)
    grammar = await grammar_for(state, req, tools.spec)
    request = NewRequest(
        prompt,
        params,
        max_new_tokens=None,
        session_id=req.session_id,
        chat=messages,
        n=req.n,
        grammar=grammar() if grammar is not None else None,
        cache_salt=req.cache_salt,
    )
    submitted = await submit(state, [request])
    cid = f"chatcmpl-{submitted.choices[0].request_id}"
    reasoning = state.config.reasoning_parser is not None
    opened = reasoning and prompt.rstrip().endswith(THINK_OPEN)
    renderer = ChatRenderer(
        cid, state.model_name, state.info.tokenizer, k, tools, reasoning, opened
    )
    if req.stream:
        events = sse(state, submitted, renderer, list(params.stop), req.stream_options)
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(renderer.body(submitted, await collect(state, submitted)))
