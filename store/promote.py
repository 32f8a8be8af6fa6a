"""Lookups and promotion: the entries a usable prefix needs, and bringing them from the lower
tiers (disk, then remote) into host memory, one batched read per tier, remembering where each
came from until its first read."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from store.entry import Kind
from store.host import HostTier

Name = tuple[bytes, Kind]


@dataclass(frozen=True)
class Lookup:
    """A store lookup: `tokens` usable tokens, with the keys a fetch needs."""

    tokens: int
    page_keys: tuple[bytes, ...]  # one per usable page
    anchor_key: bytes | None  # the GDN anchor at `tokens` (None when nothing is usable)

    def wanted(self) -> list[Name]:
        names = [(k, Kind.KV_PAGE) for k in self.page_keys]
        return names + ([(self.anchor_key, Kind.GDN_ANCHOR)] if self.anchor_key else [])


class BatchReader(Protocol):
    def get_many(self, items: list[Name]) -> list[bytes | None]: ...


class Origins:
    """The lower tier each promoted entry came from, until it is first read (or evicted): a
    hit is counted where it cost, not where it happened to be found."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[Name, str] = {}

    def note(self, name: Name, tier: str) -> None:
        with self._lock:
            self._tiers[name] = tier

    def take(self, name: Name) -> str | None:
        with self._lock:
            return self._tiers.pop(name, None)

    def clear(self) -> None:
        with self._lock:
            self._tiers.clear()


def promote(
    wanted: list[Name], host: HostTier, lowers: list[tuple[str, BatchReader]], origins: Origins
) -> tuple[Counter[str], list[Name]]:
    """Read what of `wanted` the host lacks from each lower tier in turn and put it in host
    memory; returns how many came from each tier, and what none had."""
    missing = [n for n in wanted if not host.contains(*n)]
    found: Counter[str] = Counter()
    for tier, lower in lowers:
        if not missing:
            break
        payloads = lower.get_many(missing)
        for name, payload in zip(missing, payloads, strict=True):
            if payload is not None and host.put(*name, payload):
                origins.note(name, tier)
                found[tier] += 1
        missing = [n for n, p in zip(missing, payloads, strict=True) if p is None]
    return found, missing
