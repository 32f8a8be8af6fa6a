"""The interface the store offers the engine for prefixes: `PrefixStore`, and what a fetch
returns. `store.bridge.StoreBridge` implements it over the tiered store; the engine (a layer
above) is typed against this protocol only, so any store with these methods can stand in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class FetchedPrefix:
    """A verified prefix: the KV pages of tokens `start...tokens` and the GDN state at
    `tokens`."""

    tokens: int
    kv: np.ndarray  # [pages, kv_layers, 2, page_size, kv_heads, head_dim], from page start/ps
    recurrent: np.ndarray  # [gdn_layers, v_heads, dk, dv]
    conv: np.ndarray  # [gdn_layers, kernel - 1, conv_dim]
    start: int = 0  # tokens the caller already had (a multiple of the page size)
    tier: str = "host"  # the slowest tier the prefix was read from: "host" or "disk"


class PrefixStore(Protocol):
    page_size: int
    gdn_interval: int

    def fetch(self, token_ids: list[int], start: int = 0) -> FetchedPrefix | None:
        """The deepest usable prefix of `token_ids` if it is longer than `start` tokens, fully
        verified (only pages from `start` on are read), or None."""

    def publish_pages(self, token_ids: list[int], first_page: int, kv: np.ndarray) -> None:
        """Store full pages `first_page...` of `token_ids` (kv holds one entry per page)."""

    def publish_state(self, token_ids: list[int], recurrent: np.ndarray, conv: np.ndarray) -> None:
        """Store the GDN state after the last of `token_ids` (a grid position)."""

    def stats(self) -> dict[str, dict[str, int]]:
        """Running counters per tier ("store", "host", "disk"), for metrics."""
