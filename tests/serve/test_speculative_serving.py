"""A server started with vLLM's `--speculative-config` drafts with the shipped model's MTP head:
the openai client gets the tokens decoding without drafts gives, and /metrics counts drafts,
acceptance per position and accept lengths. A bad setting stops the server at start, named."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest

from flipjax import Engine
from tests.support.http import HTTP
from tests.support.servers import ROOT, SMALL, start_server, stop_server

PROMPTS = ["def read_file(path):", "class Queue:\n    def __init__(self):", "def is_prime(n):"]
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("spec-serve") / "server.log", "w")  # noqa: SIM115
    flags = ("--model", "flipjax-py", "--speculative-config", SPEC)
    proc, base = start_server(log, *flags, "--disable-speculative-adaptive", *SMALL)
    try:
        yield base
    finally:
        stop_server(proc)
        log.close()


def test_completions_are_those_of_decoding_without_drafts(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", timeout=120, max_retries=0)
    done = client.completions.create(
        model="flipjax-py", prompt=PROMPTS, max_tokens=48, temperature=0
    )
    texts = [c.text for c in sorted(done.choices, key=lambda c: c.index)]
    plain = Engine.from_pretrained("flipjax-py", num_pages=128, warmup=False)
    assert texts == [o.text for o in plain.generate(PROMPTS, max_new_tokens=48)]
    metrics = HTTP.get(f"{served}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))

    assert total("flipjax:spec_decode_num_draft_tokens_total") > 0
    accepted = total("flipjax:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= total("flipjax:spec_decode_num_draft_tokens_total")
    assert total("flipjax:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert 'flipjax:spec_decode_num_draft_tokens_per_pos_total{position="2"}' in metrics
    rows = total("flipjax:spec_decode_num_drafts_total")
    assert total("flipjax:spec_decode_accept_length_count") == rows > 0


def test_a_bad_speculative_setting_stops_the_server_at_start_naming_it():
    bad = json.dumps({"method": "mtp", "num_speculative_tokens": 9})
    done = subprocess.run(
        [sys.executable, "-m", "flipjax.serve", "--model", "tiny", "--speculative-config", bad],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "speculative_num_steps: 9 is out of range [1, 4]" in done.stderr
