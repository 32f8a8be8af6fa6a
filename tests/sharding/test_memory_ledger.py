"""The per-device memory ledger: it agrees with the arrays the engine really holds, its KV
capacity is what the budgets leave over per page, an engine that cannot fit its budgets is
refused by name before it places anything, and a flip whose target does not fit is refused and
changes nothing.

The oracles are `jax.live_arrays()` (what the devices hold, read from the runtime) and the
page bytes worked out from the model config (2 x page_size x kv heads x head_dim x itemsize per
attention layer, split over a TP width).
"""

from __future__ import annotations

import gc
import math
from collections import Counter

import pytest

from flipjax import Engine, SamplingParams
from flipjax.model.tiny import tiny_config
from sharding.budgets import BudgetError, device_budgets, parse_size, reserve
from sharding.flip import FlipError
from sharding.ledger import KINDS
from sharding.memory import live_bytes
from tests.support.internals import parts
from tests.support.speculation import PROMPTS as SPEC_PROMPTS
from tests.support.speculation import speculative

OPTIONS = dict(num_pages=64, max_running_requests=2, max_prefill_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(i * 5 + 1) % 200 for i in range(n)] for n in (9, 21)]


def _live_ids() -> set[int]:
    gc.collect()
    return {id(a) for a in __import__("jax").live_arrays()}


def _new_live_bytes(before: set[int]) -> Counter[int]:
    """Bytes per device of the arrays alive now that were not alive at `before`."""
    gc.collect()
    return live_bytes(before)


def _page_bytes(width: int, layers: int) -> int:
    cfg = tiny_config()
    per_layer = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32, page_size 16
    return per_layer * layers // width


def _layers_on(layout: str, device: int) -> int:
    """Attention layers whose pages `device` holds: every one in tp:2; in pp:5,3
    device 0 has layers 0-4 and device 1 layers 5-7."""
    attention = tiny_config().full_attention_layers
    if layout != "pp:5,3":
        return len(attention)
    span = range(0, 5) if device == 0 else range(5, 8)
    return sum(1 for i in attention if i in span)


# Single is the one-device case of both: a pipeline of one stage and TP of width one.
@pytest.mark.parametrize("layout,width", [("pp:5,3", 1), ("tp:2", 2)])
def test_the_ledger_agrees_with_the_devices_and_its_capacity_with_the_budgets(layout, width):
    before = _live_ids()
    budget = 256 << 20
    # Pools large enough that each kind is a fair share of what a device holds.
    options = OPTIONS | dict(num_pages=512, num_slots=64)
    engine = Engine.from_pretrained("tiny", layout=layout, device_memory="256MiB", **options)
    engine.generate(PROMPTS, sampling=GREEDY)
    live = _new_live_bytes(before)
    report = engine.memory()
    assert report.layout == layout and report.devices
    per_device = {}
    for line in report.devices:
        assert set(line.bytes) == set(KINDS) and line.budget == budget
        assert line.bytes["weights"] > 0 and line.bytes["reserve"] == reserve(budget)
        assert line.bytes["workspace"] > 0  # the programs the requests compiled
        held = line.used - line.bytes["workspace"] - line.bytes["reserve"]
        # Within 5% is the promise; what else a device holds (page tables, sampler keys) is
        # well under 2% here, so a layer missing from any kind shows.
        assert abs(held - live[line.device]) <= 0.02 * live[line.device], (line, live)
        page = _page_bytes(width, _layers_on(layout, line.device))
        assert line.bytes["kv_pages"] == 512 * page  # --num-pages caps a budgeted pool
        room = budget - line.bytes["weights"] - line.bytes["gdn_slots"]
        room -= line.bytes["workspace"] + reserve(budget)
        per_device[line.device] = math.floor(room / page)
    assert sum(live[d.device] for d in report.devices) >= 0.95 * sum(live.values())
    [capacity] = report.capacity
    tightest = min(per_device, key=per_device.get)
    assert (capacity.pages, capacity.device) == (per_device[tightest], tightest)
    assert capacity.tokens == 16 * capacity.pages
    assert f"KV capacity: {layout} = {capacity.pages} pages" in report.table()
    engine.close()


def test_without_num_pages_each_layout_gets_the_pool_its_devices_hold():
    options = dict(max_running_requests=2, max_prefill_tokens=16)  # few shapes to compile
    engine = Engine.from_pretrained(
        "tiny", layout="pp:5,3", arm=("tp:2",), device_memory="30MiB,18MiB", **options
    )
    pages = {"pp:5,3": engine.stats().pools["pages_total"]}
    assert engine.info.config.engine.num_pages == pages["pp:5,3"]
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    for _ in range(3):  # both prompts in and decoding: the largest pieces have been compiled
        engine.step()
    # A flip never holds both layouts, so each layout's pool is what it alone can hold.
    engine.flip("tp:2")
    pages["tp:2"] = engine.stats().pools["pages_total"]
    after = engine.memory()
    assert {c.layout for c in after.capacity} == {"pp:5,3", "tp:2"}
    for c in after.capacity:
        assert 0.95 * c.pages <= pages[c.layout] <= c.pages, c
    assert pages["tp:2"] < pages["pp:5,3"]
    assert all(line.free >= 0 for line in after.devices)
    while engine.has_unfinished():
        engine.step()
    engine.check()
    # A request the pool could never hold is refused, naming the pool.
    small = pages["tp:2"]
    assert small * 16 < engine.info.max_model_len - 1
    with pytest.raises(ValueError, match=rf"needs {small + 1} pages of 16 tokens, the pool has"):
        engine.add_request([1] * 100, max_new_tokens=small * 16 - 99)


