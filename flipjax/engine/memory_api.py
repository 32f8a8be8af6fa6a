"""The engine's memory, a part of `Engine`'s API: the per-device ledger beside the budgets, and
the KV capacity of each layout within them (the work is in `sharding.ledger`)."""

from __future__ import annotations

from flipjax.engine.assembly import Parts
from flipjax.engine.drafter_memory import drafter_ledger
from sharding.ledger import MemoryReport, report


class MemoryAPI:
    _parts: Parts

    def memory(self) -> MemoryReport:
        """Per device of the live layout: the bytes its weights, KV pages, GDN slots, a
        speculative drafter's weights and pages, workspace and reserve take, beside its budget
        (`--device-memory`); and the KV pages the live layout and every armed one could hold
        within the budgets. `.table()` is the start-up log's text."""
        p = self._parts
        pages = p.allocator.pages.total
        armed = p.layouts.armed.values()
        sizes = p.layouts.pools.sizes
        speculation = p.stepper.speculation
        drafter = drafter_ledger(speculation.drafter) if speculation is not None else None
        page_size = p.config.engine.page_size
        return report(p.runner.binding, p.budgets, armed, pages, page_size, sizes, drafter)
