"""The OpenAI response bodies the completion routes answer with (whole, and as stream chunks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flipjax.engine.engine import Output
from serve.protocol import usage
from serve.streaming import ChunkBuilder


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
