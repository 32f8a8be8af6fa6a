"""Overlapped decoding: the next decode step is dispatched before the sampled ids reach the host.

In a steady decode batch the host's share of a step (taking the ids in, stop checks, publishing
pages, scheduling, preparing and dispatching the next programs) would otherwise leave the device
idle. Here a decode step is fed by the previous step's sampled ids while they are still on the
device, and the host takes those ids in while it runs:

    device:  model k | sample k | model k+1        | sample k+1 | model k+2 ...
    host:    dispatch model k+1 on sample k's ids, take ids k in, dispatch sample k+1, ...

Only the model step runs ahead. Sampling step k + 1 is dispatched after ids k are taken in, so
penalties, grammar masks, min_tokens and logprobs see exactly what a step-by-step run sees, and
the tokens are the same. A request that stops at token k has had token k fed once more: its KV
and GDN state then cover every token it holds (`num_computed == num_tokens`), which is a
consistent state to free or cache; its extra logits are not sampled.

It runs ahead only while the batch stays the same: one process, one stage, every running request
decoding in it and none waiting; in a speculating engine, only while its policy takes steps
without drafts (a verify step needs the ids on the host to know the drafts' prefix). Anything
else, including a row that stopped, takes the pending ids in first (`drain`), and the engine
drains before any operation outside a step (abort, flip, checkpoint, checks), so nothing else
ever sees a request whose newest id is still on device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax

from flipjax.engine.scheduler import Scheduler, StepPlan
from flipjax.engine.sequence import Sequence
from flipjax.engine.speculation import Speculation
from flipjax.engine.step import Stepper, fetched
from flipjax.runtime.model_runner import ModelRunner, Row
from flipjax.runtime.sampler import SamplerOutputs


@dataclass
class Pending:
    """Sampled ids of a decode step, still on device. `rows` in the step's order; None marks a
    row that had stopped, whose id is dropped."""

    rows: list[Sequence | None]
    out: SamplerOutputs


class Overlap:
    def __init__(
        self,
        stepper: Stepper,
        scheduler: Scheduler,
        runner: ModelRunner,
        enabled: bool,
        speculation: Speculation | None = None,
    ):
        self.stepper = stepper
        self.speculation = speculation
        self.scheduler = scheduler
        self.runner = runner
        self.enabled = enabled
        self.pending: Pending | None = None
        self.steps = 0  # decode steps dispatched ahead of their input ids

    def launchable(self, plan: StepPlan) -> bool:
        """Whether `plan`'s decode rows may leave their sampled ids on device: a decode-only
        step of every running request, with nobody waiting."""
        return self._steady(plan.decode) and not plan.prefill

    def launch(self, logits: jax.Array, seqs: list[Sequence]) -> None:
        """Dispatch sampling `seqs`' rows of `logits`, to be taken in by `advance` or `drain`."""
        self.pending = Pending(list(seqs), self.stepper.launch(logits, seqs))

    def advance(self) -> list[Sequence] | None:
        """Run the pending rows' next decode step on their ids still on device, then take
        those ids in and dispatch sampling the new step; returns the requests that finished.
        None, having run nothing, when the batch is not steady or a row's next page is not
        free (then `drain` and schedule)."""
        p, t0 = self.pending, time.perf_counter()
        if p is None or not self._steady(p.rows):
            return None
        seqs: list[Sequence] = list(p.rows)  # type: ignore[arg-type]  # `_steady`: no None
        for s in seqs:  # each feeds its pending id at position num_computed
            if not self.scheduler.reserve(s, s.num_computed + 1):
                return None
        rows = [Row([], s.num_computed, s.pages, s.slot) for s in seqs]
        logits = self.runner.run_sampled(p.out.tokens, rows)
        for s in seqs:
            s.num_computed += 1
        finished = self.drain()
        for s in seqs:  # now that the id fed is known, its page can be published
            if s.error is None and not self.stepper.publish(s, s.num_computed - 1):
                finished.append(s)
        live = [None if s.finish_reason is not None else s for s in seqs]
        if any(s is not None for s in live):
            self.pending = Pending(live, self.stepper.launch(logits, live))
        self.steps += 1
        if self.speculation is not None:
            self.speculation.after_plain_step(seqs, time.perf_counter() - t0)
        return finished

    def drain(self) -> list[Sequence]:
        """Take the pending ids in (the host waits for them); the requests that finished."""
        p, self.pending = self.pending, None
        if p is None:
            return []
        return self.stepper.accept(fetched(p.out, p.rows), p.rows)

    def _steady(self, rows: list[Sequence] | list[Sequence | None]) -> bool:
        running = self.scheduler.running
        return (
            self.enabled
            and self.runner.overlaps
            and bool(rows)
            and not self.scheduler.waiting
            and len(rows) == len(running)
            and all(r is not None and r.finish_reason is None for r in rows)
            and (self.speculation is None or not self.speculation.policy.speculate(len(rows)))
        )
