"""When to flip: a pure decision over a load snapshot and measured flip costs.

The model is small on purpose. Serving the demand in view takes, in layout L,
    T(L) = queued_prefill_tokens / prefill_tps(L) + running_decode * horizon / decode_tps(L)
seconds, where `horizon` is how many decode tokens per request the decision looks ahead.
Flipping from the current layout C to the other one X saves T(C) - T(X) and costs the flip
(an EMA of measured flips in that direction, seeded until one is measured). The policy flips
only when the saving exceeds `margin` times the cost, and never within `dwell_s` of the last
flip, so a transient (one burst of prefill) cannot make it ping-pong.
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


@dataclass(frozen=True)
class PolicyConfig:
    prefill_layout: str  # e.g. "pp:32,16,16"
    decode_layout: str  # e.g. "tp"
    dwell_s: float = 30.0
    horizon_tokens: int = 64
    margin: float = 2.0


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


@dataclass(frozen=True)
class Stay:
    reason: str


@dataclass(frozen=True)
class FlipTo:
    layout: str
    gain_s: float
    cost_s: float


def serve_seconds(snapshot: Snapshot, layout: str, horizon_tokens: int) -> float | None:
    """T(layout) for the snapshot's demand; None if the layout's throughput is unknown."""
    tp = snapshot.throughput.get(layout)
    if tp is None or tp.prefill_tps <= 0 or tp.decode_tps <= 0:
        return None
    decode_tokens = snapshot.running_decode * horizon_tokens
    return snapshot.queued_prefill_tokens / tp.prefill_tps + decode_tokens / tp.decode_tps


def decide(snapshot: Snapshot, costs: FlipCosts, config: PolicyConfig) -> Stay | FlipTo:
    current = snapshot.layout
    if current not in (config.prefill_layout, config.decode_layout):
        return Stay(f"layout {current} is not managed by the policy")
    target = config.decode_layout if current == config.prefill_layout else config.prefill_layout
    if snapshot.last_flip_s is not None and snapshot.now_s - snapshot.last_flip_s < config.dwell_s:
        return Stay("dwell")
    now_t = serve_seconds(snapshot, current, config.horizon_tokens)
    then_t = serve_seconds(snapshot, target, config.horizon_tokens)
    if now_t is None or then_t is None:
        return Stay("throughput not yet measured in both layouts")
    gain, cost = now_t - then_t, costs.estimate(current, target)
    if gain <= config.margin * cost:
        return Stay(f"gain {gain:.3f}s does not pay for the flip ({cost:.3f}s x {config.margin})")
    return FlipTo(target, gain, cost)
