"""What re-attaching a disk tier while serving needs: the identity its entries carry, the
folder it lives (or last lived) in, and the free space it must leave."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreControl:
    identity: bytes
    folder: str | None
    min_free_bytes: int = 0
