"""The automatic phase policy on a live engine: measure, decide, flip, between two steps.

`sharding.policy.decide` is pure; this feeds it. Throughput per layout is an EMA over steps
that did one kind of work only (a pure prefill step measures prompt tokens per second, a pure
decode step generated tokens per second; mixed steps say nothing about either). `calibrate`
seeds both layouts before serving with a short synthetic load in each, so the policy can act
from the first request instead of waiting to have served in both. Each flip's measured time
feeds the per-direction cost estimate.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flipjax.engine.engine import Engine, StepStats
from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Throughput, decide


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
    last_flip_s: float | None = None
    last_decision: str = "none yet"
    counters: Counter[str] = field(default_factory=Counter)  # ticks, flips, stays, refusals

    def __post_init__(self) -> None:
        if self.config.prefill_layout == self.config.decode_layout:
            raise ValueError(
                f"phase policy: the prefill and decode layouts are both "
                f"{self.config.decode_layout}; auto needs two layouts"
            )

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
        with no request left."""
        rng = random.Random(0)
        vocab = engine.config.vocab_size
        pool_tokens = engine.pages.total * engine.engine_config.page_size
        prompt_tokens = min(prompt_tokens, engine.max_model_len - 16, pool_tokens // 2)
        rows = min(rows, engine.engine_config.max_running_requests)
        with engine.reuse.paused():
            for layout in (self.config.decode_layout, self.config.prefill_layout):
                engine.flip(layout)
                for n, count, new in ((prompt_tokens, 1, 1), (4, rows, 8)):
                    for _ in range(count):
                        ids = [rng.randrange(vocab) for _ in range(n)]
                        engine.add_request(ids, max_new_tokens=new)
                    while engine.has_unfinished():
                        engine.step()
                        self.observe(engine.last_step)

    # -- deciding -------------------------------------------------------------------------------

    def tick(self, engine: Engine) -> FlipTo | None:
        """Decide on the engine's current load, and flip if the policy says so."""
        self.counters["ticks"] += 1
        scheduler = engine.scheduler
        queued = sum(s.num_pending for s in scheduler.waiting)
        queued += sum(s.num_pending for s in scheduler.running if not s.is_decoding)
        decoding = sum(s.is_decoding for s in scheduler.running)
        snapshot = Snapshot(
            self.clock(), engine.layout, queued, decoding, self.throughput(), self.last_flip_s
        )
        choice = decide(snapshot, self.costs, self.config)
        if not isinstance(choice, FlipTo):
            self.counters["stays"] += 1
            self.last_decision = f"stay: {choice.reason}"
            return None
        source = engine.layout
        record = engine.flip(choice.layout)  # a failed flip raises; the old layout serves
        self.last_flip_s = self.clock()
        if record is not None:
            self.costs.observe(source, choice.layout, record.total_ms / 1e3)
        self.counters["flips"] += 1
        self.last_decision = (
            f"flip to {choice.layout}: {choice.gain_s:.3f}s saved for {choice.cost_s:.3f}s"
        )
        return choice

    def describe(self) -> dict[str, Any]:
        """The policy's state, for `/phase`."""
        return {
            "policy": "auto",
            "prefill_layout": self.config.prefill_layout,
            "decode_layout": self.config.decode_layout,
            "throughput": {k: vars(v) for k, v in self.rates.items()},
            "flip_cost_s": dict(self.costs.measured),
            "last_decision": self.last_decision,
            "counters": dict(self.counters),
        }

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
