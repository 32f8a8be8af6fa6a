"""A session checkpoint's manifest is written only once every entry it references is durable on
disk: writes still queued land first, entries only in host memory are written then, and a
checkpoint whose entries cannot reach the disk is refused and leaves nothing pinned. Each check
opens the disk folder afresh, as a restart after a crash would, without flushing the store."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from flipjax.model.tiny import tiny_config
from flipjax.runtime.sampling import SamplingParams
from store.checkpoints import CheckpointBook, CheckpointError, CheckpointState
from store.disk import DiskTier
from store.entry import HEADER_BYTES, Kind
from store.host import HostTier
from store.keys import page_keys
from store.open import open_checkpoints
from store.open import open_store as open_server_store
from store.tiered import TieredStore
from tests.support.store_writer import IDENTITY

ROOT, PAGE = b"\x02" * 32, 4
ENTRY_BYTES = 4096 + HEADER_BYTES  # a payload and its header on disk
TOKENS = list(range(12))  # three pages, the GDN anchor at the last


def open_store(folder, disk_budget: int = 1 << 30, write_back: bool = False) -> TieredStore:
    disk = DiskTier(str(folder / "disk"), IDENTITY, budget_bytes=disk_budget)
    return TieredStore(ROOT, PAGE, PAGE, HostTier(1 << 26), disk, write_back=write_back)


def references() -> list[tuple[bytes, Kind]]:
    keys = page_keys(ROOT, TOKENS, PAGE)
    return [(k, Kind.KV_PAGE) for k in keys] + [(keys[-1], Kind.GDN_ANCHOR)]


def payload(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * 64  # 4 KiB, its own per key


def publish(store: TieredStore) -> None:
    for key, kind in references():
        store.put(key, kind, payload(key + bytes([kind])))


def state() -> CheckpointState:
    return CheckpointState(TOKENS, 5, len(TOKENS), SamplingParams(max_tokens=4), seed=3)


def on_disk_after_a_crash(folder) -> list[bool]:
    fresh = DiskTier(str(folder / "disk"), IDENTITY, budget_bytes=1 << 30)
    return [fresh.contains(k, kind) for k, kind in references()]


def test_queued_writes_land_before_the_manifest(tmp_path):
    store = open_store(tmp_path)
    gate = threading.Event()
    store.writes.submit(lambda: gate.wait(60))  # the disk writer is busy
    publish(store)  # so these writes wait in its queue
    threading.Timer(0.3, gate.set).start()
    book = CheckpointBook(store, IDENTITY.hex(), str(tmp_path / "manifests"))
    cid = book.create(state())["checkpoint_id"]
    assert os.path.exists(tmp_path / "manifests" / f"{cid}.json")
    assert on_disk_after_a_crash(tmp_path) == [True] * 4
    store.close()


def test_entries_only_in_host_memory_are_written_first(tmp_path):
    store = open_store(tmp_path, write_back=True)  # the disk gets only what the host evicts
    publish(store)
    store.flush()
    assert on_disk_after_a_crash(tmp_path) == [False] * 4
    book = CheckpointBook(store, IDENTITY.hex(), str(tmp_path / "manifests"))
    book.create(state())
    assert on_disk_after_a_crash(tmp_path) == [True] * 4
    store.close()


def test_a_checkpoint_the_disk_cannot_hold_is_refused_and_pins_nothing(tmp_path):
    store = open_store(tmp_path, disk_budget=1000, write_back=True)  # room for no entry
    publish(store)
    book = CheckpointBook(store, IDENTITY.hex(), str(tmp_path / "manifests"))
    with pytest.raises(CheckpointError, match=r"4 of its 4 store entries could not be written"):
        book.create(state())
    assert book.list() == [] and os.listdir(tmp_path / "manifests") == []
    assert all(store.pinned(k, kind) == 0 for k, kind in references())
    assert book.counters["not_durable"] == 1 and book.counters["created"] == 0
    store.close()


def test_a_restart_with_a_smaller_disk_evicts_only_after_the_pins_are_loaded(tmp_path):
    """The checkpoint's entries are the least recently used; a reopen whose disk budget holds
    only a few entries keeps them, and evicts the newer ones no checkpoint needs."""

    def reopen(disk_bytes: int):
        bridge, identity = open_server_store(
            tiny_config(), "w", "float32", PAGE, PAGE, 1 << 26, str(tmp_path), disk_bytes
        )
        return bridge.store, open_checkpoints(bridge, identity, str(tmp_path))

    store, book = reopen(1 << 30)
    keys = page_keys(store.root, TOKENS, PAGE)
    for key in keys:
        store.put(key, Kind.KV_PAGE, payload(key))
    store.put(keys[-1], Kind.GDN_ANCHOR, payload(keys[-1]))
    cid = book.create(state())["checkpoint_id"]
    filler = page_keys(store.root, list(range(100, 140)), PAGE)
    for key in filler:  # ten newer entries
        store.put(key, Kind.KV_PAGE, payload(key))
    store.close()

    store, book = reopen(6 * ENTRY_BYTES)  # room for six entries
    refs = book.references(cid)
    assert [store.disk.contains(k, kind) for k, kind in refs] == [True] * 4
    assert sum(store.disk.contains(k, Kind.KV_PAGE) for k in filler) <= 2
    assert store.disk.used_bytes <= 6 * ENTRY_BYTES
    book.load(cid)  # every reference is there
    store.close()


def test_a_disk_attached_at_run_time_keeps_what_checkpoints_pin(tmp_path):
    store = open_store(tmp_path)
    publish(store)
    book = CheckpointBook(store, IDENTITY.hex(), str(tmp_path / "manifests"))
    book.create(state())
    filler = page_keys(ROOT, list(range(100, 140)), PAGE)
    for key in filler:
        store.put(key, Kind.KV_PAGE, payload(key))
    store.detach_disk().close()
    smaller = DiskTier(str(tmp_path / "disk"), IDENTITY, budget_bytes=6 * ENTRY_BYTES)
    store.attach_disk(smaller)
    assert [smaller.contains(k, kind) for k, kind in references()] == [True] * 4
    assert smaller.used_bytes <= 6 * ENTRY_BYTES
    store.close()


def test_a_checkpoint_of_another_kv_dtype_is_refused_naming_both(tmp_path):
    """Two servers over one store folder, one with fp8 KV pages: each has its own identity, and
    asking one for the other's checkpoint names what made it and what this one runs."""

    def server(page_dtype: str | None):
        bridge, identity = open_server_store(
            tiny_config(),
            "tiny-seed-0",
            "float32",
            PAGE,
            PAGE,
            1 << 24,
            str(tmp_path),
            1 << 26,
            page_dtype=page_dtype,
        )
        return bridge, open_checkpoints(bridge, identity, str(tmp_path))

    bridge, book = server(None)
    keys = page_keys(bridge.store.root, TOKENS, PAGE)
    for key in keys:
        bridge.store.put(key, Kind.KV_PAGE, payload(key))
    bridge.store.put(keys[-1], Kind.GDN_ANCHOR, payload(keys[-1] + b"s"))
    cid = book.create(state())["checkpoint_id"]
    bridge.store.close()
    fp8, other = server("float8_e4m3fn")
    made = r"made by a server with weights 'tiny-seed-0', dtype float32, KV pages float32; "
    runs = r"this one has weights 'tiny-seed-0', dtype float32, KV pages float8_e4m3fn"
    with pytest.raises(KeyError, match=made + runs):
        other.load(cid)
    for unknown in ("0" * 32, "../" + cid, cid.upper()):  # no path leaves the book's folder
        with pytest.raises(KeyError, match="is not a checkpoint here"):
            other.load(unknown)
    fp8.store.close()
    bridge, book = server(None)  # the server that made it still restores it
    assert book.load(cid).token_ids == TOKENS
    bridge.store.close()
