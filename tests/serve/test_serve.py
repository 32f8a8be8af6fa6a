"""`python -m flipjax.serve` answers on loopback with real HTTP, checked with the openai client.

The server runs the tiny model as an uneven pipeline, so streams, 16 concurrent clients and a
phase flip to tensor parallel under their load (compiled as it goes: arming ahead is
`test_serve_load`'s) are all checked against the offline engine.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from flipjax import Engine, SamplingParams
from tests.support.http import HTTP
from tests.support.servers import INSECURE_ADMIN, SMALL, metric, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Uses the test session's 8 virtual devices (XLA_FLAGS is inherited)."""
    folder = tmp_path_factory.mktemp("server")
    with open(folder / "log.txt", "w") as log:
        proc, base = start_server(
            log,
            "--model",
            "tiny",
            "--layout",
            "pp:5,3",
            "--device-memory",
            "1GiB",
            "--num-pages",  # a cap: the budgets alone would size the pool for pp:5,3 only
            "1024",
            *SMALL,
            INSECURE_ADMIN,
            "--store-dir",
            str(folder / "store"),
        )
        try:
            yield base
        finally:
            stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_lists_tiny_as_untrained(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert "untrained" in models[0].model_extra["description"]


def test_completion_matches_offline_engine(client):
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    want = Engine.from_pretrained("tiny").generate(["Hello"], max_new_tokens=6)[0]
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.text == want.text
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(model="other", prompt="x"), "model"),
        (dict(model="tiny", prompt="x", max_tokens=0), "max_tokens"),
        (dict(model="tiny", prompt="", max_tokens=2), "prompt"),
        (dict(model="tiny", prompt=[999], max_tokens=2), "prompt"),
        (dict(model="tiny", prompt="x", temperature=3.0), "temperature"),
        (dict(model="tiny", prompt="x", top_p=0), "top_p"),
        (dict(model="tiny", prompt="x", max_tokens=5000), "max_tokens"),
    ],
)
def test_bad_requests_name_the_field(server, kwargs, param):
    r = HTTP.post(f"{server}/v1/completions", json={"temperature": 0, **kwargs}, timeout=60)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param


