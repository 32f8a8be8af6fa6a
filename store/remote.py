"""The remote tier: entries in a Redis server that several flipjax servers share.

Values are the same framed, checksummed entries the disk tier writes (`store.entry`), under the
same content keys, in a namespace per model identity (`flipjax:<identity>:<entry name>`). The
payloads do not depend on the layout, so a prefix one server computed in a pipeline layout is a
hit for another in tensor parallel, on another machine, with identical tokens.

Anyone who can write to that Redis could plant pages for popular prefixes (the first writer of a
key wins), so every value is signed: an HMAC-SHA256, keyed by the store secret the servers
share, over the entry's header and payload, in front of them. A value whose MAC does not verify
is a counted miss (`forged`) that is never decoded; a signed value that fails the entry's own
checks is `corrupt`, and deleted. A server without the secret has no remote tier at all.

Writes go down as pipelined `SET NX`s (content keys: a present value is already right), reads as
one `MGET`, and presence checks as one pipeline of `EXISTS`. Every value is verified; one that
fails is a counted miss and is deleted. Redis being down, slow or restarted never fails a
caller: an error or a timeout marks the tier down, is counted, and turns the call into misses;
while down, calls are skipped (counted) until a backoff passes, which doubles after each failed
retry, and the first call that succeeds brings the tier back. Callers are the store's worker
threads, never the serving loop.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from store.entry import CorruptEntry, Kind, decode, encode
from store.keys import entry_name

T = TypeVar("T")
MAC_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16


class RedisTier:
    def __init__(
        self,
        url: str,
        identity: bytes,
        secret: bytes,
        timeout_s: float = 0.5,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.monotonic,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"remote store: {url!r} is not a redis:// URL")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"store secret: at least {MIN_SECRET_BYTES} bytes are needed to sign the shared "
                f"tier's entries, got {len(secret)}"
            )
        self._secret = secret
        self.name = "remote"
        self.url = f"{parts.scheme}://{parts.hostname or ''}:{parts.port or 6379}{parts.path}"
        self.identity = identity
        self.prefix = f"flipjax:{identity.hex()[:32]}:"
        self.counters: Counter[str] = Counter()
        self.last_error: str | None = None
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # this tier does its own backoff
        )
        self._backoff_s = backoff_s
        self._backoff = backoff_s[0]
        self._down_until: float | None = None  # None while up
        self._clock = clock
        self._lock = threading.Lock()
        self._call("ping", self._client.ping, None)

    @property
    def available(self) -> bool:
        with self._lock:
            return self._down_until is None

    # -- entries --------------------------------------------------------------------------------

    def put_many(self, items: list[tuple[bytes, Kind, bytes]]) -> list[bool]:
        def send() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key, kind, payload in items:
                pipe.set(
                    self._key(key, kind),
                    self._sign(encode(kind, self.identity, key, payload)),
                    nx=True,
                )
            pipe.execute()
            return [True] * len(items)

        done = self._call("put", send, [False] * len(items))
        if done[:1] == [True]:
            self._count(puts=len(items), bytes_written=sum(len(p) for *_, p in items))
        return done

    def put(self, key: bytes, kind: Kind, payload: bytes) -> bool:
        return self.put_many([(key, kind, payload)])[0]

    def get_many(self, items: list[tuple[bytes, Kind]]) -> list[bytes | None]:
        """Verified payloads, one per item (None for a miss), from one `MGET`."""
        if not items:
            return []
        names = [self._key(key, kind) for key, kind in items]
        values = self._call("get", lambda: self._client.mget(names), [None] * len(items))
        out: list[bytes | None] = []
        bad, forged = [], 0
        for (key, kind), name, value in zip(items, names, values, strict=True):
            payload = None
            if value is not None:
                blob = self._verified(value)
                if blob is None:
                    forged += 1
                    self.last_error = f"{name}: its MAC does not verify under the store secret"
                else:
                    try:
                        payload = decode(blob, self.identity, key, kind)
                    except CorruptEntry as e:
                        bad.append(name)
                        self.last_error = f"{name}: {e}"
            out.append(payload)
        hits = [p for p in out if p is not None]
        self._count(
            checked=len(items),
            hits=len(hits),
            misses=len(items) - len(hits),
            corrupt=len(bad),
            forged=forged,
            bytes_read=sum(len(p) for p in hits),
        )
        if bad:
            self._call("delete", lambda: self._client.delete(*bad), 0)
        return out

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        return self.get_many([(key, kind)])[0]

    def contains_many(self, items: list[tuple[bytes, Kind]]) -> list[bool]:
        if not items:
            return []

        def ask() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key, kind in items:
                pipe.exists(self._key(key, kind))
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", ask, [False] * len(items))

    def contains(self, key: bytes, kind: Kind) -> bool:
        return self.contains_many([(key, kind)])[0]

    def delete(self, key: bytes, kind: Kind) -> bool:
        return bool(self._call("delete", lambda: self._client.delete(self._key(key, kind)), 0))

    def clear(self) -> int:
        """Delete this model's entries (other models' and other data stay); how many."""

        def sweep() -> int:
            removed = 0
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=f"{self.prefix}*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    removed += self._client.delete(*batch)
                    batch = []
            if batch:
                removed += self._client.delete(*batch)
            return removed

        removed = self._call("clear", sweep, 0)
        self._count(cleared=removed)
        return removed

    def close(self) -> None:
        self._client.close()

    # -- internals ------------------------------------------------------------------------------

    def _sign(self, blob: bytes) -> bytes:
        return hmac.new(self._secret, blob, hashlib.sha256).digest() + blob

    def _verified(self, value: bytes) -> bytes | None:
        """The entry a signed value carries, or None when its MAC does not verify."""
        if len(value) < MAC_BYTES:
            return None
        mac, blob = value[:MAC_BYTES], value[MAC_BYTES:]
        want = hmac.new(self._secret, blob, hashlib.sha256).digest()
        return blob if hmac.compare_digest(mac, want) else None

    def _key(self, key: bytes, kind: Kind) -> str:
        return self.prefix + entry_name(key, gdn=kind == Kind.GDN_ANCHOR)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                self.counters[name] += n

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """`fn()`, or `default` while the tier is down or when the call fails (marking it down
        until a backoff passes)."""
        now = self._clock()
        with self._lock:
            if self._down_until is not None and now < self._down_until:
                self.counters["skipped_down"] += 1
                return default
        try:
            result = fn()
        except (redis.RedisError, OSError) as e:
            with self._lock:
                self.counters["errors"] += 1
                if self._down_until is None:
                    self.counters["went_down"] += 1
                else:
                    self._backoff = min(self._backoff * 2, self._backoff_s[1])
                self._down_until = now + self._backoff
                self.last_error = f"{what}: {type(e).__name__}: {e}"
            return default
        with self._lock:
            if self._down_until is not None:
                self.counters["recovered"] += 1
                self._down_until, self._backoff = None, self._backoff_s[0]
        return result
