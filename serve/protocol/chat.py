"""Body of `POST /v1/chat/completions`: messages (with tool calls and tool results), tools,
logprobs, and vLLM's chat template controls."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from flipjax.engine.requests import MAX_CACHE_SALT_CHARS
from flipjax.runtime.sampling import BOUNDS
from serve.protocol.sampling import Lenient, SamplingFields


class ContentPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result answers this call
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, tool calls with their
        arguments parsed (Qwen's and Hermes' templates serialise them again)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, **BOUNDS["max_tokens"].constraints())
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, **BOUNDS["logprobs"].constraints())
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    session_id: str | None = Field(default=None, min_length=1)  # append this turn to it
    # A tenant's salt: prefixes are reused only among requests with the same one (vLLM's).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @property
    def output_tokens(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens; None: as many as fit."""
        return self.max_completion_tokens or self.max_tokens
