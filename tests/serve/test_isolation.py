"""One request's failure fails that request only, and a dead engine loop is loud.

The server runs in this process (uvicorn in a thread, real HTTP on loopback) so that faults can
be injected into its engine: an admission that raises something other than a refusal is a 500
with a reference for that request alone while a stream beside it goes on unchanged, and a loop
thread that dies turns `/health` to 503, fails what was in flight and calls its `on_death`
(the server's ends the process with a non-zero code).
"""

from __future__ import annotations

import json
import threading

import pytest

from flipjax.engine.sequence import Sequence
from flipjax.engine.step import Stepper
from tests.support.http import HTTP
from tests.support.in_process import InProcessServer
from tests.support.servers import metric

STREAM = {
    "model": "tiny",
    "prompt": "a stream beside the faults",
    "max_tokens": 40,
    "temperature": 0,
    "stream": True,
}


@pytest.fixture
def served():
    s = InProcessServer(start_s=60)
    try:
        yield s
    finally:
        s.stop()


def _stream(base: str, first: threading.Event | None = None) -> tuple[str, str | None]:
    """The streamed text, and the error event's message if the stream ended in one; `first`
    is set once the first tokens arrived."""
    text, error = [], None
    with HTTP.stream("POST", f"{base}/v1/completions", json=STREAM, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                else:
                    text.append(event["choices"][0]["text"])
                    if first is not None:
                        first.set()
    return "".join(text), error


def test_an_admission_that_raises_fails_only_its_request(served, monkeypatch):
    solo, _ = _stream(served.base)
    encode = served.engine.info.tokenizer.encode

    def poisoned(text: str, *args, **kwargs):
        if "poison" in text:
            raise RuntimeError("injected tokenizer fault")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(served.engine.info.tokenizer, "encode", poisoned)
    beside: list[tuple[str, str | None]] = []
    stream = threading.Thread(target=lambda: beside.append(_stream(served.base)))
    stream.start()
    body = {"model": "tiny", "prompt": "poison", "max_tokens": 4}
    r = HTTP.post(f"{served.base}/v1/completions", json=body, timeout=60)
    stream.join(timeout=120)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "injected tokenizer fault" in message and "reference err-" in message
    assert beside == [(solo, None)]
    assert HTTP.get(f"{served.base}/health", timeout=30).status_code == 200
    again = HTTP.post(f"{served.base}/v1/completions", json={**body, "prompt": "x"}, timeout=60)
    assert again.status_code == 200
    served.engine.check()


def test_a_fault_in_a_step_fails_only_its_request(served, monkeypatch):
    """A request whose sampler row raises mid-decode is a 500 with a reference; the stream
    decoding in the same batches ends with its solo text, and the fault is counted."""
    solo, _ = _stream(served.base)
    row = Stepper.row

    def poisoned(stepper: Stepper, seq: Sequence):
        if seq.params.seed == 4242 and len(seq.output_ids) >= 2:
            raise RuntimeError("injected sampler fault")
        return row(stepper, seq)

    monkeypatch.setattr(Stepper, "row", poisoned)
    first = threading.Event()
    beside: list[tuple[str, str | None]] = []
    stream = threading.Thread(target=lambda: beside.append(_stream(served.base, first)))
    stream.start()
    assert first.wait(60)
    body = {"model": "tiny", "prompt": "poison", "max_tokens": 8, "seed": 4242}
    r = HTTP.post(f"{served.base}/v1/completions", json=body, timeout=60)
    stream.join(timeout=120)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "while sampling" in message and "injected sampler fault" in message
    assert "reference err-" in message
    assert beside == [(solo, None)]
    assert metric(served.base, 'flipjax:request_faults_total{stage="sampling"}') == 1
    assert HTTP.get(f"{served.base}/health", timeout=30).status_code == 200
    served.engine.check()
    assert served.engine.stats().pools["pages_requests"] == 0


def test_a_dead_engine_loop_is_a_503_and_ends_the_process(served, monkeypatch):
    deaths: list[BaseException] = []
    served.loop.on_death = deaths.append
    ready = threading.Event()
    result: list[tuple[str, str | None]] = []

    def stream() -> None:
        result.append(_stream(served.base, first=ready))

    unfinished = served.engine.has_unfinished

    def dies_mid_stream() -> bool:
        if ready.is_set():
            raise RuntimeError("injected loop fault")
        return unfinished()

    monkeypatch.setattr(served.engine, "has_unfinished", dies_mid_stream)
    t = threading.Thread(target=stream)
    t.start()
    t.join(timeout=120)
    assert [type(e) for e in deaths] == [RuntimeError]
    assert result and result[0][1] is not None and "engine loop stopped" in result[0][1]
    health = HTTP.get(f"{served.base}/health", timeout=30)
    assert health.status_code == 503 and "injected loop fault" in health.json()["error"]
    body = {"model": "tiny", "prompt": "after", "max_tokens": 2}
    r = HTTP.post(f"{served.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and "engine loop stopped" in r.json()["error"]["message"]
