"""The on-disk and in-memory framing of one store entry: a fixed header, then the payload.

Header (84 bytes, little-endian): magic `FJXE`, format version (u16), kind (u8), reserved (u8),
model identity digest (32), entry key (32), payload length (u64), checksum of the payload (u32).
The checksum catches what storage and networks do to bytes (flipped bits, torn or truncated
writes); identity comes from the keys, not from the checksum. Format 2 keeps the low 32 bits of
XXH3-64, which runs several times faster than the memory copy of a read, so verifying every read
costs little; format 1 (CRC-32) is still read. A reader checks every field before it trusts a
byte of the payload; any mismatch is a `CorruptEntry` naming the field, which callers turn into
a miss.
"""

from __future__ import annotations

import enum
import struct
import zlib

import xxhash

MAGIC = b"FJXE"
FORMAT_VERSION = 2


def _xxh3_32(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF


READABLE_VERSIONS = {1: zlib.crc32, 2: _xxh3_32}  # format -> its payload checksum
_HEADER = struct.Struct("<4sHBB32s32sQI")
HEADER_BYTES = _HEADER.size


class Kind(enum.IntEnum):
    KV_PAGE = 1
    GDN_ANCHOR = 2


class CorruptEntry(ValueError):
    """An entry failed verification; the message names what did not match."""


def checksum(payload: bytes | memoryview) -> int:
    return READABLE_VERSIONS[FORMAT_VERSION](payload)


def header(kind: Kind, identity: bytes, key: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, int(kind), 0, identity, key, len(payload), checksum(payload)
    )


def encode(kind: Kind, identity: bytes, key: bytes, payload: bytes) -> bytes:
    return header(kind, identity, key, payload) + payload


def decode(blob: bytes, identity: bytes, key: bytes, kind: Kind | None = None) -> bytes:
    """Verify `blob` against what the reader expects and return its payload."""
    if len(blob) < HEADER_BYTES:
        raise CorruptEntry(f"length: {len(blob)} bytes is shorter than the header")
    payload = memoryview(blob)[HEADER_BYTES:]
    verify(blob[:HEADER_BYTES], payload, identity, key, kind)
    return bytes(payload)


def verify(
    head: bytes, payload: bytes | memoryview, identity: bytes, key: bytes, kind: Kind | None
) -> None:
    """Check a header and the payload read after it (a reader that read them apart)."""
    if len(head) != HEADER_BYTES:
        raise CorruptEntry(f"length: {len(head)} bytes is shorter than the header")
    magic, version, got_kind, _, got_identity, got_key, length, digest = _HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptEntry(f"magic: {magic!r} is not {MAGIC!r}")
    if version not in READABLE_VERSIONS:
        raise CorruptEntry(f"format version: {version} is not one of {sorted(READABLE_VERSIONS)}")
    if kind is not None and got_kind != kind:
        raise CorruptEntry(f"kind: {got_kind} is not {int(kind)}")
    if got_identity != identity:
        raise CorruptEntry("model identity: written by a different model or page size")
    if got_key != key:
        raise CorruptEntry("key: header key does not match the entry's name")
    if len(payload) != length:
        raise CorruptEntry(f"length: payload has {len(payload)} bytes, header says {length}")
    if READABLE_VERSIONS[version](payload) != digest:
        raise CorruptEntry("checksum: payload does not match its checksum")


def kind_of(blob: bytes) -> Kind:
    return Kind(_HEADER.unpack_from(blob)[2])
