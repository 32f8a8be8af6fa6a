"""Submitting requests to the engine loop, and collecting their choices.

One HTTP request becomes one engine request per prompt, each with `n` parallel choices; they are
queued all or none. `Submitted` lists every choice in response order (prompt by prompt, then
choice by choice) with the queue their updates arrive on. A refusal raises the `APIError` the
client gets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from flipjax.engine.engine import Output
from flipjax.runtime.multihost import ProcessLost
from flipjax.runtime.sampling import SamplingParams
from serve.engine_loop import LoopDead
from serve.errors import APIError, internal_error, refusal
from serve.messages import Message, Start, Update
from serve.state import ServerState


@dataclass(frozen=True)
class Choice:
    index: int  # its place in the response
    request_id: str
    prompt: int  # which of the request's prompts it answers
    prompt_tokens: int


@dataclass
class Submitted:
    choices: list[Choice]
    updates: asyncio.Queue[Update]
    sampling: list[SamplingParams]  # what each prompt runs with (a branch's may be its own)

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The OpenAI usage object; each prompt counts once, however many choices it has."""
        prompt = sum({c.prompt: c.prompt_tokens for c in self.choices}.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def final_usage(self, outputs: list[Output]) -> dict[str, Any]:
        """Usage once every choice finished; a prompt's cached tokens are its first choice's
        (the others fork from it)."""
        first = {}
        for choice, out in zip(self.choices, outputs, strict=True):
            first.setdefault(choice.prompt, out.cached_tokens)
        return self.usage(sum(len(o.token_ids) for o in outputs), sum(first.values()))


async def submit(state: ServerState, requests: list[Start]) -> Submitted:
    updates: asyncio.Queue[Update] = asyncio.Queue()
    aio = asyncio.get_running_loop()
    try:
        admitted = await asyncio.to_thread(
            state.loop.submit, requests, lambda u: aio.call_soon_threadsafe(updates.put_nowait, u)
        )
    except (ValueError, KeyError) as err:
        raise refusal(err) from None
    except (LoopDead, ProcessLost):
        raise
    except Exception as err:  # noqa: BLE001 - this request fails alone, with a reference
        raise internal_error("admitting the request", err) from None
    each = [(p, rid, a.prompt_tokens) for p, a in enumerate(admitted) for rid in a.choices]
    choices = [Choice(index, rid, p, tokens) for index, (p, rid, tokens) in enumerate(each)]
    return Submitted(choices, updates, [a.sampling for a in admitted])


async def collect(state: ServerState, submitted: Submitted) -> list[Output]:
    """Every choice's output, in response order; an engine failure is a 500."""
    done: dict[str, Output] = {}
    while len(done) < len(submitted.choices):
        update = await submitted.updates.get()
        if update.error is not None:
            for choice in submitted.choices:
                if choice.request_id not in done:
                    state.loop.abort(choice.request_id)
            raise APIError(500, update.error, None, "internal_error")
        if update.output is not None:
            done[update.request_id] = update.output
            state.metrics.request_finished(update.output)
    return [done[c.request_id] for c in submitted.choices]


async def on_loop(state: ServerState, message: Message) -> Any:
    """Apply `message` on the loop thread between two steps; refusals become 400 or 404."""
    try:
        return await asyncio.to_thread(state.loop.call, message)
    except (ValueError, KeyError) as err:
        raise refusal(err) from None
