"""Bodies of vLLM's `POST /tokenize` (a prompt, or chat messages through the template) and
`POST /detokenize`."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from serve.protocol.chat import ChatMessage, Tool
from serve.protocol.sampling import Lenient


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)
