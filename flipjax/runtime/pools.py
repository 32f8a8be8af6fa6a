"""The host ledgers of pooled ids: `PagePool` (KV pages) and `SlotPool` (GDN state slots).

Every id is free or owned, never both; pages are reference counted because a cached prefix
shares them between requests. Freeing what you do not hold raises `OwnershipError` naming the
id and the culprit; running out raises `PoolExhausted` (a refusal the caller handles) and leaves
the pool exactly as it was. Only `flipjax.runtime.allocator.Allocator` changes who holds what;
everything else reads.
"""

from __future__ import annotations

from collections import Counter


class PoolExhausted(RuntimeError):
    """Not enough free ids; nothing was allocated."""


class OwnershipError(RuntimeError):
    """An id was released or shared by someone who does not hold it."""


class PagePool:
    """Reference-counted ledger of KV page ids. An owner may hold a page at most once."""

    def __init__(self, num_pages: int, name: str = "pages"):
        if num_pages <= 0:
            raise ValueError(f"num_pages: must be positive, got {num_pages}")
        self.name = name
        self.total = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0 first
        self._holders: dict[int, set[str]] = {}
        self.counters: Counter[str] = Counter()  # checked, refused

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holders(self, page: int) -> frozenset[str]:
        return frozenset(self._holders.get(page, ()))

    def held(self) -> list[int]:
        return sorted(self._holders)

    def allocate(self, n: int, owner: str) -> list[int]:
        if n > len(self._free):
            self.counters["refused"] += 1
            raise PoolExhausted(
                f"{self.name}: {owner} asked for {n}, only {len(self._free)} of {self.total} free"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._holders[p] = {owner}
        return pages

    def share(self, pages: list[int], owner: str) -> None:
        """Add `owner` as a holder of pages someone already holds (prefix reuse)."""
        for p in pages:
            holders = self._holders.get(p)
            if not holders:
                raise OwnershipError(f"{self.name}: {owner} cannot share page {p}: it is free")
            if owner in holders:
                raise OwnershipError(f"{self.name}: {owner} already holds page {p}")
        for p in pages:
            self._holders[p].add(owner)

    def release(self, pages: list[int], owner: str) -> None:
        """Drop `owner`'s hold; a page with no holder left becomes free. All or nothing."""
        counts = Counter(pages)
        for p, c in counts.items():
            if owner not in self._holders.get(p, ()) or c > 1:
                holders = sorted(self._holders.get(p, ())) or "nobody (free)"
                raise OwnershipError(
                    f"{self.name}: {owner} released page {p}, which is held by {holders}"
                )
        for p in pages:
            holders = self._holders[p]
            holders.remove(owner)
            if not holders:
                del self._holders[p]
                self._free.append(p)

    def renumbering(self, total: int) -> dict[int, int]:
        """Where each held page at or past `total` would go for the pool to shrink to `total`
        pages: the lowest free ids below it. Changes nothing; `PoolExhausted` when more than
        `total` pages are held."""
        held = len(self._holders)
        if held > total:
            raise PoolExhausted(f"{self.name}: {held} pages are held, {total} would remain")
        moving = [p for p in sorted(self._holders) if p >= total]
        room = sorted(p for p in self._free if p < total)
        return dict(zip(moving, room, strict=False))

    def resize(self, total: int, renumbered: dict[int, int]) -> None:
        """Become a pool of `total` pages, the held pages moved as `renumbered` says (from
        `renumbering(total)`; growing needs none). All or nothing."""
        if total <= 0:
            raise ValueError(f"num_pages: must be positive, got {total}")
        holders = {renumbered.get(p, p): h for p, h in self._holders.items()}
        if len(holders) != len(self._holders) or any(p >= total for p in holders):
            raise OwnershipError(
                f"{self.name}: renumbering {renumbered} does not fit the held pages "
                f"{sorted(self._holders)} into {total}"
            )
        self._holders = holders
        self._free = [p for p in range(total - 1, -1, -1) if p not in holders]
        self.total = total

    def check(self) -> None:
        """Prove every id is in exactly one place: free xor held."""
        self.counters["checked"] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name}: a page is on the free list twice")
        held = set(self._holders)
        if free & held:
            raise AssertionError(f"{self.name}: pages both free and held: {sorted(free & held)}")
        if len(free) + len(held) != self.total or any(not h for h in self._holders.values()):
            raise AssertionError(
                f"{self.name}: free {len(free)} + held {len(held)} != total {self.total}"
            )


class SlotPool:
    """Ledger of GDN state slot ids; a slot has exactly one owner."""

    def __init__(self, num_slots: int, name: str = "slots"):
        if num_slots <= 0:
            raise ValueError(f"num_slots: must be positive, got {num_slots}")
        self.name = name
        self.total = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}
        self.counters: Counter[str] = Counter()  # checked, refused

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)

    def held(self) -> list[int]:
        return sorted(self._owner)

    def allocate(self, owner: str) -> int:
        if not self._free:
            self.counters["refused"] += 1
            raise PoolExhausted(f"{self.name}: {owner} asked for a slot, all {self.total} in use")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: str) -> None:
        if self._owner.get(slot) != owner:
            holder = self._owner.get(slot, "nobody (free)")
            raise OwnershipError(f"{self.name}: {owner} released slot {slot}, owned by {holder}")
        del self._owner[slot]
        self._free.append(slot)

    def check(self) -> None:
        self.counters["checked"] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name}: a slot is on the free list twice")
        if free & set(self._owner):
            raise AssertionError(f"{self.name}: slots both free and owned")
        if len(free) + len(self._owner) != self.total:
            raise AssertionError(
                f"{self.name}: free {len(free)} + owned {len(self._owner)} != total {self.total}"
            )
