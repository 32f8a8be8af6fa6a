"""Migration of a disk-tier folder in the former one-file-per-entry layout into segments.

It runs when the disk tier opens. Entries are appended oldest first, so the LRU order carries
over, in group commits; a file is removed only once its entry is durable in a segment. A file
that fails verification, or is not an entry at all, is counted and removed: it was never a hit.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from typing import Protocol

from store.entry import CorruptEntry, Kind, decode
from store.keys import parse_name

BATCH = 64


class Destination(Protocol):
    identity: bytes
    counters: Counter[str]

    def put_many(self, items: list[tuple[bytes, Kind, bytes]]) -> list[bool]: ...


def migrate_entries(tier: Destination, folder: str) -> None:
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
