"""Hostile requests against a real server: each is refused with a status and a message naming the
field and the limit, while a greedy stream running beside them produces its solo text, and the
server is healthy with its pools empty afterwards.

The server has no admin key and no `--allow-insecure-admin`, so its admin routes are off.
"""

from __future__ import annotations

import json
import threading

import pytest

from serve.protocol.sampling import MAX_UNKNOWN_FIELD_NAMES, OTHER_FIELDS
from tests.support.http import HTTP
from tests.support.schemas import nested_array_schema
from tests.support.servers import SMALL, metric, start_server, stop_server

MAX_BODY = 65536  # the test server's --max-request-bytes (the default is 16 MiB)
STREAM = {
    "model": "tiny",
    "prompt": "a stream beside the hostile requests",
    "max_tokens": 48,
    "temperature": 0,
    "stream": True,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    with open(folder / "log.txt", "w") as log:
        proc, base = start_server(
            log,
            "--model",
            "tiny",
            "--store-dir",
            "none",
            *SMALL,
            "--max-request-bytes",
            str(MAX_BODY),
        )
        try:
            yield base
        finally:
            stop_server(proc)


def _streamed_text(base: str) -> str:
    text = []
    with HTTP.stream("POST", f"{base}/v1/completions", json=STREAM, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def _completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}


# (body fields, status, param, words the message must hold)
REFUSED = [
    ({"n": 17}, 400, "n", "at most 16 choices"),
    ({"n": 10**7}, 400, "n", "at most 16 choices"),
    ({"best_of": 10**7}, 400, "best_of", "at most 16 choices"),
    ({"top_k": 3 * 10**9}, 400, "top_k", "the vocabulary"),
    ({"stop_token_ids": [10**6], "min_tokens": 2}, 400, "stop_token_ids", "outside the vocab"),
    ({"stop_token_ids": [-1], "min_tokens": 2}, 400, "stop_token_ids", "must be >= 0"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, 400, "logit_bias", "at most 1024"),
    ({"logit_bias": {"100000": 1.0}}, 400, "logit_bias", "outside the vocabulary"),
    ({"stop": [f"s{i}" for i in range(17)]}, 400, "stop", "at most 16 stop strings"),
    ({"stop": ["x" * 257]}, 400, "stop", "at most 256 bytes"),
    ({"logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ({"max_tokens": 10**9}, 400, "max_tokens", "exceed the context"),
    ({"guided_json": nested_array_schema(100)}, 400, "guided_json", "at most 64"),
    ({"guided_regex": "(" * 80 + ")" * 80}, 400, "guided_regex", "80 levels deep"),
]


def test_hostile_requests_are_refused_and_a_stream_beside_them_is_unchanged(server):
    solo = _streamed_text(server)
    beside: list[str] = []
    stream = threading.Thread(target=lambda: beside.append(_streamed_text(server)))
    stream.start()
    failures = []
    for fields, status, param, words in REFUSED:
        r = HTTP.post(f"{server}/v1/completions", json=_completion(**fields), timeout=60)
        error = r.json().get("error", {})
        if (r.status_code, error.get("param")) != (status, param) or words not in error["message"]:
            failures.append((fields if len(str(fields)) < 80 else param, r.status_code, error))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}
    r = HTTP.post(f"{server}/v1/chat/completions", json=chat, timeout=60)
    if r.status_code != 400 or r.json()["error"]["param"] != "n":
        failures.append(("chat n", r.status_code, r.text))
    stream.join(timeout=120)
    assert not failures, failures
    assert beside == [solo]
    assert HTTP.get(f"{server}/health", timeout=30).status_code == 200
    assert metric(server, "flipjax:kv_pages_used") == 0
    assert metric(server, "flipjax:gdn_slots_used") == 0


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server, declared):
    body = b'{"model": "tiny", "prompt": "' + b"x" * MAX_BODY + b'"}'
    # Without a declared length (chunked) the server counts what arrives.
    content = body if declared else iter([body[:1000], body[1000:]])
    headers = {"content-type": "application/json"}
    r = HTTP.post(f"{server}/v1/completions", content=content, headers=headers, timeout=60)
    assert r.status_code == 413
    assert f"--max-request-bytes ({MAX_BODY} bytes)" in r.json()["error"]["message"]
    fits = _completion(prompt="x" * (MAX_BODY // 2))
    assert HTTP.post(f"{server}/v1/completions", json=fits, timeout=120).status_code != 413


def test_admin_routes_without_a_key_are_off(server):
    for method, route, body in [
        ("POST", "/flush_cache", None),
        ("GET", "/phase", None),
        ("POST", "/phase_flip", {"to": "tp:2"}),
        ("PUT", "/hicache/storage-backend", {"dir": "/tmp"}),
    ]:
        r = HTTP.request(method, f"{server}{route}", json=body, timeout=30)
        assert r.status_code == 403, (route, r.text)
        assert "--admin-api-key" in r.json()["error"]["message"]
    assert HTTP.get(f"{server}/health", timeout=30).status_code == 200


def test_unknown_field_names_cannot_grow_the_metrics_without_bound(server):
    junk = {f"junk_{i}": 1 for i in range(2 * MAX_UNKNOWN_FIELD_NAMES)}
    r = HTTP.post(f"{server}/v1/completions", json=_completion(**junk), timeout=60)
    assert r.status_code == 200
    text = HTTP.get(f"{server}/metrics", timeout=30).text
    labels = [
        line
        for line in text.splitlines()
        if line.startswith("flipjax:unknown_request_fields_total{")
    ]
    assert len(labels) == MAX_UNKNOWN_FIELD_NAMES + 1
    assert metric(server, f'flipjax:unknown_request_fields_total{{field="{OTHER_FIELDS}"}}') > 0
