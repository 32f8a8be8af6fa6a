"""The on-disk and in-memory framing of one store entry: a fixed header, then the payload.

Header (96 bytes, little-endian): magic `FJXE`, format version (u16), kind (u8), reserved (u8),
model identity digest (32), entry key (32), payload length (u64), blake2b-128 of the payload
(16). A reader checks every field before it trusts a byte of the payload; any mismatch is a
`CorruptEntry` naming the field, which callers turn into a miss.
"""

from __future__ import annotations

import enum
import hashlib
import struct

MAGIC = b"FJXE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBB32s32sQ16s")
HEADER_BYTES = _HEADER.size


class Kind(enum.IntEnum):
    KV_PAGE = 1
    GDN_ANCHOR = 2


class CorruptEntry(ValueError):
    """An entry failed verification; the message names what did not match."""


def checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode(kind: Kind, identity: bytes, key: bytes, payload: bytes) -> bytes:
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, int(kind), 0, identity, key, len(payload), checksum(payload)
    )
    return header + payload


def decode(blob: bytes, identity: bytes, key: bytes, kind: Kind | None = None) -> bytes:
    """Verify `blob` against what the reader expects and return its payload."""
    if len(blob) < HEADER_BYTES:
        raise CorruptEntry(f"length: {len(blob)} bytes is shorter than the header")
    magic, version, got_kind, _, got_identity, got_key, length, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptEntry(f"magic: {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version: {version} is not {FORMAT_VERSION}")
    if kind is not None and got_kind != kind:
        raise CorruptEntry(f"kind: {got_kind} is not {int(kind)}")
    if got_identity != identity:
        raise CorruptEntry("model identity: written by a different model or page size")
    if got_key != key:
        raise CorruptEntry("key: header key does not match the entry's name")
    payload = blob[HEADER_BYTES:]
    if len(payload) != length:
        raise CorruptEntry(f"length: payload has {len(payload)} bytes, header says {length}")
    if checksum(payload) != digest:
        raise CorruptEntry("checksum: payload does not match its checksum")
    return payload


def kind_of(blob: bytes) -> Kind:
    return Kind(_HEADER.unpack_from(blob)[2])
