"""The phase policy's pricing and its memory: round trips priced as both legs, manual flips
seen, backoff after failures, the demand hold and the TTFT budget, on hand-worked snapshots;
then the same on a live engine."""

from __future__ import annotations

import pytest

from flipjax import Engine
from flipjax.engine.engine import StepStats
from flipjax.engine.pilot import Autopilot
from sharding.flip import FlipError
from sharding.governor import Governor
from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Stay, Throughput, decide

CONFIG = PolicyConfig(
    prefill_layout="pp:4,4", decode_layout="tp", dwell_s=30, margin=2.0, horizon_tokens=64
)
# PP prefills twice as fast; TP decodes three times as fast.
MEASURED = {"pp:4,4": Throughput(20_000, 1_000), "tp": Throughput(10_000, 3_000)}


def snap(layout: str, prefill: int, decode: int, now: float = 100.0, waiting: float = 0.0):
    return Snapshot(now, layout, prefill, decode, MEASURED, None, waiting)


def measured(there: float, back: float) -> FlipCosts:
    costs = FlipCosts(seed_s=0.01, alpha=1.0)
    costs.observe("tp", "pp:4,4", there)
    costs.observe("pp:4,4", "tp", back)
    return costs


def test_a_flip_the_load_will_undo_is_priced_as_both_legs():
    # 200k prompts queued beside 64 decodes in TP. T(tp) = 20 + 64*64/3000 = 21.365 s,
    # T(pp) = 10 + 4.096 = 14.096 s: 7.269 s saved. The decodes outlast the burst and decode
    # faster in TP, so PP will be undone: the flip costs 2 s there + 3 s back = 5 s, and
    # 7.269 s < 2 x 5 s. Priced as one leg (2 s) it would have flipped.
    choice = decide(snap("tp", 200_000, 64), measured(2.0, 3.0), CONFIG)
    assert isinstance(choice, Stay) and "both legs" in choice.terms
    cheaper = PolicyConfig(**{**vars(CONFIG), "margin": 1.0})
    choice = decide(snap("tp", 200_000, 64), measured(2.0, 3.0), cheaper)
    assert isinstance(choice, FlipTo) and choice.cost_s == 5.0
    assert choice.gain_s == pytest.approx(21.36533 - 14.096, abs=1e-4)
    # Without decodes beside the burst nothing pulls the flip back: one leg.
    one = decide(snap("tp", 200_000, 0), measured(2.0, 3.0), CONFIG)
    assert isinstance(one, FlipTo) and one.cost_s == 2.0 and "one leg" in one.terms


def test_costs_say_how_much_of_the_round_trip_is_measured():
    costs = FlipCosts()
    assert costs.provenance("tp", "pp:4,4") == "seeded"
    costs.observe("tp", "pp:4,4", 1.0)
    assert costs.provenance("pp:4,4", "tp") == "one leg measured"
    costs.observe("pp:4,4", "tp", 1.0)
    assert costs.provenance("tp", "pp:4,4") == "both measured"


def test_a_seen_flip_restarts_the_dwell_and_feeds_its_cost():
    governor = Governor(CONFIG, FlipCosts(seed_s=0.1, alpha=1.0))
    governor.flipped("pp:4,4", "tp", 4.0, now_s=100.0)  # say, an operator's manual flip
    assert governor.decide(snap("tp", 10**6, 0, now=110.0)) == Stay("dwell")
    assert governor.costs.estimate("pp:4,4", "tp") == 4.0
    assert isinstance(governor.decide(snap("tp", 10**6, 0, now=131.0)), FlipTo)


def test_failures_back_off_exponentially_instead_of_retrying():
    governor = Governor(CONFIG, FlipCosts(seed_s=0.1))
    burst = 10**6
    delays = []
    now = 100.0
    for _ in range(4):
        assert isinstance(governor.decide(snap("tp", burst, 0, now=now)), FlipTo)
        governor.failed("device lost", now)
        delays.append(governor.backoff_until_s - now)
        assert governor.decide(snap("tp", burst, 0, now=now + delays[-1] / 2)) == Stay("backoff")
        now += delays[-1]
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert governor.counters["failures"] == 4 and governor.counters["backed_off"] == 4
    assert governor.describe(now)["backoff"]["reason"] == "device lost"
    governor.flipped("tp", "pp:4,4", 1.0, now)
    assert governor.failures == 0 and governor.backoff_until_s == 0.0


