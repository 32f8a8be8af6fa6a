"""The disk tier: entries in a log of append-only segments (`store.segment_log`).

A batch (`put_many`, how the tiered store's worker writes) appends its entries to the active
segment, makes them durable with one barrier, appends their index records, and makes those
durable with a second: a crash leaves whole entries or bytes no record describes, which the
next open cuts off. Only then does the batch become visible. Every read verifies the entry's
header and checksum; a bad entry is copied to `quarantine/`, retired and counted, and the read
is a miss, never wrong bytes. An I/O error is retried, then a counted miss that keeps the
entry: unreadable is not corrupt. Eviction keeps the live bytes under the budget and the file system
above its free-space floor, least recently used first, passing over entries pinned by session
checkpoints; a write that cannot fit is refused and counted. The space of evicted or deleted
entries comes back by compaction: a sealed segment less than half live has its live entries
copied forward, then its files go. Readers wait only for the index, never for a writer's I/O.
A folder in the former one-file-per-entry layout is migrated at open (`store.disk_migration`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections import Counter

from store.backend import Pins, StoreTier
from store.disk_index import DiskIndex
from store.disk_migration import migrate_entries
from store.entry import HEADER_BYTES, CorruptEntry, Kind, header, verify
from store.keys import entry_name, parse_name
from store.segment_log import Framed, SegmentLog
from store.segments import PUT, Location

log = logging.getLogger("flipjax.store")

COMPACT_BELOW = 0.5  # a sealed segment with less than this share of live bytes is compacted


def _name(key: bytes, kind: Kind) -> str:
    return entry_name(key, gdn=kind == Kind.GDN_ANCHOR)


class DiskTier(StoreTier):
    def __init__(self, root: str, identity: bytes, budget_bytes: int, min_free_bytes: int = 0):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        self.name = "disk"
        self.root = root
        self.identity = identity
        self._budget = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.counters: Counter[str] = Counter()
        self.last_corruption: str | None = None
        self._lock = threading.Lock()  # the index: held briefly, by readers too
        self._write_lock = threading.Lock()  # one writer (batch, delete, compaction) at a time
        self._pins = Pins()  # held by session checkpoints: never evicted
        self._index = DiskIndex()
        os.makedirs(os.path.join(root, "quarantine"), exist_ok=True)
        segment_bytes = min(128 << 20, max(64 << 10, budget_bytes // 8))
        self.log = SegmentLog(os.path.join(root, "segments"), segment_bytes)
        for r in self.log.replay():
            place = self._index.place if r.op == PUT else self._index.unplace
            place(_name(r.key, r.kind), r.at)
        self.counters["incomplete_removed"] += self.log.torn
        # No eviction yet: the checkpoints that pin entries load after the tier opens (`trim`).
        migrate_entries(self, os.path.join(root, "entries"))

    # -- StoreTier ------------------------------------------------------------------------------

    def put(self, key: bytes, kind: Kind, payload: bytes) -> bool:
        return self.put_many([(key, kind, payload)])[0]

    def put_many(self, items: list[tuple[bytes, Kind, bytes]]) -> list[bool]:
        """Store several entries with one group commit; one result per item, as `put`'s."""
        results, plan, reserved = [], {}, 0
        with self._write_lock:
            with self._lock:
                for key, kind, payload in items:
                    name = _name(key, kind)
                    if name in self._index.entries or name in plan:
                        if name in self._index.entries:
                            self._index.entries.move_to_end(name)
                        self.counters["put_existing"] += 1
                        results.append(True)
                        continue
                    head = header(kind, self.identity, key, payload)
                    size = len(head) + len(payload)
                    if size > self._budget or not self._make_room(reserved + size):
                        self.counters["refused"] += 1
                        results.append(False)
                        continue
                    plan[name] = (key, kind, (head, payload))
                    reserved += size
                    results.append(True)
            self._commit(list(plan.values()))
            if len(plan) > 1:
                self.counters["group_commits"] += 1
            self._compact_one()
        return results

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        return self.get_many([(key, kind)])[0]

    def get_many(self, items: list[tuple[bytes, Kind]]) -> list[bytes | None]:
        """`get` of several entries (None for each miss), under one hold of the index."""
        reads: list[tuple[str, Location, bytes, bytes] | None] = []
        with self._lock:
            self.counters["checked"] += len(items)
            for key, kind in items:
                name = _name(key, kind)
                at = self._index.entries.get(name)
                if at is not None:
                    self._index.entries.move_to_end(name)
                read = None if at is None else self._read(name, at)
                reads.append(None if read is None else (name, at, *read))
        out: list[bytes | None] = []
        for (key, kind), read in zip(items, reads, strict=True):
            payload = None
            if read is not None:
                name, at, head, body = read
                try:
                    verify(head, body, self.identity, key, kind)
                    payload = body
                except CorruptEntry as e:
                    self._reject(name, at, head + body, str(e))
            out.append(payload)
        with self._lock:
            hits = [p for p in out if p is not None]
            self.counters["hits"] += len(hits)
            self.counters["misses"] += len(out) - len(hits)
            self.counters["bytes_read"] += sum(len(p) + HEADER_BYTES for p in hits)
        return out

    def contains(self, key: bytes, kind: Kind) -> bool:
        with self._lock:
            return _name(key, kind) in self._index.entries

    def delete(self, key: bytes, kind: Kind) -> bool:
        """Retire an entry now, durably: a restart does not bring it back."""
        with self._write_lock:
            with self._lock:
                if _name(key, kind) not in self._index.entries:
                    return False
                self._index.retire(_name(key, kind))
            self._commit([])
        return True

    def pin(self, key: bytes, kind: Kind) -> None:
        """Keep an entry from eviction, whether it is written yet or not (a queued write lands
        pinned); pins are counted, so two checkpoints may hold one entry."""
        with self._lock:
            self._pins[_name(key, kind)] += 1

    def unpin(self, key: bytes, kind: Kind) -> None:
        name = _name(key, kind)
        with self._lock:
            self._pins.release(name, f"disk: unpin of {name[:16]}")

    def entries(self) -> list[tuple[bytes, Kind]]:
        """Every indexed entry's key and kind, least recently used first."""
        with self._lock:
            return [parse_name(n) for n in self._index.entries]

    def resize(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        with self._lock:
            self._budget = budget_bytes
        self.trim()

    def trim(self) -> None:
        """Evict down to the budget and the free-space floor now, passing over pinned entries.
        A tier opened over a fuller folder waits for this (or its first write), so that the
        session checkpoints' pins are in place first."""
        with self._write_lock:
            with self._lock:
                self._make_room(0)
            self._commit([])

    def close(self) -> None:
        """Close the segment files held open for reading (the tier is not used after)."""
        with self._write_lock, self._lock:
            self.log.close()

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def clear(self) -> tuple[int, int]:
        """Retire every entry no one pins, durably, and reclaim the space: segments left with
        nothing live go, and pinned entries are copied out of the others. Returns (removed,
        kept because pinned)."""
        with self._write_lock:
            with self._lock:
                gone = [n for n in self._index.entries if not self._pins[n]]
                for name in gone:
                    self._index.retire(name)
            self._commit([])
            self.log.seal()  # the active segment becomes reclaimable too
            while self._compact_one():
                pass
        self.counters["cleared"] += len(gone)
        return len(gone), len(self._index.entries)

    def footprint(self) -> int:
        """Bytes the segments take on disk, dead ones included until compaction."""
        with self._lock:
            return sum(self.log.sizes.values())

    # -- internals ------------------------------------------------------------------------------

    def _commit(self, plan: list[tuple[bytes, Kind, Framed]]) -> None:
        """Append `plan`'s entries, then their records and the pending retirements: durable,
        then visible. A failure leaves none of `plan` indexed. Holds the write lock."""
        with self._lock:
            dead, self._index.dead = self._index.dead, []
        try:
            records = self.log.append(plan)
            self.log.write_records(records + dead)
        except BaseException:
            with self._lock:
                self._index.dead = dead + self._index.dead
            raise
        with self._lock:
            for r in records:
                self._index.place(_name(r.key, r.kind), r.at)
                self.counters["puts"] += 1
                self.counters["bytes_written"] += r.at.length

    def _make_room(self, incoming: int) -> bool:
        def fits() -> bool:
            return self._index.used + incoming <= self._budget and self._enough_free(incoming)

        if fits():
            return True
        pinned = self._pins.__getitem__
        self.counters["evictions"] += self._index.make_room(incoming, self._budget, pinned, fits)
        return fits()

    def _enough_free(self, incoming: int) -> bool:
        if self.min_free_bytes <= 0:
            return True
        return shutil.disk_usage(self.root).free - incoming >= self.min_free_bytes

    def _compact_one(self) -> bool:
        """Reclaim one sealed segment that is mostly dead: copy its live entries forward, then
        drop its files. Holds the write lock; readers see old or new locations, both whole."""
        sizes = self.log.sizes
        active = max(sizes, default=0)
        for segment in sorted(s for s in sizes if s != active):
            if self._index.live[segment] >= COMPACT_BELOW * sizes[segment]:
                continue
            with self._lock:
                moving = self._index.in_segment(segment)
            # No other writer runs, so the segment stays put while it is read without the lock.
            blobs = self.log.read_many([at for _, at in moving])
            plan = [
                (*parse_name(name), (b[:HEADER_BYTES], b[HEADER_BYTES:]))
                for (name, _), b in zip(moving, blobs, strict=True)
            ]
            records = self.log.append(plan)
            self.log.write_records(records + self.log.carried_tombs(segment))
            with self._lock:
                for r, (name, at) in zip(records, moving, strict=True):
                    if self._index.entries.get(name) == at:  # not evicted or deleted meanwhile
                        self._index.place(name, r.at)
                self.log.drop(segment)
                self._index.live.pop(segment, None)
            self.counters["compactions"] += 1
            return True
        return False

    def _read(self, name: str, at: Location) -> tuple[bytes, bytes] | None:
        """An entry's header and payload; None (a counted `read_errors` miss) when an I/O error
        outlasts the log's retries. The entry stays: bytes that cannot be read now are not
        known to be bad, and a later read verifies them."""
        try:
            return self.log.read(at)
        except OSError as err:
            self.counters["read_errors"] += 1
            log.warning("disk store: reading %s failed: %s", name, err)
            return None

    def _reject(self, name: str, at: Location, blob: bytes, reason: str) -> None:
        """Copy an entry that failed verification to `quarantine/` and retire it durably: a
        restart must not offer it again. Another reader may have got there first."""
        with self._lock:
            if self._index.entries.get(name) == at:
                path = os.path.join(self.root, "quarantine", f"{name}.{uuid.uuid4().hex[:8]}")
                with open(path, "wb") as f:
                    f.write(blob)
                self._index.retire(name)
                self.counters["corrupt"] += 1
                self.last_corruption = f"{name}: {reason}"
        with self._write_lock:
            self._commit([])
