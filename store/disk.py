"""The disk tier: entries in a log of append-only segments (`store.segment_log`).

A batch (`put_many`, how the tiered store's worker writes) appends its entries to the active
segment, makes them durable with one barrier, appends their index records, and makes those
durable with a second: a crash leaves whole entries or bytes no record describes, which the
next open cuts off. Only then does the batch become visible. Every read verifies the entry's
header and checksum; a bad entry is copied to `quarantine/`, retired and counted, and the read
is a miss, never wrong bytes. Eviction keeps the live bytes under the budget and the file system
above its free-space floor, least recently used first, passing over entries pinned by session
checkpoints; a write that cannot fit is refused and counted. The space of evicted or deleted
entries comes back by compaction: a sealed segment less than half live has its live entries
copied forward, then its files go. Readers wait only for the index, never for a writer's I/O.

A store folder in the former one-file-per-entry layout (`entries/`) is migrated at open: every
entry that verifies is appended to segments, then its file is removed.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections import Counter, OrderedDict

from store.backend import Pins, StoreTier
from store.entry import CorruptEntry, Kind, decode, encode
from store.keys import entry_name
from store.segment_log import SegmentLog
from store.segments import DEAD, PUT, Location, Record

COMPACT_BELOW = 0.5  # a sealed segment with less than this share of live bytes is compacted


def _name(key: bytes, kind: Kind) -> str:
    return entry_name(key, gdn=kind == Kind.GDN_ANCHOR)


def _parse(name: str) -> tuple[bytes, Kind]:
    kind = Kind.GDN_ANCHOR if name.endswith(".gdn") else Kind.KV_PAGE
    return bytes.fromhex(name.removesuffix(".gdn")), kind


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
        self._index: OrderedDict[str, Location] = OrderedDict()  # LRU first
        self._pins = Pins()  # held by session checkpoints: never evicted
        self._used = 0  # live bytes
        self._live: Counter[int] = Counter()  # live bytes per segment
        self._dead: list[Record] = []  # retirements not yet in an index file
        os.makedirs(os.path.join(root, "quarantine"), exist_ok=True)
        segment_bytes = min(128 << 20, max(64 << 10, budget_bytes // 8))
        self.log = SegmentLog(os.path.join(root, "segments"), segment_bytes)
        for r in self.log.replay():
            (self._place if r.op == PUT else self._unplace)(r)
        self.counters["incomplete_removed"] += self.log.torn
        with self._write_lock:
            with self._lock:
                self._make_room(0)
            self._commit([])
        self._migrate()

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
                    if name in self._index or name in plan:
                        if name in self._index:
                            self._index.move_to_end(name)
                        self.counters["put_existing"] += 1
                        results.append(True)
                        continue
                    blob = encode(kind, self.identity, key, payload)
                    if len(blob) > self._budget or not self._make_room(reserved + len(blob)):
                        self.counters["refused"] += 1
                        results.append(False)
                        continue
                    plan[name] = (key, kind, blob)
                    reserved += len(blob)
                    results.append(True)
            self._commit(list(plan.values()))
            if len(plan) > 1:
                self.counters["group_commits"] += 1
            self._compact_one()
        return results

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        name = _name(key, kind)
        with self._lock:
            self.counters["checked"] += 1
            at = self._index.get(name)
            if at is None:
                self.counters["misses"] += 1
                return None
            try:
                blob = self.log.read(at)
            except OSError:
                blob = b""
            self._index.move_to_end(name)
        try:
            payload = decode(blob, self.identity, key, kind)
        except CorruptEntry as e:
            with self._lock:
                if self._index.get(name) == at:
                    self._quarantine(name, blob, str(e))
                self.counters["misses"] += 1
            with self._write_lock:  # retired durably: a restart must not offer it again
                self._commit([])
            return None
        with self._lock:
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(blob)
        return payload

    def contains(self, key: bytes, kind: Kind) -> bool:
        with self._lock:
            return _name(key, kind) in self._index

    def delete(self, key: bytes, kind: Kind) -> bool:
        """Retire an entry now, durably: a restart does not bring it back."""
        with self._write_lock:
            with self._lock:
                if _name(key, kind) not in self._index:
                    return False
                self._retire(_name(key, kind))
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
            return [_parse(n) for n in self._index]

    def resize(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        with self._write_lock:
            with self._lock:
                self._budget = budget_bytes
                self._make_room(0)
            self._commit([])

    def footprint(self) -> int:
        """Bytes the segments take on disk, dead ones included until compaction."""
        with self._lock:
            return sum(self.log.sizes.values())

    # -- internals ------------------------------------------------------------------------------

    def _commit(self, plan: list[tuple[bytes, Kind, bytes]]) -> None:
        """Append `plan`'s entries, then their records and the pending retirements: durable,
        then visible. A failure leaves none of `plan` indexed. Holds the write lock."""
        with self._lock:
            dead, self._dead = self._dead, []
        try:
            records = self.log.append(plan)
            self.log.write_records(records + dead)
        except BaseException:
            with self._lock:
                self._dead = dead + self._dead
            raise
        with self._lock:
            for r in records:
                self._place(r)
                self.counters["puts"] += 1
                self.counters["bytes_written"] += r.at.length

    def _place(self, r: Record) -> None:
        """Index a PUT; a newer one of the same entry (a compacted copy) keeps its LRU place."""
        name = _name(r.key, r.kind)
        old = self._index.get(name)
        if old is not None:
            self._used -= old.length
            self._live[old.segment] -= old.length
        self._index[name] = r.at
        self._used += r.at.length
        self._live[r.at.segment] += r.at.length

    def _unplace(self, r: Record) -> None:
        """Replay a DEAD: it retires the entry only at the location it names."""
        name = _name(r.key, r.kind)
        if self._index.get(name) == r.at:
            self._index.pop(name)
            self._used -= r.at.length
            self._live[r.at.segment] -= r.at.length

    def _retire(self, name: str) -> None:
        """Drop an entry from the index; its DEAD record goes down with the next commit."""
        at = self._index.pop(name)
        self._used -= at.length
        self._live[at.segment] -= at.length
        key, kind = _parse(name)
        self._dead.append(Record(DEAD, key, kind, at))

    def _make_room(self, incoming: int) -> bool:
        for name in list(self._index):  # least recently used first, in one pass
            if self._used + incoming <= self._budget and self._enough_free(incoming):
                break
            if self._pins[name]:
                continue
            self._retire(name)
            self.counters["evictions"] += 1
        return self._used + incoming <= self._budget and self._enough_free(incoming)

    def _enough_free(self, incoming: int) -> bool:
        if self.min_free_bytes <= 0:
            return True
        return shutil.disk_usage(self.root).free - incoming >= self.min_free_bytes

    def _compact_one(self) -> None:
        """Reclaim one sealed segment that is mostly dead: copy its live entries forward, then
        drop its files. Holds the write lock; readers see old or new locations, both whole."""
        sizes = self.log.sizes
        active = max(sizes, default=0)
        for segment in sorted(s for s in sizes if s != active):
            if self._live[segment] >= COMPACT_BELOW * sizes[segment]:
                continue
            with self._lock:
                moving = [(n, at) for n, at in self._index.items() if at.segment == segment]
            # No other writer runs, so the segment stays put while it is read without the lock.
            plan = [(*_parse(name), self.log.read(at)) for name, at in moving]
            records = self.log.append(plan)
            self.log.write_records(records + self.log.carried_tombs(segment))
            with self._lock:
                for r, (name, at) in zip(records, moving, strict=True):
                    if self._index.get(name) == at:  # not evicted or deleted meanwhile
                        self._place(r)
                self.log.drop(segment)
                self._live.pop(segment, None)
            self.counters["compactions"] += 1
            return

    def _migrate(self) -> None:
        """Move a former one-file-per-entry folder into segments, oldest first."""
        old = os.path.join(self.root, "entries")
        if not os.path.isdir(old):
            return
        found = [os.path.join(d, f) for d, _, fs in os.walk(old) for f in fs]
        for path in sorted(found, key=os.path.getmtime):
            key, kind = _parse(os.path.basename(path))
            with open(path, "rb") as f:
                blob = f.read()
            try:
                self.put(key, kind, decode(blob, self.identity, key, kind))
                self.counters["migrated"] += 1
            except CorruptEntry:
                self.counters["migration_skipped"] += 1
            os.remove(path)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(os.path.join(self.root, "tmp"), ignore_errors=True)

    def _quarantine(self, name: str, blob: bytes, reason: str) -> None:
        path = os.path.join(self.root, "quarantine", f"{name}.{uuid.uuid4().hex[:8]}")
        with open(path, "wb") as f:
            f.write(blob)
        self._retire(name)
        self.counters["corrupt"] += 1
        self.last_corruption = f"{name}: {reason}"
