"""Migration of a disk-tier folder in the former one-file-per-entry layout into segments.

It runs when the disk tier opens. Entries are appended oldest first, so the LRU order carries
over, in group commits; a file is removed only once its entry is durable in a segment. A file
that fails verification, or is not an entry at all, is counted and removed: it was never a hit.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from store.entry import CorruptEntry, Kind, decode

if TYPE_CHECKING:
    from store.disk import DiskTier

BATCH = 64


def parse_name(name: str) -> tuple[bytes, Kind]:
    """The key and kind an entry's file name (`store.keys.entry_name`) stands for."""
    kind = Kind.GDN_ANCHOR if name.endswith(".gdn") else Kind.KV_PAGE
    key = bytes.fromhex(name.removesuffix(".gdn"))
    if len(key) != 32:
        raise ValueError(f"{name}: not a 32-byte key")
    return key, kind


def migrate_entries(tier: DiskTier, folder: str) -> None:
    if not os.path.isdir(folder):
        return
    found = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    found.sort(key=os.path.getmtime)
    for start in range(0, len(found), BATCH):
        batch, paths = [], found[start : start + BATCH]
        for path in paths:
            try:
                key, kind = parse_name(os.path.basename(path))
                with open(path, "rb") as f:
                    batch.append((key, kind, decode(f.read(), tier.identity, key, kind)))
            except (ValueError, CorruptEntry):  # CorruptEntry is a ValueError; named for clarity
                tier.counters["migration_skipped"] += 1
        placed = tier.put_many(batch)
        tier.counters["migrated"] += sum(placed)
        for path in paths:
            os.remove(path)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(os.path.join(os.path.dirname(folder), "tmp"), ignore_errors=True)
