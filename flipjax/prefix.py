"""What the engine needs from a prefix store, stated without naming one (the store depends on
flipjax, never the reverse). `store.bridge.StoreBridge` is the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class FetchedPrefix:
    """A verified prefix: `tokens` tokens of KV pages and the GDN state at their end."""

    tokens: int
    kv: np.ndarray  # [pages, kv_layers, 2, page_size, kv_heads, head_dim]
    recurrent: np.ndarray  # [gdn_layers, v_heads, dk, dv]
    conv: np.ndarray  # [gdn_layers, kernel - 1, conv_dim]


class PrefixStore(Protocol):
    page_size: int
    gdn_interval: int

    def fetch(self, token_ids: list[int]) -> FetchedPrefix | None:
        """The deepest usable prefix of `token_ids`, fully verified, or None."""

    def publish_pages(self, token_ids: list[int], first_page: int, kv: np.ndarray) -> None:
        """Store full pages `first_page...` of `token_ids` (kv holds one entry per page)."""

    def publish_state(self, token_ids: list[int], recurrent: np.ndarray, conv: np.ndarray) -> None:
        """Store the GDN state after the last of `token_ids` (a grid position)."""
