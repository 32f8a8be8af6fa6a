"""Logprobs in the OpenAI shapes: the completions form (tokens, token_logprobs, top_logprobs,
text_offset) and the chat form (content[] with token, logprob, bytes and top_logprobs).

Every value is the model's own log-softmax before any sampling modifier (penalties, bias,
grammar, temperature, top-k/p), as vLLM returns them. A token is shown as its own decoded text,
or as `token_id:<id>` (vLLM's form) when that text is empty or not whole characters, so that
distinct tokens never share a key; the completions form's top_logprobs also holds the chosen
token, as vLLM's does.
"""

from __future__ import annotations

from typing import Any

from flipjax.engine.sequence import TokenLogprob
from flipjax.model.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """How a token is shown: its decoded text, or `token_id:<id>` when that is empty or holds
    a broken character (a byte of a longer UTF-8 sequence)."""
    text = tokenizer.decode([token])
    return text if text and "\ufffd" not in text else f"token_id:{token}"


class CompletionLogprobs:
    """The completions form, built up over a stream; `text_offset` counts from `offset`."""

    def __init__(self, tokenizer: Tokenizer, top: int, offset: int = 0):
        self.tokenizer = tokenizer
        self.top = top
        self.offset = offset

    def block(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict[str, Any]:
        """The logprobs of `tokens` (entry None: the first prompt token, which has none)."""
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(self.tokenizer.decode([t]))
        return {
            "tokens": [token_text(self.tokenizer, t) for t in tokens],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [self._top(e) for e in entries],
            "text_offset": offsets,
        }

    def _top(self, entry: TokenLogprob | None) -> dict[str, float] | None:
        if entry is None:
            return None
        top = {token_text(self.tokenizer, i): lp for i, lp in entry.top[: self.top]}
        top.setdefault(token_text(self.tokenizer, entry.token_id), entry.logprob)
        return top


def merge(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One completions-form logprobs object from consecutive blocks (prompt, then output)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for b in blocks for v in b[k]] for k in keys}


def chat_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob], top: int
) -> list[dict[str, Any]]:
    """The chat form's `content` entries for generated tokens."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_text(tokenizer, token),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token)),
        }

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top[:top]]}
        for e in entries
    ]
