"""The remote tier against a real `redis-server` on loopback: batched round trips, a corrupted
value as a counted miss, and an outage (SIGKILL, then a restart) that never fails a caller and
ends by itself; then two stores sharing one Redis, as two servers would."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from store.entry import Kind, encode
from store.host import HostTier
from store.keys import entry_name, page_keys
from store.remote import MAC_BYTES, RedisTier
from store.tiered import TieredStore
from tests.support.redis_server import RedisServer

IDENTITY = bytes(range(32))
SECRET = b"the servers' shared store secret"
ROOT = bytes(32)
PS, GRID = 4, 8
TOKENS = list(range(24))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path)).start()
    yield s
    s.kill()


def test_round_trip_in_batches(server):
    tier = RedisTier(server.url, IDENTITY, SECRET)
    items = [(bytes([i]) * 32, Kind.KV_PAGE, b"page %d" % i) for i in range(10)]
    assert tier.put_many(items) == [True] * 10
    names = [(k, kind) for k, kind, _ in items]
    assert tier.get_many(names) == [p for *_, p in items]
    assert tier.contains_many(names + [(b"x" * 32, Kind.KV_PAGE)]) == [True] * 10 + [False]
    assert tier.get(items[0][0], Kind.GDN_ANCHOR) is None  # same key, other kind: a miss
    assert tier.counters["hits"] == 10 and tier.counters["misses"] == 1
    stored = server.client().get(f"flipjax:{IDENTITY.hex()[:32]}:{entry_name(items[0][0])}")
    assert stored.endswith(b"page 0") and len(stored) > len(b"page 0")  # framed, checksummed
    tier.close()


def _signed(secret: bytes, blob: bytes) -> bytes:
    return hmac.new(secret, blob, hashlib.sha256).digest() + blob


def test_a_forged_value_is_a_counted_miss_even_with_a_right_checksum(server):
    """Anyone who can write to the Redis can frame an entry with a correct xxh3 checksum; only
    the secret makes a MAC that verifies. Such values are misses, never decoded nor deleted."""
    tier = RedisTier(server.url, IDENTITY, SECRET)
    key = b"k" * 32
    tier.put(key, Kind.KV_PAGE, b"abcdefgh")
    name = f"flipjax:{IDENTITY.hex()[:32]}:{entry_name(key)}"
    signed = server.client().get(name)
    forged = encode(Kind.KV_PAGE, IDENTITY, key, b"ABCDEFGH")  # framed and checksummed
    for value in (
        signed[:MAC_BYTES] + forged,
        _signed(b"some other secret, 32 bytes", forged),
        forged,
        b"short",
    ):
        server.client().set(name, value)
        assert tier.get(key, Kind.KV_PAGE) is None
    assert tier.counters["forged"] == 4 and tier.counters["corrupt"] == 0
    assert "MAC" in tier.last_error
    assert server.client().exists(name)  # not this server's to delete
    tier.close()


def test_a_signed_but_corrupted_value_is_a_counted_miss_and_deleted(server):
    tier = RedisTier(server.url, IDENTITY, SECRET)
    key = b"k" * 32
    tier.put(key, Kind.KV_PAGE, b"abcdefgh")
    name = f"flipjax:{IDENTITY.hex()[:32]}:{entry_name(key)}"
    raw = bytearray(server.client().get(name)[MAC_BYTES:])
    raw[-1] ^= 0x01  # one flipped bit in the payload, by a writer that holds the secret
    server.client().set(name, _signed(SECRET, bytes(raw)))
    assert tier.get(key, Kind.KV_PAGE) is None
    assert tier.counters["corrupt"] == 1 and tier.counters["misses"] == 1
    assert "checksum" in tier.last_error
    assert not server.client().exists(name)  # removed, so no other server reads it
    tier.close()


def test_a_short_secret_is_refused(server):
    with pytest.raises(ValueError, match="store secret: at least 16 bytes"):
        RedisTier(server.url, IDENTITY, b"short")


def test_an_outage_fails_nothing_backs_off_and_ends_by_itself(server):
    clock = Clock()
    tier = RedisTier(server.url, IDENTITY, SECRET, timeout_s=0.5, backoff_s=(1.0, 8.0), clock=clock)
    key = b"a" * 32
    assert tier.put(key, Kind.KV_PAGE, b"before")
    server.kill()
    assert tier.get(key, Kind.KV_PAGE) is None  # an error, not an exception
    assert not tier.available and tier.counters["errors"] == 1
    assert tier.put_many([(key, Kind.KV_PAGE, b"x")]) == [False]  # skipped while down
    assert tier.contains(key, Kind.KV_PAGE) is False
    assert tier.counters["skipped_down"] == 2 and tier.counters["errors"] == 1
    clock.now += 1.0  # the backoff has passed: one retry, which fails and doubles it
    assert tier.get(key, Kind.KV_PAGE) is None and tier.counters["errors"] == 2
    clock.now += 1.5
    assert tier.get(key, Kind.KV_PAGE) is None and tier.counters["skipped_down"] == 3
    server.start()  # the same port, empty (nothing was saved)
    clock.now += 0.5
    assert tier.put(key, Kind.KV_PAGE, b"after")  # the first call after the backoff succeeds
    assert tier.available and tier.counters["recovered"] == 1
    assert tier.get(key, Kind.KV_PAGE) == b"after"
    tier.close()


def test_a_server_that_is_down_at_start_comes_up_later(tmp_path):
    down = RedisServer(str(tmp_path))  # not started
    clock = Clock()
    tier = RedisTier(down.url, IDENTITY, SECRET, backoff_s=(1.0, 8.0), clock=clock)
    assert not tier.available and tier.counters["went_down"] == 1
    down.start()
    clock.now += 1.0
    assert tier.put(b"b" * 32, Kind.KV_PAGE, b"late") and tier.available
    tier.close()
    down.kill()


def _store(url: str) -> TieredStore:
    return TieredStore(ROOT, PS, GRID, HostTier(1 << 20), remote=RedisTier(url, IDENTITY, SECRET))


def test_two_stores_share_prefixes_through_redis(server):
    """What one store publishes (write-through, in the background) another finds: a lookup
    counts it, a prefetch promotes it, and its first read is counted as a remote hit."""
    a, b = _store(server.url), _store(server.url)
    keys = page_keys(ROOT, TOKENS, PS)
    for i, k in enumerate(keys):
        a.put(k, Kind.KV_PAGE, b"kv%d" % i)
    for i in a.anchor_pages(len(TOKENS)):
        a.put(keys[i], Kind.GDN_ANCHOR, b"gdn%d" % i)
    a.flush()
    assert b.lookup(TOKENS).tokens == 24 and b.lookup(TOKENS, resident=True).tokens == 0
    ticket = b.prefetch(TOKENS)
    assert ticket.done.wait(10) and ticket.tokens == 24
    assert b.stats()["store"]["prefetched_remote"] == 7  # six pages and the anchor
    assert b.get_from(keys[2], Kind.KV_PAGE, resident=True) == (b"kv2", "remote")
    assert b.get_from(keys[2], Kind.KV_PAGE, resident=True) == (b"kv2", "host")
    assert a.stats()["remote"]["puts"] == 9 and b.stats()["remote"]["available"] == 1
    a.close()
    b.close()
