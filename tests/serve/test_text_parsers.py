"""The reasoning and tool-call parsers: whole texts, and streams cut anywhere giving the same."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from serve.text_parsers import (
    ReasoningStream,
    ToolCallStream,
    parse_tool_calls,
    split_reasoning,
)

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TEXTS = [
    "plain answer",
    f"Let me add. {CALL}",
    f"{CALL}\n{CALL.replace('add', 'mul')}",
    "<tool_call>not json</tool_call> and text",
    "unclosed <tool_call>{",
    "<tool_ca",
]


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def test_tool_calls_parse_whole():
    content, calls = parse_tool_calls(f"Let me add. {CALL}")
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse_tool_calls("<tool_call>not json</tool_call> and text")
    assert calls == [] and content == "<tool_call>not json</tool_call> and text"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 80), max_size=8))
def test_a_tool_call_stream_cut_anywhere_equals_the_whole(text, cuts):
    stream, content, names = ToolCallStream(), "", []
    for piece in pieces(text, cuts):
        delta, calls = stream.feed(piece)
        content += delta
        names += [c["function"]["name"] for c in calls]
    content += stream.close()
    whole_content, whole_calls = parse_tool_calls(text)
    assert names == [c["function"]["name"] for c in whole_calls]
    assert (content.strip() or None) == whole_content


def test_reasoning_splits_whole():
    assert split_reasoning("<think>\nhmm\n</think>\n\nyes") == ("hmm", "yes")
    assert split_reasoning("hmm</think>yes", opened=True) == ("hmm", "yes")
    assert split_reasoning("hmm</think>yes") == (None, "hmm</think>yes")
    assert split_reasoning("<think>cut short") == ("cut short", None)
    assert split_reasoning("no thinking") == (None, "no thinking")


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["<think>\nhmm\n</think>\n\nyes", "hmm</think>yes", "<think>cut", "plain"]),
    st.booleans(),
    st.lists(st.integers(0, 30), max_size=6),
)
def test_a_reasoning_stream_cut_anywhere_equals_the_whole(text, opened, cuts):
    stream, reasoning, content = ReasoningStream.after(opened), "", ""
    for piece in pieces(text, cuts):
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.close()
    reasoning, content = reasoning + r, content + c
    whole_reasoning, whole_content = split_reasoning(text, opened)
    assert (reasoning.strip("\n") or None) == whole_reasoning
    assert (content or None) == whole_content
