"""The phase policy on synthetic snapshots: flips when it pays, never within the dwell time."""

from __future__ import annotations

from sharding.policy import FlipCosts, FlipTo, PolicyConfig, Snapshot, Stay, Throughput, decide

CONFIG = PolicyConfig(prefill_layout="pp:4,4", decode_layout="tp", dwell_s=30, margin=2.0)
# PP prefills twice as fast; TP decodes three times as fast.
MEASURED = {"pp:4,4": Throughput(20_000, 1_000), "tp": Throughput(10_000, 3_000)}


def snap(layout: str, prefill: int, decode: int, now: float = 100.0, last: float | None = None):
    return Snapshot(now, layout, prefill, decode, MEASURED, last)


def test_prefill_burst_in_tp_flips_to_pp():
    # 200k queued tokens: 20 s in TP, 10 s in PP; 10 s saved against a 1 s seeded cost.
    choice = decide(snap("tp", 200_000, 0), FlipCosts(seed_s=1.0), CONFIG)
    assert choice == FlipTo("pp:4,4", gain_s=10.0, cost_s=1.0)


def test_decode_heavy_in_pp_flips_to_tp():
    choice = decide(snap("pp:4,4", 0, 256), FlipCosts(seed_s=1.0), CONFIG)
    assert isinstance(choice, FlipTo) and choice.layout == "tp"


def test_gain_below_cost_stays():
    # 20k tokens save 1 s; the measured flip costs 0.6 s, and 1 s < 2 x 0.6 s.
    costs = FlipCosts(seed_s=0.01)
    costs.observe("tp", "pp:4,4", 0.6)
    choice = decide(snap("tp", 20_000, 0), costs, CONFIG)
    assert isinstance(choice, Stay) and "does not pay" in choice.reason
    assert isinstance(decide(snap("tp", 20_000, 0), FlipCosts(seed_s=0.4), CONFIG), FlipTo)


def test_no_flip_back_within_the_dwell_time():
    """A transient burst flips to PP; when it is gone, the policy waits out the dwell."""
    costs = FlipCosts(seed_s=0.1)
    assert isinstance(decide(snap("tp", 200_000, 0, now=100), costs, CONFIG), FlipTo)
    for now in (101, 110, 129.9):
        assert decide(snap("pp:4,4", 0, 256, now=now, last=100), costs, CONFIG) == Stay("dwell")
    assert isinstance(decide(snap("pp:4,4", 0, 256, now=130.1, last=100), costs, CONFIG), FlipTo)


def test_unmeasured_layout_stays():
    s = Snapshot(0.0, "tp", 10**6, 0, {"tp": MEASURED["tp"]})
    assert isinstance(decide(s, FlipCosts(), CONFIG), Stay)


def test_flip_cost_is_an_ema_per_direction():
    costs = FlipCosts(seed_s=5.0, alpha=0.5)
    assert costs.estimate("tp", "pp:4,4") == 5.0
    costs.observe("tp", "pp:4,4", 2.0)
    costs.observe("tp", "pp:4,4", 4.0)
    assert costs.estimate("tp", "pp:4,4") == 3.0
    assert costs.estimate("pp:4,4", "tp") == 5.0
