"""Server-sent events over every choice of a request.

Each engine update becomes at most one chunk, for the choice it is about; a `Renderer` (the
completions or the chat shape) turns it into that choice's delta. Text is released through
`IncrementalText`, so a stream never carries a broken character or a stop string. The stream
ends after every choice finished, with a usage chunk (`choices: []`) when the client asked
`stream_options.include_usage`, then `[DONE]`; with `continuous_usage_stats` every chunk also
carries the usage so far. A client that goes away mid-stream aborts whatever is still running.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from flipjax.engine.engine import Output
from serve.detokenize import IncrementalText
from serve.messages import Update
from serve.protocol.sampling import StreamOptions
from serve.state import ServerState
from serve.submission import Choice, Submitted


@dataclass
class ChoiceStream:
    """One choice as its stream goes: its text so far and what it has been sent."""

    choice: Choice
    text: IncrementalText
    tokens: int = 0  # generated tokens seen
    started: bool = False  # whether its first delta went out
    state: dict[str, Any] = field(default_factory=dict)  # the renderer's own (parsers)


class Renderer(Protocol):
    def delta(self, c: ChoiceStream, update: Update) -> dict[str, Any] | None:
        """The choice's part of a chunk for new tokens; None when there is nothing to send."""

    def last(self, c: ChoiceStream, out: Output) -> dict[str, Any]:
        """The choice's part of its final chunk, with the finish reason."""

    def chunk(self, parts: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """An SSE event's body."""


async def sse(
    state: ServerState,
    submitted: Submitted,
    renderer: Renderer,
    stops: list[str],
    options: StreamOptions | None,
) -> AsyncIterator[str]:
    tokenizer = state.info.tokenizer
    streams = {
        c.request_id: ChoiceStream(c, IncrementalText(tokenizer, stops)) for c in submitted.choices
    }
    pending = set(streams)
    outputs: dict[str, Output] = {}
    continuous = options is not None and options.continuous_usage_stats
    try:
        while pending:
            update = await submitted.updates.get()
            if update.error is not None:
                error = {"message": update.error, "type": "internal_error", "code": 500}
                yield _event({"error": error})
                pending.clear()
                break
            c = streams[update.request_id]
            if update.output is not None:
                pending.discard(update.request_id)
                outputs[update.request_id] = update.output
                state.metrics.request_finished(update.output)
                part: dict[str, Any] | None = renderer.last(c, update.output)
                c.tokens = len(update.output.token_ids)
            else:
                part = renderer.delta(c, update)
                c.tokens += len(update.new_ids)
            c.started = c.started or part is not None
            if part is not None:
                usage = _usage_so_far(submitted, streams) if continuous else None
                yield _event(renderer.chunk([part], usage))
        if options is not None and options.include_usage and not pending:
            ordered = [outputs[c.request_id] for c in submitted.choices]
            yield _event(renderer.chunk([], submitted.final_usage(ordered)))
        yield "data: [DONE]\n\n"
    finally:
        for request_id in pending:  # the client went away: stop what still runs
            state.loop.abort(request_id)


def _usage_so_far(submitted: Submitted, streams: dict[str, ChoiceStream]) -> dict[str, Any]:
    return submitted.usage(sum(s.tokens for s in streams.values()))


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
