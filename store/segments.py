"""The disk tier's files: append-only segments of entries, each with an index of records.

`NNNNNN.seg` holds entries back to back, each framed as `store.entry` frames it (header with
its own checksum, then the payload). `NNNNNN.idx` holds fixed 64-byte records, appended after
the entries they describe are durable: a `PUT` says where an entry lies (segment, offset,
length) with its CRC, a `DEAD` retires the entry at such a location (evicted, deleted or found
corrupt). Every record carries its own CRC, so a torn tail (a crash mid-append) is recognised
and cut off, and a damaged record inside an index costs only itself; bytes at a segment's tail
that no record describes are an interrupted batch and are cut off too. An entry is visible
only once its record is.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

from store import durable
from store.entry import Kind

RECORD = struct.Struct("<4sBBH32sIQII4x")  # magic, op, kind, 0, key, segment, offset, len, crc
RECORD_BYTES = RECORD.size + 4  # and the record's own CRC-32
MAGIC = b"FJXI"
PUT, DEAD = 1, 2


@dataclass(frozen=True)
class Location:
    segment: int
    offset: int
    length: int
    crc: int  # of the framed entry's payload, as its header says


@dataclass(frozen=True)
class Record:
    op: int
    key: bytes
    kind: Kind
    at: Location

    def pack(self) -> bytes:
        body = RECORD.pack(
            MAGIC,
            self.op,
            int(self.kind),
            0,
            self.key,
            self.at.segment,
            self.at.offset,
            self.at.length,
            self.at.crc,
        )
        return body + struct.pack("<I", zlib.crc32(body))


def unpack(blob: bytes) -> Record | None:
    """A record, or None when its bytes are torn or not a record."""
    if len(blob) != RECORD_BYTES:
        return None
    body, (crc,) = blob[: RECORD.size], struct.unpack("<I", blob[RECORD.size :])
    if zlib.crc32(body) != crc:
        return None
    magic, op, kind, _, key, segment, offset, length, entry_crc = RECORD.unpack(body)
    if magic != MAGIC or op not in (PUT, DEAD) or kind not in (k.value for k in Kind):
        return None
    return Record(op, key, Kind(kind), Location(segment, offset, length, entry_crc))


def seg_path(folder: str, segment: int) -> str:
    return os.path.join(folder, f"{segment:06d}.seg")


def idx_path(folder: str, segment: int) -> str:
    return os.path.join(folder, f"{segment:06d}.idx")


def segment_ids(folder: str) -> list[int]:
    return sorted(int(n[:-4]) for n in os.listdir(folder) if n.endswith(".seg"))


def read_index(folder: str, segment: int) -> tuple[list[Record], int]:
    """The segment's whole records, and how many of the file's bytes were not records. A
    damaged record costs only itself: the scan resumes at the next place a record's magic
    starts a valid record. Bytes past the last record (a torn tail) are cut off here."""
    path = idx_path(folder, segment)
    if not os.path.exists(path):
        return [], 0
    with open(path, "rb") as f:
        data = f.read()
    records: list[Record] = []
    at, end = 0, 0
    while at + RECORD_BYTES <= len(data):
        record = unpack(data[at : at + RECORD_BYTES])
        if record is not None:
            records.append(record)
            at = end = at + RECORD_BYTES
            continue
        at = data.find(MAGIC, at + 1)
        if at < 0:
            break
    whole = len(records) * RECORD_BYTES
    if whole < end:  # damage between records: the file is rewritten without it, once
        durable.replace_file(path, b"".join(r.pack() for r in records), ".rewrite")
    elif end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return records, len(data) - whole


def cut_tail(folder: str, segment: int, end: int) -> int:
    """Drop the bytes of a segment past `end` (an interrupted batch); how many there were."""
    path = seg_path(folder, segment)
    size = os.path.getsize(path)
    if size > end:
        with open(path, "r+b") as f:
            f.truncate(end)
    return max(0, size - end)
