"""Two server processes in different layouts share prefixes through one real `redis-server`:
what the pipeline server computed, the tensor-parallel one reads, with identical tokens. Redis
killed mid-run fails no request and changes no token; it comes back by itself when Redis does.
A changed value, whose MAC no longer verifies, is then a counted miss."""

from __future__ import annotations

import logging
import time

from tests.support.http import HTTP
from tests.support.prompts import STORE_PROMPT as PROMPT
from tests.support.redis_server import RedisServer
from tests.support.servers import INSECURE_ADMIN, SMALL, metric, start_server, stop_server

GRID = ("--gdn-checkpoint-interval", "32")


def complete(base: str, prompt: str = PROMPT) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = HTTP.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def remote_hits(base: str) -> float:
    return metric(base, 'flipjax:prefix_hits_total{tier="remote"}')


def store_event(base: str, event: str) -> float:
    return metric(base, f'flipjax:store_events_total{{event="{event}",tier="remote"}}')


def wait_until(check, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def settled(count, quiet_s: float = 1.0) -> int:
    """`count()` once it has not changed for `quiet_s`."""
    last, since = count(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
    return last


SECRET = "the servers' shared store secret"


def test_two_servers_in_different_layouts_share_one_redis_through_an_outage(tmp_path):
    redis = RedisServer(str(tmp_path)).start()
    flags = (
        *("--store-dir", "none", "--remote-store", redis.url, "--store-secret", SECRET),
        *(*GRID, *SMALL, INSECURE_ADMIN, "--prefetch-wait-ms", "30000"),
    )
    with open(tmp_path / "pp.txt", "w") as a_log, open(tmp_path / "tp.txt", "w") as b_log:
        a, a_base = start_server(a_log, "--layout", "pp:5,3", *flags)
        b, b_base = start_server(b_log, "--layout", "tp:2", *flags)
    try:
        first = complete(a_base)  # computed in the pipeline, published to Redis
        assert cached(first) == 0
        wait_until(lambda: store_event(a_base, "puts") >= 4)  # two pages... and their anchors
        shared = complete(b_base)  # a fresh device and host tier: only Redis holds it
        assert cached(shared) == 64
        assert shared["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert remote_hits(b_base) == 1
        assert metric(b_base, 'flipjax:prefix_hit_tokens_total{tier="remote"}') == 64

        redis.kill()  # mid-run: both servers keep answering, with the same tokens
        other = PROMPT[::-1]
        for base in (a_base, b_base):
            again = complete(base, other)
            assert (
                again["choices"][0]["token_ids"]
                == complete(a_base, other)["choices"][0]["token_ids"]
            )
        wait_until(lambda: metric(b_base, 'flipjax:store_tier_available{tier="remote"}') == 0)
        assert store_event(b_base, "errors") >= 1
        state = HTTP.get(f"{b_base}/hicache/storage-backend", timeout=30).json()
        assert state["remote"]["available"] is False and state["remote"]["last_error"]

        redis.start()  # the same port, empty: the tier comes back by itself after its backoff

        def back() -> bool:
            complete(b_base, PROMPT[:40] + "z" * 50)
            return metric(b_base, 'flipjax:store_tier_available{tier="remote"}') == 1

        wait_until(back)
        assert store_event(b_base, "recovered") >= 1

        fresh = "q" * 30 + PROMPT[30:]  # computed by the pipeline server only, then corrupted
        client = redis.client()
        stored = settled(lambda: len(client.keys("flipjax:*")))  # earlier writes have landed
        first = complete(a_base, fresh)  # six pages and three anchors more
        wait_until(lambda: len(client.keys("flipjax:*")) >= stored + 9)
        for name in client.scan_iter(match="flipjax:*"):  # one bit of every value
            value = bytearray(client.get(name))
            value[-1] ^= 0x40
            client.set(name, bytes(value))
        hits_before = remote_hits(b_base)
        again = complete(b_base, fresh)  # no hit from bad bytes: computed, the same tokens
        assert cached(again) == 0
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        # A changed byte breaks the entry's MAC: a forged value, a miss never decoded.
        assert store_event(b_base, "forged") >= 1 and remote_hits(b_base) == hits_before
    finally:
        for proc in (a, b):
            stop_server(proc)
        redis.kill()


def test_without_the_store_secret_the_shared_tier_is_neither_read_nor_written(monkeypatch, caplog):
    from flipjax.serve import _open_store, parse_args

    monkeypatch.delenv("FLIPJAX_STORE_SECRET", raising=False)
    config = parse_args(["--store-dir", "none", "--remote-store", "redis://127.0.0.1:9/0"])
    with caplog.at_level(logging.WARNING):
        bridge, _, _ = _open_store(config, logging.getLogger("flipjax.serve"))
    assert bridge.store.remote is None
    assert "is off: without --store-secret" in caplog.text
    bridge.store.close()
    monkeypatch.setenv("FLIPJAX_STORE_SECRET", SECRET)
    assert parse_args(["--remote-store", "redis://127.0.0.1:9/0"]).store.store_secret == SECRET
