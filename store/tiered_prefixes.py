"""Prefix lookups over the tiers: how many tokens of a prompt the store holds, under the hybrid
rule, and prefetch, which brings what the host tier lacks into it on the read worker.

`TieredPrefixes` is a part of `TieredStore`'s API; the store holds the tiers, the workers and
the counters. The serving loop's reads are `resident` (host memory only); only a prefetch, on
the read worker, reads the disk or the network, so this file never waits on either for the
serving loop.
"""

from __future__ import annotations

import threading
from collections import Counter

from flipjax.runtime.hybrid import is_grid_page, usable_prefix
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.keys import page_keys
from store.prefix import Prefetch
from store.promote import Lookup, Name, Origins, promote
from store.remote import RedisTier
from store.worker import Worker


class TieredPrefixes:
    """A part of `TieredStore`'s API: the prefix lookups and prefetch over its tiers."""

    root: bytes
    page_size: int
    gdn_interval: int
    host: HostTier
    disk: DiskTier | None
    remote: RedisTier | None
    origins: Origins
    reads: Worker
    counters: Counter[str]
    _lock: threading.Lock

    def where(self, key: bytes, kind: Kind) -> str | None:
        raise NotImplementedError

    def _count(self, name: str, n: int = 1) -> None:
        raise NotImplementedError

    def lookup(
        self, token_ids: list[int], resident: bool = False, root: bytes | None = None
    ) -> Lookup:
        """The usable prefix of `token_ids` under the hybrid rule, and the keys to fetch it:
        in host memory when `resident`, else in any tier (the remote one asked in one batch).
        `root` is the key chain's (a salted one; the store's own by default)."""
        self._count("lookups")
        keys = page_keys(self.root if root is None else root, token_ids, self.page_size)
        remote = self.remote if not resident else None
        elsewhere: set[Name] = set()
        if remote is not None:
            grid = self.anchor_pages(len(keys) * self.page_size)
            names = [(k, Kind.KV_PAGE) for k in keys] + [(keys[i], Kind.GDN_ANCHOR) for i in grid]
            names = [n for n in names if self.where(*n) is None]
            held = remote.contains_many(names)
            elsewhere = {n for n, hit in zip(names, held, strict=True) if hit}

        def has(key: bytes, kind: Kind) -> bool:
            if resident:
                return self.host.contains(key, kind)
            return self.where(key, kind) is not None or (key, kind) in elsewhere

        tokens = usable_prefix(
            len(keys),
            self.page_size,
            self.gdn_interval,
            lambda i: has(keys[i], Kind.KV_PAGE),
            lambda i: has(keys[i], Kind.GDN_ANCHOR),
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

    def prefetch(self, token_ids: list[int], root: bytes | None = None) -> Prefetch:
        """Find the stored prefix of `token_ids` and bring what the host lacks into it, in the
        background; the ticket is done when the entries are there (or could not be)."""
        ticket = Prefetch()
        found = None
        if self.remote is None:  # the local indexes answer at once; only reads go to the worker
            found = self.lookup(token_ids, root=root)
            ticket.tokens = found.tokens
            if all(self.host.contains(*n) for n in found.wanted()):
                ticket.done.set()
                return ticket
        if not self.reads.submit(lambda: self._prefetch(list(token_ids), ticket, found, root)):
            ticket.done.set()
        return ticket

    def _prefetch(
        self, token_ids: list[int], ticket: Prefetch, found: Lookup | None, root: bytes | None
    ) -> None:
        """On the read worker: look up in every tier (unless the caller did), then promote
        what the host lacks."""
        try:
            found = found if found is not None else self.lookup(token_ids, root=root)
            lowers = [(n, t) for n, t in (("disk", self.disk), ("remote", self.remote)) if t]
            promoted, _ = promote(found.wanted(), self.host, lowers, self.origins)
            with self._lock:
                for tier, n in promoted.items():
                    self.counters[f"prefetched_{tier}"] += n
            ticket.tokens = found.tokens
        finally:
            ticket.done.set()
