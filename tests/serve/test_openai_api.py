"""The OpenAI surface real clients use, driven with the openai SDK against a real server.

References: the offline engine (a choice alone with its seed, greedy texts, logprobs), the
JSON-schema validator `jsonschema` for structured output, and the SDK's own response types.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from flipjax import Engine, SamplingParams
from tests.support.http import HTTP
from tests.support.servers import SMALL, metric, start_server, stop_server

PROMPT = "The quick brown fox"
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "pet"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
}
DIGITS = {"type": "integer", "minimum": 0, "maximum": 999}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["a", "b"],
            "properties": {"a": DIGITS, "b": DIGITS},
        },
    },
}
GREET = {
    "type": "function",
    "function": {
        "name": "greet",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["who"],
            "properties": {"who": {"enum": ["ann", "bob"]}},
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, GREET)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai")
    with open(folder / "log.txt", "w") as log:
        proc, base = start_server(
            log,
            "--model",
            "tiny",
            "--served-model-name",
            "tiny",
            "tiny-alias",
            "--disable-any-whitespace",
            "--store-dir",
            "none",
            *SMALL,
        )
        try:
            yield base
        finally:
            stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return Engine.from_pretrained("tiny", max_running_requests=16, max_prefill_tokens=64)


def test_n_choices_each_equal_their_seed_streamed_or_not(client, offline):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.9, seed=5, n=3)
    resp = client.completions.create(**kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    want = [
        offline.generate(
            [PROMPT], sampling=SamplingParams(temperature=0.9, seed=5 + i, max_tokens=6)
        )[0]
        for i in range(3)
    ]
    assert [c.model_extra["token_ids"] for c in resp.choices] == [w.token_ids for w in want]
    assert resp.usage.prompt_tokens == len(PROMPT) and resp.usage.completion_tokens == 18
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in resp.choices]


def test_best_of_keeps_the_likeliest_choice(client, offline):
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=1, best_of=3
    )
    candidates = [
        offline.generate(
            [PROMPT], sampling=SamplingParams(temperature=1.0, seed=7 + i, max_tokens=5, logprobs=0)
        )[0]
        for i in range(3)
    ]
    best = max(candidates, key=lambda o: sum(lp.logprob for lp in o.logprobs))
    assert len(resp.choices) == 1 and resp.choices[0].logprobs is None
    assert resp.choices[0].model_extra["token_ids"] == best.token_ids
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="x", n=2, best_of=1)


def test_prompts_in_every_form_answer_in_order(client, offline):
    ids = [72, 105, 33]
    for prompt, want in (
        (["ab", "cd"], ["ab", "cd"]),
        (ids, [ids]),
        ([ids, [65, 66]], [ids, [65, 66]]),
    ):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        got = [c.model_extra["token_ids"] for c in resp.choices]
        assert got == [o.token_ids for o in offline.generate(want, max_new_tokens=4)]


def test_completion_logprobs_are_the_model_distribution(client, offline):
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    want = offline.generate(
        [PROMPT], sampling=SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    )[0]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert len(lp.tokens) == 5 and lp.text_offset == sorted(lp.text_offset)
    for top, entry in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(entry.top[0][1])


def test_echo_streams_the_prompt_first_and_chat_takes_n(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + whole.choices[0].text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=1,
        seed=2,
        n=2,
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6


def test_chat_logprobs_give_token_bytes_and_alternatives(client):
    resp = client.chat.completions.create(
        model="tiny-alias",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and resp.model == "tiny"
    for entry in content:
        if entry.token.startswith("token_id:"):  # a lone byte of a character, or no text
            token = int(entry.token.removeprefix("token_id:"))
            want = [token] if token < 256 else []  # the tiny vocabulary: bytes, then specials
        else:
            want = list(entry.token.encode())
        assert entry.bytes == want and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_stream_usage_arrives_last_and_continuously_when_asked(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    body = {
        **kw,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with HTTP.stream("POST", f"{client.base_url}completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6


def test_sampling_extras_do_what_vllm_does(client):
    forced = client.completions.create(
        model="tiny", prompt="x", max_tokens=4, temperature=1, seed=1, logit_bias={"65": 100}
    )
    assert forced.choices[0].text == "AAAA"
    held = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=20,
        temperature=0,
        extra_body={"min_tokens": 3, "stop_token_ids": [66], "logit_bias": {"66": 100}},
    )
    ids = held.choices[0].model_extra["token_ids"]
    assert len(ids) == 4 and ids[-1] == 66 and 66 not in ids[:3]
    assert held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="x", suffix="y")


def test_unknown_fields_are_ignored_and_counted_wrong_ones_refused(server):
    before = metric(server, 'flipjax:unknown_request_fields_total{field="frobnicate"}')
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "frobnicate": 1}
    assert HTTP.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    assert metric(server, 'flipjax:unknown_request_fields_total{field="frobnicate"}') == before + 1
    r = HTTP.post(f"{server}/v1/completions", json={**body, "n": "two"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_validates_for_every_seed(client, seed):
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=120,
        temperature=1.0,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)


def test_every_guided_form_constrains_the_text(client):
    def complete(**extra):
        return (
            client.completions.create(
                model="tiny", prompt="x", max_tokens=60, temperature=1, seed=3, extra_body=extra
            )
            .choices[0]
            .text
        )

    assert re.fullmatch(r"[a-c]{3}", complete(guided_regex="[a-c]{3}"))
    assert complete(guided_choice=["left", "right"]) in ("left", "right")
    assert complete(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert complete(guided_grammar='root ::= "yes" | "no"') in ("yes", "no")
    assert isinstance(json.loads(complete(response_format={"type": "json_object"})), dict)


def test_bad_structured_output_is_refused_by_name(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    r = HTTP.post(
        f"{server}/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": bad,
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"
    r = HTTP.post(
        f"{server}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
    )
    assert r.status_code == 400 and "only one structured output" in r.json()["error"]["message"]


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(2))
def test_required_and_named_tool_calls_always_parse(client, seed):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "add 1 and 2"}],
        tools=[ADD, GREET],
        max_tokens=400,
        temperature=1.0,
        seed=seed,
    )
    required = client.chat.completions.create(**kw, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(required.choices[0].message.tool_calls)
    named = client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "greet"}}
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["greet"]
    assert_valid_calls(named.choices[0].message.tool_calls)
    one = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_assemble_to_the_whole_answer(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "greet"}],
        tools=[ADD, GREET],
        max_tokens=400,
        temperature=1.0,
        seed=4,
    )
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        whole = client.chat.completions.create(**kw, tool_choice=choice).choices[0].message
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**kw, tool_choice=choice, stream=True):
            for frag in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(frag.index, {"name": "", "arguments": ""})
                call["name"] += frag.function.name or ""
                call["arguments"] += frag.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        names = [c.function.name for c in whole.tool_calls]
        assert [calls[i]["name"] for i in sorted(calls)] == names
        assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
            json.loads(c.function.arguments) for c in whole.tool_calls
        ]


def test_tool_choice_without_tools_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tool_choice="required"
        )


def test_tool_calls_and_results_go_back_into_the_prompt(server):
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = HTTP.post(f"{server}/tokenize", json={"messages": messages, "tools": [ADD]}, timeout=30)
    text = HTTP.post(f"{server}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text
    assert "tool: 3\n" in text and text.endswith("assistant: ") and '"name": "add"' in text


def test_continue_final_message_leaves_the_last_turn_open(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = HTTP.post(f"{server}/tokenize", json=body, timeout=30).json()["tokens"]
    assert bytes(tokens).decode() == "user: hi\nassistant: Sure, "
    both = {**body, "add_generation_prompt": True}
    assert HTTP.post(f"{server}/tokenize", json=both, timeout=30).status_code == 400


def test_tokenize_detokenize_version_and_model_names(server, client):
    r = HTTP.post(f"{server}/tokenize", json={"prompt": "hey"}, timeout=30).json()
    assert r == {"count": 3, "max_model_len": r["max_model_len"], "tokens": [104, 101, 121]}
    assert HTTP.post(f"{server}/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", HTTP.get(f"{server}/version").json()["version"])
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    resp = client.completions.create(model="tiny-alias", prompt="x", max_tokens=1)
    assert resp.model == "tiny"


def test_openapi_documents_every_request_body(server):
    spec = HTTP.get(f"{server}/openapi.json", timeout=30).json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    without = [p for p, op in posts.items() if "requestBody" not in op and p != "/flush_cache"]
    assert not without and "/v1/chat/completions" in posts
    chat = spec["components"]["schemas"]["ChatRequest"]["properties"]
    assert chat["temperature"]["maximum"] == 2.0 and "tools" in chat
