"""Each layout's pool size, and a flip between pools of different sizes.

A windowed flip may change the pool's size: each layout gets the pages its devices hold
(`sharding.pool_sizing`, from the budgets). Into a smaller pool, the engine's `PoolResizer`
first refuses the flip if a request in flight could never finish there, then frees pages
(cached prefixes first, then the youngest requests go back to waiting). The held pages past
the new end are renumbered into free ones as they land (`PagePool.renumbering`), and every
table follows once the flip has landed. Into a larger pool the extra pages are free at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from flipjax.runtime.allocator import Allocator
from flipjax.runtime.placement import Placement
from sharding.budgets import BudgetError


class PoolResizer(Protocol):
    """What the engine does for a flip into a pool of another size (`flipjax.engine`)."""

    def refusal(self, total: int) -> str | None:
        """Why a pool of `total` pages could not serve what is in flight; None if it can."""

    def shrink_to(self, total: int) -> None:
        """Free pages until at most `total` are held."""

    def renumber(self, renumbered: dict[int, int]) -> None:
        """Follow the pool's renumbering (holders other than requests)."""


class FlipPools:
    def __init__(self, allocator: Allocator, pool_pages: Callable[[Placement], int] | None):
        self.allocator = allocator
        # A layout's own size in pages; None: every layout keeps the current size.
        self.pool_pages = pool_pages
        self.sizes: dict[str, int] = {}
        self.resizer: PoolResizer | None = None

    def pages_for(self, placement: Placement, current: Placement, resizable: bool) -> int:
        """The pool's size in pages once in `placement` (`resizable`: the flip can resize)."""
        total = self.allocator.pages.total
        if not resizable or self.pool_pages is None or placement.key == current.key:
            return total
        if placement.name not in self.sizes:
            try:
                self.sizes[placement.name] = self.pool_pages(placement)
            except BudgetError:
                # Not one page fits there: the flip's room check refuses it with today's pool,
                # naming the device, its need and its budget.
                return total
        return self.sizes[placement.name]

    def refusal(self, total: int) -> str | None:
        """Why the pool cannot become `total` pages (the engine's refusal; without the
        engine, when more are held)."""
        if total >= self.allocator.pages.total:
            return None
        if self.resizer is not None:
            return self.resizer.refusal(total)
        held = self.allocator.pages.total - self.allocator.free_pages
        if held > total:
            return f"{held} pages are held, the pool there has {total}"
        return None

    def shrink_to(self, total: int) -> None:
        if self.resizer is not None and total < self.allocator.pages.total:
            self.resizer.shrink_to(total)

    def landed(self, source: str, total: int, renumbered: dict[int, int]) -> None:
        """After a flip from `source` landed a pool of `total` pages: the ledgers follow."""
        if total == self.allocator.pages.total:
            return
        self.sizes[source] = self.allocator.pages.total
        self.allocator.resize_pages(total, renumbered)
        if self.resizer is not None:
            self.resizer.renumber(renumbered)