def test_malformed_json_is_a_400(server):
    r = HTTP.post(
        f"{server}/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400


def test_seeded_sampling_over_http_matches_offline(client):
    kwargs = dict(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    resp = client.completions.create(model="tiny", prompt="Hello", **kwargs)
    want = Engine.from_pretrained("tiny").generate(["Hello"], sampling=SamplingParams(**kwargs))[0]
    assert resp.choices[0].model_extra["token_ids"] == want.token_ids


PROMPTS = [f"stream {i}: " + "x" * (3 * i) for i in range(16)]  # 16 concurrent clients


@pytest.fixture(scope="module")
def offline() -> dict[str, str]:
    """Greedy texts of PROMPTS from a single-device offline engine: the reference."""
    outs = Engine.from_pretrained("tiny").generate(PROMPTS, max_new_tokens=24)
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


def stream_text(client, prompt: str, first_chunk: threading.Event | None = None) -> str:
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
    )
    parts, finish = [], None
    for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if first_chunk is not None:
            first_chunk.set()
    assert finish in ("stop", "length")
    return "".join(parts)


def test_streaming_equals_offline(client, offline):
    assert stream_text(client, PROMPTS[3]) == offline[PROMPTS[3]]


def test_flip_under_load_keeps_every_stream_identical(server, client, offline):
    results: dict[str, str] = {}
    started = threading.Event()

    def run(prompt: str) -> None:
        results[prompt] = stream_text(client, prompt, started)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    assert started.wait(120)
    r = HTTP.post(f"{server}/phase_flip", json={"to": "tp:2"}, timeout=120)
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(180)
    assert results == offline
    phase = HTTP.get(f"{server}/phase", timeout=30).json()
    assert phase["layout"] == "tp:2" and phase["generation"] == 1
    assert phase["last_flip"]["direction"] == "pp:5,3->tp:2"
    assert phase["last_flip"]["weights_bytes"] > 0


def test_phase_flip_refuses_a_layout_the_model_cannot_take(server):
    before = HTTP.get(f"{server}/phase", timeout=30).json()
    r = HTTP.post(f"{server}/phase_flip", json={"to": "pp:1,1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "to"
    assert "sum to 2" in r.json()["error"]["message"]
    r = HTTP.post(f"{server}/phase_flip", json={"layout": "tp"}, timeout=60)
    assert r.status_code == 400
    assert HTTP.get(f"{server}/phase", timeout=30).json() == before


def test_chat_completions_render_the_template(client):
    from serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = ChatTemplate(DEFAULT_TEMPLATE).render(messages)
    assert prompt == "system: be brief\nuser: hi\nassistant: "
    want = Engine.from_pretrained("tiny").generate([prompt], max_new_tokens=12)[0]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(prompt.encode())
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_generate_takes_and_returns_token_ids(server):
    want = Engine.from_pretrained("tiny").generate([[72, 105, 33]], max_new_tokens=5)[0]
    r = HTTP.post(
        f"{server}/generate",
        json={"input_ids": [72, 105, 33], "max_tokens": 5, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want.token_ids
    r = HTTP.post(f"{server}/generate", json={"input_ids": [], "max_tokens": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"


def test_abort_and_disconnect_free_pages_and_slots(server, client):
    stream = client.completions.create(
        model="tiny",
        prompt="abort me",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    r = HTTP.post(f"{server}/abort_request", json={"request_id": first.id}, timeout=30)
    assert r.status_code == 200, r.text
    finishes = [c.choices[0].finish_reason for c in stream]
    assert finishes[-1] == "abort"
    r = HTTP.post(f"{server}/abort_request", json={"request_id": first.id}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"

    with HTTP.stream(
        "POST",
        f"{server}/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "go away",
            "max_tokens": 3000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        next(r.iter_lines())  # one event, then the client hangs up
    deadline = time.monotonic() + 30
    while metric(server, "flipjax:kv_pages_used") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "flipjax:kv_pages_used") == 0
    assert metric(server, "flipjax:gdn_slots_used") == 0
    assert metric(server, 'flipjax:request_success_total{finish_reason="abort"}') >= 1


def test_metrics_show_traffic_and_the_flip(server):
    assert metric(server, "flipjax:generation_tokens_total") > 0
    assert metric(server, "flipjax:prompt_tokens_total") > 0
    assert metric(server, 'flipjax:flips_total{direction="pp:5,3->tp:2"}') == 1
    assert metric(server, 'flipjax:layout{layout="tp:2"}') == 1
    assert metric(server, "flipjax:time_to_first_token_seconds_count") > 0
    # The ledger of the live layout's devices (tp:2 after the flip: devices 0 and 1).
    for device in ("0", "1"):
        assert (
            metric(server, f'flipjax_device_memory_bytes{{device="{device}",kind="budget"}}')
            == 2**30
        )
        assert (
            metric(server, f'flipjax_device_memory_bytes{{device="{device}",kind="weights"}}') > 0
        )
        assert (
            metric(server, f'flipjax_device_memory_bytes{{device="{device}",kind="kv_pages"}}') > 0
        )


def test_keys_guard_the_routes(tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        proc, base = start_server(
            log, "--api-key", "user-k", "--admin-api-key", "admin-k", "--store-dir", "none", *SMALL
        )
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert HTTP.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 401
        user = {"authorization": "Bearer user-k"}
        admin = {"authorization": "Bearer admin-k"}
        r = HTTP.post(f"{base}/v1/completions", json=body, headers=user, timeout=120)
        assert r.status_code == 200
        assert HTTP.get(f"{base}/phase", headers=user, timeout=30).status_code == 401
        r = HTTP.get(f"{base}/phase", headers=admin, timeout=30)
        assert r.status_code == 200 and r.json()["layout"] == "single"
    finally:
        stop_server(proc)


def test_admin_routes_answer_only_to_allowed_hosts_and_json(server):
    """DNS rebinding (a foreign Host), a cross-site request (a foreign Origin) and a form post
    (not JSON) are refused; the same request from loopback with JSON is answered."""
    phase = f"{server}/phase"
    layout = HTTP.get(phase, timeout=30).json()["layout"]
    r = HTTP.get(phase, headers={"host": "evil.example"}, timeout=30)
    assert r.status_code == 403 and "Host: 'evil.example'" in r.json()["error"]["message"]
    r = HTTP.get(phase, headers={"origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"]
    form = {"content-type": "text/plain"}
    r = HTTP.post(f"{server}/phase_flip", content='{"to": "tp:2"}', headers=form, timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert HTTP.get(phase, timeout=30).json()["layout"] == layout  # the form post flipped nothing
