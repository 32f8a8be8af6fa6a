"""`--layout auto`: stages split in proportion to the budgets, the widest TP that fits armed,
and the ladder of candidates logged with why each was taken or refused."""

from __future__ import annotations

import logging

import pytest

from flipjax import Engine, SamplingParams
from sharding.auto_layout import proportional_split
from sharding.budgets import BudgetError
from sharding.layout import LayoutError

OPTIONS = dict(num_pages=64, max_running_requests=2, max_prefill_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 7 + 2) % 250 for i in range(21)]


def test_layers_split_in_proportion_to_the_budgets():
    assert proportional_split(64, [32, 10, 10]) == (40, 12, 12)
    assert proportional_split(8, [64, 20, 20]) == (5, 2, 1)
    assert proportional_split(3, [100, 1, 1]) == (1, 1, 1)  # every stage keeps a layer
    assert proportional_split(12, [1, 1, 1]) == (4, 4, 4)
    with pytest.raises(LayoutError, match="cannot split 2 layers over 3 stages"):
        proportional_split(2, [1, 1, 1])


def test_auto_takes_the_proportional_pipeline_arms_tp_and_logs_the_ladder(caplog):
    caplog.set_level(logging.INFO, logger="flipjax.engine")
    engine = Engine.from_pretrained(
        "tiny", layout="auto", device_memory="64MiB,26MiB,26MiB", **OPTIONS
    )
    lc = engine.info.config.layout
    assert (engine.stats().layout, lc.layout, lc.arm) == ("pp:4,2,2", "pp:4,2,2", ("tp:2",))
    ladder = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layout auto")]
    assert ladder[0] == "layout auto: live pp:4,2,2: taken (stages in proportion to budgets)"
    assert ladder[1].startswith("layout auto: arm tp:3: refused (layout: tp width 3 does not")
    assert ladder[2] == "layout auto: arm tp:2: taken (the widest TP that fits)"
    want = Engine.from_pretrained("tiny", **OPTIONS).generate([PROMPT], sampling=GREEDY)
    assert engine.generate([PROMPT], sampling=GREEDY)[0].token_ids == want[0].token_ids


def test_auto_refuses_by_name_when_nothing_fits():
    with pytest.raises(BudgetError, match=r"no layout fits the budgets: live pp:\d,\d: refused"):
        Engine.from_pretrained("tiny", layout="auto", device_memory="4MiB,4MiB", **OPTIONS)
