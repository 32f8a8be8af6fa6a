"""Structured output holds for any JSON schema: refused with a 400 naming the field and the
reason, or output that is JSON the schema accepts (`tests.support.schema_fuzz`, no model).

A bounded fuzz with a fixed seed must find no failure, and each failure the full fuzz found
(`python -m tests.support.schema_fuzz --cases 4000`) has a regression test of its own here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from flipjax.runtime.json_pattern import xgrammar_pattern
from flipjax.runtime.utf8_guard import STATES, Utf8Guard
from serve.errors import install_handlers
from serve.protocol.chat import ChatRequest
from tests.support.schema_fuzz import SchemaFuzz
from tests.support.schema_gen import deep, random_schema
from tests.support.schema_http import DEEP_BODY, MALFORMED


@pytest.fixture(scope="module")
def fuzz():
    f = SchemaFuzz(walks=2)
    yield f
    f.close()


def always_valid(fuzz: SchemaFuzz, schema: dict, form: str = "guided_json", walks: int = 40):
    for seed in range(walks):
        got = fuzz.check(form, schema, seed)
        assert got.kind == "valid", (got.reason, got.text)


def test_a_bounded_fuzz_finds_no_failure(fuzz):
    result = fuzz.run(cases=450, seed=3, shrink_failures=False)
    assert result["failures"] == [], result["failures"][:3]
    assert result["valid"] > 200 and result["refused"] > 100  # both ways were exercised


REFUSED = [
    # Keywords xgrammar passed over: the output broke them.
    ({"type": "integer", "multipleOf": 7}, "#/multipleOf: is not supported"),
    ({"not": {"type": "string"}}, "#/not: is not supported"),
    ({"type": "array", "uniqueItems": True}, "#/uniqueItems: is not supported"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "#/if: is not supported"),
    ({"type": "array", "contains": {"type": "integer"}}, "#/contains: is not supported"),
    # Keywords beside another form, which xgrammar applied alone.
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}, "minLength": 3}, "$ref beside"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, "anyOf beside"),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]}, "more than one"),
    ({"type": "string", "enum": ["a", 1]}, "#/enum: holds a value that is not of type"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "branches 0 and 1 may both match"),
    ({"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}, "branches 0 and 1 may both match"),
    ({"type": "object", "required": ["x"]}, "'x' is not in properties"),
    ({"maxLength": 2}, "maxLength needs a type"),
    ({"minimum": 5}, "minimum needs a type"),
    ({"type": "string", "pattern": "^a?$", "minLength": 3}, "pattern beside minLength"),
    ({"type": "string", "format": "date", "maxLength": 3}, "format date beside maxLength"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "format email beside pattern"),
    # Number ranges xgrammar compiled to an empty value, or doubles cannot keep apart.
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-6}, "no number of at"),
    ({"type": "number", "minimum": 0.1234567, "maximum": 0.1234568}, "no number of at"),
    ({"type": "number", "exclusiveMaximum": -1e30}, "#/exclusiveMaximum: past"),
    # Patterns xgrammar got wrong.
    ({"type": "string", "pattern": "^(a|b)*c{200}$"}, "repetition {200} past 128"),
    ({"type": "string", "pattern": "(?=x)y"}, "lookaround"),
    ({"type": "string", "pattern": '^"$'}, "JSON escapes it"),
    ({"type": "string", "pattern": "^\\t$"}, "JSON escapes it"),
    # No finite value: a walk never ends.
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite"),
    # Invalid schemas xgrammar took.
    ({"type": "string", "minLength": 1.5}, "#/minLength: must be a non-negative integer"),
    ({"type": "integer", "minimum": True}, "#/minimum: must be a finite number"),
    ({"$schema": "http://json-schema.org/draft-04/schema#"}, "only drafts 6, 7"),
    ({"type": "string", "pattern": "\\p{L}"}, "not a valid regular expression"),
]


@pytest.mark.parametrize("form", ["guided_json", "response_format", "named"])
@pytest.mark.parametrize("schema, reason", REFUSED)
def test_what_would_not_be_enforced_is_refused_by_field_and_path(fuzz, form, schema, reason):
    got = fuzz.check(form, schema)
    field = {"guided_json": "guided_json", "response_format": "response_format.json_schema"}
    assert got.kind == "refused", (got.reason, got.text)
    assert got.detail.startswith(f"{field.get(form, 'tools')}: ") and reason in got.detail


def test_a_required_cycle_under_an_optional_branch_is_refused(fuzz):
    """An empty array met this schema, but a walk that began an item never ended."""
    node = {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}}
    schema = {"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": node}}
    always_valid(fuzz, schema, walks=10)  # optional, the recursion ends
    node["required"] = ["n"]
    got = fuzz.check("guided_json", schema)
    assert got.kind == "refused" and "#/$defs/n: admits no finite value" in got.detail


def test_a_schema_too_deep_to_write_out_is_a_400_not_a_500(fuzz):
    got = fuzz.check("structured", deep(500))
    assert got.kind == "refused" and got.reason == "too deep or too large", got.detail


def test_strings_never_hold_a_surrogate_or_an_overlong_form(fuzz):
    """A JSON string's characters admitted ED A0..BF xx (surrogates), a pattern's `.` also
    E0 8x (overlong): not UTF-8. Every walk below once produced one within 40 seeds."""
    for pattern in ("^.{1,12}$", "^[^a]{3}\\S*$"):
        always_valid(fuzz, {"type": "string", "pattern": pattern})
    always_valid(fuzz, {"type": "object", "additionalProperties": {"type": "string"}})


def test_the_utf8_guard_masks_what_would_break_utf8():
    vocab = [bytes([i]) for i in range(256)] + [b"\xe2\x82\xac", b"\xed\xa0\x80", b"\x82\xac"]
    guard = Utf8Guard(vocab, 288)

    def allowed(state: int) -> set[int]:
        everything = np.full(guard.masks[0].shape, -1, np.int32)
        bits = np.unpackbits(guard.narrow(everything, state).view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[:259]).tolist())

    ed = guard.advance(0, 0xED)
    assert STATES[ed] == (2, 0x80, 0x9F) and allowed(ed) == {*range(0x80, 0xA0), 258}
    assert allowed(guard.advance(0, 0xE0)) == set(range(0xA0, 0xC0))  # no overlong form
    start = allowed(0)
    assert 256 in start and 257 not in start  # a whole euro sign; never a surrogate token
    assert 0xC0 not in start and 0xF5 not in start and 0x80 not in start
    assert guard.advance(guard.advance(0, 0xE2), 258) == 0  # a token ending a character


def test_patterns_xgrammar_got_wrong_hold_after_the_rewrite(fuzz):
    """`(...)?` let parts of the group be skipped ("ayb" for `^a(xy+)?b$`); a non-ASCII
    character beside `.` let it emit control characters (invalid JSON)."""
    for pattern in ("^a(xy+)?b$", "^-?\\d+(\\.\\d{1,3})?$", "^(?:é|.)+$", "^[^é]|é$", "[ -~]+"):
        always_valid(fuzz, {"type": "string", "pattern": pattern})
    assert xgrammar_pattern("^a(xy+)?b$", "p") == "^a(xy+){0,1}b$"
    assert xgrammar_pattern("é|.", "p") == "\\u00e9|."
    assert xgrammar_pattern("[ -$]", "p") == "[\\u0020-\\u0021\\u0023-\\u0024]"


def test_loose_formats_are_held_to_their_rfcs(fuzz):
    """xgrammar's date admitted 02-30 and 04-31, its ipv4 leading zeros (087)."""
    for fmt in ("date", "date-time", "ipv4"):
        always_valid(fuzz, {"type": "string", "format": fmt}, walks=150)


