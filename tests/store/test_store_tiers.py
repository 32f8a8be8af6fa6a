"""Host tier budgets and pins, the hybrid rule, and the tiered store's paths and controls."""

from __future__ import annotations

import hashlib
import threading

import pytest

from flipjax.runtime.hybrid import usable_prefix
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.keys import page_keys
from store.tiered import TieredStore

IDENTITY = b"\x01" * 32
ROOT = hashlib.blake2b(b"root", digest_size=32).digest()
PS, GRID = 4, 8  # anchors every second page
TOKENS = list(range(100, 124))  # six full pages


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def test_host_budget_lru_and_pins():
    host = HostTier(budget_bytes=300)
    for i in range(3):
        assert host.put(key(i), Kind.KV_PAGE, bytes([i]) * 100)
    assert host.pin(key(0), Kind.KV_PAGE)
    assert host.put(key(3), Kind.KV_PAGE, b"x" * 100)  # evicts key 1, not pinned key 0
    assert host.contains(key(0), Kind.KV_PAGE) and not host.contains(key(1), Kind.KV_PAGE)
    assert host.used_bytes <= 300
    host.pin(key(2), Kind.KV_PAGE)
    host.pin(key(3), Kind.KV_PAGE)
    assert not host.put(key(4), Kind.KV_PAGE, b"y" * 100)  # only pinned entries left
    assert host.counters["refused"] == 1 and host.used_bytes == 300
    host.unpin(key(0), Kind.KV_PAGE)
    assert host.put(key(4), Kind.KV_PAGE, b"y" * 100)
    with pytest.raises(RuntimeError, match="not pinned"):
        host.unpin(key(0), Kind.KV_PAGE)


def test_hybrid_rule_needs_pages_and_a_state():
    def run(pages: set[int], states: set[int]) -> int:
        return usable_prefix(6, PS, GRID, lambda i: i in pages, lambda i: i in states)

    everything = set(range(6))
    assert run(everything, {1, 3, 5}) == 24
    assert run(everything, {1, 3}) == 16  # no state at the end: back to the last one
    assert run(everything, set()) == 0  # KV without state is worth nothing
    assert run(everything - {2}, {1, 3, 5}) == 8  # a missing middle page cuts the prefix
    assert run(everything, {0, 2, 4}) == 0  # states off the grid do not count
    with pytest.raises(ValueError, match="multiple of the page size"):
        usable_prefix(6, PS, 6, lambda i: True, lambda i: True)


def _publish(store: TieredStore, tokens: list[int], anchors: bool = True) -> list[bytes]:
    keys = page_keys(ROOT, tokens, PS)
    for i, k in enumerate(keys):
        store.put(k, Kind.KV_PAGE, b"kv%d" % i)
    if anchors:
        for i in store.anchor_pages(len(tokens)):
            store.put(keys[i], Kind.GDN_ANCHOR, b"gdn%d" % i)
    return keys


def test_lookup_read_through_and_promotion(tmp_path):
    disk = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 20)
    store = TieredStore(ROOT, PS, GRID, HostTier(1 << 20), disk)
    keys = _publish(store, TOKENS)
    store.flush()
    found = store.lookup(TOKENS + [1, 2])
    assert found.tokens == 24 and found.page_keys == tuple(keys) and found.anchor_key == keys[5]
    # drop the host copies: the disk answers, and promotes
    store.host.resize(1)
    assert store.host.used_bytes == 0
    assert store.lookup(TOKENS).tokens == 24
    assert store.get(keys[0], Kind.KV_PAGE) == b"kv0"
    assert store.host.contains(keys[0], Kind.KV_PAGE) is False  # host budget is 1 byte
    store.host.resize(1 << 20)
    assert store.get(keys[1], Kind.KV_PAGE) == b"kv1"
    assert store.host.contains(keys[1], Kind.KV_PAGE)
    s = store.stats()
    assert s["store"]["hits_disk"] == 2 and s["disk"]["checked"] == 2
    store.close()


def test_prefix_without_anchor_is_worth_nothing(tmp_path):
    store = TieredStore(ROOT, PS, GRID, HostTier(1 << 20))
    _publish(store, TOKENS, anchors=False)
    assert store.lookup(TOKENS).tokens == 0
    assert store.stats()["store"]["lookups"] == 1
    store.close()


def test_restart_finds_what_was_committed(tmp_path):
    store = TieredStore(
        ROOT, PS, GRID, HostTier(1 << 20), DiskTier(str(tmp_path), IDENTITY, 1 << 20)
    )
    _publish(store, TOKENS)
    store.close()
    again = TieredStore(
        ROOT, PS, GRID, HostTier(1 << 20), DiskTier(str(tmp_path), IDENTITY, 1 << 20)
    )
    found = again.lookup(TOKENS)
    assert found.tokens == 24
    assert again.lookup(TOKENS, resident=True).tokens == 0  # nothing in host memory yet
    ticket = again.prefetch(TOKENS)
    assert ticket.done.wait(10) and ticket.tokens == 24
    assert all(again.host.contains(k, Kind.KV_PAGE) for k in found.page_keys)
    assert again.stats()["store"]["prefetched_disk"] == 7  # six pages and the anchor
    assert again.lookup(TOKENS, resident=True).tokens == 24
    # the first read of a promoted entry counts where it came from; later ones are host hits
    assert again.get_from(found.page_keys[0], Kind.KV_PAGE, resident=True)[1] == "disk"
    assert again.get_from(found.page_keys[0], Kind.KV_PAGE, resident=True)[1] == "host"
    again.close()


def test_write_back_reaches_disk_on_eviction(tmp_path):
    disk = DiskTier(str(tmp_path), IDENTITY, 1 << 20)
    store = TieredStore(ROOT, PS, GRID, HostTier(1 << 20), disk, write_back=True)
    keys = _publish(store, TOKENS)
    store.flush()
    assert disk.used_bytes == 0
    store.host.resize(1)
    store.flush()
    assert disk.contains(keys[3], Kind.KV_PAGE) and disk.get(keys[3], Kind.KV_PAGE) == b"kv3"
    store.close()


def test_full_queue_refuses_and_counts_without_blocking(tmp_path):
    gate = threading.Event()
    disk = DiskTier(str(tmp_path), IDENTITY, 1 << 20)
    store = TieredStore(ROOT, PS, GRID, HostTier(1 << 20), disk, queue_size=2)
    store.writes.submit(gate.wait)  # occupy the worker
    keys = _publish(store, TOKENS)  # 9 disk writes into a queue of 2
    assert store.stats()["store"]["write_queue_full"] >= 6
    assert all(store.host.contains(k, Kind.KV_PAGE) for k in keys)  # nothing lost from host
    gate.set()
    store.close()


def test_attach_detach_resize_while_serving(tmp_path):
    store = TieredStore(ROOT, PS, GRID, HostTier(1 << 20))
    disk = DiskTier(str(tmp_path), IDENTITY, 1 << 20)
    store.attach_disk(disk)
    with pytest.raises(RuntimeError, match="attached already"):
        store.attach_disk(disk)
    keys = _publish(store, TOKENS)
    detached = store.detach_disk()
    assert detached is disk and store.disk is None
    assert disk.contains(keys[0], Kind.KV_PAGE)  # detach never deletes
    with pytest.raises(RuntimeError, match="none is attached"):
        store.resize_disk(10)
    store.attach_disk(disk)
    store.resize_disk(disk.used_bytes // 2)
    assert disk.used_bytes <= disk.budget_bytes and disk.counters["evictions"] > 0
    store.close()
