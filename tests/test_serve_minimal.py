"""`python -m flipjax.serve` answers on loopback with real HTTP, checked with the openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from flipjax import Engine, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flipjax.serve", "--model", "tiny", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy in 180 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


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
        (dict(model="tiny", prompt="x", bogus=1), "bogus"),
        (dict(model="tiny", prompt="x", stream=True), "stream"),
    ],
)
def test_bad_requests_name_the_field(server, kwargs, param):
    r = httpx.post(f"{server}/v1/completions", json={"temperature": 0, **kwargs}, timeout=60)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param


def test_malformed_json_is_a_400(server):
    r = httpx.post(
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
