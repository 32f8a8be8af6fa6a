"""The engine's pools and caches as one thing to inspect and administer: ledger checks, who
holds what, flushing the device prefix cache, and warming every program that moves pages."""

from __future__ import annotations

from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.radix_cache import RadixCache
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.model_runner import ModelRunner


class Caches:
    def __init__(
        self,
        allocator: Allocator,
        prefix_cache: RadixCache | None,
        reuse: PrefixReuse,
        moves_state: bool,
    ):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.reuse = reuse
        self.moves_state = moves_state  # pages and states move between slots, host and device

    def check(self) -> None:
        """Prove the pools' ledgers are consistent (free + owned == total) and agree with the
        prefix cache."""
        self.allocator.check()
        if self.prefix_cache is not None:
            self.prefix_cache.check()

    def usage(self) -> dict[str, int]:
        """Pages and slots held by requests, and those only the prefix cache holds."""
        pages, slots, cache = self.allocator.pages, self.allocator.slots, self.prefix_cache
        cache_pages = cache.sole_pages() if cache is not None else 0
        cache_states = cache.num_states if cache is not None else 0
        return {
            "pages_requests": pages.total - pages.num_free - cache_pages,
            "pages_cache": cache_pages,
            "slots_requests": slots.total - slots.num_free - cache_states,
            "slots_cache": cache_states,
        }

    def flush(self) -> dict[str, int]:
        """Drop the device prefix cache (requests in flight keep what they use); the store's
        tiers are untouched. Returns the pages and states released."""
        if self.prefix_cache is None:
            return {"pages": 0, "states": 0}
        pages, states = self.prefix_cache.flush()
        return {"pages": pages, "states": states}

    def reseed(self) -> int:
        """Drop the device prefix cache ahead of a flip, so it is not moved; returns the pages
        it freed. Counted, and so are the tokens the store serves again afterwards."""
        freed = self.flush()["pages"]
        self.reuse.counters["reseed_flips"] += 1
        self.reuse.counters["reseed_dropped_pages"] += freed
        self.reuse.reseeded = True
        return freed

    def warmup(self, runner: ModelRunner) -> None:
        """Compile every step shape now, so serving never compiles the model step later; when
        state moves, also every program that moves pages and states."""
        runner.warmup()
        if self.moves_state:
            runner.warm_state_io()
