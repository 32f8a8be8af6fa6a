"""Turning a request's engine updates into a response: collected, or streamed as SSE.

`updates` carries what the engine loop pushes after each step. Streams release text through
`IncrementalText`, end with a chunk that has the finish reason and usage, then `[DONE]`. A
client that goes away mid-stream aborts its request at once, freeing its pages and slot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from flipjax.engine.engine import Output
from serve.detokenize import IncrementalText
from serve.engine_loop import EngineLoop, Update
from serve.responses import ChunkBuilder, usage


async def collect(updates: asyncio.Queue[Update]) -> Update:
    """The final update: the output, or the error."""
    while (update := await updates.get()).output is None and update.error is None:
        pass
    return update


async def stream(
    loop: EngineLoop,
    request_id: str,
    updates: asyncio.Queue[Update],
    text: IncrementalText,
    build: ChunkBuilder,
    on_finish: Callable[[Output], None],
) -> AsyncIterator[str]:
    finished = False
    try:
        while True:
            update = await updates.get()
            if update.error is not None:
                finished = True
                error = {"message": update.error, "type": "internal_error", "code": 500}
                yield _event({"error": error})
                break
            if update.output is not None:
                finished = True
                out = update.output
                on_finish(out)
                yield _event(build(text.finish(out.text), out.finish_reason, usage(out)))
                break
            delta = text.update(update.new_ids)
            if delta:
                yield _event(build(delta, None, None))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            loop.abort(request_id)


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
