"""The interface the store offers the engine for prefixes: `PrefixStore`, and what a fetch
returns. `store.bridge.StoreBridge` implements it over the tiered store; the engine (a layer
above) is typed against this protocol only, so any store with these methods can stand in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flipjax.runtime.host_pages import HostPages


@dataclass
class FetchedPrefix:
    """A verified prefix: the KV pages of tokens `start...tokens` and the GDN state at
    `tokens`."""

    tokens: int
    kv: HostPages  # [pages, kv_layers, 2, page_size, kv_heads, head_dim], from page start/ps
    recurrent: np.ndarray  # [gdn_layers, v_heads, dk, dv]
    conv: np.ndarray  # [gdn_layers, kernel - 1, conv_dim]
    start: int = 0  # tokens the caller already had (a multiple of the page size)
    tier: str = "host"  # the slowest tier the prefix came from: "host", "disk" or "remote"


@dataclass
class Prefetch:
    """A prefix being brought into host memory in the background: `done` is set once it is
    there (or could not be), and `tokens` is then how many tokens the store held."""

    tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class PrefixStore(Protocol):
    page_size: int
    gdn_interval: int

    @property
    def dtypes(self) -> tuple[str, str]:
        """The dtypes of the model (its GDN conv states) and of the KV pages it holds."""

    # `salt` (a tenant's cache salt) keys a chain of its own: a salted prefix is found only
    # with the same salt.

    def fetch(
        self, token_ids: list[int], start: int = 0, salt: str | None = None
    ) -> FetchedPrefix | None:
        """The deepest usable prefix of `token_ids` in host memory if it is longer than `start`
        tokens, fully verified (only pages from `start` on are read), or None. It never waits
        on a disk or the network."""

    def prefetch(self, token_ids: list[int], salt: str | None = None) -> Prefetch | None:
        """Start bringing the stored prefix of `token_ids` into host memory (None: nothing to
        bring, every entry is in host memory already)."""

    def publish_pages(
        self, token_ids: list[int], first_page: int, kv: HostPages, salt: str | None = None
    ) -> None:
        """Store full pages `first_page...` of `token_ids` (kv holds one entry per page)."""

    def publish_state(
        self,
        token_ids: list[int],
        recurrent: np.ndarray,
        conv: np.ndarray,
        salt: str | None = None,
    ) -> None:
        """Store the GDN state after the last of `token_ids` (a grid position)."""

    def stats(self) -> dict[str, dict[str, int]]:
        """Running counters per tier ("store", "host", "disk"), for metrics."""
