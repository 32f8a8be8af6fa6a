"""The host tier: entries in RAM under a byte budget, least recently used evicted first.

An entry becomes visible in one step, when its complete bytes are inserted; there is no
half-inserted state to read. Pinned entries (being read or written by the tiered store, or held
by a session checkpoint) are never evicted: a write that could only fit by evicting a pinned
entry is refused and counted instead.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable

from store.backend import Pins, StoreTier
from store.entry import Kind

Name = tuple[bytes, Kind]


class HostTier(StoreTier):
    def __init__(
        self, budget_bytes: int, on_evict: Callable[[bytes, Kind, bytes], None] | None = None
    ):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        self.name = "host"
        self._budget = budget_bytes
        self._entries: OrderedDict[Name, bytes] = OrderedDict()  # LRU first
        self._pins = Pins()
        self._used = 0
        self._lock = threading.Lock()
        self.on_evict = on_evict  # write-back hook: called with each evicted entry
        self.counters: Counter[str] = Counter()

    def put(self, key: bytes, kind: Kind, payload: bytes) -> bool:
        name = (key, kind)
        evicted: list[tuple[Name, bytes]] = []
        with self._lock:
            if name in self._entries:
                self._entries.move_to_end(name)
                self.counters["put_existing"] += 1
                return True
            if not self._make_room(len(payload), evicted):
                self.counters["refused"] += 1
                ok = False
            else:
                self._entries[name] = bytes(payload)
                self._used += len(payload)
                self.counters["puts"] += 1
                ok = True
        self._notify(evicted)
        return ok

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        with self._lock:
            self.counters["checked"] += 1
            payload = self._entries.get((key, kind))
            if payload is None:
                self.counters["misses"] += 1
                return None
            self._entries.move_to_end((key, kind))
            self.counters["hits"] += 1
            return payload

    def contains(self, key: bytes, kind: Kind) -> bool:
        with self._lock:
            return (key, kind) in self._entries

    def delete(self, key: bytes, kind: Kind, force: bool = False) -> bool:
        """Remove an entry; a pinned one only with `force` (its pin stays counted)."""
        with self._lock:
            if (key, kind) not in self._entries or (self._pins[(key, kind)] and not force):
                return False
            self._used -= len(self._entries.pop((key, kind)))
            return True

    def resize(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        evicted: list[tuple[Name, bytes]] = []
        with self._lock:
            self._budget = budget_bytes
            self._make_room(0, evicted)
        self._notify(evicted)

    def pin(self, key: bytes, kind: Kind) -> bool:
        """Protect a present entry from eviction; False when it is not present."""
        with self._lock:
            if (key, kind) not in self._entries:
                return False
            self._pins[(key, kind)] += 1
            return True

    def unpin(self, key: bytes, kind: Kind) -> None:
        with self._lock:
            self._pins.release((key, kind), f"host: unpin of {key.hex()[:16]} ({kind.name})")

    def clear(self) -> tuple[int, int]:
        """Drop every entry no one pins (an operator's clear; nothing is written back). Returns
        (removed, kept because pinned)."""
        with self._lock:
            gone = [n for n in self._entries if not self._pins[n]]
            for name in gone:
                self._used -= len(self._entries.pop(name))
            self.counters["cleared"] += len(gone)
            return len(gone), len(self._entries)

    def _make_room(self, incoming: int, evicted: list[tuple[Name, bytes]]) -> bool:
        if incoming > self._budget:
            return False
        if self._used + incoming <= self._budget:
            return True  # the common case: no scan of the entries
        for name in list(self._entries):
            if self._used + incoming <= self._budget:
                break
            if self._pins[name]:
                continue
            payload = self._entries.pop(name)
            self._used -= len(payload)
            self.counters["evictions"] += 1
            evicted.append((name, payload))
        return self._used + incoming <= self._budget

    def _notify(self, evicted: list[tuple[Name, bytes]]) -> None:
        if self.on_evict is not None:
            for (key, kind), payload in evicted:
                self.on_evict(key, kind, payload)
