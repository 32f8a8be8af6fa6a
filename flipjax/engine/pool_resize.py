"""The engine's side of a flip between layouts whose page pools differ in size.

Each layout's pool is sized from the device budgets (`sharding.pool_sizing`), so a flip can go
into a smaller pool or a larger one. `sharding.flip.Layouts` drives the flip and asks this
object three things:

1. `refusal(total)`: whether a request in flight could never finish in a pool of `total` pages
   (its prompt plus `max_tokens` need more). Such a flip is refused before anything changes.
2. `shrink_to(total)`: hold at most `total` pages. Cached prefixes go first, coldest first: the
   store already has them (pages are written through to it as they are computed), so they come
   back as host hits. If that is not enough, the youngest running requests move back to
   waiting, as the scheduler's own retraction does; they resume from the cache and produce the
   tokens they would have. No request is aborted.
3. `renumber(renumbered)`: after the move, the prefix cache follows the pool's renumbering
   (the requests' tables follow in `Allocator.resize_pages`).

A larger pool needs none of this: its extra pages are free the moment the flip lands.
"""

from __future__ import annotations

from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.scheduler import Scheduler


class PoolResize:
    """Counted in the scheduler's counters: `shrink_evicted_pages`, `shrink_retracted`."""

    def __init__(self, scheduler: Scheduler, prefix_cache: RadixCache | None):
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache

    def refusal(self, total: int) -> str | None:
        sched = self.scheduler
        everyone = [*sched.running, *sched.waiting]
        everyone += [c for s in everyone for c in s.forks]
        for seq in everyone:
            worst = sched.worst_pages(seq)
            if worst > total:
                return (
                    f"{seq.request_id} needs {worst} pages of {sched.page_size} tokens (prompt "
                    f"plus max_tokens), the pool there has {total}"
                )
        return None

    def shrink_to(self, total: int) -> None:
        sched, pages = self.scheduler, self.scheduler.pages
        while (held := pages.total - pages.num_free) > total:
            if self.prefix_cache is not None:
                evicted = self.prefix_cache.evict_pages(held - total)
                sched.counters["shrink_evicted_pages"] += evicted
            if pages.total - pages.num_free <= total or not sched.running:
                break
            sched.retract(sched.running[-1])
            sched.counters["shrink_retracted"] += 1

    def renumber(self, renumbered: dict[int, int]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.renumber(renumbered)
