"""Where memory is tight: with budgets in the 32:10:10 proportions of a 32 GB card beside two
10 GB ones, a flip PP -> TP -> PP with requests in flight keeps every device within the larger
of its two footprints plus the window at every wave, and changes no token; and a model whose
whole does not fit device 0 starts, because nothing is staged there.

The oracles: `jax.live_arrays()` read at every wave (what the devices really hold, plus the
wave program's temporary memory from XLA's own analysis), and a single-device run that never
flips.
"""

from __future__ import annotations

import gc
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flipjax import Engine, SamplingParams
from flipjax.runtime import binding as binding_module
from flipjax.runtime.host_image import HostImage
from sharding.budgets import format_bytes
from sharding.flip_waves import PoolLeaf, land, pull
from sharding.layout import placement_for
from sharding.memory import live_bytes
from tests.support.internals import parts

OPTIONS = dict(num_pages=96, max_running_requests=2, max_prefill_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[(i * 11 + j) % 250 for i in range(60 + 7 * j)] for j in range(2)]
# Small enough that a pool's live pages leave in several chunks (a GDN state row, 64 KiB, is
# the largest row and fits): a chunk the pull kept would show.
WINDOW = "72KiB"
PP, TP = "pp:4,2,2", "tp:2"


def _live(before: set[int]) -> Counter[int]:
    gc.collect()
    return live_bytes(before)


def _used(layout: str) -> list[int]:
    """What each device of `layout` holds with no budget (weights, pools, workspace)."""
    engine = Engine.from_pretrained("tiny", layout=layout, **OPTIONS)
    engine.generate(PROMPTS, sampling=GREEDY)
    used = [line.used for line in engine.memory().devices]
    engine.close()
    return used


