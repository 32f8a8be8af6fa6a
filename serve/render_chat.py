"""The `chat.completion` shapes: the whole answer, and the stream's chunks (a `Renderer`).

A choice's text goes through the reasoning parser (with `--reasoning-parser qwen3`) and then the
tool-call handling its `ToolPlan` asks for, so `message.content`, `reasoning_content` and
`tool_calls` (with `finish_reason: "tool_calls"`) come out the same whole or streamed. A
streamed call goes out as OpenAI's `delta.tool_calls` fragments: the id and name first, then
the arguments.
"""

from __future__ import annotations

import time
from typing import Any

from flipjax.engine.engine import Output
from flipjax.model.tokenizer import Tokenizer
from serve.logprobs import chat_logprobs
from serve.messages import Update
from serve.streaming import ChoiceStream
from serve.submission import Submitted
from serve.text_parsers import ReasoningStream, ToolCallStream, parse_tool_calls, split_reasoning
from serve.tools import ToolPlan


class ChatRenderer:
    def __init__(
        self,
        cid: str,
        model: str,
        tokenizer: Tokenizer,
        top_logprobs: int | None,
        tools: ToolPlan,
        reasoning: bool,
        thinking_opened: bool = False,
    ):
        self.cid = cid
        self.model = model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs  # None: the client asked no logprobs
        self.tools = tools
        self.reasoning = reasoning
        self.opened = thinking_opened  # the prompt ends inside <think>
        self.created = int(time.time())

    # -- whole ----------------------------------------------------------------------------------

    def body(self, submitted: Submitted, outputs: list[Output]) -> dict[str, Any]:
        choices = []
        for c, out in zip(submitted.choices, outputs, strict=True):
            reasoning, content = (
                split_reasoning(out.text, self.opened) if self.reasoning else (None, out.text)
            )
            content, calls = self._calls(content)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(out.logprobs),
                    "finish_reason": _finish(out.finish_reason, bool(calls)),
                }
            )
        return self._wrap("chat.completion", choices, submitted.final_usage(outputs))

    def _calls(self, content: str | None) -> tuple[str | None, list[dict[str, Any]]]:
        mode = self.tools.mode
        if mode in ("named", "required"):
            return None, self.tools.calls(content or "")
        if mode == "auto" and content:
            return parse_tool_calls(content)
        return content, []

    # -- streamed -------------------------------------------------------------------------------

    def delta(self, c: ChoiceStream, update: Update) -> dict[str, Any] | None:
        delta = self._feed(c, c.text.update(update.new_ids), final=False)
        logprobs = self._logprobs(update.new_logprobs)
        if not delta and not logprobs and c.started:
            return None
        return self._part(c, delta, logprobs, None)

    def last(self, c: ChoiceStream, out: Output) -> dict[str, Any]:
        delta = self._feed(c, c.text.finish(out.text), final=True)
        rest = list(out.logprobs or [])[c.tokens :]
        calls = bool(c.state.get("calls"))
        return self._part(c, delta, self._logprobs(rest), _finish(out.finish_reason, calls))

    def chunk(self, parts: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return self._wrap("chat.completion.chunk", parts, usage)

    def _feed(self, c: ChoiceStream, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for new text: reasoning first, then content or tool calls."""
        s = c.state
        delta: dict[str, Any] = {}
        if self.reasoning:
            think = s.setdefault("reasoning", ReasoningStream.after(self.opened))
            reasoning, text = think.feed(text)
            if final:
                more_reasoning, more = think.close()
                reasoning, text = reasoning + more_reasoning, text + more
            if reasoning:
                delta["reasoning_content"] = reasoning
        mode = self.tools.mode
        if mode == "named":
            call = s.get("named")
            if call is None:
                call = s["named"] = self.tools.calls("")[0]
                fn = {"name": call["function"]["name"], "arguments": text}
                s["calls"] = [call]
                delta["tool_calls"] = [
                    {"index": 0, "id": call["id"], "type": "function", "function": fn}
                ]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            return delta
        if mode == "required":
            s["text"] = s.get("text", "") + text
            if final:
                s["calls"] = self.tools.calls(s["text"])
                delta.update(_fragments(s["calls"], 0))
            return delta
        if mode == "auto":
            stream = s.setdefault("tools", ToolCallStream())
            text, calls = stream.feed(text)
            if final:
                text += stream.close()
            if calls:
                delta.update(_fragments(calls, len(stream.calls) - len(calls)))
                s["calls"] = stream.calls
        if text:
            delta["content"] = text
        return delta

    # -- internals ------------------------------------------------------------------------------

    def _part(
        self, c: ChoiceStream, delta: dict[str, Any], logprobs: Any, finish: str | None
    ) -> dict[str, Any]:
        if not c.started:
            delta = {"role": "assistant", "content": "", **delta}
        return {
            "index": c.choice.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def _logprobs(self, entries: list[Any] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or not entries:
            return None
        return {"content": chat_logprobs(self.tokenizer, list(entries), self.top_logprobs)}

    def _wrap(
        self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = {
            "id": self.cid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return body if usage is None else {**body, "usage": usage}


def _finish(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def _fragments(calls: list[dict[str, Any]], first: int) -> dict[str, Any]:
    """`delta.tool_calls` for whole calls: each with its index, id, type, name and arguments."""
    return {"tool_calls": [{"index": first + i, **call} for i, call in enumerate(calls)]}
