"""When to flip: a pure decision over a load snapshot and measured flip costs.

The model is small on purpose. Serving the demand in view takes, in layout L,
    T(L) = queued_prefill_tokens / prefill_tps(L) + decode_tokens / decode_tps(L)
seconds, where `decode_tokens` is what the running requests have left to generate (each capped
at `horizon_tokens`, the most the decision looks ahead per request), or, when the snapshot does
not know, `running_decode * horizon_tokens`.
Flipping from the current layout C to the other one X saves T(C) - T(X) and costs the flip:
an EMA of measured flips per direction, seeded until one is measured. A flip the load will
undo (it is for queued prompts, and the decodes running beside them decode faster in C) is
priced as both legs, there and back. The policy flips only when the saving exceeds `margin`
times that cost, never within `dwell_s` of the last flip, and never against the TTFT budget: a
flip that would keep the queued prompts past `ttft_budget_s` is refused, one that alone brings
them within it is taken. Every decision names its terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Throughput:
    prefill_tps: float  # prompt tokens per second
    decode_tps: float  # generated tokens per second, all requests together


@dataclass(frozen=True)
class Snapshot:
    now_s: float
    layout: str
    queued_prefill_tokens: int
    running_decode: int
    throughput: dict[str, Throughput]  # recent, per layout
    last_flip_s: float | None = None
    waiting_s: float = 0.0  # how long the oldest prompt without a first token has waited
    decode_tokens_left: int | None = None  # capped at the horizon per request; None: unknown


@dataclass(frozen=True)
class PolicyConfig:
    prefill_layout: str  # e.g. "pp:32,16,16"
    decode_layout: str  # e.g. "tp"
    dwell_s: float = 30.0
    horizon_tokens: int = 1024
    margin: float = 2.0
    ttft_budget_s: float | None = None  # a ceiling on the queued prompts' time to first token
    hold_rounds: int = 200  # the demand hold lasts at most this many decisions
    backoff_s: float = 1.0  # after a refused or failed flip; doubles each time, up to the max
    backoff_max_s: float = 120.0


@dataclass
class FlipCosts:
    """Seconds per flip direction: an EMA of measured flips, `seed_s` until the first one."""

    seed_s: float = 1.0
    alpha: float = 0.3
    measured: dict[str, float] = field(default_factory=dict)

    def estimate(self, source: str, target: str) -> float:
        return self.measured.get(f"{source}->{target}", self.seed_s)

    def observe(self, source: str, target: str, seconds: float) -> None:
        key = f"{source}->{target}"
        old = self.measured.get(key, seconds)
        self.measured[key] = (1 - self.alpha) * old + self.alpha * seconds

    def provenance(self, a: str, b: str) -> str:
        """How much of the round trip a <-> b is measured rather than seeded."""
        known = sum(f"{s}->{t}" in self.measured for s, t in ((a, b), (b, a)))
        return ("seeded", "one leg measured", "both measured")[known]


@dataclass(frozen=True)
class Stay:
    reason: str
    terms: str = field(default="", compare=False)


@dataclass(frozen=True)
class FlipTo:
    layout: str
    gain_s: float
    cost_s: float  # both legs when the load will undo the flip
    terms: str = field(default="", compare=False)


def serve_seconds(snapshot: Snapshot, layout: str, horizon_tokens: int) -> float | None:
    """T(layout) for the snapshot's demand; None if the layout's throughput is unknown."""
    tp = snapshot.throughput.get(layout)
    if tp is None or tp.prefill_tps <= 0 or tp.decode_tps <= 0:
        return None
    decode_tokens = snapshot.decode_tokens_left
    if decode_tokens is None:
        decode_tokens = snapshot.running_decode * horizon_tokens
    return snapshot.queued_prefill_tokens / tp.prefill_tps + decode_tokens / tp.decode_tps


def decide(snapshot: Snapshot, costs: FlipCosts, config: PolicyConfig) -> Stay | FlipTo:
    current = snapshot.layout
    if current not in (config.prefill_layout, config.decode_layout):
        return Stay(f"layout {current} is not managed by the policy")
    target = config.decode_layout if current == config.prefill_layout else config.prefill_layout
    if snapshot.last_flip_s is not None and snapshot.now_s - snapshot.last_flip_s < config.dwell_s:
        return Stay(
            "dwell", f"dwell {snapshot.now_s - snapshot.last_flip_s:.1f}s of {config.dwell_s:.1f}s"
        )
    now_t = serve_seconds(snapshot, current, config.horizon_tokens)
    then_t = serve_seconds(snapshot, target, config.horizon_tokens)
    if now_t is None or then_t is None:
        return Stay("throughput not yet measured in both layouts")
    there, back = costs.estimate(current, target), costs.estimate(target, current)
    undone = _undone(snapshot, current, target)
    gain, cost = now_t - then_t, there + (back if undone else 0.0)
    terms = (
        f"gain {gain:.3f}s, legs {there:.3f}s there + {back:.3f}s back "
        f"({costs.provenance(current, target)}), priced {'both legs' if undone else 'one leg'}, "
        f"margin {config.margin}"
    )
    budget = _ttft_verdict(snapshot, current, target, there, config)
    if budget == "flip":
        return FlipTo(target, gain, cost, terms + ", the TTFT budget needs the flip")
    if budget == "stay":
        return Stay("the flip would break the TTFT budget", terms)
    if gain <= config.margin * cost:
        return Stay(
            f"gain {gain:.3f}s does not pay for the flip ({cost:.3f}s x {config.margin})", terms
        )
    return FlipTo(target, gain, cost, terms)


def _undone(snapshot: Snapshot, current: str, target: str) -> bool:
    """Whether the load will pull the flip back: it is for queued prompts, and the decodes
    running beside them, which outlast the burst, decode faster in `current`."""
    tp_c, tp_t = snapshot.throughput[current], snapshot.throughput[target]
    return (
        snapshot.queued_prefill_tokens > 0
        and snapshot.running_decode > 0
        and tp_c.decode_tps > tp_t.decode_tps
    )


def _ttft_verdict(
    snapshot: Snapshot, current: str, target: str, leg_s: float, config: PolicyConfig
) -> str | None:
    """ "flip" when only the flip brings the queued prompts within the budget, "stay" when only
    staying does, None when the budget does not decide."""
    if config.ttft_budget_s is None or not snapshot.queued_prefill_tokens:
        return None
    queued = snapshot.queued_prefill_tokens
    stay = snapshot.waiting_s + queued / snapshot.throughput[current].prefill_tps
    flip = snapshot.waiting_s + leg_s + queued / snapshot.throughput[target].prefill_tps
    within_stay, within_flip = stay <= config.ttft_budget_s, flip <= config.ttft_budget_s
    if within_flip and not within_stay:
        return "flip"
    if within_stay and not within_flip:
        return "stay"
    return None
