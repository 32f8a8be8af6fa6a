"""What re-attaching a disk tier while serving needs: the identity its entries carry, and the
folder it lives (or last lived) in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreControl:
    identity: bytes
    folder: str | None
