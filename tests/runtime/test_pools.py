"""Page and slot ledgers: ownership, refcounts, refusals that leave state unchanged."""

from __future__ import annotations

import pytest

from flipjax.runtime.pools import OwnershipError, PagePool, PoolExhausted, SlotPool


def test_allocate_release_round_trip():
    pool = PagePool(8)
    a = pool.allocate(3, "a")
    b = pool.allocate(5, "b")
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    pool.check()
    pool.release(a, "a")
    pool.release(b, "b")
    assert pool.num_free == 8
    pool.check()
    assert pool.counters["checked"] == 2


def test_exhaustion_is_a_refusal_that_changes_nothing():
    pool = PagePool(4)
    pool.allocate(3, "a")
    with pytest.raises(PoolExhausted, match="b asked for 2, only 1 of 4 free"):
        pool.allocate(2, "b")
    assert pool.num_free == 1 and pool.counters["refused"] == 1
    pool.check()


def test_double_free_names_page_and_culprit():
    pool = PagePool(4)
    pages = pool.allocate(2, "a")
    pool.release(pages, "a")
    with pytest.raises(
        OwnershipError, match=rf"a released page {pages[0]}, which is held by nobody"
    ):
        pool.release(pages, "a")
    pool.check()


def test_foreign_free_names_the_owner_and_is_all_or_nothing():
    pool = PagePool(4)
    mine = pool.allocate(2, "a")
    theirs = pool.allocate(1, "b")
    with pytest.raises(
        OwnershipError, match=rf"a released page {theirs[0]}, which is held by \['b'\]"
    ):
        pool.release(mine + theirs, "a")
    # nothing was released, not even a's own pages
    assert pool.num_free == 1 and pool.holders(mine[0]) == {"a"}
    pool.check()


def test_shared_pages_are_freed_by_the_last_holder():
    pool = PagePool(4)
    pages = pool.allocate(2, "a")
    pool.share(pages, "cache")
    pool.release(pages, "a")
    assert pool.num_free == 2 and pool.holders(pages[0]) == {"cache"}
    with pytest.raises(OwnershipError, match="already holds"):
        pool.share(pages, "cache")
    pool.release(pages, "cache")
    assert pool.num_free == 4
    with pytest.raises(OwnershipError, match="it is free"):
        pool.share(pages, "x")
    pool.check()


def test_slot_pool_ownership():
    slots = SlotPool(2)
    s0 = slots.allocate("a")
    slots.allocate("b")
    with pytest.raises(PoolExhausted, match="all 2 in use"):
        slots.allocate("c")
    with pytest.raises(OwnershipError, match=f"c released slot {s0}, owned by a"):
        slots.release(s0, "c")
    slots.release(s0, "a")
    with pytest.raises(OwnershipError, match="owned by nobody"):
        slots.release(s0, "a")
    slots.check()
    assert slots.counters["refused"] == 1 and slots.counters["checked"] == 1


def test_check_catches_a_corrupted_ledger():
    pool = PagePool(3)
    pool.allocate(1, "a")
    pool._free.append(0)  # simulate a bug: page 0 both held and free
    with pytest.raises(AssertionError, match="both free and held"):
        pool.check()
