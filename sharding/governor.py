"""The phase policy's memory between decisions: the dwell clock, the flip-cost EMAs, the
backoff after a refused or failed flip, and the demand hold. Pure of any engine: the live
pilot (`flipjax.engine.pilot`) and the policy bench drive the same code.

- Every flip is seen, automatic or manual (`flipped`): it restarts the dwell clock and feeds
  its direction's cost EMA.
- A refused or failed flip (`failed`) backs off: no flip for `backoff_s`, doubling with each
  failure in a row up to `backoff_max_s`, instead of a retry every step.
- The demand hold: after a flip to the prefill layout, stay until the prompts that pulled it
  have their first token, for at most `hold_rounds` decisions.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Stay, decide


@dataclass
class Governor:
    config: PolicyConfig
    costs: FlipCosts = field(default_factory=FlipCosts)
    last_flip_s: float | None = None
    failures: int = 0  # refused or failed flips in a row
    backoff_until_s: float = 0.0
    backoff_reason: str | None = None
    hold: frozenset[str] = frozenset()  # the prompts that pulled the last flip to prefill
    hold_rounds: int = 0
    last: Stay | FlipTo | None = None
    counters: Counter[str] = field(default_factory=Counter)  # decisions, flips, stays, ...

    def decide(self, snapshot: Snapshot, awaiting: frozenset[str] = frozenset()) -> Stay | FlipTo:
        """The decision for `snapshot`; `awaiting` are the requests without a first token."""
        self.counters["decisions"] += 1
        choice = self._decide(snapshot, awaiting)
        self.counters["flips_chosen" if isinstance(choice, FlipTo) else "stays"] += 1
        self.last = choice
        return choice

    def _decide(self, snapshot: Snapshot, awaiting: frozenset[str]) -> Stay | FlipTo:
        now = snapshot.now_s
        if now < self.backoff_until_s:
            self.counters["backed_off"] += 1
            return Stay(
                "backoff",
                f"backoff {self.backoff_until_s - now:.1f}s more after "
                f"{self.failures} failure(s): {self.backoff_reason}",
            )
        if self.hold:
            waiting = self.hold & awaiting
            self.hold_rounds += 1
            if waiting and self.hold_rounds <= self.config.hold_rounds:
                self.counters["held"] += 1
                return Stay(
                    "hold",
                    f"hold: {len(waiting)} prompt(s) that pulled the flip await "
                    f"their first token (round {self.hold_rounds})",
                )
            self.hold = frozenset()
        known = Snapshot(**{**vars(snapshot), "last_flip_s": self.last_flip_s})
        return decide(known, self.costs, self.config)

    def flipped(
        self,
        source: str,
        target: str,
        seconds: float,
        now_s: float,
        awaiting: frozenset[str] = frozenset(),
    ) -> None:
        """A flip happened (this policy's or an operator's): restart the dwell clock, feed the
        cost EMA, and hold a flip to the prefill layout for the prompts awaiting then."""
        self.costs.observe(source, target, seconds)
        self.last_flip_s = now_s
        self.failures, self.backoff_until_s, self.backoff_reason = 0, 0.0, None
        self.counters["flips"] += 1
        if target == self.config.prefill_layout:
            self.hold, self.hold_rounds = awaiting, 0

    def failed(self, reason: str, now_s: float) -> None:
        """A flip was refused or failed: back off exponentially, counted with the reason."""
        self.failures += 1
        delay = min(self.config.backoff_s * 2 ** (self.failures - 1), self.config.backoff_max_s)
        self.backoff_until_s = now_s + delay
        self.backoff_reason = reason
        self.counters["failures"] += 1

    def describe(self, now_s: float) -> dict[str, Any]:
        """The policy's state for `GET /phase`."""
        a, b = self.config.prefill_layout, self.config.decode_layout
        last, last_decision = self.last, None
        if last is not None:
            last_decision = {
                "choice": f"flip to {last.layout}" if isinstance(last, FlipTo) else "stay",
                "reason": last.reason if isinstance(last, Stay) else "pays",
                "terms": last.terms,
            }
        return {
            "flip_cost_s": {f"{s}->{t}": self.costs.estimate(s, t) for s, t in ((a, b), (b, a))},
            "flip_cost_provenance": self.costs.provenance(a, b),
            "last_decision": last_decision,
            "backoff": {
                "failures": self.failures,
                "reason": self.backoff_reason,
                "seconds_left": max(0.0, self.backoff_until_s - now_s),
            },
            "hold": {"prompts": len(self.hold), "rounds": self.hold_rounds},
            "dwell_s": self.config.dwell_s,
            "ttft_budget_s": self.config.ttft_budget_s,
            "counters": dict(self.counters),
        }