def test_schemas_clients_send_compile_and_hold(fuzz):
    """What pydantic and OpenAI's examples write: $defs and $ref, nullable unions, titles,
    enums, a discriminated oneOf, through response_format and both forced tool choices."""
    pet = {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    dog = {
        "type": "object",
        "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
        "required": ["kind", "good"],
    }
    schema = {
        "title": "Person",
        "type": "object",
        "properties": {
            "name": {"type": "string", "title": "Name", "maxLength": 20},
            "age": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
            "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "pet"],
        "additionalProperties": False,
        "$defs": {"Cat": pet, "Dog": dog},
    }
    for form in ("response_format", "required", "named", "guided_text"):
        always_valid(fuzz, schema, form, walks=10)


def test_the_fuzz_generator_is_seeded():
    assert [random_schema(random.Random(s)) for s in range(20)] == [
        random_schema(random.Random(s)) for s in range(20)
    ]


def test_a_body_too_deep_to_parse_is_a_400_in_the_openai_shape():
    """FastAPI answered `{"detail": ...}` for a body deeper than Python's JSON reader goes."""
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        return {}

    client = TestClient(app)
    headers = {"content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=DEEP_BODY, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body: ")
    for body, _ in MALFORMED:  # refused by the body's model, or left to the route
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}], **body})
        assert r.status_code in (200, 400) and (r.status_code == 200 or r.json()["error"])
