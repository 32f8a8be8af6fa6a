"""Continuous batching: which requests run this step, with which prefill chunks.

Each step decodes every running request whose prompt is done (one token each) and spends the
prefill token budget on chunks, in arrival order: running requests mid-prompt first, then new
admissions. Admission is FIFO: if the head of the queue does not fit, nothing behind it jumps
ahead. Pages are allocated as tokens need them. When a decode step needs a page and none is
free, the newest running request is retracted (pages and slot freed, re-queued at the front);
it resumes later by recomputing, so no output is lost.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flipjax.buckets import pages_for
from flipjax.cache import PagePool, PoolExhausted, SlotPool
from flipjax.sequence import Sequence, Status


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

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        slots: SlotPool,
        page_size: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunk_grid: int | None = None,
        on_admit: Callable[[Sequence], None] | None = None,
    ):
        self.pages = pages
        self.slots = slots
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        # Prefill chunks end on this grid, so the GDN state exists at every grid point.
        self.chunk_grid = chunk_grid
        # Called once a request holds its slot, before its first chunk (e.g. to seed a prefix).
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last
        self.counters: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        worst = pages_for(len(seq.prompt_ids) + seq.max_tokens, self.page_size)
        if worst > self.pages.total:
            raise ValueError(
                f"max_tokens: prompt plus max_tokens needs {worst} pages of {self.page_size} "
                f"tokens, the pool has {self.pages.total}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        while True:
            plan = self._plan()
            if not plan.empty or not self.running:
                return plan
            # Every running request is stuck mid-prompt on pages: free the newest.
            self._retract(self.running[-1])

    def finish(self, seq: Sequence) -> None:
        """Free a finished (or aborted) request's pages and slot at once."""
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
                budget -= self._chunk(seq, budget, plan)
        # A request just retracted to make room must not be readmitted into that same room.
        admit = self.counters["retracted"] == retracted_before
        while (
            admit and budget > 0 and self.waiting and len(self.running) < self.max_running_requests
        ):
            seq = self.waiting[0]
            if self.slots.num_free == 0:
                break
            if not self._reserve(seq, seq.num_computed + 1, retract=False):
                break  # FIFO: the head waits for pages, nobody jumps ahead
            self.waiting.popleft()
            seq.slot = self.slots.allocate(seq.request_id)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.counters["admitted"] += 1
            if self.on_admit is not None:
                self.on_admit(seq)
            budget -= self._chunk(seq, budget, plan)
        return plan

    def _chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        want = min(seq.num_pending, budget)
        # Take what fits in pages held plus pages free; a partial chunk still makes progress.
        room = (len(seq.pages) + self.pages.num_free) * self.page_size - seq.num_computed
        length = min(want, room)
        if self.chunk_grid:
            next_grid = (seq.num_computed // self.chunk_grid + 1) * self.chunk_grid
            length = min(length, next_grid - seq.num_computed)
        if length <= 0:
            return 0
        self._reserve(seq, seq.num_computed + length, retract=False)
        plan.prefill.append(PrefillChunk(seq, seq.num_computed, length))
        return length

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make a running request hold pages for `num_tokens` tokens; False if none are free."""
        return self._reserve(seq, num_tokens, retract=False)

    def _reserve(self, seq: Sequence, num_tokens: int, retract: bool) -> bool:
        """Make `seq` hold pages for its first `num_tokens` tokens."""
        need = pages_for(num_tokens, self.page_size) - len(seq.pages)
        while need > 0:
            try:
                seq.pages.extend(self.pages.allocate(need, seq.request_id))
                return True
            except PoolExhausted:
                if not retract or not self.running:
                    return False
                victim = self.running[-1]
                self._retract(victim)
                if victim is seq:
                    return False
        return True

    def _retract(self, seq: Sequence) -> None:
        self._free(seq)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.counters["retracted"] += 1

    def _free(self, seq: Sequence) -> None:
        if seq.pages:
            self.pages.release(seq.pages, seq.request_id)
            seq.pages = []
        if seq.slot is not None:
            self.slots.release(seq.slot, seq.request_id)
            seq.slot = None
