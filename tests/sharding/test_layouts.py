"""Layouts and the live phase flip on 8 virtual CPU devices: same tokens in every layout, across
flips mid-generation, and nothing lost when a flip is refused or fails."""

from __future__ import annotations

import gc

import jax
import pytest
from jax.sharding import PartitionSpec as P

from flipjax import Engine
from sharding import flip as flip_module
from sharding.layout import PP, TP, LayoutError, parse_layout, placement_for
from tests.support.internals import params, parts

PROMPTS = [[(i * 7 + 3) % 256 for i in range(n)] for n in (5, 17, 40)]
# A grid of 16 tokens: a second run of PROMPTS reuses the device prefix cache, across flips too.
OPTIONS = dict(
    num_pages=64,
    max_running_requests=4,
    max_prefill_tokens=32,
    gdn_checkpoint_interval=16,
    num_slots=16,  # room for every grid state a run leaves
)
NEW_TOKENS = 24  # enough decode steps for ten round trips in one run


def make(layout: str | None = None) -> Engine:
    return Engine.from_pretrained("tiny", layout=layout, **OPTIONS)


def run(engine: Engine, flips: dict[int, str] | None = None) -> list[list[int]]:
    """Generate PROMPTS; before step i, flip to flips[i]."""
    ids = [engine.add_request(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS]
    done, step = {}, 0
    while engine.has_unfinished():
        if flips and step in flips:
            engine.flip(flips[step])
        for out in engine.step():
            done[out.request_id] = out.token_ids
        step += 1
    engine.check()
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def straight() -> list[list[int]]:
    """Single device, never flipped: the reference every other run must equal."""
    return run(make())


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Starts in an uneven pipeline; both layouts armed once for the module."""
    e = make("pp:5,3")
    e.warmup()
    e.arm("tp:2")
    return e


def test_layout_text_forms():
    assert parse_layout("tp") == TP()
    assert parse_layout("tp:4") == TP(4)
    assert parse_layout("pp:32,16,16") == PP((32, 16, 16))
    assert parse_layout("pp:32,16,16@4,2,2") == PP((32, 16, 16), (4, 2, 2))
    for text in ("tp:4", "pp:32,16,16@4,2,2", "single"):
        assert str(parse_layout(text)) == text
    for bad, named in [
        ("pp", "not one of"),
        ("pp:3,x", "integers"),
        ("pp:4,4@2", "widths"),
        ("tp:0", "positive"),
    ]:
        with pytest.raises(LayoutError, match=named):
            parse_layout(bad)


def test_placements_split_what_they_say(engine):
    cfg = engine.info.model
    tp = placement_for("tp:2", cfg)
    shardings = tp.param_shardings(params(engine))
    q = shardings["model"]["layers"][3]["self_attn"]["q_proj"]["kernel"].get_value()
    o = shardings["model"]["layers"][3]["self_attn"]["o_proj"]["kernel"].get_value()
    assert q.spec == P(None, "tp") and o.spec == P("tp", None)  # kernels are [in, out]
    state_sh = tp.state_shardings(cfg, kv_scales=True)
    assert state_sh.kv[0].k.spec == P(None, None, "tp", None)
    assert state_sh.kv[0].k_scale.spec == P(None, "tp")  # an 8-bit page's scales: its heads
    assert state_sh.gdn[0].recurrent.spec == P(None, "tp", None, None)
    # Under the pipeline each stage's leaves live on its own device only.
    devices = jax.devices()
    layers = params(engine)["model"]["layers"]
    assert layers[0]["input_layernorm"]["weight"].get_value().devices() == {devices[0]}
    assert layers[7]["input_layernorm"]["weight"].get_value().devices() == {devices[1]}
    assert parts(engine).runner.state.kv[0].k.devices() == {devices[0]}  # layer 3
    assert parts(engine).runner.state.kv[1].k.devices() == {devices[1]}  # layer 7


@pytest.mark.parametrize("layout", ["tp:2", "pp:3,5@2,2"])
def test_every_layout_generates_the_same_tokens(layout, straight):
    assert run(make(layout)) == straight


def test_flip_mid_generation_both_ways(engine, straight):
    before = engine.stats().compiles
    assert run(engine, {3: "tp:2"}) == straight  # PP -> TP after prefill, mid-decode
    assert engine.stats().layout == "tp:2"
    hits = engine.stats().prefix.get("hit_tokens_device", 0)
    assert run(engine, {1: "pp:5,3"}) == straight  # TP -> PP mid-prefill
    assert engine.stats().layout == "pp:5,3"
    # The 17- and 40-token prompts reused cached pages and states written before the flip.
    assert engine.stats().prefix.get("hit_tokens_device", 0) - hits == 16 + 32
    assert engine.stats().compiles == before, "a flip between armed layouts compiled"
    record = engine.stats().flips[-1]
    assert record.direction == "tp:2->pp:5,3" and record.generation == engine.stats().generation
    assert record.weights_bytes == sum(x.nbytes for x in jax.tree.leaves(params(engine)))
    assert record.kv_bytes > 0 and record.gdn_bytes > 0 and record.total_ms > 0


def live_arrays() -> int:
    gc.collect()  # earlier tests' engines free their arrays only when their cycles are collected
    return len(jax.live_arrays())


def test_ten_round_trips_in_a_row(engine, straight):
    live = live_arrays()
    flips = {i: ("tp:2" if i % 2 == 0 else "pp:5,3") for i in range(20)}  # a flip every step
    generation = engine.stats().generation
    assert run(engine, flips) == straight
    assert engine.stats().generation == generation + 20
    assert engine.stats().layout == "pp:5,3"
    assert live_arrays() == live, "a flip left arrays behind"


def test_refused_flip_keeps_the_old_layout(engine, straight):
    refusals = [
        ("pp:5,4", "sum to 9"),
        ("tp:4", "linear_num_key_heads"),
        ("pp:4,4@4,4,", "integers"),
        ("pp:4,4@8,8", "needs 16 devices"),
    ]
    for bad, named in refusals:
        with pytest.raises(LayoutError, match=named):
            engine.flip(bad)
        assert engine.stats().layout == "pp:5,3"
    assert run(engine) == straight


@pytest.mark.parametrize("phase", ["pull", "weights", "pools"])
def test_a_failure_in_any_wave_of_a_flip_loses_nothing(engine, straight, phase):
    """An allocation that fails in a wave of the pull (the old layout untouched), of the
    weights or of the pools (the old layout already freed) ends in the old layout, with every
    request's tokens those of a straight run."""
    layouts = parts(engine).layouts
    waves: list[str] = []

    def fail_second_wave(label: str, temp: object) -> None:
        waves.append(label)
        if waves.count(phase) == 2 and label == phase:
            raise RuntimeError(f"injected: allocation failed in a {phase} wave")

    binding, generation = parts(engine).runner.binding, engine.stats().generation
    failed = layouts.counters["failed"]
    layouts.on_wave = fail_second_wave
    ids = [engine.add_request(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    for _ in range(3):
        done.update({o.request_id: o.token_ids for o in engine.step()})
    try:
        with pytest.raises(flip_module.FlipError, match=f"injected: .* {phase} wave"):
            engine.flip("tp:2")
    finally:
        layouts.on_wave = None
    assert waves.count(phase) == 2 and layouts.counters["failed"] == failed + 1
    assert engine.stats().layout == "pp:5,3" and engine.stats().generation == generation
    # Before anything is freed the old binding simply stays; after, it is landed again.
    assert (parts(engine).runner.binding is binding) == (phase == "pull")
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step()})
    engine.check()
    assert [done[i] for i in ids] == straight
