"""Opening the store a server runs with: identity, tiers and the engine's bridge in one place.

The disk tier lives in a sub-folder of `store_dir` named by the model identity's digest, so
several models (or dtypes, or page sizes) can share one store directory without ever reading
each other's entries (the entry headers check the identity too).
"""

from __future__ import annotations

import os

from flipjax.model.config import ModelConfig
from store.bridge import StoreBridge
from store.checkpoints import CheckpointBook
from store.disk import DiskTier
from store.host import HostTier
from store.keys import ModelIdentity, root_key
from store.payload import PayloadLayout
from store.remote import RedisTier
from store.tiered import TieredStore


def disk_folder(store_dir: str, identity: ModelIdentity) -> str:
    return os.path.join(os.path.expanduser(store_dir), identity.digest().hex()[:32])


def open_store(
    cfg: ModelConfig,
    weights_id: str,
    kv_dtype: str,
    page_size: int,
    gdn_interval: int,
    host_bytes: int,
    store_dir: str | None,
    disk_bytes: int,
    remote_url: str | None = None,
    disk_min_free_bytes: int = 0,
    remote_secret: bytes | None = None,
    page_dtype: str | None = None,
) -> tuple[StoreBridge, ModelIdentity]:
    """A tiered store (host, plus disk when `store_dir` is set and `disk_bytes` > 0, plus a
    shared Redis tier at `remote_url`, whose entries are signed with `remote_secret`) behind a
    bridge the engine can seed from and publish to. `kv_dtype` is the model's dtype and
    `page_dtype` the KV pages' (default the same): both are part of the store's identity, so a
    page computed in one KV dtype is never served to a pool of another."""
    if remote_url and not remote_secret:
        raise ValueError("store secret: a shared (remote) tier needs a secret to sign its entries")
    pages = page_dtype or kv_dtype
    dtypes = kv_dtype if pages == kv_dtype else f"{kv_dtype}/pages:{pages}"
    identity = ModelIdentity.create(cfg.to_dict(), weights_id, dtypes, page_size)
    disk = None
    if store_dir is not None and disk_bytes > 0:
        disk = DiskTier(
            disk_folder(store_dir, identity), identity.digest(), disk_bytes, disk_min_free_bytes
        )
    remote = RedisTier(remote_url, identity.digest(), remote_secret) if remote_url else None
    store = TieredStore(
        root_key(identity), page_size, gdn_interval, HostTier(host_bytes), disk, remote=remote
    )
    layout = PayloadLayout.for_model(cfg, page_size, kv_dtype, pages)
    return StoreBridge(store, layout), identity


def open_checkpoints(
    bridge: StoreBridge, identity: ModelIdentity, store_dir: str | None
) -> CheckpointBook:
    """The session checkpoint book over `bridge`'s store: manifests in the model's folder
    under `store_dir` (beside the disk tier's entries), or in memory without a disk tier. The disk
    tier evicts what its budget cannot keep only after the book has pinned what it needs."""
    disk = bridge.store.disk
    folder = None
    if store_dir is not None and disk is not None:  # manifests last no longer than entries
        folder = os.path.join(disk_folder(store_dir, identity), "manifests")
    model, pages = bridge.dtypes
    about = f"weights {identity.weights!r}, dtype {model}, KV pages {pages}"
    book = CheckpointBook(bridge.store, identity.digest().hex(), folder, about)
    if disk is not None:
        disk.trim()  # the disk tier opened without evicting: the book's pins are in place now
    return book
