"""A flip moves what is live, not the pool: bytes bounded by the held pages and slots, tokens
identical to a run without the flip, room checked before anything moves, and a reseed flip
that leaves cached prefixes to the store."""

from __future__ import annotations

import jax
import pytest

from flipjax import Engine, SamplingParams
from flipjax.runtime.buckets import pages_for
from sharding.flip import FlipError
from store.open import open_store
from tests.support.flip_runs import run_with_flip
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned

OPTIONS = dict(num_pages=256, max_running_requests=4, max_prefill_tokens=32)
PROMPTS = [[(i * 13 + j) % 250 for i in range(40)] for j in range(2)]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(engine: Engine, flip_at: int | None, target: str) -> list[list[int]]:
    return run_with_flip(engine, PROMPTS, GREEDY, flip_at, target)


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_pretrained("tiny", layout="pp:5,3", **OPTIONS)
    e.arm("tp:2")
    return e


def test_a_flip_moves_the_live_set_and_changes_no_token(engine):
    straight = Engine.from_pretrained("tiny", **OPTIONS).generate(PROMPTS, sampling=GREEDY)
    assert run(engine, 3, "tp:2") == [o.token_ids for o in straight]
    stats = engine.stats()
    record, slots_total = stats.flips[-1], stats.pools["slots_total"]
    state = parts(engine).runner.binding.state
    page_bytes = sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(state.kv))
    slot_bytes = sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(state.gdn))
    assert 0 < record.live_pages <= 2 * pages_for(40 + 12, 16) + 2 and record.live_slots >= 2
    # In one process a flip passes the live rows through the host, exactly those.
    assert record.kv_bytes == page_bytes * record.live_pages
    assert record.gdn_bytes == slot_bytes * record.live_slots < slot_bytes * slots_total
    assert record.kv_bytes <= page_bytes * OPTIONS["num_pages"] / 16 < record.held_bytes
    engine.check()
    engine.flip("pp:5,3")


def test_a_flip_without_room_is_refused_with_the_numbers(engine):
    layouts = parts(engine).layouts
    layouts.headroom = 1 << 20  # 1 MiB a device: the tiny state needs more
    before = layouts.counters["refused_memory"]
    with pytest.raises(FlipError, match=r"needs [\d.]+ MiB .* [\d.]+ MiB are free"):
        engine.flip("tp:2")
    layouts.headroom = None
    assert engine.stats().layout == "pp:5,3" and layouts.counters["refused_memory"] == before + 1
    out = engine.generate([PROMPTS[0]], sampling=GREEDY)[0]
    assert (
        out.token_ids
        == Engine.from_pretrained("tiny", **OPTIONS)
        .generate([PROMPTS[0]], sampling=GREEDY)[0]
        .token_ids
    )


@pytest.fixture
def bridge():
    """A host-memory store, closed (its worker thread ended) however the test ends."""
    bridge, _ = open_store(
        Engine.from_pretrained("tiny").info.model, "tiny-seed", "float32", 16, 16, 64 << 20, None, 0
    )
    yield bridge
    bridge.store.close()


def test_a_reseed_flip_leaves_cached_prefixes_to_the_store(bridge):
    engine = Engine.from_pretrained("tiny", prefix_store=bridge, **OPTIONS)
    first = engine.generate([PROMPTS[0]], sampling=GREEDY)[0]  # cached on the device
    held = parts(engine).allocator.held_pages()
    assert held and not engine.has_unfinished()
    record = engine.flip("tp:2", reseed=True)
    assert record.live_pages == 0 and record.reseeded == len(held)
    again = engine.generate([PROMPTS[0]], sampling=GREEDY)[0]
    assert again.token_ids == first.token_ids and again.cached_tokens == 32
    counters = engine.stats().prefix
    assert counters["hits_host"] == 1 and counters["reseed_reread_tokens"] == 32
    assert counters["reseed_dropped_pages"] == len(held)
    engine.flush_prefix_cache()
    assert_pools_returned(engine)
