"""The per-device memory ledger: it agrees with the arrays the engine really holds, its KV
capacity is what the budgets leave over per page, an engine that cannot fit its budgets is
refused by name before it places anything, and a flip whose target does not fit beside what
the devices hold is refused and changes nothing.

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

OPTIONS = dict(num_pages=64, max_running_requests=2, max_prefill_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(i * 5 + 1) % 200 for i in range(n)] for n in (9, 21)]


def _live_ids() -> set[int]:
    gc.collect()
    return {id(a) for a in __import__("jax").live_arrays()}


def _new_live_bytes(before: set[int]) -> Counter[int]:
    """Bytes per device of the arrays alive now that were not alive at `before`."""
    import jax

    gc.collect()
    held: Counter[int] = Counter()
    for a in jax.live_arrays():
        if id(a) in before or a.is_deleted():
            continue
        for shard in a.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return held


def _page_bytes(width: int, layers: int) -> int:
    cfg = tiny_config()
    per_layer = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32, page_size 16
    return per_layer * layers // width


def _layers_on(layout: str, device: int) -> int:
    """Attention layers whose pages `device` holds: every one in single and tp:2; in pp:5,3
    device 0 has layers 0-4 and device 1 layers 5-7."""
    attention = tiny_config().full_attention_layers
    if layout != "pp:5,3":
        return len(attention)
    span = range(0, 5) if device == 0 else range(5, 8)
    return sum(1 for i in attention if i in span)


@pytest.mark.parametrize("layout,width", [("single", 1), ("pp:5,3", 1), ("tp:2", 2)])
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
        if layout != "single" or line.device == 0:
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


def _flip_bound(a: tuple, b: tuple, pages: int, budgets: dict[int, int]) -> int:
    """The pages a flip between two layouts' ledgers (both held at once) leaves room for."""
    lines = {}
    for report in (a, b):
        for line in report:
            lines.setdefault(line.device, []).append(line)
    best = None
    for device, held in lines.items():
        budget = budgets[device]
        fixed = sum(x.bytes["weights"] + x.bytes["gdn_slots"] for x in held)
        work = max(x.bytes["workspace"] for x in held)
        per_page = sum(x.bytes["kv_pages"] for x in held) // pages
        fits = (budget - reserve(budget) - work - fixed) // per_page
        best = fits if best is None else min(best, fits)
    return best


def test_without_num_pages_the_pool_fits_every_layout_and_a_flip_between_them():
    options = dict(max_running_requests=2, max_prefill_tokens=16)  # few shapes to compile
    budgets = {0: 48 << 20, 1: 32 << 20}
    engine = Engine.from_pretrained(
        "tiny", layout="pp:5,3", arm=("tp:2",), device_memory="48MiB,32MiB", **options
    )
    pages = engine.stats().pools["pages_total"]
    assert engine.info.config.engine.num_pages == pages
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    for _ in range(3):  # both prompts in and decoding: the largest pieces have been compiled
        engine.step()
    before = engine.memory()
    # The flip allocates tp:2's whole pool beside pp:5,3's, however full: it fits the budgets.
    engine.flip("tp:2")
    after = engine.memory()
    assert {c.layout for c in after.capacity} == {"pp:5,3", "tp:2"}
    assert all(pages <= c.pages for c in after.capacity)
    bound = _flip_bound(before.devices, after.devices, pages, budgets)
    assert 0.95 * bound <= pages <= bound
    assert all(line.free >= 0 for line in after.devices)
    while engine.has_unfinished():
        engine.step()
    engine.check()
    # A request the pool could never hold is refused, naming the pool.
    assert pages * 16 < engine.info.max_model_len - 1
    with pytest.raises(ValueError, match=rf"needs {pages + 1} pages of 16 tokens, the pool has"):
        engine.add_request([1] * 100, max_new_tokens=pages * 16 - 99)


def test_an_engine_over_its_budget_is_refused_by_name():
    with pytest.raises(BudgetError, match=r"single leaves device 0 -.* for KV pages beside"):
        Engine.from_pretrained("tiny", device_memory="4MiB", **OPTIONS)
    # Over two stages each device holds its own share: a budget one device could not meet.
    single = Engine.from_pretrained("tiny", **OPTIONS).memory().devices[0]
    share = (single.bytes["weights"] + single.bytes["kv_pages"] + single.bytes["gdn_slots"]) * 0.8
    Engine.from_pretrained("tiny", layout="pp:4,4", device_memory=f"{int(share)}", **OPTIONS)
    with pytest.raises(BudgetError, match="device 0"):
        Engine.from_pretrained("tiny", device_memory=f"{int(share)}", **OPTIONS)


def test_a_flip_that_does_not_fit_beside_the_old_layout_is_refused_and_changes_nothing():
    straight = Engine.from_pretrained("tiny", layout="pp:4,4", **OPTIONS)
    want = [o.token_ids for o in straight.generate(PROMPTS, sampling=GREEDY)]
    held = straight.memory().devices[0]
    # Device 0 holds half the model in pp:4,4; tp:2 puts half of every layer beside it.
    tight = int((held.used + 0.2 * held.bytes["weights"]) / 0.95)
    engine = Engine.from_pretrained("tiny", layout="pp:4,4", device_memory=str(tight), **OPTIONS)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    with pytest.raises(FlipError, match=r"flip to tp:2 refused: device 0 needs .*--device-memory"):
        engine.flip("tp:2")
    assert engine.stats().layout == "pp:4,4" and engine.stats().flips == ()
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
