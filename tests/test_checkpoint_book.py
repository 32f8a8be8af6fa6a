"""A session checkpoint's manifest is written only once every entry it references is durable on
disk: writes still queued land first, entries only in host memory are written then, and a
checkpoint whose entries cannot reach the disk is refused and leaves nothing pinned. Each check
opens the disk folder afresh, as a restart after a crash would, without flushing the store."""

from __future__ import annotations

import os
import threading

import pytest

from flipjax.runtime.sampling import SamplingParams
from store.checkpoints import CheckpointBook, CheckpointError, CheckpointState
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.keys import page_keys
from store.tiered import TieredStore
from tests.store_writer import IDENTITY, payload_for

ROOT, PAGE = b"\x02" * 32, 4
TOKENS = list(range(12))  # three pages, the GDN anchor at the last


def open_store(folder, disk_budget: int = 1 << 30, write_back: bool = False) -> TieredStore:
    disk = DiskTier(str(folder / "disk"), IDENTITY, budget_bytes=disk_budget)
    return TieredStore(ROOT, PAGE, PAGE, HostTier(1 << 26), disk, write_back=write_back)


def references() -> list[tuple[bytes, Kind]]:
    keys = page_keys(ROOT, TOKENS, PAGE)
    return [(k, Kind.KV_PAGE) for k in keys] + [(keys[-1], Kind.GDN_ANCHOR)]


def publish(store: TieredStore) -> None:
    for key, kind in references():
        store.put(key, kind, payload_for(key + bytes([kind])))


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
