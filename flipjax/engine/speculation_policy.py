"""When to speculate: by the decode rate each way, measured on this machine as the engine runs.

A verify step multiplies K + 1 positions per row and the head drafts K more, so it pays only
where a step is bound by reading the weights (a large model, a small batch) and not by
arithmetic or per-call costs (a small model on a CPU, a large batch). Rather than guess, the
policy measures: per batch-size bucket, a few steps each way (the tokens a step takes, on
average, over the time a step usually takes: the median, as a stalled step is not the usual
one, while a verify step's tokens vary from step to step but its time does not), then the
faster way, with the other measured again after `REPROBE_EVERY` steps in case the load
changed. A way is judged on its last `STEPS_KEPT` steps, not only the few of its latest
measure: over six steps the measured ratio of the two ways spread over 0.8-2.2x at batch 1
(about 1.5x in truth), and a measure that took plain steps for the faster way cost the 192
steps after it. Each measure that confirms the choice doubles the wait before the next, up to
`MAX_REPROBE_EVERY` (a measure costs a few of the slower way's steps); a change of choice sets
it back. The first step after each switch is not counted (it may compile, and a request's
drafts are empty after plain steps). The tokens are the same either way.

Over more than one row speculation must win by `TAIL_MARGIN`: it takes each row a different
number of tokens a step, so the rows of a batch that started together end apart, and a batch
that is not refilled ends with steps of few rows that cost nearly a full step. A step's measure
cannot see that cost: at batch 8 on a 2-core CPU, verify steps took 1.03x plain's tokens a
second, and equal-length batches decoded 0.73-0.99x as fast speculating in every step.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from flipjax.runtime.buckets import pow2_bucket

PROBE_STEPS = 6  # steps of a way measured before it is judged
STEPS_KEPT = 32  # the most recent steps of a way its measure rests on
FIRST_MEASURE = 2 * PROBE_STEPS  # steps of each way (in turns) before the first judgement
REPROBE_EVERY = 192  # steps of the chosen way before the other is measured again
MAX_REPROBE_EVERY = 8 * REPROBE_EVERY  # the wait once many measures confirmed the choice
TAIL_MARGIN = 0.2  # how much faster a step speculation must be over more than one row


@dataclass
class _Bucket:
    steps: dict[bool, deque[tuple[int, float]]] = field(  # (tokens, seconds) of recent steps
        default_factory=lambda: {True: deque(maxlen=STEPS_KEPT), False: deque(maxlen=STEPS_KEPT)}
    )
    last: bool | None = None  # the way the previous step took
    since_probe: int = 0  # steps of the chosen way since the other was last measured
    probing: int = 0  # steps left measuring the way not chosen
    probe_way: bool = False  # the way being measured again
    decided: bool | None = None  # the way chosen for the step not yet recorded
    reprobe_every: int = REPROBE_EVERY  # steps of the chosen way before the next measure
    choice: bool | None = None  # the way last chosen on the measures
    measured: bool = False  # a measure of the other way just ended

    def rate(self, speculate: bool) -> float:
        # Asked every step: `statistics.mean`'s exact arithmetic cost 20 us a call here.
        steps = self.steps[speculate]
        tokens = sum(t for t, _ in steps) / len(steps)
        return tokens / statistics.median(s for _, s in steps)


class SpeculationPolicy:
    def __init__(self, adaptive: bool = True):
        """`adaptive` False: always speculate."""
        self.adaptive = adaptive
        self.counters: Counter[str] = Counter()  # speculated, plain, switches
        self._buckets: dict[int, _Bucket] = {}

    def speculate(self, rows: int) -> bool:
        """Whether the next decode step of `rows` rows speculates: asked again before that step
        is recorded, the same answer (the overlap of plain steps asks ahead of the stepper)."""
        if not self.adaptive:
            return True
        bucket = self._bucket(rows)
        if bucket.decided is None:
            bucket.decided = self._choose(rows)
        return bucket.decided

    def record(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` rows took `tokens` tokens in `seconds`."""
        self.counters["speculated" if speculated else "plain"] += 1
        bucket = self._bucket(rows)
        bucket.decided = None
        switched = bucket.last is not None and bucket.last != speculated
        self.counters["switches"] += switched
        if bucket.last is not None and not switched and seconds > 0:
            # Per step, not per row: a batch that is not refilled is done when its slowest row
            # is, so speculation's steps after the first rows end (fewer rows, the bucket's
            # cost) count against it, as they cost it.
            bucket.steps[speculated].append((tokens, seconds))
        bucket.last = speculated

    def _choose(self, rows: int) -> bool:
        bucket = self._bucket(rows)
        # Each way measured before either is judged, the first time in turns: a spell of this
        # machine's speed then falls on both ways.
        for needed in range(PROBE_STEPS, FIRST_MEASURE + 1, PROBE_STEPS):
            for way in (True, False):
                if len(bucket.steps[way]) < needed:
                    return way
        if bucket.probing:
            bucket.probing -= 1
            return bucket.probe_way
        margin = TAIL_MARGIN if pow2_bucket(rows) > 1 else 0.0
        best = bucket.rate(True) > bucket.rate(False) * (1 + margin)
        if best != bucket.choice:  # by a measure, or as the chosen way's own steps slowed
            bucket.reprobe_every, bucket.since_probe = REPROBE_EVERY, 0
        elif bucket.measured:  # confirmed
            bucket.reprobe_every = min(2 * bucket.reprobe_every, MAX_REPROBE_EVERY)
        bucket.choice, bucket.measured = best, False
        bucket.since_probe += 1
        if bucket.since_probe > bucket.reprobe_every:  # measure the other way: the load changes
            bucket.since_probe, bucket.probing, bucket.probe_way = 0, PROBE_STEPS, not best
            bucket.measured = True
            return not best
        return best

    def _bucket(self, rows: int) -> _Bucket:
        return self._buckets.setdefault(pow2_bucket(rows), _Bucket())
