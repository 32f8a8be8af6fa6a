"""A flip between layouts whose pools differ in size: into a pool smaller than the live set,
cached prefixes are dropped (the host store has them) and the youngest requests go back to
waiting, and every request still ends with the tokens of a straight run that never flips; the
pages that were dropped come back from the host store as hits. Into a larger pool the extra
pages are free at once. A flip into a pool a request in flight could never finish in is refused
by name and changes nothing.

Each layout's size normally comes from the device budgets (`test_memory_ledger.py` checks
that); here the sizes are given directly, so the pools are small and exact.

The oracle is a straight run: the same requests on one device, no store, no flip.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from sharding.flip import FlipError
from store.open import open_store
from tests.support.internals import parts

PS, GRID = 16, 32
PP, TP = "pp:4,4", "tp:2"
SIZES = {PP: 48, TP: 14}  # pages: four requests of 8 pages fit PP's pool, not TP's
PROMPTS = [[(i * 7 + 13 * j) % 256 for i in range(90 + 3 * j)] for j in range(4)]
# The first request ends early, so the pool's low pages are cached rather than held by a
# request, and the requests that stay hold pages past the small pool's end: they must be
# renumbered as they land.
SAMPLING = [
    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=4, max_tokens=20, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


@pytest.fixture(scope="module")
def straight(model) -> list[list[int]]:
    config = FlipjaxConfig.build(dtype="float32", page_size=PS, max_prefill_tokens=32)
    engine = Engine(model, ByteTokenizer(), config, name="tiny")
    return [o.token_ids for o in engine.generate(PROMPTS, sampling=SAMPLING)]


def make(model, tmp_path) -> Engine:
    """PP with TP armed, over a host store, each layout's pool sized as SIZES says."""
    bridge, _ = open_store(model.cfg, "tiny-seed-0", "float32", PS, GRID, 64 << 20, None, 0)
    config = FlipjaxConfig.build(
        dtype="float32",
        page_size=PS,
        max_prefill_tokens=32,
        max_running_requests=4,
        num_pages=SIZES[PP],
        layout=PP,
    )
    engine = Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=bridge)
    parts(engine).layouts.pools.pool_pages = lambda placement: SIZES[placement.name]
    engine.arm(TP)
    return engine


def test_a_flip_into_a_smaller_pool_spills_retracts_and_changes_no_token(model, straight, tmp_path):
    engine = make(model, tmp_path)
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, SAMPLING, strict=True)]
    done: dict[str, list[int]] = {}
    # The first request done, the others decoding.
    while ids[0] not in done or len(engine.stats().decode_tokens_left) < 3:
        done.update({o.request_id: o.token_ids for o in engine.step()})
    held = parts(engine).allocator.held_pages()
    assert len(held) > SIZES[TP] and max(held) >= SIZES[TP]

    record = engine.flip(TP)

    after = engine.stats()
    assert record.direction == f"{PP}->{TP}"
    assert after.pools["pages_total"] == SIZES[TP]
    assert after.scheduling["shrink_evicted_pages"] > 0  # cached prefixes went first
    assert after.scheduling["shrink_retracted"] > 0  # then the youngest requests
    assert after.running + after.waiting == 3
    engine.check()  # every table renumbered into the smaller pool, every page owned once
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step()})
        engine.check()
    assert [done[i] for i in ids] == straight
    # The retracted requests resumed from what the flip dropped: the host store had it.
    assert engine.stats().prefix["hits_host"] > 0

    # Back into the larger pool: its extra pages are free the moment it lands.
    engine.flip(PP)
    pools = engine.stats().pools
    assert pools["pages_total"] == SIZES[PP]
    assert pools["pages_free"] == SIZES[PP] - pools["pages_cache"]
    again = engine.generate(PROMPTS, sampling=SAMPLING)
    assert [o.token_ids for o in again] == straight
    engine.check()


def test_a_flip_into_a_pool_a_request_could_never_finish_in_is_refused_and_changes_nothing(
    model, straight, tmp_path
):
    engine = make(model, tmp_path)
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)  # 15 pages in all
    rid = engine.add_request(PROMPTS[0], long)
    engine.step()
    before = engine.stats()
    with pytest.raises(
        FlipError,
        match=rf"flip to {TP} refused: {rid} needs 15 pages of 16 tokens \(prompt plus "
        rf"max_tokens\), the pool there has {SIZES[TP]}",
    ):
        engine.flip(TP)
    after = engine.stats()
    assert (after.layout, after.generation, after.flips) == (PP, before.generation, ())
    assert after.pools == before.pools and after.scheduling == before.scheduling
    assert parts(engine).layouts.counters["refused_pool"] == 1
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step()})
    assert out[rid][:3] == straight[0]
    engine.check()