def test_the_demand_hold_waits_for_the_first_tokens_it_flipped_for():
    config = PolicyConfig(**{**vars(CONFIG), "dwell_s": 0.0, "hold_rounds": 3})
    governor = Governor(config, FlipCosts(seed_s=0.1))
    governor.flipped("tp", "pp:4,4", 1.0, 100.0, awaiting=frozenset({"a", "b"}))
    decode_heavy = snap("pp:4,4", 0, 256, now=101.0)
    assert governor.decide(decode_heavy, frozenset({"a"})) == Stay("hold")
    assert isinstance(governor.decide(decode_heavy, frozenset({"c"})), FlipTo), "a and b done"
    governor.flipped("tp", "pp:4,4", 1.0, 101.0, awaiting=frozenset({"a"}))
    holds = [governor.decide(decode_heavy, frozenset({"a"})) for _ in range(4)]
    assert holds[:3] == [Stay("hold")] * 3 and isinstance(holds[3], FlipTo), "hold is bounded"


def test_the_ttft_budget_is_a_ceiling_on_the_decision():
    budget = PolicyConfig(**{**vars(CONFIG), "ttft_budget_s": 12.0})
    # 100k queued in TP: 10 s there, 5 s + a 1 s flip in PP. The saving (5 s) pays for
    # nothing at margin 2 x 4 s, but only the flip keeps the queue within 12 s after 5 s waited.
    costs = measured(4.0, 4.0)
    assert isinstance(decide(snap("tp", 100_000, 0), costs, CONFIG), Stay)
    choice = decide(snap("tp", 100_000, 0, waiting=5.0), measured(1.0, 1.0), budget)
    assert isinstance(choice, FlipTo) and "TTFT budget" in choice.terms
    # And a flip whose own cost would break the budget that staying keeps is refused.
    slow = decide(snap("tp", 100_000, 0, waiting=1.0), measured(9.0, 9.0), budget)
    assert slow == Stay("the flip would break the TTFT budget")


OPTIONS = dict(num_pages=64, max_running_requests=4, max_prefill_tokens=32)
LIVE = PolicyConfig(prefill_layout="single", decode_layout="tp:2", dwell_s=60, margin=1.0)


def primed(pilot: Autopilot) -> Autopilot:
    for layout, prefill, decode in (("single", 10_000, 100), ("tp:2", 1_000, 1_000)):
        pilot.observe(StepStats(layout, prefill, 0, 1.0))
        pilot.observe(StepStats(layout, 0, decode, 1.0))
    return pilot


def test_a_live_pilot_sees_manual_flips_and_backs_off(monkeypatch):
    engine = Engine.from_pretrained("tiny", **OPTIONS)
    pilot = primed(Autopilot(LIVE, FlipCosts(seed_s=0.01)))
    engine.flip("tp:2")  # manual, as POST /phase_flip does
    for k in range(4):
        engine.add_request([k] * 200, max_new_tokens=1)  # prefill-heavy: would pull to single
    assert pilot.tick(engine) is None and engine.stats().layout == "tp:2", "inside the manual dwell"
    assert pilot.governor.last == Stay("dwell") and "single->tp:2" in pilot.costs.measured
    pilot.governor.last_flip_s = -1e9  # the dwell is over
    calls = []

    def failing(layout, reseed=False):
        calls.append(layout)
        raise FlipError("injected: no room")

    monkeypatch.setattr(engine, "flip", failing)
    assert pilot.tick(engine) is None and calls == ["single"]
    for _ in range(5):  # backing off: no retry storm
        assert pilot.tick(engine) is None
    assert calls == ["single"] and pilot.counters["refusals"] == 1
    assert pilot.describe()["backoff"]["reason"] == "injected: no room"
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
