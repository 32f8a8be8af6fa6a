"""`make serve` serves the shipped model `flipjax-py` by default, and it speaks Python: through
the openai client, greedy completions of common function headers have bodies that parse."""

from __future__ import annotations

import os
import signal
import subprocess

import openai
import pytest
from transformers import AutoTokenizer

from flipjax.model.shipped import resolve
from flipjax.train.report import Signature, parses
from tests.support.servers import ROOT, SMALL, free_port, wait_healthy

# Headers end at their colon: the newline and indent are the model's (see `report.Signature`).
HEADERS = [
    "def fibonacci(n):",
    "def read_file(path):",
    "def is_prime(n):",
    "def push(self, item):",
    "def main():",
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("make-serve") / "server.log"
    port = free_port()
    with open(log_path, "w") as log:
        # The Makefile's own recipe, default MODEL and all; a session of its own, so the server
        # make starts is stopped with it.
        proc = subprocess.Popen(
            [
                "make",
                "--no-print-directory",
                "serve",
                f"PORT={port}",
                f"SERVE_ARGS={' '.join(SMALL)}",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, str(log_path))
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_make_serve_serves_the_shipped_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["flipjax-py"]
    assert "Python standard library" in models[0].model_extra["description"]


def test_greedy_completions_of_common_headers_parse(client):
    done = client.completions.create(
        model="flipjax-py", prompt=HEADERS, max_tokens=96, temperature=0
    )
    assert len(done.choices) == len(HEADERS)
    ok = []
    for choice in sorted(done.choices, key=lambda c: c.index):
        header = HEADERS[choice.index]
        ok.append(parses(Signature("prompt", header), choice.text, choice.finish_reason == "stop"))
    assert sum(ok) >= 3, [c.text for c in done.choices]


def test_chat_uses_the_model_s_own_template(client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    reply = client.chat.completions.create(
        model="flipjax-py", messages=messages, max_tokens=16, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    # transformers renders the shipped folder's template with its tokenizer: the same prompt.
    tokenizer = AutoTokenizer.from_pretrained(resolve("flipjax-py"))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
