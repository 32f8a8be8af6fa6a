"""The tiered store: host RAM in front of an optional disk tier, with background disk I/O.

Reads go host first, then disk; a disk hit is promoted into the host tier. Writes land in the
host tier at once and reach the disk through a bounded queue served by a worker thread, either
right away (write-through, the default) or when the host tier evicts them (write-back). The
serving loop never waits on the disk to write: a full queue refuses the job and counts it.
`prefetch` warms the host tier with a looked-up prefix in the background.

The disk tier can be attached, detached (its files stay) and resized while serving. Every path
is counted; `stats()` reports the store's counters and each tier's, and a gate that never ran
reads `checked: 0` rather than nothing.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from flipjax.runtime.hybrid import check_interval, is_grid_page, usable_prefix
from store.backend import Pins
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.keys import page_keys


@dataclass(frozen=True)
class Lookup:
    """A store lookup: `tokens` usable tokens, with the keys a fetch needs."""

    tokens: int
    page_keys: tuple[bytes, ...]  # one per usable page
    anchor_key: bytes | None  # the GDN anchor at `tokens` (None when nothing is usable)


class TieredStore:
    def __init__(
        self,
        root: bytes,
        page_size: int,
        gdn_interval: int,
        host: HostTier,
        disk: DiskTier | None = None,
        write_back: bool = False,
        queue_size: int = 1024,
    ):
        check_interval(gdn_interval, page_size)
        self.root = root
        self.page_size = page_size
        self.gdn_interval = gdn_interval
        self.host = host
        self.disk = disk
        self.write_back = write_back
        self.counters: Counter[str] = Counter()
        self._queue: queue.Queue[Job] = queue.Queue(queue_size)
        self._lock = threading.Lock()
        self._pins = Pins()  # by session checkpoints
        self._host_pins = Pins()  # those the host tier took
        host.on_evict = self._on_host_evict
        self._worker = threading.Thread(target=self._work, name="flipjax-store", daemon=True)
        self._worker.start()

    # -- entries --------------------------------------------------------------------------------

    def put(self, key: bytes, kind: Kind, payload: bytes) -> None:
        """Publish an entry: host now, disk in the background (or on eviction, write-back)."""
        self._count("puts")
        in_host = self.host.put(key, kind, payload)
        disk = self.disk
        if disk is not None and (not self.write_back or not in_host):
            self._submit(_DiskPut(disk, key, kind, payload))

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        """The verified payload from the nearest tier; a disk hit is promoted to host."""
        return self.get_from(key, kind)[0]

    def get_from(self, key: bytes, kind: Kind) -> tuple[bytes | None, str | None]:
        """`get`, and the tier that answered ("host" or "disk"; None for a miss)."""
        payload = self.host.get(key, kind)
        if payload is not None:
            self._count("hits_host")
            return payload, "host"
        disk = self.disk
        payload = disk.get(key, kind) if disk is not None else None
        if payload is None:
            self._count("misses")
            return None, None
        self._count("hits_disk")
        self.host.put(key, kind, payload)
        return payload, "disk"

    def where(self, key: bytes, kind: Kind) -> str | None:
        if self.host.contains(key, kind):
            return "host"
        disk = self.disk
        if disk is not None and disk.contains(key, kind):
            return "disk"
        return None

    # -- prefixes -------------------------------------------------------------------------------

    def lookup(self, token_ids: list[int]) -> Lookup:
        """The usable prefix of `token_ids` under the hybrid rule, and the keys to fetch it."""
        self._count("lookups")
        keys = page_keys(self.root, token_ids, self.page_size)
        tokens = usable_prefix(
            len(keys),
            self.page_size,
            self.gdn_interval,
            lambda i: self.where(keys[i], Kind.KV_PAGE) is not None,
            lambda i: self.where(keys[i], Kind.GDN_ANCHOR) is not None,
        )
        pages = tokens // self.page_size
        if pages:
            self._count("lookup_hits")
            self._count("lookup_hit_tokens", tokens)
        return Lookup(tokens, tuple(keys[:pages]), keys[pages - 1] if pages else None)

    def anchor_pages(self, num_tokens: int) -> list[int]:
        """Indices of the full pages of a `num_tokens` prefix whose end lies on the grid."""
        pages = num_tokens // self.page_size
        return [i for i in range(pages) if is_grid_page(i, self.page_size, self.gdn_interval)]

    def prefetch(self, found: Lookup) -> None:
        """Bring a looked-up prefix into the host tier in the background."""
        disk = self.disk
        if disk is None:
            return
        wanted = [(k, Kind.KV_PAGE) for k in found.page_keys]
        if found.anchor_key is not None:
            wanted.append((found.anchor_key, Kind.GDN_ANCHOR))
        for key, kind in wanted:
            if not self.host.contains(key, kind):
                self._submit(lambda key=key, kind=kind: self._promote(disk, key, kind))

    # -- runtime control ------------------------------------------------------------------------

    def attach_disk(self, disk: DiskTier) -> None:
        with self._lock:
            if self.disk is not None:
                raise RuntimeError(f"disk tier: one is attached already at {self.disk.root}")
            self.disk = disk
            for (key, kind), n in self._pins.items():  # checkpoints keep their hold
                for _ in range(n):
                    disk.pin(key, kind)

    def detach_disk(self) -> DiskTier | None:
        """Stop using the disk tier after its queued writes land; its files stay."""
        self.flush()
        with self._lock:
            disk, self.disk = self.disk, None
            if disk is not None:
                for (key, kind), n in self._pins.items():
                    for _ in range(n):
                        disk.unpin(key, kind)
        return disk

    # -- pins -----------------------------------------------------------------------------------

    def pin(self, key: bytes, kind: Kind) -> None:
        """Keep an entry from eviction until `unpin`: on disk by name (a queued write lands
        pinned), and in the host tier when it is there."""
        with self._lock:
            self._pins[(key, kind)] += 1
            if self.host.pin(key, kind):
                self._host_pins[(key, kind)] += 1
            if self.disk is not None:
                self.disk.pin(key, kind)

    def unpin(self, key: bytes, kind: Kind) -> None:
        with self._lock:
            name = (key, kind)
            self._pins.release(name, f"store: unpin of {key.hex()[:16]} ({kind.name})")
            if self._host_pins[name]:
                self._host_pins.release(name, "host pin")
                self.host.unpin(key, kind)
            if self.disk is not None:
                self.disk.unpin(key, kind)

    def delete(self, key: bytes, kind: Kind) -> bool:
        """Remove an entry from every tier, pinned or not: an operator's removal, or a lost
        file. A checkpoint that needs it then refuses to branch, naming it."""
        self.flush()  # a queued write must not bring it back
        removed = self.host.delete(key, kind, force=True)
        disk = self.disk
        if disk is not None:
            removed = disk.delete(key, kind) or removed
        self._count("deleted" if removed else "delete_missing")
        return removed

    def pinned(self, key: bytes, kind: Kind) -> int:
        with self._lock:
            return self._pins[(key, kind)]

    def resize_disk(self, budget_bytes: int) -> None:
        if self.disk is None:
            raise RuntimeError("disk tier: none is attached")
        self.flush()
        self.disk.resize(budget_bytes)

    def flush(self) -> None:
        """Wait until every queued disk job has run."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._worker.join()

    def stats(self) -> dict[str, dict[str, int]]:
        tiers = {"store": self.counters, "host": self.host.counters}
        if self.disk is not None:
            tiers["disk"] = self.disk.counters
        out = {name: dict(c) for name, c in tiers.items()}
        for c in out.values():
            c.setdefault("checked", 0)
        return out

    # -- internals ------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
            self._count("queued")
        except queue.Full:
            self._count("queue_full")

    def _promote(self, disk: DiskTier, key: bytes, kind: Kind) -> None:
        payload = disk.get(key, kind)
        if payload is not None:
            self.host.put(key, kind, payload)
            self._count("prefetched")

    def _on_host_evict(self, key: bytes, kind: Kind, payload: bytes) -> None:
        disk = self.disk
        if self.write_back and disk is not None:
            self._submit(_DiskPut(disk, key, kind, payload))

    def _work(self) -> None:
        """Run queued jobs; consecutive disk puts to one tier go down as one group commit."""
        while True:
            jobs = [self._queue.get()]
            while isinstance(jobs[-1], _DiskPut) and len(jobs) < _MAX_BATCH:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run(jobs)
            finally:
                for _ in jobs:
                    self._queue.task_done()
            if jobs[-1] is None:
                return

    def _run(self, jobs: list[Job]) -> None:
        batch: list[_DiskPut] = []
        for job in [*jobs, None]:
            if isinstance(job, _DiskPut) and (not batch or batch[0].disk is job.disk):
                batch.append(job)
                continue
            if batch:
                self._guarded(lambda b=batch: b[0].disk.put_many([p.item for p in b]))
                batch = []
            if isinstance(job, _DiskPut):
                batch.append(job)
            elif job is not None:
                self._guarded(job)

    def _guarded(self, job: Callable[[], object]) -> None:
        try:
            job()
        except Exception:  # a failed disk job must not kill the worker; count it
            self._count("job_errors")


@dataclass(frozen=True)
class _DiskPut:
    """A queued disk write; the worker batches consecutive ones into one `put_many`."""

    disk: DiskTier
    key: bytes
    kind: Kind
    payload: bytes

    @property
    def item(self) -> tuple[bytes, Kind, bytes]:
        return self.key, self.kind, self.payload


Job = Callable[[], None] | _DiskPut | None
_MAX_BATCH = 64  # a batch holds the disk tier's lock; bound how long a reader can wait
