"""The automatic phase policy on a live engine: measure, decide, flip, between two steps.

`sharding.policy.decide` is pure and `sharding.governor.Governor` keeps its state; this feeds
them from the engine. Throughput per layout is an EMA over steps that did one kind of work only
(a pure prefill step measures prompt tokens per second, a pure decode step generated tokens per
second; mixed steps say nothing about either). `calibrate` seeds both layouts before serving
with a short synthetic load in each, so the policy can act from the first request. Every flip
the engine made since the last decision, the policy's or an operator's, is folded in first: it
restarts the dwell clock and feeds its direction's cost. A refused or failed flip backs off.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flipjax.engine.engine import Engine, StepStats
from sharding.flip import FlipError, FlipRecord
from sharding.governor import Governor
from sharding.layout import LayoutError
from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Throughput

log = logging.getLogger("flipjax.pilot")


@dataclass
class _Rates:
    prefill_tps: float | None = None
    decode_tps: float | None = None


@dataclass
class Autopilot:
    config: PolicyConfig
    costs: FlipCosts = field(default_factory=FlipCosts)
    alpha: float = 0.2  # EMA weight of the newest step
    clock: Callable[[], float] = time.monotonic
    rates: dict[str, _Rates] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)  # ticks, flips, stays, refusals
    seen_flips: int = 0  # the engine's flip records folded into the policy so far

    def __post_init__(self) -> None:
        if self.config.prefill_layout == self.config.decode_layout:
            raise ValueError(
                f"phase policy: the prefill and decode layouts are both "
                f"{self.config.decode_layout}; auto needs two layouts"
            )
        self.governor = Governor(self.config, self.costs)

    # -- measuring ------------------------------------------------------------------------------

    def observe(self, step: StepStats) -> None:
        """Fold one finished step into its layout's throughput."""
        if step.seconds <= 0 or (step.prefill_tokens > 0) == (step.decode_rows > 0):
            return  # an empty or mixed step
        rates = self.rates.setdefault(step.layout, _Rates())
        if step.prefill_tokens:
            rates.prefill_tps = self._ema(rates.prefill_tps, step.prefill_tokens / step.seconds)
        else:
            rates.decode_tps = self._ema(rates.decode_tps, step.decode_rows / step.seconds)

    def throughput(self) -> dict[str, Throughput]:
        return {
            layout: Throughput(r.prefill_tps, r.decode_tps)
            for layout, r in self.rates.items()
            if r.prefill_tps is not None and r.decode_tps is not None
        }

    def calibrate(self, engine: Engine, prompt_tokens: int = 256, rows: int = 8) -> None:
        """Measure both layouts with a synthetic load: one long prompt (pure prefill steps),
        then `rows` requests decoding together. Its prompts are random, and prefix reuse is
        paused meanwhile (nothing looked up, nothing published). Ends in the prefill layout,
        with no request left; its flips feed the cost estimates but start no dwell."""
        rng = random.Random(0)
        info = engine.info
        vocab, ec = info.model.vocab_size, info.config.engine
        longest = min(prompt_tokens, info.max_model_len - 16)
        rows = min(rows, ec.max_running_requests)
        # The pilot is part of the engine: it alone may pause reuse, so calibration neither
        # looks up nor publishes its random prompts.
        with engine._parts.reuse.paused():
            for layout in (self.config.decode_layout, self.config.prefill_layout):
                engine.flip(layout)
                # Each layout's pool may differ in size (sized by the device budgets).
                pool_tokens = engine.stats().pools["pages_total"] * ec.page_size
                prompt_tokens = min(longest, pool_tokens // 2)
                for n, count, new in ((prompt_tokens, 1, 1), (4, rows, 8)):
                    for _ in range(count):
                        ids = [rng.randrange(vocab) for _ in range(n)]
                        engine.add_request(ids, max_new_tokens=new)
                    while engine.has_unfinished():
                        engine.step()
                        self.observe(engine.stats().last_step)
        flips = engine.stats().flips
        for record in flips[self.seen_flips :]:
            self.costs.observe(record.source, record.target, record.total_ms / 1e3)
        self.seen_flips = len(flips)

    # -- deciding -------------------------------------------------------------------------------

    def tick(self, engine: Engine) -> FlipTo | None:
        """Decide on the engine's current load, and flip if the policy says so."""
        self.counters["ticks"] += 1
        stats = engine.stats()
        awaiting = stats.awaiting_first_token
        self._sync(stats.flips, frozenset(awaiting))
        horizon = self.config.horizon_tokens
        left = sum(min(n, horizon) for n in stats.decode_tokens_left)
        waited = time.perf_counter() - min(awaiting.values(), default=time.perf_counter())
        snapshot = Snapshot(
            self.clock(),
            stats.layout,
            stats.queued_tokens,
            len(stats.decode_tokens_left),
            self.throughput(),
            waiting_s=waited,
            decode_tokens_left=left,
        )
        choice = self.governor.decide(snapshot, frozenset(awaiting))
        if not isinstance(choice, FlipTo):
            self.counters["stays"] += 1
            return None
        try:
            engine.flip(choice.layout)
        except (FlipError, LayoutError) as err:  # refused or failed: the old layout serves
            self.counters["refusals"] += 1
            self.governor.failed(str(err), self.clock())
            log.warning("phase policy: flip to %s refused, backing off: %s", choice.layout, err)
            return None
        self._sync(engine.stats().flips, frozenset(awaiting))
        self.counters["flips"] += 1
        log.info("phase policy: flip to %s (%s)", choice.layout, choice.terms)
        return choice

    def _sync(self, flips: tuple[FlipRecord, ...], awaiting: frozenset[str]) -> None:
        """Fold in the flips the engine made since the last look, whoever asked for them."""
        for record in flips[self.seen_flips :]:
            self.governor.flipped(
                record.source, record.target, record.total_ms / 1e3, self.clock(), awaiting
            )
        self.seen_flips = len(flips)

    def describe(self) -> dict[str, Any]:
        """The policy's state, for `/phase`."""
        return {
            "policy": "auto",
            "prefill_layout": self.config.prefill_layout,
            "decode_layout": self.config.decode_layout,
            "throughput": {k: vars(v) for k, v in self.rates.items()},
            **self.governor.describe(self.clock()),
            "counters": {**self.governor.counters, **self.counters},
        }

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
