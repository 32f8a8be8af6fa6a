"""What re-attaching a disk tier while serving needs: the identity its entries carry, the
folder it lives (or last lived) in, the free space it must leave, and the root every folder a
request names must lie under (`--store-root`): a request names a directory, and the store
opens, migrates and writes there. And `describe`, the store's state as the routes show it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from store.tiered import TieredStore


@dataclass
class StoreControl:
    identity: bytes
    folder: str | None
    min_free_bytes: int = 0
    root: str | None = None  # None: only the server's own folder may be attached

    def allowed(self, folder: str) -> str:
        """`folder`, resolved (links followed), if a request may attach it; else ValueError."""
        resolved = _resolved(folder)
        if self.folder is not None and resolved == _resolved(self.folder):
            return resolved
        if self.root is None:
            raise ValueError("dir: without --store-root only the server's own store folder")
        root = _resolved(self.root)
        if os.path.commonpath([resolved, root]) != root:
            raise ValueError(f"dir: {folder!r} is not under --store-root {self.root!r}")
        return resolved


def _resolved(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def describe(store: TieredStore) -> dict[str, Any]:
    """The store's tiers, budgets and counters, as the store routes answer."""
    disk, remote = store.disk, store.remote
    return {
        "host": {"budget_bytes": store.host.budget_bytes, "used_bytes": store.host.used_bytes},
        "disk": None
        if disk is None
        else {
            "dir": disk.root,
            "budget_bytes": disk.budget_bytes,
            "used_bytes": disk.used_bytes,
            "min_free_bytes": disk.min_free_bytes,
            "footprint_bytes": disk.footprint(),
        },
        "remote": None
        if remote is None
        else {"url": remote.url, "available": remote.available, "last_error": remote.last_error},
        "counters": store.stats(),
    }
