"""The schema fuzz through real HTTP: the app in this process under uvicorn, the tiny model
generating under each grammar, and malformed structured-output bodies beside the drawn schemas.

A case passes when the answer is a 400 (or 413) with an error in the OpenAI shape, or a 200
whose text (or each tool call's arguments) validates against the schema, unless it was cut at
`max_tokens`; any other status, a 500 above all, is a failure.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import httpx

from tests.support.in_process import InProcessServer
from tests.support.schema_check import validation_error
from tests.support.schema_gen import random_schema

FORMS = ("response_format", "guided_json", "guided_text", "structured", "named", "required")
OTHER_TOOL = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
DEEP = "{" + '"a":{' * 3000 + "}" * 3000 + "}"
# Bodies whose structured-output fields are malformed: (body text, the schema a 200 must meet;
# None: a 200 is not checked).
MALFORMED = [
    ({"response_format": {"type": "json_schema"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "str"}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": None}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, None),
    ({"response_format": {"type": "xml"}}, None),
    ({"response_format": "json_object"}, None),
    (
        {"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
        {"type": "object"},
    ),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": 5}, None),
    ({"guided_json": "not json"}, None),
    ({"guided_json": "[1, 2]"}, None),
    ({"guided_json": {"type": "integer"}, "guided_regex": "a"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, None),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": "required"}, None),
    ({"tools": [], "tool_choice": "required"}, None),
    ({"structured_outputs": {"json": {"const": 1}, "regex": "a"}}, None),
    ({"guided_json": {"enum": [f"v{i:05}" for i in range(9000)]}}, None),
]
_RAW = '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
RAW = [  # bodies that are not what json.dumps writes
    _RAW + '"guided_json": {"const": Infinity}}',
    _RAW + '"guided_json": {"type": "number", "maximum": NaN}}',
    _RAW + '"response_format": {"type": "json_schema", "json_schema": {"schema": ' + DEEP + "}}}",
    _RAW + '"guided_json": {"type": "object", "properties": {"a": {}, "a": {"type": 1}}}}',
]


DEEP_BODY = _RAW + '"guided_json": ' + "[" * 10_000 + "]" * 10_000 + "}"


def request_body(form: str, schema: Any, max_tokens: int = 64) -> dict[str, Any]:
    """A chat completion body that sends `schema` as `form` (one of FORMS) asks."""
    body: dict[str, Any] = {**CHAT, "max_tokens": max_tokens}
    if form == "response_format":
        wrapped = {"name": "s", "schema": schema}
        body["response_format"] = {"type": "json_schema", "json_schema": wrapped}
    elif form in ("guided_json", "guided_text"):
        body["guided_json"] = _text(schema) if form == "guided_text" else schema
    elif form == "structured":
        body["structured_outputs"] = {"json": schema}
    else:
        fns = [{"name": "f", "parameters": schema}, {"name": "g", "parameters": OTHER_TOOL}]
        body["tools"] = [{"type": "function", "function": fn} for fn in fns]
        named = {"type": "function", "function": {"name": "f"}}
        body["tool_choice"] = named if form == "named" else "required"
    return body


def _text(schema: Any) -> str:
    """`schema` as JSON text; one too deep to write out is sent as a text as deep."""
    try:
        return json.dumps(schema)
    except RecursionError:
        return "[" * 10_000


def _body_text(body: dict[str, Any], seed: int) -> str:
    """`body` as JSON text; a schema too deep to write out goes as a text as deep."""
    try:
        return json.dumps({**body, "temperature": 1.0, "seed": seed})
    except RecursionError:
        return DEEP_BODY


def judge(r: httpx.Response, schema: Any, tools: bool) -> tuple[str, str]:
    """(outcome, why): refused, valid, cut, unchecked or failure."""
    if r.status_code in (400, 413):
        error = r.json().get("error", {})
        return ("refused", str(error.get("param"))) if error.get("message") else ("failure", r.text)
    if r.status_code != 200:
        return "failure", f"HTTP {r.status_code}: {r.text[:300]}"
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return "cut", "max_tokens"
    if schema is None:
        return "unchecked", ""
    if not tools:
        problem = validation_error(choice["message"]["content"].encode(), schema)
        return ("failure", problem) if problem else ("valid", "")
    calls = choice["message"].get("tool_calls") or []
    if not calls:
        return "failure", f"no tool calls: {choice['message']}"
    for call in calls:
        target = schema if call["function"]["name"] == "f" else OTHER_TOOL
        problem = validation_error(call["function"]["arguments"].encode(), target)
        if problem:
            return "failure", problem
    return "valid", ""


def http_fuzz(cases: int, seed: int = 0, max_tokens: int = 96) -> dict[str, Any]:
    """`cases` requests: the malformed bodies first, then drawn schemas in drawn forms."""
    served = InProcessServer(log_level="error")
    counts: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    try:
        with httpx.Client(base_url=served.base, timeout=300) as client:
            for case in range(cases):
                rng = random.Random(seed * 7919 + case)
                fixed = [(json.dumps({**CHAT, **b}), s) for b, s in MALFORMED]
                fixed += [(raw, None) for raw in RAW]
                tools = False
                if case < len(fixed):
                    text, schema = fixed[case]
                else:
                    schema, form = random_schema(rng), rng.choice(FORMS)
                    text = _body_text(request_body(form, schema, max_tokens), case)
                    tools = form in ("named", "required")
                headers = {"content-type": "application/json"}
                r = client.post("/v1/chat/completions", content=text, headers=headers)
                outcome, why = judge(r, schema, tools)
                counts[outcome] += 1
                if outcome == "failure":
                    failures.append({"case": case, "body": text[:400], "why": why[:400]})
    finally:
        served.stop()
    return {"cases": cases, **counts, "failures": failures}
