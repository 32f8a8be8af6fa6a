"""The device prefix cache: the radix tree's rules on bare pools, then the engine reusing it with
the same tokens as a run that computes everything."""

from __future__ import annotations

from collections import Counter

import jax.numpy as jnp
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.engine.radix_cache import OWNER, RadixCache
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.pools import PagePool
from tests.support.pool_checks import assert_pools_returned

PS, GRID = 4, 8  # page size and GDN grid for the bare-tree tests


def tree(num_pages: int = 16, num_slots: int = 4, max_states: int = 2):
    allocator = Allocator(num_pages, num_slots, PS)
    return RadixCache(allocator, GRID, max_states), allocator.pages, allocator.slots


def request_pages(pages: PagePool, n: int, owner: str = "req") -> list[int]:
    return pages.allocate(n, owner)


def test_a_match_stops_at_the_deepest_state():
    cache, pages, _ = tree()
    tokens = list(range(16))
    held = request_pages(pages, 4)
    assert cache.insert(tokens, held) == 4
    assert cache.match(tokens + [99]).tokens == 0, "pages without a state are no match"
    copied: list[int] = []
    assert cache.add_state(tokens[:8], copied.append)
    match = cache.match(tokens + [99])
    assert (match.tokens, match.pages, match.slot) == (8, held[:2], copied[0])
    assert cache.add_state(tokens[:16], copied.append)
    assert cache.match(tokens + [99]).tokens == 16
    assert cache.match(tokens[:8] + [7] * 8).tokens == 8, "a fork after the grid point"
    assert cache.match(tokens[:4] + [7] * 12).tokens == 0, "a fork before the first state"
    with pytest.raises(ValueError, match="not on the grid"):
        cache.add_state(tokens[:12], copied.append)
    cache.check()


def test_inserting_a_prefix_twice_keeps_the_first_pages():
    cache, pages, _ = tree()
    tokens = list(range(8))
    first, second = request_pages(pages, 2, "a"), request_pages(pages, 2, "b")
    assert cache.insert(tokens, first) == 2
    assert cache.insert(tokens, second) == 0
    assert pages.holders(second[0]) == {"b"} and pages.holders(first[0]) == {"a", OWNER}
    cache.check()


def test_eviction_frees_least_recently_used_leaves_the_cache_alone_holds():
    cache, pages, _ = tree()
    old, new, busy = [0] * 8, [1] * 8, [2] * 8
    for owner, tokens in (("a", old), ("b", new), ("c", busy)):
        held = request_pages(pages, 2, owner)
        cache.insert(tokens, held)
        if owner != "c":
            pages.release(held, owner)  # finished: only the cache holds these
    cache.match(new)  # touch
    assert cache.evict_pages(1) == 1
    assert cache.match(old).tokens == 0 and len(cache._path(old)) == 1, "old's leaf went first"
    assert cache.evict_pages(10) == 3, "busy's pages are held by a running request"
    assert cache.num_pages == 2 and pages.num_free == 14
    cache.check()


def test_a_state_is_evicted_alone_and_states_are_capped():
    cache, pages, slots = tree(max_states=2)
    prefixes = [[k] * 8 for k in range(3)]
    for k, tokens in enumerate(prefixes):
        cache.insert(tokens, request_pages(pages, 2, f"r{k}"))
        assert cache.add_state(tokens, lambda slot: None)
    assert cache.num_states == 2 and cache.counters["evicted_states"] == 1
    assert cache.match(prefixes[0]).tokens == 0, "the oldest state made room"
    assert len(cache._path(prefixes[0])) == 2, "its pages stayed"
    assert cache.match(prefixes[2]).tokens == 8
    assert slots.num_free == 2
    cache.check()


def test_flush_returns_everything():
    cache, pages, slots = tree()
    assert cache.flush() == (0, 0)
    cache.insert(list(range(16)), request_pages(pages, 4))
    cache.add_state(list(range(8)), lambda slot: None)
    pages.release([0, 1, 2, 3], "req")
    assert cache.flush() == (4, 1)
    assert pages.num_free == 16 and slots.num_free == 4
    assert cache.match(list(range(16))).tokens == 0
    cache.check()


def test_check_catches_a_page_released_behind_the_cache():
    cache, pages, _ = tree()
    held = request_pages(pages, 4)
    cache.insert(list(range(16)), held)
    cache.check()
    pages.release([held[2]], OWNER)
    with pytest.raises(AssertionError, match="not held"):
        cache.check()


# -- the engine ---------------------------------------------------------------------------------

PROMPT = [(i * 11 + 5) % 256 for i in range(45)]  # 2 grid points of 16, then 13 tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def make(model, **options) -> Engine:
    config = FlipjaxConfig.build(
        dtype="float32", page_size=8, gdn_checkpoint_interval=16, max_prefill_tokens=64, **options
    )
    return Engine(model, ByteTokenizer(), config, name="tiny")


SAMPLINGS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=20),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_a_repeated_prompt_is_served_from_the_device_with_the_same_tokens(model, sampling):
    straight = make(model, prefix_cache=False)
    want = straight.generate([PROMPT], sampling=sampling)[0].token_ids
    assert straight.generate([PROMPT], sampling=sampling)[0].token_ids == want, "A vs A"
    cached = make(model)
    first = cached.generate([PROMPT], sampling=sampling)[0]
    second = cached.generate([PROMPT], sampling=sampling)[0]
    longer = cached.generate([PROMPT + second.token_ids[:4]], sampling=sampling)[0]
    assert first.cached_tokens == 0 and second.cached_tokens == 32
    assert longer.cached_tokens == 48, "the first run's output pages and states are cached too"
    assert first.token_ids == second.token_ids == want
    alone = straight.generate([PROMPT + second.token_ids[:4]], sampling=sampling)[0]
    assert longer.token_ids == alone.token_ids
    prefix = cached.stats().prefix
    assert prefix.get("hits_device", 0) == 2 and prefix.get("misses", 0) == 1
    assert_pools_returned(cached)
    again = cached.generate([PROMPT], sampling=sampling)[0]
    assert again.cached_tokens == 0 and again.token_ids == want, "flushed: computed again"


def test_a_tight_pool_climbs_the_relief_ladder_and_loses_nothing(model):
    prompts = [PROMPT[: 20 + 3 * k] + [k] * 9 for k in range(8)]
    sampling = [SamplingParams(temperature=0, max_tokens=24)] * 8
    roomy = make(model, prefix_cache=False).generate(prompts, sampling=sampling)
    tight = make(model, num_pages=24, max_running_requests=8)
    squeezed = tight.generate(prompts, sampling=sampling)
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    counters = Counter(tight.stats().scheduling)
    assert counters["evicted"] > 0 and counters["retracted"] > 0, counters
    assert counters["throttled"] + counters["parked"] > 0, counters
    assert tight.stats().prefix.get("hits_device", 0) > 0
    assert_pools_returned(tight)
