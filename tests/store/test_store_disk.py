"""The disk tier: atomic entries, verified reads, quarantine, budgets, restarts, crashes.

The tier is a log of segments; where a test damages bytes it finds them through the index
(`where`), and a torn segment tail is tested beside the kills."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from store import durable
from store import segment_log as log_module
from store.disk import DiskTier
from store.entry import HEADER_BYTES, Kind, encode
from store.segments import seg_path
from tests.support.paths import REPO_ROOT
from tests.support.store_writer import IDENTITY, payload_for

ROOT = str(REPO_ROOT)


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def files_under(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def where(tier: DiskTier, k: bytes, kind: Kind = Kind.KV_PAGE) -> tuple[str, int, int]:
    """The segment file, offset and length holding an entry."""
    at = tier._index.entries[k.hex() + (".gdn" if kind == Kind.GDN_ANCHOR else "")]
    return seg_path(tier.log.folder, at.segment), at.offset, at.length


def test_round_trip_and_restart(tmp_path):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    for i in range(20):
        assert tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
    assert tier.put(key(0), Kind.GDN_ANCHOR, b"state")
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert again.used_bytes == tier.used_bytes
    assert all(again.get(key(i), Kind.KV_PAGE) == payload_for(key(i)) for i in range(20))
    assert again.get(key(0), Kind.GDN_ANCHOR) == b"state"
    assert again.get(key(1), Kind.GDN_ANCHOR) is None
    assert again.counters["hits"] == 21 and again.counters["misses"] == 1
    assert again.counters["checked"] == 22


@pytest.mark.parametrize("damage", ["flip", "truncate", "identity"])
def test_bad_entries_are_quarantined_misses(tmp_path, damage):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    k = key(1)
    tier.put(k, Kind.KV_PAGE, payload_for(k))
    path, offset, length = where(tier, k)
    if damage == "identity":
        tier = DiskTier(str(tmp_path), b"\x08" * 32, budget_bytes=1 << 30)
    else:
        data = bytearray(open(path, "rb").read())
        if damage == "flip":
            data[offset + HEADER_BYTES + 100] ^= 0x01
        else:
            data = data[: offset + length // 2]
        open(path, "wb").write(bytes(data))
    assert tier.get(k, Kind.KV_PAGE) is None
    assert tier.counters["corrupt"] == 1 and tier.counters["misses"] == 1
    assert not DiskTier(str(tmp_path), IDENTITY, 1 << 30).contains(k, Kind.KV_PAGE), "retired"
    assert len(files_under(str(tmp_path / "quarantine"))) == 1
    assert tier.used_bytes == 0 and not tier.contains(k, Kind.KV_PAGE)
    want = {"flip": "checksum", "truncate": "length", "identity": "model identity"}[damage]
    assert want in tier.last_corruption


def test_an_io_error_is_retried_and_never_taken_for_corruption(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    k = key(1)
    tier.put(k, Kind.KV_PAGE, payload_for(k))
    real, failures = os.pread, [2]

    def flaky(fd: int, n: int, offset: int) -> bytes:
        if failures[0] > 0:
            failures[0] -= 1
            raise OSError(5, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(log_module.os, "pread", flaky)
    assert tier.get(k, Kind.KV_PAGE) == payload_for(k)  # two failures, then a good read
    assert tier.log.read_retries == 2 and tier.counters["read_errors"] == 0
    failures[0] = 10**6  # a disk that stays unreadable
    assert tier.get(k, Kind.KV_PAGE) is None
    assert tier.counters["read_errors"] == 1 and tier.counters["misses"] == 1
    assert tier.counters["corrupt"] == 0 and not files_under(str(tmp_path / "quarantine"))
    failures[0] = 0  # readable again: the entry was kept
    assert tier.get_many([(k, Kind.KV_PAGE)]) == [payload_for(k)]
    assert DiskTier(str(tmp_path), IDENTITY, 1 << 30).contains(k, Kind.KV_PAGE)


def test_budget_is_never_exceeded_and_eviction_is_lru(tmp_path):
    size = len(payload_for(key(0))) + HEADER_BYTES
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=size * 3)
    tier.put(key(0), Kind.KV_PAGE, payload_for(key(0)))
    for i in range(1, 30):
        if payload_for(key(i)).__len__() + HEADER_BYTES > size:
            continue  # keep all entries one size for an exact count
        tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
        tier.get(key(0), Kind.KV_PAGE)  # keep key 0 hot
        assert tier.used_bytes <= tier.budget_bytes
        # Dead bytes wait for compaction: at most as many again, plus the segment being filled.
        assert tier.footprint() <= 2 * size * 3 + tier.log.segment_bytes + size
    assert tier.contains(key(0), Kind.KV_PAGE)
    assert tier.counters["evictions"] > 0


def test_too_large_or_no_space_is_a_counted_refusal(tmp_path):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=100)
    assert not tier.put(key(1), Kind.KV_PAGE, b"x" * 200)
    assert tier.counters["refused"] == 1 and tier.used_bytes == 0
    roomy = DiskTier(
        str(tmp_path / "w"), IDENTITY, budget_bytes=1 << 30, min_free_bytes=1 << 62
    )  # more free space than any disk has
    assert not roomy.put(key(1), Kind.KV_PAGE, b"x")
    assert roomy.counters["refused"] == 1
    assert roomy.used_bytes == 0 and roomy.footprint() == 0


def test_shrinking_evicts_at_once(tmp_path):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    for i in range(10):
        tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
    tier.resize(tier.used_bytes // 2)
    assert tier.used_bytes <= tier.budget_bytes
    survivors = [k for k, _ in tier.entries()]
    assert survivors and key(9) in survivors and key(0) not in survivors


def test_concurrent_writers_and_readers_never_see_partial_entries(tmp_path):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(40)
            if rng.random() < 0.5:
                tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
            else:
                got = tier.get(key(i), Kind.KV_PAGE)
                if got is not None and got != payload_for(key(i)):
                    errors.append(f"wrong bytes for {i}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.counters["corrupt"] == 0
    fresh = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert fresh.used_bytes == tier.used_bytes


def test_a_writer_killed_at_random_never_leaves_a_wrong_entry(tmp_path):
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": ROOT}
    seen_entries = 0
    interrupted_writes = 0
    for attempt in range(20):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.store_writer",
                str(tmp_path),
                str(attempt * 100_000),
                str(1 if attempt % 2 else 8),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.01, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 40)
        assert tier.footprint() == sum(
            os.path.getsize(seg_path(tier.log.folder, s)) for s in tier.log.sizes
        ), "bytes no record describes were cut at open"
        entries = tier.entries()
        for k, kind in entries:
            assert tier.get(k, kind) == payload_for(k)
        assert tier.counters["corrupt"] == 0
        seen_entries = len(entries)
        interrupted_writes += tier.counters["incomplete_removed"]
    assert seen_entries > 20  # the writer did get entries in before being killed
    assert interrupted_writes > 0  # and some kills landed mid-write


def test_put_many_group_commits_a_batch(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    barriers = []
    real_barrier = durable.barrier
    monkeypatch.setattr(
        log_module.durable, "barrier", lambda r, p: (barriers.append(len(p)), real_barrier(r, p))
    )
    items = [(key(i), Kind.KV_PAGE, payload_for(key(i))) for i in range(10)]
    items.append(items[3])  # a duplicate inside the batch is stored once
    assert tier.put_many(items) == [True] * 11
    assert len(barriers) == 2  # two barriers for the whole batch: entries, then records
    assert tier.counters["group_commits"] == 1 and tier.counters["puts"] == 10
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert all(again.get(k, kind) == p for k, kind, p in items)


def test_put_many_that_fails_leaves_nothing(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert tier.put(key(100), Kind.KV_PAGE, b"kept")
    real_barrier = durable.barrier

    def failing_barrier(root, paths):
        raise OSError("injected: disk gone")

    monkeypatch.setattr(log_module.durable, "barrier", failing_barrier)
    with pytest.raises(OSError, match="injected"):
        tier.put_many([(key(i), Kind.KV_PAGE, payload_for(key(i))) for i in range(5)])
    monkeypatch.setattr(log_module.durable, "barrier", real_barrier)
    assert [k for k, _ in tier.entries()] == [key(100)]
    assert tier.used_bytes == HEADER_BYTES + len(b"kept")
    assert tier.get(key(100), Kind.KV_PAGE) == b"kept"
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)  # and after a restart
    assert [k for k, _ in again.entries()] == [key(100)] and again.used_bytes == tier.used_bytes


def test_put_many_refuses_what_does_not_fit_and_keeps_the_rest(tmp_path):
    small = payload_for(key(0))[:1000]
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=3 * (HEADER_BYTES + 1000))
    items = [(key(i), Kind.KV_PAGE, small) for i in range(2)]
    items.insert(1, (key(9), Kind.KV_PAGE, b"x" * 10_000))  # bigger than the whole budget
    assert tier.put_many(items) == [True, False, True]
    assert tier.counters["refused"] == 1
    assert tier.get(key(1), Kind.KV_PAGE) == small


def test_pinned_entries_outlive_eviction_until_unpinned(tmp_path):
    payload = b"p" * 1000
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=3 * (HEADER_BYTES + 1000))
    tier.pin(key(0), Kind.KV_PAGE)  # pinned before it is written: it lands pinned
    for i in range(6):
        assert tier.put(key(i), Kind.KV_PAGE, payload)
    assert tier.contains(key(0), Kind.KV_PAGE), "the oldest entry was pinned"
    assert not tier.contains(key(1), Kind.KV_PAGE) and tier.counters["evictions"] == 3
    tier.pin(key(5), Kind.KV_PAGE)
    tier.pin(key(4), Kind.KV_PAGE)
    assert not tier.put(key(9), Kind.KV_PAGE, payload), "only pinned entries are left"
    assert tier.counters["refused"] == 1
    tier.unpin(key(0), Kind.KV_PAGE)
    assert tier.put(key(9), Kind.KV_PAGE, payload)
    assert not tier.contains(key(0), Kind.KV_PAGE)
    with pytest.raises(RuntimeError, match="not pinned"):
        tier.unpin(key(0), Kind.KV_PAGE)


def test_a_torn_segment_tail_is_cut_and_the_rest_stays(tmp_path):
    """A crash mid-batch: the entry bytes got out, their records half did."""
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    for i in range(3):
        tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
    path, offset, length = where(tier, key(2))
    index = path[: -len(".seg")] + ".idx"
    with open(index, "r+b") as f:  # the last record lost its second half
        f.truncate(os.path.getsize(index) - 20)
    with open(path, "ab") as f:  # and an unrecorded entry's bytes lie beyond
        f.write(b"\x00" * 5000)
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert again.counters["incomplete_removed"] == 1
    assert [k for k, _ in again.entries()] == [key(0), key(1)]
    assert all(again.get(key(i), Kind.KV_PAGE) == payload_for(key(i)) for i in range(2))
    assert os.path.getsize(path) == offset, "the torn entry and the stray bytes were cut"
    assert again.put(key(2), Kind.KV_PAGE, payload_for(key(2)))
    assert DiskTier(str(tmp_path), IDENTITY, 1 << 30).get(key(2), Kind.KV_PAGE) == payload_for(
        key(2)
    )


def test_a_record_whose_entry_never_landed_is_not_trusted(tmp_path):
    """A file system that kept an index record but not all of its entry's bytes (the order of
    the two barriers broken underneath): the entry is not offered, and is not corruption."""
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    for i in range(3):
        tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
    path, offset, length = where(tier, key(2))
    with open(path, "r+b") as f:
        f.truncate(offset + length - 100)
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert [k for k, _ in again.entries()] == [key(0), key(1)]
    assert again.counters["incomplete_removed"] == 1 and again.counters["corrupt"] == 0
    assert os.path.getsize(path) == offset


def test_compaction_reclaims_space_and_keeps_every_live_entry(tmp_path):
    size = HEADER_BYTES + 20_000
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=size * 8)  # 64 KiB segments
    for i in range(40):
        assert tier.put(key(i), Kind.KV_PAGE, payload_for(key(i))[:20_000])
    assert tier.counters["evictions"] > 0 and tier.counters["compactions"] > 0
    assert tier.footprint() <= 2 * tier.budget_bytes + tier.log.segment_bytes
    live = [k for k, _ in tier.entries()]
    assert all(tier.get(k, Kind.KV_PAGE) == payload_for(k)[:20_000] for k in live)
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=size * 8)
    assert [k for k, _ in again.entries()] == live, "a restart sees what compaction left"
    assert all(again.get(k, Kind.KV_PAGE) == payload_for(k)[:20_000] for k in live)


def test_a_per_file_store_folder_is_migrated(tmp_path):
    old = tmp_path / "entries" / "ab" / "cd"
    old.mkdir(parents=True)
    for i in range(3):
        blob = encode(Kind.KV_PAGE, IDENTITY, key(i), payload_for(key(i)))
        (old / key(i).hex()).write_bytes(blob)
    (old / key(9).hex()).write_bytes(blob[:50])  # the store's, torn
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert tier.counters["migrated"] == 3 and tier.counters["migration_skipped"] == 1
    assert all(tier.get(key(i), Kind.KV_PAGE) == payload_for(key(i)) for i in range(3))
    assert not (tmp_path / "entries").exists()


def test_a_migration_deletes_only_files_the_store_wrote(tmp_path):
    """A folder named as a storage backend may hold anything: files that are not the store's
    entries or temp files, even under its folder names, are left where they are."""
    old = tmp_path / "entries" / "ab"
    old.mkdir(parents=True)
    (old / key(0).hex()).write_bytes(encode(Kind.KV_PAGE, IDENTITY, key(0), payload_for(key(0))))
    foreign = {
        old / "notes.txt": b"keep me",
        old / key(1).hex(): b"named like an entry",
        tmp_path / "tmp" / "important.db": b"keep me too",
    }
    (tmp_path / "tmp").mkdir()
    stale = tmp_path / "tmp" / f"{'0' * 32}.part"  # the former layout's temp file
    stale.write_bytes(b"half a write")
    for path, data in foreign.items():
        path.write_bytes(data)
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert tier.counters["migrated"] == 1 and tier.counters["migration_left_foreign"] == 2
    assert all(path.read_bytes() == data for path, data in foreign.items())
    assert not stale.exists() and not (old / key(0).hex()).exists()
    assert tier.get(key(0), Kind.KV_PAGE) == payload_for(key(0))


def test_clear_keeps_what_is_pinned_and_stays_cleared_after_a_restart(tmp_path):
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    tier.put_many([(key(i), Kind.KV_PAGE, payload_for(key(i))) for i in range(30)])
    tier.pin(key(7), Kind.KV_PAGE)
    before = tier.footprint()
    assert tier.clear() == (29, 1)
    assert tier.footprint() < before // 10  # the space came back, not just the index
    assert tier.get(key(7), Kind.KV_PAGE) == payload_for(key(7))
    assert tier.get(key(8), Kind.KV_PAGE) is None
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert [k for k, _ in again.entries()] == [key(7)]
    assert again.get(key(7), Kind.KV_PAGE) == payload_for(key(7))


@pytest.mark.parametrize("damage", ["flipped", "inserted"])
def test_a_damaged_index_record_costs_only_its_own_entry(tmp_path, damage):
    """Bytes gone bad inside an index (a flipped bit, stray bytes between records): the records
    after them still count, and the index is rewritten without the damage, once."""
    tier = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    for i in range(4):
        tier.put(key(i), Kind.KV_PAGE, payload_for(key(i)))
    path, _, _ = where(tier, key(0))
    index = path[: -len(".seg")] + ".idx"
    data = bytearray(open(index, "rb").read())
    record = len(data) // 4
    if damage == "flipped":  # the second record's key: its CRC no longer holds
        data[record + 10] ^= 0x40
        kept = [key(0), key(2), key(3)]
    else:
        data[record:record] = b"FJXI" + b"\x07" * 9  # a magic that starts no valid record
        kept = [key(i) for i in range(4)]
    with open(index, "wb") as f:
        f.write(bytes(data))
    again = DiskTier(str(tmp_path), IDENTITY, budget_bytes=1 << 30)
    assert [k for k, _ in again.entries()] == kept
    assert all(again.get(k, Kind.KV_PAGE) == payload_for(k) for k in kept)
    assert again.counters["incomplete_removed"] == 1
    assert os.path.getsize(index) == len(kept) * record
    assert DiskTier(str(tmp_path), IDENTITY, 1 << 30).counters["incomplete_removed"] == 0
