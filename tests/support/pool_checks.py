"""What every test that runs requests to the end proves about the pools."""

from __future__ import annotations

from flipjax import Engine
from flipjax.engine.radix_cache import OWNER
from tests.support.internals import parts


def assert_pools_returned(engine: Engine) -> None:
    """No request holds a page or a slot any more (the prefix cache may), and once the cache
    is flushed every id is free."""
    engine.check()
    pages, slots = parts(engine).allocator.pages, parts(engine).allocator.slots
    page_holders = set().union(*(pages.holders(p) for p in range(pages.total)))
    slot_owners = {slots.owner(s) for s in range(slots.total)} - {None}
    assert page_holders <= {OWNER} and slot_owners <= {OWNER}, (page_holders, slot_owners)
    engine.flush_prefix_cache()
    engine.check()
    pools = engine.stats().pools
    assert pools["pages_free"] == pools["pages_total"]
    assert pools["slots_free"] == pools["slots_total"]
