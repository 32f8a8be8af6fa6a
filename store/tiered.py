"""The tiered store: host RAM in front of an optional disk tier and an optional shared remote
tier (Redis), with every disk and network operation on background workers.

Writes land in the host tier at once. They reach the disk through a bounded queue, right away
(write-through, the default) or when the host tier evicts them (write-back), and the remote
tier through the same queue, always write-through: it is there to be shared. A full queue
refuses the job and counts it; the serving loop never waits on a write.

Reads by the serving loop are `resident`: host memory only. `prefetch` looks a prompt's prefix
up in every tier and promotes what the host lacks, on a second worker, so that a later resident
read finds it; the ticket it returns says when, and how many tokens it found (the lookups are
in `store.tiered_prefixes`). A promoted entry remembers the tier it came from until its first
read, so hits are counted where they cost.

The disk tier can be attached, detached (its files stay) and resized while serving. Every path
is counted; `stats()` reports the store's counters and each tier's, and a gate that never ran
reads `checked: 0` rather than nothing.
"""

from __future__ import annotations

import threading
from collections import Counter

from flipjax.runtime.hybrid import check_interval
from store.backend import Pins
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.promote import Origins
from store.remote import RedisTier
from store.tiered_prefixes import TieredPrefixes
from store.worker import TierPut, Worker

ORDER = ("host", "disk", "remote")  # nearest first


class TieredStore(TieredPrefixes):
    def __init__(
        self,
        root: bytes,
        page_size: int,
        gdn_interval: int,
        host: HostTier,
        disk: DiskTier | None = None,
        write_back: bool = False,
        queue_size: int = 1024,
        remote: RedisTier | None = None,
    ):
        check_interval(gdn_interval, page_size)
        self.root = root
        self.page_size = page_size
        self.gdn_interval = gdn_interval
        self.host = host
        self.disk = disk
        self.remote = remote
        self.write_back = write_back
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pins = Pins()  # by session checkpoints
        self._host_pins = Pins()  # those the host tier took
        self.origins = Origins()
        host.on_evict = self._on_host_evict
        self.writes = Worker("write", self.counters, self._lock, queue_size)
        # The remote tier has its own writer: a slow network must not hold up the disk's writes.
        self.remote_writes = Worker("remote_write", self.counters, self._lock, queue_size)
        self.reads = Worker("read", self.counters, self._lock, queue_size)

    # -- entries --------------------------------------------------------------------------------

    def put(self, key: bytes, kind: Kind, payload: bytes) -> None:
        """Publish an entry: host now; disk and remote in the background."""
        self._count("puts")
        in_host = self.host.put(key, kind, payload)
        disk, remote = self.disk, self.remote
        if disk is not None and (not self.write_back or not in_host):
            self.writes.submit(TierPut(disk, key, kind, payload))
        if remote is not None:
            self.remote_writes.submit(TierPut(remote, key, kind, payload))

    def get(self, key: bytes, kind: Kind) -> bytes | None:
        """The verified payload from the nearest tier; a lower tier's hit is promoted to host."""
        return self.get_from(key, kind)[0]

    def get_from(
        self, key: bytes, kind: Kind, resident: bool = False
    ) -> tuple[bytes | None, str | None]:
        """`get`, and the tier the entry came from ("host", "disk", "remote"; None for a miss).
        `resident` reads host memory only: what the serving loop may wait for."""
        payload = self.host.get(key, kind)
        if payload is not None:
            tier = self.origins.take((key, kind)) or "host"
            self._count(f"hits_{tier}")
            return payload, tier
        if not resident:
            for tier, lower in (("disk", self.disk), ("remote", self.remote)):
                payload = lower.get(key, kind) if lower is not None else None
                if payload is not None:
                    self._count(f"hits_{tier}")
                    self.host.put(key, kind, payload)
                    return payload, tier
        self._count("misses")
        return None, None

    def where(self, key: bytes, kind: Kind) -> str | None:
        """The nearest local tier holding the entry (the remote tier is asked in batches)."""
        if self.host.contains(key, kind):
            return "host"
        disk = self.disk
        if disk is not None and disk.contains(key, kind):
            return "disk"
        return None

    # -- runtime control ------------------------------------------------------------------------

    def attach_disk(self, disk: DiskTier) -> None:
        with self._lock:
            if self.disk is not None:
                raise RuntimeError(f"disk tier: one is attached already at {self.disk.root}")
            self.disk = disk
            for (key, kind), n in self._pins.items():  # checkpoints keep their hold
                for _ in range(n):
                    disk.pin(key, kind)
        disk.trim()  # only now: the pins are in place

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

    def resize_disk(self, budget_bytes: int) -> None:
        if self.disk is None:
            raise RuntimeError("disk tier: none is attached")
        self.flush()
        self.disk.resize(budget_bytes)

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

    def pinned(self, key: bytes, kind: Kind) -> int:
        with self._lock:
            return self._pins[(key, kind)]

    def delete(self, key: bytes, kind: Kind) -> bool:
        """Remove an entry from every local tier, pinned or not: an operator's removal, or a
        lost file. A checkpoint that needs it then refuses to branch, naming it."""
        self.flush()  # a queued write must not bring it back
        removed = self.host.delete(key, kind, force=True)
        disk = self.disk
        if disk is not None:
            removed = disk.delete(key, kind) or removed
        self._count("deleted" if removed else "delete_missing")
        return removed

    def clear(self, remote: bool = False) -> dict[str, dict[str, int]]:
        """Drop every entry no session checkpoint pins from host and disk (and this model's
        entries from the remote tier when `remote`), safe while serving: queued writes land
        first, so none brings an entry back, and a read finds an entry whole or not at all."""
        self.flush()
        out: dict[str, dict[str, int]] = {}
        removed, kept = self.host.clear()
        out["host"] = {"removed": removed, "kept_pinned": kept}
        self.origins.clear()
        if self.disk is not None:
            removed, kept = self.disk.clear()
            out["disk"] = {"removed": removed, "kept_pinned": kept}
        if remote and self.remote is not None:
            out["remote"] = {"removed": self.remote.clear()}
        self._count("clears")
        return out

    def flush(self) -> None:
        """Wait until every queued write, then every queued prefetch, has run."""
        self.writes.flush()
        self.remote_writes.flush()
        self.reads.flush()

    def close(self) -> None:
        self.reads.close()
        self.writes.close()
        self.remote_writes.close()
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()

    def stats(self) -> dict[str, dict[str, int]]:
        tiers = {"store": self.counters, "host": self.host.counters}
        for name, tier in (("disk", self.disk), ("remote", self.remote)):
            if tier is not None:
                tiers[name] = tier.counters
        with self._lock:
            out = {name: dict(c) for name, c in tiers.items()}
        for c in out.values():
            c.setdefault("checked", 0)
        if self.remote is not None:
            out["remote"]["available"] = int(self.remote.available)
        return out

    # -- internals ------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _on_host_evict(self, key: bytes, kind: Kind, payload: bytes) -> None:
        self.origins.take((key, kind))
        disk = self.disk
        if self.write_back and disk is not None:
            self.writes.submit(TierPut(disk, key, kind, payload))
