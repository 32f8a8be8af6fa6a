"""Tool calling: what `tools` and `tool_choice` ask of a chat completion.

`auto` renders the tools into the prompt and parses Hermes/Qwen `<tool_call>` blocks out of the
answer. `required` and a named function are constrained by a grammar, as vLLM does, so the
arguments always parse and match the function's parameters schema: a named function's output
is its arguments object, `required`'s a JSON array of `{"name", "arguments"}` calls (one when
`parallel_tool_calls` is false). `none` renders the tools but never parses a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve.errors import bad_request
from serve.protocol.chat import ChatRequest, NamedToolChoice
from serve.structured import Spec
from serve.text_parsers import tool_call


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # as the chat template reads them
    name: str | None = None  # the named function
    spec: Spec | None = None  # the grammar that forces the call

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The calls a grammar-forced answer makes (`required` or named)."""
        if self.mode == "named":
            return [tool_call(self.name or "", text)]
        try:
            items = json.loads(text)
        except ValueError:
            return []  # cut short by max_tokens: no complete call
        return [tool_call(i["name"], i["arguments"]) for i in items]


def plan(req: ChatRequest) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: there are no tools to choose from", "tool_choice")
        return ToolPlan("none", None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    functions = {t.function.name: t.function for t in req.tools}
    if choice in (None, "auto", "none"):
        return ToolPlan(choice or "auto", tools)
    if isinstance(choice, NamedToolChoice):
        fn = functions.get(choice.function.name)
        if fn is None:
            field = "tool_choice.function.name"
            raise bad_request(f"{field}: {choice.function.name!r} is not among the tools", field)
        return ToolPlan("named", tools, fn.name, ("json", fn.parameters, "tools"))
    calls = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
        }
        for f in functions.values()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolPlan("required", tools, spec=("json", schema, "tools"))
