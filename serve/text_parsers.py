"""Parsers that split a chat completion's text: Qwen3's `<think>...</think>` reasoning, and
Hermes/Qwen tool calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each works on the whole text (`split_reasoning`, `parse_tool_calls`) and as a stream (`feed`
new text, `close` at the end); a stream finds the same calls and reasoning as the whole text,
and its content deltas join to the same content before the whole-text parse trims it. A
streaming parser holds back any tail that could still become its tag, the way the detokenizer
holds back a stop string.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of Qwen3 output. Reasoning is what follows `<think>` up to
    `</think>` (all the rest when it never closes); `opened` says the prompt already ends
    with `<think>` (templates that think by default put it there)."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(THINK_OPEN):
        return None, text or None
    body = text if opened else stripped[len(THINK_OPEN) :]
    if THINK_CLOSE not in body:
        return body.strip("\n") or None, None
    reasoning, content = body.split(THINK_CLOSE, 1)
    return reasoning.strip("\n") or None, content.lstrip("\n") or None


@dataclass
class ReasoningStream:
    """Streams `split_reasoning`: deltas of (reasoning, content)."""

    buffer: str = ""
    phase: str = "start"  # start (before any text), think, closed (just after it), content

    @classmethod
    def after(cls, opened: bool) -> ReasoningStream:
        return cls(phase="think" if opened else "start")

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.phase == "start":
            stripped = self.buffer.lstrip()
            if THINK_OPEN.startswith(stripped) and len(stripped) < len(THINK_OPEN):
                return "", ""  # could still be the opening tag
            if stripped.startswith(THINK_OPEN):
                self.buffer, self.phase = stripped[len(THINK_OPEN) :].lstrip("\n"), "think"
            else:
                self.phase = "content"
        if self.phase == "think":
            if THINK_CLOSE in self.buffer:
                reasoning, self.buffer = self.buffer.split(THINK_CLOSE, 1)
                self.phase = "closed"
            else:
                cut = len(self.buffer) - _partial_tail(self.buffer, THINK_CLOSE)
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return reasoning, ""
        if self.phase == "closed":  # newlines right after the close belong to neither
            self.buffer = self.buffer.lstrip("\n")
            self.phase = "content" if self.buffer else "closed"
        if self.phase == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def close(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.phase == "think" else ("", rest)


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """A `message.tool_calls` entry; arguments are a JSON string, as OpenAI sends them."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls, the calls) of Hermes-style output. A block that is not a
    JSON object with a name stays in the content, untouched."""
    content, calls, rest = [], [], text
    while CALL_OPEN in rest:
        before, after = rest.split(CALL_OPEN, 1)
        if CALL_CLOSE not in after:
            break
        body, rest = after.split(CALL_CLOSE, 1)
        call = _call(body)
        content.append(before)
        if call is None:
            content.append(CALL_OPEN + body + CALL_CLOSE)
        else:
            calls.append(call)
    content.append(rest)
    joined = "".join(content).strip()
    return joined or None, calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


@dataclass
class ToolCallStream:
    """Streams `parse_tool_calls`: content deltas, and each call whole once it closes."""

    buffer: str = ""
    inside: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, new = "", []
        while True:
            if not self.inside:
                if CALL_OPEN in self.buffer:
                    before, self.buffer = self.buffer.split(CALL_OPEN, 1)
                    content += before
                    self.inside = True
                    continue
                cut = len(self.buffer) - _partial_tail(self.buffer, CALL_OPEN)
                content += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return content, new
            if CALL_CLOSE not in self.buffer:
                return content, new
            body, self.buffer = self.buffer.split(CALL_CLOSE, 1)
            self.inside = False
            call = _call(body)
            if call is None:
                content += CALL_OPEN + body + CALL_CLOSE
            else:
                self.calls.append(call)
                new.append(call)

    def close(self) -> str:
        """Whatever was held back: an unclosed call is content, as the whole-text parse says."""
        rest = (CALL_OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return rest
