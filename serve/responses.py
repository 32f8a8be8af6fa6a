"""The OpenAI response bodies the completion routes answer with (whole, and as stream chunks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flipjax.engine.engine import Output

# (text delta, finish reason or None, usage or None) -> one SSE event's JSON body
ChunkBuilder = Callable[[str, str | None, dict[str, Any] | None], dict[str, Any]]


def usage(out: Output) -> dict[str, Any]:
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def text_completion(cid: str, model: str) -> tuple[ChunkBuilder, Callable[[Output], Any]]:
    """The chunk and final-body builders of a `text_completion` response."""

    def chunk(delta: str, finish: str | None, use: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}],
        }  # fmt: skip
        return body if use is None else {**body, "usage": use}

    def body(out: Output) -> dict[str, Any]:
        full = chunk(out.text, out.finish_reason, usage(out))
        full["choices"][0]["token_ids"] = out.token_ids
        return full

    return chunk, body


def chat_completion(cid: str, model: str) -> tuple[ChunkBuilder, Callable[[Output], Any]]:
    """The chunk and final-body builders of a `chat.completion` response; the first chunk
    carries the assistant role."""
    first = [True]

    def chunk(delta: str, finish: str | None, use: dict[str, Any] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta}
        if first[0]:
            message["role"] = "assistant"
            first[0] = False
        body: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": message, "finish_reason": finish}],
        }  # fmt: skip
        return body if use is None else {**body, "usage": use}

    def body(out: Output) -> dict[str, Any]:
        return {
            "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": out.finish_reason}],
            "usage": usage(out),
        }  # fmt: skip

    return chunk, body