@pytest.fixture(scope="module")
def budgets() -> list[int]:
    """Budgets in 32:10:10 where device 1 holds either layout alone but not both at once."""
    pp, tp = _used(PP), _used(TP)
    small = int(max(pp[1], tp[1]) / 0.95 * 1.03)
    assert pp[1] + tp[1] > small, "today's flip (both layouts at once) must not fit"
    return [small * 32 // 10, small, small]


def test_a_flip_each_way_stays_within_its_window_and_changes_no_token(budgets):
    straight = Engine.from_pretrained("tiny", **OPTIONS).generate(PROMPTS, sampling=GREEDY)
    before = {id(a) for a in jax.live_arrays()}
    device_memory = ",".join(map(str, budgets))
    engine = Engine.from_pretrained(
        "tiny", layout=PP, arm=(TP,), device_memory=device_memory, flip_window=WINDOW, **OPTIONS
    )
    layouts = parts(engine).layouts
    peaks: list[tuple[str, dict[int, int]]] = []

    def measure(label: str, temp: Counter[int]) -> None:
        now = live_bytes(before)  # no collection here: what a wave frees goes at once
        peaks.append((label, {d: now[d] + temp[d] for d in set(now) | set(temp)}))

    layouts.on_wave = measure
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    for target in (TP, PP):
        for _ in range(3):
            done.update({o.request_id: o.token_ids for o in engine.step()})
        old, peaks[:] = _live(before), []
        window = layouts.window(placement_for(target, engine.info.model))
        engine.flip(target)
        new = _live(before)
        assert {label for label, _ in peaks} == {"pull", "weights", "pools"}
        for label, peak in peaks:
            for device, held in peak.items():
                bound = max(old[device], new[device]) + window[device]
                assert held <= bound, (
                    f"{target} {label} wave: device {device} held {format_bytes(held)}, over "
                    f"{format_bytes(bound)}"
                )
                assert held <= budgets[device]
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step()})
    engine.check()
    assert [done[i] for i in ids] == [o.token_ids for o in straight]
    assert [r.direction for r in engine.stats().flips] == [f"{PP}->{TP}", f"{TP}->{PP}"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random HF checkpoint whose weights outweigh its pools, saved by transformers."""
    from tests.support.hf_oracle import make_checkpoint

    folder = str(tmp_path_factory.mktemp("hf"))
    make_checkpoint(folder, hidden_size=256, intermediate_size=512, vocab_size=1024)
    return folder


def _held(path: str, layout: str) -> tuple[list[int], list[list[int]]]:
    """What each device of `layout` holds with no budget, and the tokens it generates."""
    engine = Engine.from_pretrained(path, layout=layout, **OPTIONS)
    out = engine.generate(PROMPTS, sampling=GREEDY)
    return [line.used for line in engine.memory().devices], [o.token_ids for o in out]


def test_a_model_larger_than_device_0_starts_with_nothing_staged_there(checkpoint, monkeypatch):
    share, tokens = _held(checkpoint, "pp:2,1,1")
    budgets = [int(share[0] / 0.95) + 4096, 1 << 30, 1 << 30]
    assert sum(share) > budgets[0], "the whole model must not fit device 0"
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    seen: list[Counter[int]] = []
    place, zeros = HostImage.place, binding_module.placed_zeros

    def watched_place(self, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(_live(before))
        return place(self, *args, **kwargs)

    def watched_zeros(*args, **kwargs):  # noqa: ANN202
        seen.append(_live(before))
        return zeros(*args, **kwargs)

    monkeypatch.setattr(HostImage, "place", watched_place)
    monkeypatch.setattr(binding_module, "placed_zeros", watched_zeros)
    memory = ",".join(map(str, budgets))
    engine = Engine.from_pretrained(checkpoint, layout="pp:2,1,1", device_memory=memory, **OPTIONS)
    seen.append(_live(before))
    assert len(seen) > 3
    assert max(held[0] for held in seen) <= budgets[0]
    out = engine.generate(PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in out] == tokens  # those of the same layout without budgets


def test_the_pull_holds_at_most_one_chunk_of_rows_on_the_device():
    """Rows leave a pool a chunk at a time, and no chunk outlives its wave on the device."""
    device = jax.devices()[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("tp",)), PartitionSpec())
    pool = jax.device_put(
        np.random.default_rng(0).standard_normal((512, 16, 2, 64), np.float32), sharding
    )
    live = np.arange(3, 403, dtype=np.int32)
    window = {device.id: 256 << 10}  # 16 rows of 8 KiB a chunk: 25 chunks
    before = {id(a) for a in jax.live_arrays()}
    held: list[int] = []
    [rows] = pull([pool], [live], window, lambda label, temp: held.append(live_bytes(before)[0]))
    assert len(held) == 25 and max(held) <= window[device.id]
    np.testing.assert_array_equal(rows, np.asarray(pool)[live])


@pytest.mark.parametrize(
    "live", [np.arange(3, 403, dtype=np.int32), np.arange(512, dtype=np.int32)]
)
def test_rows_pulled_and_landed_on_other_devices_are_the_live_rows(live):
    """A pool moved from one device to two (split by heads) through the host holds its live
    rows where they were and zeros elsewhere, whether some rows or all of them are live."""
    devices = jax.devices()
    source = NamedSharding(Mesh(np.array(devices[:1]), ("tp",)), PartitionSpec())
    target = NamedSharding(Mesh(np.array(devices[1:3]), ("tp",)), PartitionSpec(None, None, "tp"))
    values = np.random.default_rng(1).standard_normal((512, 16, 2, 64), np.float32)
    pool = jax.device_put(values, source)
    window = {d.id: 256 << 10 for d in devices}
    [rows] = pull([pool], [live], window, None)
    leaf = PoolLeaf(values.shape, values.dtype, live)
    landed: list[jax.Array] = []
    _, [moved], _ = land(None, [], [], [leaf], [target], [rows], window, None, landed)
    want = np.zeros_like(values)
    want[live] = values[live]
    assert moved.sharding == target
    np.testing.assert_array_equal(np.asarray(moved), want)
