"""The one allocator: every change to who holds a KV page or a GDN slot goes through it.

Requests are `Holder`s (an owner name, the pages it holds in order, its slot); the allocator is
the only code that writes their `pages` and `slot`, and the only caller of the pools' ledger
operations. Other owners that are not requests (the device prefix cache) hold single pages and
slots by name. Each operation is all or nothing: a refusal returns False (or raises
`PoolExhausted`) and changes nothing.
"""

from __future__ import annotations

from typing import Protocol

from flipjax.runtime.buckets import pages_for
from flipjax.runtime.pools import PagePool, PoolExhausted, SlotPool


class Holder(Protocol):
    """A request as the allocator sees it."""

    request_id: str
    pages: list[int]  # page i holds tokens [i * page_size, (i + 1) * page_size)
    slot: int | None
    draft_slots: list[int]  # where a speculative verify step keeps its states (K of them)


class Allocator:
    def __init__(self, num_pages: int, num_slots: int, page_size: int):
        self.pages = PagePool(num_pages, "kv pages")
        self.slots = SlotPool(num_slots, "gdn slots")
        self.page_size = page_size
        # Every request holding something, by owner name: a pool that shrinks renumbers their
        # pages, and `check` proves each holds what its table says.
        self._holders: dict[str, Holder] = {}

    # -- requests -------------------------------------------------------------------------------

    def grow(self, holder: Holder, num_tokens: int) -> bool:
        """Make `holder` hold pages for its first `num_tokens` tokens; False (and nothing
        allocated) when too few are free."""
        need = pages_for(num_tokens, self.page_size) - len(holder.pages)
        if need <= 0:
            return True
        try:
            holder.pages.extend(self.pages.allocate(need, holder.request_id))
        except PoolExhausted:
            return False
        self._holders[holder.request_id] = holder
        return True

    def take_slot(self, holder: Holder) -> None:
        """Give `holder` a GDN slot; raises `PoolExhausted` when none is free."""
        if holder.slot is not None:
            raise ValueError(f"{holder.request_id} already holds slot {holder.slot}")
        holder.slot = self.slots.allocate(holder.request_id)
        self._holders[holder.request_id] = holder

    def take_draft_slots(self, holder: Holder, count: int) -> bool:
        """Give `holder` `count` more slots for a verify step's states (`draft_slots`); False
        (and nothing taken) when too few are free."""
        if self.slots.num_free < count:
            return False
        holder.draft_slots.extend(self.slots.allocate(holder.request_id) for _ in range(count))
        self._holders[holder.request_id] = holder
        return True

    def promote_draft_slot(self, holder: Holder, i: int) -> None:
        """Make `holder`'s draft slot `i` its slot, and its slot that draft slot: a verify step
        left the state to keep there. Both are its own, so nothing changes hands."""
        if holder.slot is None or not 0 <= i < len(holder.draft_slots):
            raise ValueError(f"{holder.request_id}: no slot and draft slot {i} to exchange")
        holder.slot, holder.draft_slots[i] = holder.draft_slots[i], holder.slot

    def adopt(self, holder: Holder, cached: list[int]) -> None:
        """Replace the pages `holder` reserved with shared references to `cached`, the pages of
        a cached prefix (they hold its first len(cached) pages of tokens)."""
        self.pages.share(cached, holder.request_id)
        self.pages.release(holder.pages, holder.request_id)
        holder.pages = list(cached)
        self._holders[holder.request_id] = holder

    def free(self, holder: Holder) -> None:
        """Release everything `holder` holds."""
        if holder.pages:
            self.pages.release(holder.pages, holder.request_id)
            holder.pages = []
        if holder.slot is not None:
            self.slots.release(holder.slot, holder.request_id)
            holder.slot = None
        for slot in holder.draft_slots:
            self.slots.release(slot, holder.request_id)
        holder.draft_slots = []
        self._holders.pop(holder.request_id, None)

    # -- resizing -------------------------------------------------------------------------------

    def resize_pages(self, total: int, renumbered: dict[int, int]) -> None:
        """Make the page pool `total` pages, the held pages moved as `renumbered` says
        (`PagePool.renumbering`); every request's table follows. Other owners (the prefix
        cache) renumber their own."""
        self.pages.resize(total, renumbered)
        for holder in self._holders.values():
            holder.pages = [renumbered.get(p, p) for p in holder.pages]

    # -- other owners ---------------------------------------------------------------------------

    def share_page(self, page: int, owner: str) -> None:
        self.pages.share([page], owner)

    def release_page(self, page: int, owner: str) -> None:
        self.pages.release([page], owner)

    def allocate_slot(self, owner: str) -> int:
        return self.slots.allocate(owner)

    def release_slot(self, slot: int, owner: str) -> None:
        self.slots.release(slot, owner)

    # -- reading --------------------------------------------------------------------------------

    def held_pages(self) -> list[int]:
        """Every page someone holds (requests, the prefix cache), ascending."""
        return self.pages.held()

    def held_slots(self) -> list[int]:
        return self.slots.held()

    @property
    def free_pages(self) -> int:
        return self.pages.num_free

    @property
    def free_slots(self) -> int:
        return self.slots.num_free

    def check(self) -> None:
        """Prove both ledgers (free + held == total), and that every request holds what its
        table says."""
        self.pages.check()
        self.slots.check()
        for name, holder in self._holders.items():
            for page in holder.pages:
                if name not in self.pages.holders(page):
                    raise AssertionError(f"kv pages: {name}'s table has page {page}, not held")
            for slot in [*([holder.slot] if holder.slot is not None else []), *holder.draft_slots]:
                if self.slots.owner(slot) != name:
                    raise AssertionError(f"gdn slots: {name}'s slot {slot} is not its own")
