"""StoreBridge: the engine's view of the tiered store (flipjax.prefix.PrefixStore).

It turns canonical arrays into payloads and keys and back. A fetch looks the prefix up under
the hybrid rule, reads every KV page first and the GDN state last, and returns nothing unless
all of them verified: a missing state can never look like a complete seed.
"""

from __future__ import annotations

import numpy as np

from flipjax.prefix import FetchedPrefix
from store.entry import Kind
from store.keys import page_keys
from store.payload import PayloadLayout
from store.tiered import TieredStore


class StoreBridge:
    def __init__(self, store: TieredStore, layout: PayloadLayout):
        self.store = store
        self.layout = layout
        self.page_size = store.page_size
        self.gdn_interval = store.gdn_interval

    def fetch(self, token_ids: list[int]) -> FetchedPrefix | None:
        found = self.store.lookup(token_ids)
        if not found.tokens:
            return None
        pages = []
        for key in found.page_keys:
            payload = self.store.get(key, Kind.KV_PAGE)
            if payload is None:
                return None
            pages.append(self.layout.decode_kv(payload))
        state = self.store.get(found.anchor_key, Kind.GDN_ANCHOR)
        if state is None:
            return None
        rec, conv = self.layout.decode_gdn(state)
        return FetchedPrefix(found.tokens, np.stack(pages), rec, conv)

    def publish_pages(self, token_ids: list[int], first_page: int, kv: np.ndarray) -> None:
        end = (first_page + len(kv)) * self.page_size
        keys = page_keys(self.store.root, token_ids[:end], self.page_size)
        for key, page in zip(keys[first_page:], kv, strict=True):
            self.store.put(key, Kind.KV_PAGE, self.layout.encode_kv(page))

    def publish_state(self, token_ids: list[int], recurrent: np.ndarray, conv: np.ndarray) -> None:
        if len(token_ids) % self.gdn_interval:
            raise ValueError(
                f"gdn anchor: {len(token_ids)} tokens is not on the {self.gdn_interval} grid"
            )
        key = page_keys(self.store.root, token_ids, self.page_size)[-1]
        self.store.put(key, Kind.GDN_ANCHOR, self.layout.encode_gdn(recurrent, conv))
