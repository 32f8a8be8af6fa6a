"""The disk tier: one file per entry under a two-level fan-out, written atomically.

A write goes to `tmp/`, is made durable, renamed into place and the directory made durable, so
a reader (or a restart after a crash) sees a whole entry or none. `put_many` does this for a
batch with one group commit (two barriers for the whole batch), which is how the tiered store's
worker writes. Every read verifies the header and the
checksum; a bad file is moved to `quarantine/` and counted, and the read is a miss. The index
(sizes and LRU order) is rebuilt by scanning at open; leftovers in `tmp/` are incomplete writes
and are removed. Eviction keeps the tier under its byte budget and the file system above its
free-space watermark, passing over entries pinned by session checkpoints; a write that cannot
fit is refused and counted, never half-done.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable

from store.backend import Pins, StoreTier
from store.entry import CorruptEntry, Kind, decode, header
from store.keys import entry_name


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
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> file size, LRU first
        self._pins = Pins()  # held by session checkpoints: never evicted
        self._used = 0
        self.last_corruption: str | None = None
        for sub in ("entries", "tmp", "quarantine"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        self._open()

    # -- StoreTier ------------------------------------------------------------------------------

    def put(self, key: bytes, kind: Kind, payload: bytes) -> bool:
        return self.put_many([(key, kind, payload)])[0]

    def put_many(self, items: list[tuple[bytes, Kind, bytes]]) -> list[bool]:
        """Store several entries with one group commit; one result per item, as `put`'s.

        Every file is written to `tmp/` first; one durability barrier makes all of their bytes
        durable; only then are they renamed into place, and a second barrier makes the names
        durable. A crash at any point leaves whole entries or none, as with single puts, while
        a batch of N pays two barriers instead of 2N fsyncs.
        """
        results: list[bool] = []
        staged: list[tuple[str, int, str, str]] = []  # name, size, tmp path, final path
        with self._lock:
            try:
                for key, kind, payload in items:
                    results.append(self._stage(key, kind, payload, staged))
                _barrier(self.root, [tmp for _, _, tmp, _ in staged])
                for _, _, tmp, final in staged:
                    os.replace(tmp, final)
                _barrier(self.root, sorted({os.path.dirname(f) for _, _, _, f in staged}))
            except BaseException:
                for name, _, tmp, final in staged:  # nothing of a failed batch stays indexed
                    self._forget(name)
                    for path in (tmp, final):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                raise
            for _, size, _, _ in staged:
                self.counters["puts"] += 1
                self.counters["bytes_written"] += size
            if len(staged) > 1:
                self.counters["group_commits"] += 1
        return results

    def _stage(
        self, key: bytes, kind: Kind, payload: bytes, staged: list[tuple[str, int, str, str]]
    ) -> bool:
        """Write one entry to `tmp/` (not yet durable) and reserve its place in the index."""
        name = entry_name(key, gdn=kind == Kind.GDN_ANCHOR)
        head = header(kind, self.identity, key, payload)
        size = len(head) + len(payload)
        if name in self._index:
            self._index.move_to_end(name)
            self.counters["put_existing"] += 1
            return True
        if size > self._budget or not self._make_room(size):
            self.counters["refused"] += 1
            return False
        tmp = os.path.join(self.root, "tmp", f"{uuid.uuid4().hex}.part")
        final = self._path(name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
        # Indexed now so later items of the batch see the space taken and the name present.
        self._index[name] = size
        self._used += size
        staged.append((name, size, tmp, final))
        return True

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        name = entry_name(key, gdn=kind == Kind.GDN_ANCHOR)
        with self._lock:
            self.counters["checked"] += 1
            if name not in self._index:
                self.counters["misses"] += 1
                return None
            try:
                with open(self._path(name), "rb") as f:
                    blob = f.read()
                payload = decode(blob, self.identity, key, kind)
            except FileNotFoundError:
                self._forget(name)
                self.counters["misses"] += 1
                return None
            except CorruptEntry as e:
                self._quarantine(name, str(e))
                self.counters["misses"] += 1
                return None
            self._index.move_to_end(name)
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(blob)
            return payload

    def contains(self, key: bytes, kind: Kind) -> bool:
        with self._lock:
            return entry_name(key, gdn=kind == Kind.GDN_ANCHOR) in self._index

    def delete(self, key: bytes, kind: Kind) -> bool:
        name = entry_name(key, gdn=kind == Kind.GDN_ANCHOR)
        with self._lock:
            if name not in self._index:
                return False
            self._remove(name)
            return True

    def pin(self, key: bytes, kind: Kind) -> None:
        """Keep an entry from eviction, whether it is written yet or not (a queued write lands
        pinned); pins are counted, so two checkpoints may hold one entry."""
        with self._lock:
            self._pins[entry_name(key, gdn=kind == Kind.GDN_ANCHOR)] += 1

    def unpin(self, key: bytes, kind: Kind) -> None:
        name = entry_name(key, gdn=kind == Kind.GDN_ANCHOR)
        with self._lock:
            self._pins.release(name, f"disk: unpin of {name[:16]}")

    def entries(self) -> list[tuple[bytes, Kind]]:
        """Every indexed entry's key and kind, least recently used first."""
        with self._lock:
            names = list(self._index)
        return [
            (bytes.fromhex(n.removesuffix(".gdn")),
             Kind.GDN_ANCHOR if n.endswith(".gdn") else Kind.KV_PAGE)
            for n in names
        ]  # fmt: skip

    def resize(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
        with self._lock:
            self._budget = budget_bytes
            self._make_room(0)

    # -- internals ------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.root, "entries", name[:2], name[2:4], name)

    def _open(self) -> None:
        """Rebuild the index from the files; drop incomplete writes left by a crash."""
        tmp_dir = os.path.join(self.root, "tmp")
        for leftover in os.listdir(tmp_dir):
            os.remove(os.path.join(tmp_dir, leftover))
            self.counters["incomplete_removed"] += 1
        found = []
        for dirpath, _, files in os.walk(os.path.join(self.root, "entries")):
            for name in files:
                stat = os.stat(os.path.join(dirpath, name))
                found.append((stat.st_mtime, name, stat.st_size))
        for _, name, size in sorted(found):  # oldest first: the LRU order survives restarts
            self._index[name] = size
            self._used += size
        self._make_room(0)

    def _make_room(self, incoming: int) -> bool:
        for name in list(self._index):  # least recently used first, in one pass
            if self._used + incoming <= self._budget and self._enough_free(incoming):
                break
            if self._pins[name]:
                continue
            self._remove(name)
            self.counters["evictions"] += 1
        return self._used + incoming <= self._budget and self._enough_free(incoming)

    def _enough_free(self, incoming: int) -> bool:
        if self.min_free_bytes <= 0:
            return True
        return shutil.disk_usage(self.root).free - incoming >= self.min_free_bytes

    def _remove(self, name: str) -> None:
        try:
            os.remove(self._path(name))
        except FileNotFoundError:
            pass
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._used -= self._index.pop(name, 0)

    def _quarantine(self, name: str, reason: str) -> None:
        target = os.path.join(self.root, "quarantine", f"{name}.{uuid.uuid4().hex[:8]}")
        try:
            os.replace(self._path(name), target)
        except FileNotFoundError:
            pass
        self._forget(name)
        self.counters["corrupt"] += 1
        self.last_corruption = f"{name}: {reason}"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs() -> Callable[[int], int] | None:
    """Linux `syncfs(2)`: one call makes every dirty file of a file system durable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):
        return None


_SYNCFS = _syncfs()


def _barrier(root: str, paths: list[str]) -> None:
    """Make `paths` (files or directories under `root`) durable: fsync each, or, for several
    on a system with `syncfs`, one flush of the whole file system."""
    if len(paths) > 1 and _SYNCFS is not None:
        fd = os.open(root, os.O_RDONLY)
        try:
            if _SYNCFS(fd) != 0:
                raise OSError(ctypes.get_errno(), "syncfs failed", root)
        finally:
            os.close(fd)
        return
    for path in paths:
        fsync_path(path)
