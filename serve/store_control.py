"""What re-attaching a disk tier while serving needs: the identity its entries carry, the
folder it lives (or last lived) in, the free space it must leave, and the root every folder a
request names must lie under (`--store-root`): a request names a directory, and the store
opens, migrates and writes there."""

from __future__ import annotations

import os
from dataclasses import dataclass


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
