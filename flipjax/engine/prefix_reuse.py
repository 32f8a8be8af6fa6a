"""Prefix reuse: where an admitted request's prefix comes from, and where computed pages go.

A queued request's stored prefix starts on its way into host memory at once (the store's
worker reads disk and network). An admitted request starts from the deepest cached prefix of
its tokens: the device prefix cache first (pages shared, the grid state copied into the
request's slot), then what the store holds in host memory beyond that (pages and state written
into the request's own); no step waits on a disk or network read. A prefill that began before
its prefetch landed catches up after a later chunk, skipping what the store now holds. As pages
and grid states are computed they are offered to both, write-through. Every admission is
counted by the tier its prefix came from, or as a miss.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sequence import Sequence
from flipjax.runtime.model_runner import ModelRunner
from store.prefix import PrefixStore


class PrefixReuse:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        page_size: int,
        interval: int,
        cache: RadixCache | None,
        store: PrefixStore | None,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.page_size = page_size
        self.interval = interval
        self.cache = cache
        self.store = store
        self.counters: Counter[str] = Counter()
        self.reseeded = False  # a flip dropped the device cache for the store to serve again
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Neither look prefixes up nor publish them (for synthetic load, e.g. calibration)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def seed(self, seq: Sequence) -> None:
        """Start an admitted request from the deepest cached prefix of its tokens: the device
        cache first, then the store for whatever it holds beyond that.

        At least one token is left to compute, since its logits are what gets sampled.
        """
        if seq.num_computed or self._paused:
            return
        if seq.params.prompt_logprobs is not None:  # every prompt position's logits are needed
            self.counters["scoring_skips"] += 1
            return
        known = seq.all_ids[:-1]
        tokens, tier = 0, None
        cache = self.cache
        if cache is not None:
            match = cache.match(known, seq.cache_salt)
            if match.tokens:
                # Swap the page reserved at admission for the cached ones, then one to grow into.
                self.scheduler.allocator.adopt(seq, match.pages)
                self.scheduler.reserve(seq, match.tokens + 1)  # the page just released fits
                self._copy_state(match.slot, seq.slot)
                tokens, tier = match.tokens, "device"
        store = self.store
        found = store.fetch(known, tokens, seq.cache_salt) if store is not None else None
        if found is not None and self.scheduler.reserve(seq, found.tokens):
            ps = self.page_size
            pages = seq.pages[tokens // ps : found.tokens // ps]
            self.runner.write(pages, found.kv, seq.slot, found.recurrent, found.conv)
            tokens, tier = found.tokens, found.tier
        seq.num_computed = tokens
        if not seq.output_ids:  # a resumed request's usage keeps its first admission's count
            seq.cached_tokens = tokens
        self.counters[f"hits_{tier}" if tier else "misses"] += 1
        if tier:
            self.counters[f"hit_tokens_{tier}"] += tokens
        if tier in ("host", "disk") and self.reseeded:
            self.counters["reseed_reread_tokens"] += tokens

    def prefetch(self, seq: Sequence) -> None:
        """Start bringing a queued request's stored prefix into host memory."""
        store = self.store
        if store is None or self._paused or seq.params.prompt_logprobs is not None:
            return
        seq.prefetch = store.prefetch(seq.all_ids[:-1], seq.cache_salt)
        if seq.prefetch is not None:
            self.counters["prefetches"] += 1

    def catch_up(self, seq: Sequence) -> None:
        """After a prefill chunk: when the request's prefetch has landed with more than it has
        computed, write the rest of the stored prefix into its pages and slot. Only pages from
        the one being filled on are written: full ones may be shared already."""
        ticket, store = seq.prefetch, self.store
        if ticket is None or store is None or not ticket.done.is_set():
            return
        seq.prefetch = None
        if ticket.tokens <= seq.num_computed:
            return
        ps = self.page_size
        start = seq.num_computed // ps * ps
        found = store.fetch(seq.all_ids[:-1], start, seq.cache_salt)
        if found is None or found.tokens <= seq.num_computed:
            self.counters["catch_up_misses"] += 1
            return
        if not self.scheduler.reserve(seq, found.tokens):
            self.counters["catch_up_no_room"] += 1
            return
        pages = seq.pages[start // ps : found.tokens // ps]
        self.runner.write(pages, found.kv, seq.slot, found.recurrent, found.conv)
        gained = found.tokens - seq.num_computed
        seq.num_computed = found.tokens
        if not seq.output_ids:
            seq.cached_tokens += gained
        self.counters["catch_ups"] += 1
        self.counters[f"hit_tokens_{found.tier}"] += gained

    def publish(self, seq: Sequence, start: int) -> None:
        """Offer pages completed since `start`, and a grid state, to the device prefix cache
        and the prefix store."""
        if self._paused:
            return
        cache, store, salt = self.cache, self.store, seq.cache_salt
        ps, end = self.page_size, seq.num_computed
        first, last = start // ps, end // ps
        on_grid = end > start and end % self.interval == 0
        if cache is not None and last > first:
            cache.insert(seq.all_ids[: last * ps], seq.pages[:last], salt)
        if cache is not None and on_grid:
            copy = functools.partial(self._copy_state, seq.slot)
            cache.add_state(seq.all_ids[:end], copy, salt)
        if store is None:
            return
        if last > first:
            kv = self.runner.read_pages(seq.pages[first:last])
            store.publish_pages(seq.all_ids, first, kv, salt)
        if on_grid:
            rec, conv = self.runner.read_slot(seq.slot)
            store.publish_state(seq.all_ids[:end], rec, conv, salt)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` exactly where `parent` is, its prompt computed: the parent's full pages
        shared, its partly filled last page and its GDN state copied into the child's own.
        False (nothing held) when no slot or page is free; the child then computes alone."""
        allocator, ps = self.scheduler.allocator, self.page_size
        full, computed = parent.num_computed // ps, parent.num_computed
        if not allocator.free_slots:
            return False
        allocator.take_slot(child)
        allocator.adopt(child, parent.pages[:full])
        if not allocator.grow(child, computed):
            allocator.free(child)
            return False
        if computed % ps:
            self.runner.copy_page(parent.pages[full], child.pages[full])
        self.runner.copy_slot(parent.slot, child.slot)
        child.num_computed = computed
        child.cached_tokens = computed
        child.prompt_logprobs = list(parent.prompt_logprobs)
        self.counters["forks"] += 1
        return True

    def _copy_state(self, src: int, dst: int) -> None:
        self.runner.copy_slot(src, dst)
