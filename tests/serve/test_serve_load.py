"""The server under pressure and under its own phase policy: a burst of long requests into a
small page pool, served while `--phase-policy auto` may flip between steps, completes with the
offline engine's text and leaves every page and slot free."""

from __future__ import annotations

import threading

import openai
import pytest

from flipjax import Engine
from flipjax.serve import parse_args
from tests.support.http import HTTP
from tests.support.servers import INSECURE_ADMIN, SMALL, metric, start_server, stop_server


def test_auto_phase_policy_needs_one_decode_layout(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--phase-policy", "auto"])
    assert "exactly one arm layout (--arm" in capsys.readouterr().err


def test_a_burst_into_a_small_pool_under_the_auto_policy(tmp_path):
    prompts = [f"burst {i}: " + "y" * (40 + i) for i in range(8)]  # 4 pages each, growing to 7
    want = Engine.from_pretrained("tiny").generate(prompts, max_new_tokens=40)
    flags = (
        *("--num-pages", "16", "--store-dir", "none", "--layout", "single", "--arm", "tp:2"),
        *("--phase-policy", "auto", *SMALL, INSECURE_ADMIN, "--max-running-requests", "8"),
        *("--max-prefill-tokens", "32"),  # prompts in chunks; fewer step shapes to compile
    )
    with open(tmp_path / "log.txt", "w") as log:
        proc, base = start_server(log, *flags)
    try:
        policy = HTTP.get(f"{base}/phase", timeout=30).json()["policy"]
        assert policy["policy"] == "auto" and policy["decode_layout"] == "tp:2"
        for layout in ("single", "tp:2"):
            rates = policy["throughput"][layout]
            assert rates["prefill_tps"] > 0 and rates["decode_tps"] > 0, layout

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        results: dict[int, str] = {}

        def run(i: int) -> None:
            resp = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=40, temperature=0
            )
            results[i] = resp.choices[0].text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [results.get(i) for i in range(8)] == [o.text for o in want]
        assert metric(base, 'flipjax:relief_steps_total{step="retracted"}') > 0
        assert metric(base, 'flipjax:relief_steps_total{step="evicted"}') > 0
        assert metric(base, "flipjax:kv_pages_used") == 0
        assert metric(base, "flipjax:gdn_slots_used") == 0
        assert HTTP.post(f"{base}/flush_cache", timeout=30).status_code == 200
        assert metric(base, "flipjax:prefix_cache_pages") == 0
        assert metric(base, "flipjax:prefix_cache_states") == 0
        ticks = HTTP.get(f"{base}/phase", timeout=30).json()["policy"]["counters"]["ticks"]
        assert ticks > 0, "the policy never looked at the load"
        # A manual flip is seen by the policy: it restarts the dwell, so no flip back.
        here = HTTP.get(f"{base}/phase", timeout=30).json()["layout"]
        other = "tp:2" if here == "single" else "single"
        flipped = HTTP.post(f"{base}/phase_flip", json={"to": other}, timeout=120).json()
        client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, temperature=0)
        phase = HTTP.get(f"{base}/phase", timeout=30).json()
        policy = phase["policy"]
        assert flipped["layout"] == other == phase["layout"]
        assert policy["last_decision"]["reason"] == "dwell"
        assert policy["last_decision"]["terms"].startswith("dwell")
        assert policy["flip_cost_provenance"] == "both measured"
    finally:
        stop_server(proc)