def test_an_engine_over_its_budget_is_refused_by_name():
    with pytest.raises(BudgetError, match=r"single leaves device 0 -.* for KV pages beside"):
        Engine.from_pretrained("tiny", device_memory="4MiB", **OPTIONS)
    # Over two stages each device holds its own share: a budget one device could not meet.
    single = Engine.from_pretrained("tiny", **OPTIONS).memory().devices[0]
    share = (single.bytes["weights"] + single.bytes["kv_pages"] + single.bytes["gdn_slots"]) * 0.8
    Engine.from_pretrained("tiny", layout="pp:4,4", device_memory=f"{int(share)}", **OPTIONS)
    with pytest.raises(BudgetError, match="device 0"):
        Engine.from_pretrained("tiny", device_memory=f"{int(share)}", **OPTIONS)


def test_a_flip_whose_target_cannot_fit_is_refused_and_changes_nothing():
    straight = Engine.from_pretrained("tiny", layout="pp:6,2", **OPTIONS)
    want = [o.token_ids for o in straight.generate(PROMPTS, sampling=GREEDY)]
    held = straight.memory().devices[1]
    # Device 1 holds two of eight layers in pp:6,2 and would hold half of every layer in tp:2.
    tight = int(held.used / 0.95) + 4096
    budgets = f"1GiB,{tight}"
    engine = Engine.from_pretrained("tiny", layout="pp:6,2", device_memory=budgets, **OPTIONS)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    refused = r"flip to tp:2 refused: device 1 needs [\d.]+ \w+ .* over its budget of [\d.]+ \w+"
    with pytest.raises(FlipError, match=refused):
        engine.flip("tp:2")
    assert engine.stats().layout == "pp:6,2" and engine.stats().flips == ()
    outs = {}
    while len(outs) < len(ids):
        outs |= {o.request_id: o.token_ids for o in engine.step()}
    assert [outs[i] for i in ids] == want
    engine.check()


def test_budgets_are_read_as_sizes_and_refused_by_name():
    assert parse_size("32GiB") == 32 << 30 and parse_size("10G") == 10 * 10**9
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("4096") == 4096
    devices = __import__("jax").devices()[:3]
    assert device_budgets(devices, "32GiB,10GiB,10GiB", 0.9) == {
        devices[0].id: 32 << 30,
        devices[1].id: 10 << 30,
        devices[2].id: 10 << 30,
    }
    assert device_budgets(devices, "1GiB", 0.9) == {d.id: 1 << 30 for d in devices}
    assert device_budgets(devices, None, 0.9) is None  # the CPU reports no memory limit
    for bad in ("lots", "10 parsecs", "0", "-1GiB", "2PiB"):
        with pytest.raises(BudgetError, match="device_memory"):
            parse_size(bad)
    with pytest.raises(BudgetError, match="4 sizes for 3 devices"):
        device_budgets(devices, "1G,1G,1G,1G", 0.9)
    with pytest.raises(ValueError, match="device_memory"):
        Engine.from_pretrained("tiny", device_memory="ten gigs", **OPTIONS)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        Engine.from_pretrained("tiny", mem_fraction_static=1.5, **OPTIONS)


def test_a_drafter_is_in_the_ledger_and_its_pages_in_the_pool_it_sizes():
    """A speculative engine's drafter (the MTP head, its copies of the embedding and head, its
    own KV pages) is a line of the ledger, which still agrees with the live arrays, and the
    budget sizes the pool with the drafter's pages counted: every device stays within it."""
    before = _live_ids()
    budget = parse_size("48MiB")
    engine = speculative(
        num_steps=2, layout="tp:2", device_memory="48MiB", num_pages=None, num_slots=16
    )
    engine.generate(SPEC_PROMPTS[:2], max_new_tokens=8)
    live = _new_live_bytes(before)
    report = engine.memory()
    pages = engine.stats().pools["pages_total"]
    drafter = parts(engine).stepper.speculation.drafter
    drafter_held = Counter()
    for leaf in __import__("jax").tree.leaves(drafter.held()):
        drafter_held[next(iter(leaf.devices())).id] += leaf.nbytes
    assert drafter_held[0] > 0
    for line in report.devices:
        assert line.bytes["drafter"] == drafter_held[line.device]
        held = line.used - line.bytes["workspace"] - line.bytes["reserve"]
        assert abs(held - live[line.device]) <= 0.02 * live[line.device], (line, live)
        assert line.budget == budget and line.free >= 0, line
    [capacity] = report.capacity
    assert capacity.device == 0  # the drafter's device is the tightest
    assert pages <= capacity.pages
    # Its pages take as many as the pool has (free >= 0 above: they were priced in its size).
    weights, page = drafter.bytes
    assert drafter_held[0] == weights + pages * page
    engine.close()
