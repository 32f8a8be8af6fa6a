"""Migration of a disk-tier folder in the former one-file-per-entry layout into segments.

It runs when the disk tier opens. Entries are appended oldest first, so the LRU order carries
over, in group commits; a file is removed only once its entry is durable in a segment. A file
the store wrote (an entry's name and its magic) that fails verification is counted and removed:
it was never a hit. Anything else in the folder is counted and left where it is, and so are
folders that still hold something: the store deletes only files it wrote itself.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Protocol

from store.entry import MAGIC, CorruptEntry, Kind, decode
from store.keys import parse_name

BATCH = 64
_OLD_TEMP = re.compile(r"[0-9a-f]{32}\.part")  # the former layout's temp files


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
        batch, ours = [], []
        for path in found[start : start + BATCH]:
            try:
                key, kind = parse_name(os.path.basename(path))
                with open(path, "rb") as f:
                    blob = f.read()
            except (ValueError, OSError):
                tier.counters["migration_left_foreign"] += 1  # not named as an entry: not ours
                continue
            if not blob.startswith(MAGIC):
                tier.counters["migration_left_foreign"] += 1  # named like one, but not ours
                continue
            ours.append(path)
            try:
                batch.append((key, kind, decode(blob, tier.identity, key, kind)))
            except CorruptEntry:  # written by the store, torn or damaged: never a hit
                tier.counters["migration_skipped"] += 1
        placed = tier.put_many(batch)
        tier.counters["migrated"] += sum(placed)
        for path in ours:
            os.remove(path)
    _remove_empty_folders(folder)
    temp = os.path.join(os.path.dirname(folder), "tmp")
    if os.path.isdir(temp):
        for name in os.listdir(temp):
            if _OLD_TEMP.fullmatch(name):
                os.remove(os.path.join(temp, name))
        _remove_empty_folders(temp)


def _remove_empty_folders(top: str) -> None:
    """Remove `top` and the folders under it that are empty; a folder holding anything stays."""
    for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: it holds files the store did not write
