"""What every test that runs requests to the end proves about the pools."""

from __future__ import annotations

from flipjax import Engine
from flipjax.engine.radix_cache import OWNER


def assert_pools_returned(engine: Engine) -> None:
    """No request holds a page or a slot any more (the prefix cache may), and once the cache
    is flushed every id is free."""
    engine.check()
    page_holders = set().union(*(engine.pages.holders(p) for p in range(engine.pages.total)))
    slot_owners = {engine.slots.owner(s) for s in range(engine.slots.total)} - {None}
    assert page_holders <= {OWNER} and slot_owners <= {OWNER}, (page_holders, slot_owners)
    engine.flush_prefix_cache()
    engine.check()
    assert engine.pages.num_free == engine.pages.total
    assert engine.slots.num_free == engine.slots.total
