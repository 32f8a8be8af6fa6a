"""StoreBridge: the engine's view of the tiered store (`store.prefix.PrefixStore`).

It turns canonical arrays into payloads and keys and back. A fetch looks the prefix up under
the hybrid rule, reads every KV page first and the GDN state last, and returns nothing unless
all of them verified: a missing state can never look like a complete seed. Fetches read host
memory only, what a prefetch brought there; `sync_reads` makes them read every tier in place,
the behaviour before prefetching, kept to measure against.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from flipjax.runtime.host_pages import HostPages
from store.entry import Kind
from store.keys import page_keys, salted_root
from store.payload import PayloadLayout
from store.prefix import FetchedPrefix, Prefetch
from store.tiered import ORDER, TieredStore


class KeyChains:
    """Recently computed key chains, so that publishing page n of a growing sequence hashes the
    new pages only: without it every publish rehashes the whole prefix (quadratic in length)."""

    def __init__(self, page_size: int, capacity: int = 64):
        self.page_size = page_size
        self.capacity = capacity
        self._chains: OrderedDict[bytes, list[bytes]] = OrderedDict()  # root + tokens -> keys
        self.hashed_pages = 0  # pages hashed so far, for tests and stats

    def keys(self, root: bytes, token_ids: list[int], pages: int, resume: int) -> list[bytes]:
        """Keys of the first `pages` full pages under `root`, continuing a cached chain of
        `resume` pages when there is one."""
        ps = self.page_size
        ids = np.asarray(token_ids[: pages * ps], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
            raise ValueError("token_ids: every id must fit in uint32")
        raw = root + ids.astype("<u4").tobytes()
        hit = self._chains.get(raw)
        if hit is None:
            start = len(root) + resume * ps * 4
            known = self._chains.get(raw[:start], []) if resume else []
            parent = known[-1] if known else root
            tail = page_keys(parent, token_ids[len(known) * ps : pages * ps], ps)
            self.hashed_pages += len(tail)
            hit = known + tail
            self._chains[raw] = hit
        self._chains.move_to_end(raw)
        while len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return hit


class StoreBridge:
    def __init__(self, store: TieredStore, layout: PayloadLayout, sync_reads: bool = False):
        self.store = store
        self.layout = layout
        self.sync_reads = sync_reads
        self.page_size = store.page_size
        self.gdn_interval = store.gdn_interval
        self._chains = KeyChains(store.page_size)
        # Entries that verified but do not have this model's payload shape: a miss each, never
        # an error in the engine's seeding.
        self.bad_payloads = 0

    @property
    def dtypes(self) -> tuple[str, str]:
        """The dtypes of the model (its GDN conv states) and of the KV pages it stores."""
        return self.layout.kv_dtype, self.layout.page_dtype

    def fetch(
        self, token_ids: list[int], start: int = 0, salt: str | None = None
    ) -> FetchedPrefix | None:
        resident = not self.sync_reads
        found = self.store.lookup(token_ids, resident, salted_root(self.store.root, salt))
        if found.tokens <= start:
            return None
        pages, tiers = [], set()
        try:
            for key in found.page_keys[start // self.page_size :]:
                payload, tier = self.store.get_from(key, Kind.KV_PAGE, resident)
                if payload is None:
                    return None
                pages.append(self.layout.decode_kv(payload))
                tiers.add(tier)
            state, tier = self.store.get_from(found.anchor_key, Kind.GDN_ANCHOR, resident)
            if state is None:
                return None
            tiers.add(tier)
            rec, conv = self.layout.decode_gdn(state)
        except ValueError:  # another length, or a page scale or value no page holds
            self.bad_payloads += 1
            return None
        # A prefix that needed a lower tier anywhere counts as that tier's hit: that is its cost.
        where = max(tiers, key=ORDER.index)
        return FetchedPrefix(found.tokens, HostPages.stack(pages), rec, conv, start, where)

    def prefetch(self, token_ids: list[int], salt: str | None = None) -> Prefetch | None:
        if self.sync_reads or (self.store.disk is None and self.store.remote is None):
            return None
        return self.store.prefetch(token_ids, salted_root(self.store.root, salt))

    def stats(self) -> dict[str, dict[str, int]]:
        out = self.store.stats()
        out["store"]["bad_payloads"] = self.bad_payloads
        return out

    def publish_pages(
        self, token_ids: list[int], first_page: int, kv: HostPages, salt: str | None = None
    ) -> None:
        root = salted_root(self.store.root, salt)
        keys = self._chains.keys(root, token_ids, first_page + len(kv), resume=first_page)
        for key, (values, scales) in zip(keys[first_page:], kv.each(), strict=True):
            self.store.put(key, Kind.KV_PAGE, self.layout.encode_kv(values, scales))

    def publish_state(
        self,
        token_ids: list[int],
        recurrent: np.ndarray,
        conv: np.ndarray,
        salt: str | None = None,
    ) -> None:
        if len(token_ids) % self.gdn_interval:
            raise ValueError(
                f"gdn anchor: {len(token_ids)} tokens is not on the {self.gdn_interval} grid"
            )
        pages = len(token_ids) // self.page_size
        root = salted_root(self.store.root, salt)
        key = self._chains.keys(root, token_ids, pages, resume=pages)[-1]
        self.store.put(key, Kind.GDN_ANCHOR, self.layout.encode_gdn(recurrent, conv))
