"""The automatic phase policy on a live engine: what it measures, and the flips it makes, which
must leave every request's tokens as a run without the policy."""

from __future__ import annotations

import pytest

from flipjax import Engine
from flipjax.engine.engine import StepStats
from flipjax.engine.pilot import Autopilot
from sharding.policy import FlipCosts, PolicyConfig
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned

CONFIG = PolicyConfig(prefill_layout="single", decode_layout="tp:2", dwell_s=0, margin=1.0)
PROMPTS = [[(i * 5 + k) % 256 for i in range(12 + 7 * k)] for k in range(4)]
OPTIONS = dict(num_pages=64, max_running_requests=4, max_prefill_tokens=32)


def make() -> Engine:
    return Engine.from_pretrained("tiny", **OPTIONS)


def test_only_single_kind_steps_are_measured():
    pilot = Autopilot(CONFIG, alpha=0.5)
    pilot.observe(StepStats("single", 100, 0, 0.5))  # 200 prefill tokens/s
    pilot.observe(StepStats("single", 100, 4, 0.5))  # mixed: says nothing
    pilot.observe(StepStats("single", 0, 0, 0.0))  # empty
    assert pilot.throughput() == {}, "no decode rate yet"
    pilot.observe(StepStats("single", 0, 8, 0.1))  # 80 decode tokens/s
    pilot.observe(StepStats("single", 300, 0, 0.5))  # 600: EMA halfway -> 400
    rates = pilot.throughput()["single"]
    assert (rates.prefill_tps, rates.decode_tps) == (400, 80)


def test_one_layout_for_both_phases_is_refused():
    with pytest.raises(ValueError, match="auto needs two layouts"):
        Autopilot(PolicyConfig(prefill_layout="tp:2", decode_layout="tp:2"))


def test_flips_follow_the_load_and_change_no_token():
    straight = make().generate(PROMPTS, max_new_tokens=20)
    engine = make()
    pilot = Autopilot(CONFIG, FlipCosts(seed_s=0.1))
    # Decoding is ten times faster in TP, prefill ten times faster on one device.
    for layout, prefill, decode in (("single", 10_000, 100), ("tp:2", 1_000, 1_000)):
        pilot.observe(StepStats(layout, prefill, 0, 1.0))
        pilot.observe(StepStats(layout, 0, decode, 1.0))
    ids = [engine.add_request(p, max_new_tokens=20) for p in PROMPTS]
    done, layouts = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
        pilot.tick(engine)
        layouts.append(engine.stats().layout)
    assert "tp:2" in layouts, "decode-heavy load never moved to the decode layout"
    assert [done[i] for i in ids] == [o.token_ids for o in straight]
    assert pilot.counters["flips"] >= 1 and "single->tp:2" in pilot.costs.measured
    # A queue of long prompts in TP is prefill-heavy: back to the prefill layout.
    for k in range(4):
        engine.add_request([k] * 200, max_new_tokens=1)
    assert pilot.tick(engine) is not None and engine.stats().layout == "single"
    while engine.has_unfinished():
        engine.step()
    assert_pools_returned(engine)


def test_calibration_measures_both_layouts_and_leaves_nothing_behind():
    engine = make()
    pilot = Autopilot(CONFIG)
    pilot.calibrate(engine, prompt_tokens=64, rows=4)
    assert set(pilot.throughput()) == {"single", "tp:2"}
    assert all(t.prefill_tps > 0 and t.decode_tps > 0 for t in pilot.throughput().values())
    assert engine.stats().layout == "single" and not engine.has_unfinished()
    assert parts(engine).prefix_cache.num_pages == 0
    assert_pools_returned(engine)
