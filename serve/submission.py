"""Submitting a request to the engine loop, and answering it: collected, or streamed as SSE.

`submit` queues `start(engine)` on the loop thread and returns the request's id and the queue
its updates arrive on; a refusal raises the `APIError` the client gets. `respond` turns the
updates into the response, with `build` making each stream chunk and `body` the whole answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from flipjax.engine.engine import Engine, Output
from flipjax.runtime.sampling import SamplingParams
from serve.detokenize import IncrementalText
from serve.engine_loop import Update
from serve.errors import APIError, refusal
from serve.state import ServerState
from serve.streaming import ChunkBuilder, collect, stream

Submitted = tuple[str, asyncio.Queue[Update]]


async def submit(state: ServerState, start: Callable[[Engine], str]) -> Submitted:
    updates: asyncio.Queue[Update] = asyncio.Queue()
    aio = asyncio.get_running_loop()
    try:
        rid = await asyncio.to_thread(
            state.loop.submit, start, lambda u: aio.call_soon_threadsafe(updates.put_nowait, u)
        )
    except (ValueError, KeyError) as err:
        raise refusal(err) from None
    return rid, updates


async def on_loop(state: ServerState, fn: Callable[[Engine], Any]) -> Any:
    """Run `fn(engine)` on the loop thread between two steps; refusals become 400 or 404."""
    try:
        return await asyncio.to_thread(state.loop.call, fn)
    except (ValueError, KeyError) as err:
        raise refusal(err) from None


async def respond(
    state: ServerState,
    submitted: Submitted,
    params: SamplingParams,
    streamed: bool,
    build: ChunkBuilder,
    body: Callable[[Output], Any],
) -> Response:
    rid, updates = submitted
    if streamed:
        text = IncrementalText(state.engine.tokenizer, params.stop)
        events = stream(state.loop, rid, updates, text, build, state.metrics.request_finished)
        return StreamingResponse(events, media_type="text/event-stream")
    update = await collect(updates)
    if update.error is not None:
        raise APIError(500, update.error, None, "internal_error")
    state.metrics.request_finished(update.output)
    return JSONResponse(body(update.output))
