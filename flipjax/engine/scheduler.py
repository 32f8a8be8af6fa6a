"""Continuous batching: which requests run this step, with which prefill chunks.

Each step decodes every running request whose prompt is done (one token each) and spends the
prefill token budget on chunks, in arrival order: running requests mid-prompt first, then new
admissions. Chunks end on the GDN checkpoint grid, so a state exists at every grid point for
the prefix cache and the store. Admission is FIFO: if the head of the queue does not fit,
nothing behind it jumps ahead. Pages are allocated as tokens need them.

When pages run short the scheduler climbs a relief ladder, counting every step:
1. `evicted`: free pages only the device prefix cache holds, least recently used first (their
   content stays in the store's host tier, which every computed page is published to);
2. `throttled`: hold back admissions that would leave running decodes no page to grow into;
3. `retracted`: free the newest running request; it is re-queued at the front and resumes
   from the deepest cached prefix of its tokens, recomputing the rest, so no output is lost;
4. `parked`: new work waits in the queue until pages come back.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flipjax.engine.faults import Faults
from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.sequence import Sequence, Status
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.buckets import pages_for


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first position fed this step
    length: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk feeds the last pending token, so its logits are sampled."""
        return self.start + self.length == self.seq.num_tokens


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    awaits_store: bool = False  # the queue's head waits for its prefix to reach host memory

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        allocator: Allocator,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunk_grid: int | None = None,
        on_admit: Callable[[Sequence], None] | None = None,
        prefix_cache: RadixCache | None = None,
        prefetch_wait_s: float = 0.0,
        faults: Faults | None = None,
    ):
        self.allocator = allocator
        self.pages = allocator.pages  # read only: the allocator changes who holds what
        self.page_size = allocator.page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        # Prefill chunks end on this grid, so the GDN state exists at every grid point.
        self.chunk_grid = chunk_grid
        # Called once a request holds its slot, before its first chunk (e.g. to seed a prefix).
        self.on_admit = on_admit
        self.on_add: Callable[[Sequence], None] | None = None  # called once a request is queued
        self.prefix_cache = prefix_cache
        self.prefetch_wait_s = prefetch_wait_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last
        self.counters: Counter[str] = Counter()
        self.faults = faults if faults is not None else Faults()
        self._faulted: list[Sequence] = []  # failed while admitted, for the engine to finish

    def add(self, seq: Sequence) -> None:
        if 1 + len(seq.forks) > self.max_running_requests:
            raise ValueError(
                f"n: {1 + len(seq.forks)} choices exceed max_running_requests "
                f"{self.max_running_requests}; each choice runs as a request"
            )
        worst = self.worst_pages(seq)
        if worst > self.pages.total:
            raise ValueError(
                f"max_tokens: prompt plus max_tokens needs {worst} pages of {self.page_size} "
                f"tokens, the pool has {self.pages.total}"
            )
        self.waiting.append(seq)
        if self.on_add is not None:
            self.on_add(seq)

    def worst_pages(self, seq: Sequence) -> int:
        """The pages `seq` holds at its longest: its prompt plus `max_tokens`."""
        return pages_for(len(seq.prompt_ids) + seq.max_tokens, self.page_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        while True:
            plan = self._plan()
            if not plan.empty:
                return plan
            if not self.running:
                if plan.awaits_store:
                    return plan  # nothing to run until the head's prefix lands (or its wait ends)
                if self.waiting:  # an empty pool that cannot admit would spin forever
                    raise RuntimeError(
                        f"scheduler: cannot admit {self.waiting[0].request_id} with no request "
                        f"running ({self.pages.num_free} of {self.pages.total} pages free)"
                    )
                return plan
            # Every running request is stuck mid-prompt on pages: free the newest.
            self.retract(self.running[-1])

    def release_forks(
        self, parent: Sequence, fork: Callable[[Sequence, Sequence], bool]
    ) -> list[Sequence]:
        """Hand `parent`'s waiting choices over: each that `fork(parent, child)` starts where
        the parent is runs from now on; the others queue to compute their prompt alone. Returns
        the forked ones."""
        forked = []
        for child in parent.forks:
            child.parent = None
            if fork(parent, child):
                child.status = Status.RUNNING
                self.running.append(child)
                forked.append(child)
            else:
                self.waiting.appendleft(child)
                self.counters["unforked"] += 1
        parent.forks = []
        return forked

    def take_faulted(self) -> list[Sequence]:
        """The requests that failed while being admitted, since the last call (freed
        already; the engine answers them)."""
        faulted, self._faulted = self._faulted, []
        return faulted

    def finish(self, seq: Sequence) -> None:
        """Free a finished (or aborted) request's pages and slot at once."""
        self.allocator.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.parent is not None:  # a choice still waiting for its parent's prompt
            seq.parent.forks.remove(seq)
            seq.parent = None
        for child in seq.forks:  # the parent ended first: its choices compute alone
            child.parent = None
            self.waiting.appendleft(child)
        seq.forks = []
        seq.status = Status.FINISHED

    # -- internals ------------------------------------------------------------------------------

    def _plan(self) -> StepPlan:
        plan = StepPlan()
        retracted_before = self.counters["retracted"]
        for seq in list(self.running):
            if seq.status is Status.RUNNING and seq.is_decoding:
                if self._reserve(seq, seq.num_computed + 1, retract=True):
                    plan.decode.append(seq)
        plan.decode = [s for s in plan.decode if s.status is Status.RUNNING]

        budget = self.max_prefill_tokens
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.is_decoding:
                budget -= self._chunks(seq, budget, plan)
        # A request just retracted to make room must not be readmitted into that same room.
        admit = self.counters["retracted"] == retracted_before
        while admit and budget > 0 and self.waiting:
            seq = self.waiting[0]
            if self._awaits_store(seq):
                plan.awaits_store = True
                break
            if not self._room(seq):
                break
            if not self._admissible(seq, len(plan.decode)):
                break  # FIFO: the head waits for pages, nobody jumps ahead
            self.waiting.popleft()
            self.allocator.take_slot(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.counters["admitted"] += 1
            if self.on_admit is not None:
                self.faults.guard(seq, "admitting", functools.partial(self.on_admit, seq))
                if seq.error is not None:
                    self.finish(seq)
                    self._faulted.append(seq)
                    continue
            budget -= self._chunks(seq, budget, plan)
        return plan

    def _awaits_store(self, seq: Sequence) -> bool:
        """Whether the queue's head waits for its prefetch, within `prefetch_wait_s` of its
        arrival: a read is cheaper than computing, and nobody behind jumps ahead (FIFO)."""
        ticket = seq.prefetch
        if ticket is None or ticket.done.is_set():
            return False
        if time.perf_counter() - seq.arrival_time >= self.prefetch_wait_s:
            return False
        self.counters["prefetch_waits"] += 1  # steps the head waited through
        return True

    def _room(self, seq: Sequence) -> bool:
        """Whether `seq` and its parallel choices fit beside the running requests and the
        choices those have yet to fork (each choice runs as a request with its own slot)."""
        reserved = sum(len(s.forks) for s in self.running)
        need = 1 + len(seq.forks)
        return (
            len(self.running) + reserved + need <= self.max_running_requests
            and self.allocator.free_slots - reserved >= need
        )

    def _admissible(self, seq: Sequence, decoding: int) -> bool:
        """Whether the queue's head can start now: its first page, plus one page of headroom
        per running decode, must be free (after evicting the prefix cache if need be)."""
        need = pages_for(seq.num_computed + 1, self.page_size) - len(seq.pages)
        if self._make_room(need + decoding) < need + decoding:
            self.counters["parked" if self.pages.num_free < need else "throttled"] += 1
            return False
        return self._reserve(seq, seq.num_computed + 1, retract=False)

    def _chunks(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan `seq`'s prefill chunks within `budget`, each ending on the grid; returns the
        tokens planned."""
        start, planned = seq.num_computed, 0
        while planned < budget and start + planned < seq.num_tokens:
            length = self._chunk(seq, start + planned, budget - planned, plan)
            if length == 0:
                break
            planned += length
        return planned

    def _chunk(self, seq: Sequence, start: int, budget: int, plan: StepPlan) -> int:
        length = min(seq.num_tokens - start, budget)
        if self.chunk_grid:
            next_grid = (start // self.chunk_grid + 1) * self.chunk_grid
            length = min(length, next_grid - start)
        # Take what fits in pages held plus pages free; a partial chunk still makes progress.
        need = pages_for(start + length, self.page_size) - len(seq.pages)
        self._make_room(need)
        room = (len(seq.pages) + self.pages.num_free) * self.page_size - start
        length = min(length, room)
        if length <= 0:
            return 0
        self._reserve(seq, start + length, retract=False)
        plan.prefill.append(PrefillChunk(seq, start, length))
        return length

    def _make_room(self, pages: int) -> int:
        """Evict the prefix cache until `pages` are free, if it can; returns pages free."""
        short = pages - self.pages.num_free
        if short > 0 and self.prefix_cache is not None:
            self.counters["evicted"] += self.prefix_cache.evict_pages(short)
        return self.pages.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make a running request hold pages for `num_tokens` tokens; False if none are free."""
        return self._reserve(seq, num_tokens, retract=False)

    def _reserve(self, seq: Sequence, num_tokens: int, retract: bool) -> bool:
        """Make `seq` hold pages for its first `num_tokens` tokens."""
        need = pages_for(num_tokens, self.page_size) - len(seq.pages)
        while need > 0:
            self._make_room(need)  # a retracted request's pages stay cached: evict them too
            if self.allocator.grow(seq, num_tokens):
                return True
            if not retract or not self.running:
                return False
            victim = self.running[-1]
            self.retract(victim)
            if victim is seq:
                return False
        return True

    def retract(self, seq: Sequence) -> None:
        """Free a running request and queue it first; it resumes from the cache."""
        self.allocator.free(seq)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.counters["retracted"] += 1
