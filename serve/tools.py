"""Tool calling: what `tools` and `tool_choice` ask of a chat completion.

`auto` renders the tools into the prompt and parses Hermes/Qwen `<tool_call>` blocks out of the
answer. `required` and a named function are constrained by a grammar, as vLLM does, so the
arguments always parse and match the function's parameters schema: a named function's output
is its arguments object, `required`'s a JSON array of `{"name", "arguments"}` calls (one when
`parallel_tool_calls` is false; each function's parameters sit in its `$defs`, their own
references rebased). `none` renders the tools but never parses a call.
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
    # Each function's parameters sit in $defs, their own references rebased there, so that a
    # "#/$defs/..." inside them still finds what it named.
    defs = {
        f"tool{i}": rebased(f.parameters, f"#/$defs/tool{i}")
        for i, f in enumerate(functions.values())
    }
    calls = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{name}"}},
        }
        for name, f in zip(defs, functions.values(), strict=True)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    schema["$defs"] = defs
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolPlan("required", tools, spec=("json", schema, "tools"))


def rebased(schema: dict[str, Any], at: str) -> dict[str, Any]:
    """A copy of `schema` to place at the JSON pointer `at` of another: each reference into it
    ("#", "#/...") points there instead. Iterative, so no depth overflows the stack; values
    (const, enum, default, examples) are copied as they are."""
    root = {k: v for k, v in schema.items() if k != "$id"}
    stack: list[tuple[Any, bool]] = [(root, False)]  # (a copy, whether its keys are names)
    while stack:
        node, names = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            ref = key == "$ref" and not names and isinstance(value, str)
            if ref and (value == "#" or value.startswith("#/")):
                node[key] = at + value[1:]
            elif isinstance(value, dict | list) and (names or key not in VALUES):
                node[key] = copy = dict(value) if isinstance(value, dict) else list(value)
                stack.append((copy, isinstance(node, dict) and not names and key in MAPS))
    return root


VALUES = ("const", "enum", "default", "examples")  # instances, not schemas
MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
