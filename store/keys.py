"""Content keys for KV pages and GDN anchors.

A page key is blake2b-256 of (parent key, the page's token ids as little-endian uint32). The
chain starts at a root that binds the model identity (config, weights fingerprint, KV dtype,
page size) and an optional tenant salt. Keys never contain a rank, stage, device or TP width,
so every layout, process and machine computes the same key for the same tokens. Only full pages
have keys. This module must not import jax or anything that places data.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from store.entry import Kind

KEY_BYTES = 32
_ROOT_TAG = b"flipjax.store.root.v1"
_GDN_SUFFIX = ".gdn"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        # Length-prefix every part so that no two part lists hash the same bytes.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that makes two KV payloads interchangeable."""

    config: str  # canonical JSON of the model config
    weights: str  # hex fingerprint of the weights
    kv_dtype: str
    page_size: int

    @classmethod
    def create(
        cls, config: dict[str, Any], weights: str, kv_dtype: str, page_size: int
    ) -> ModelIdentity:
        if page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
        return cls(canonical, weights, kv_dtype, page_size)

    def digest(self) -> bytes:
        return _digest(json.dumps(asdict(self), sort_keys=True).encode())


def weights_fingerprint(named_arrays: dict[str, np.ndarray], sample: int = 4096) -> str:
    """Hex fingerprint over names, shapes, dtypes and a strided sample of every array's values.

    Reading every byte of a large checkpoint would cost seconds per start; a strided sample of
    each tensor tells different weights apart with overwhelming odds.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(named_arrays):
        a = np.asarray(named_arrays[name])
        flat = a.reshape(-1)
        step = max(1, flat.size // sample)
        h.update(f"{name}|{a.shape}|{a.dtype}".encode())
        h.update(np.ascontiguousarray(flat[::step][:sample]).tobytes())
    return h.hexdigest()


def root_key(identity: ModelIdentity, salt: str | bytes | None = None) -> bytes:
    salt_bytes = salt.encode() if isinstance(salt, str) else (salt or b"")
    return _digest(_ROOT_TAG, identity.digest(), salt_bytes)


def salted_root(root: bytes, salt: str | None) -> bytes:
    """The chain root for requests carrying `salt` (a tenant's `cache_salt`): their keys share
    nothing with another salt's, or with unsalted ones, so no tenant can find another's
    prefixes or learn from a hit that they exist."""
    return root if salt is None else _digest(_ROOT_TAG, root, salt.encode())


def page_keys(root: bytes, token_ids: list[int], page_size: int) -> list[bytes]:
    """Keys of every full page of `token_ids`, in order; a partial last page has none."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token_ids: every id must fit in uint32")
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(ids) - page_size + 1, page_size):
        page = ids[start : start + page_size].astype("<u4").tobytes()
        parent = _digest(parent, page)
        keys.append(parent)
    return keys


def entry_name(key: bytes, gdn: bool = False) -> str:
    """File-system-safe name of an entry: the key in hex, `.gdn` for a GDN anchor."""
    return key.hex() + (_GDN_SUFFIX if gdn else "")


def parse_name(name: str) -> tuple[bytes, Kind]:
    """The key and kind an entry's name (`entry_name`) stands for; ValueError for anything
    else."""
    kind = Kind.GDN_ANCHOR if name.endswith(_GDN_SUFFIX) else Kind.KV_PAGE
    key = bytes.fromhex(name.removesuffix(_GDN_SUFFIX))
    if len(key) != 32:
        raise ValueError(f"{name}: not a 32-byte key")
    return key, kind


def files_fingerprint(folder: str, sample: int = 1 << 16) -> str:
    """Fingerprint of a checkpoint folder without loading it: every file's relative path and
    size, and `sample` bytes from the start, middle and end of each. Stable across processes
    and machines; any rewritten weight file changes it."""
    h = hashlib.blake2b(digest_size=16)
    for dirpath, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            size = os.path.getsize(path)
            h.update(f"{os.path.relpath(path, folder)}|{size}|".encode())
            with open(path, "rb") as f:
                for offset in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                    f.seek(offset)
                    h.update(f.read(sample))
    return h.hexdigest()
