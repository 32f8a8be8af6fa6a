"""A tenant's `cache_salt` keeps its prefixes its own, on the device and in the store.

A salted prefix is reused only by requests with the same salt: another salt, or none, finds
nothing, so `cached_tokens` tells no tenant what another has sent. The reference for the
tokens is each test's first run, which computes the whole prompt.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from store.bridge import StoreBridge
from store.host import HostTier
from store.keys import ModelIdentity, root_key
from store.payload import PayloadLayout
from store.tiered import TieredStore
from tests.support.pool_checks import assert_pools_returned

PS, GRID = 16, 32
PROMPT = [(i * 13 + 7) % 256 for i in range(100)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def make(model, store: StoreBridge | None = None) -> Engine:
    config = FlipjaxConfig.build(
        dtype="float32", page_size=PS, max_prefill_tokens=48, gdn_checkpoint_interval=GRID
    )
    return Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=store)


def run(engine: Engine, salt: str | None):
    rid = engine.add_request(PROMPT, GREEDY, cache_salt=salt)
    done = {}
    while rid not in done:
        done.update((o.request_id, o) for o in engine.step())
    return done[rid]


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    return make(model)


def test_the_device_cache_serves_a_salted_prefix_to_its_salt_only(engine):
    straight = run(engine, "a")
    assert straight.cached_tokens == 0
    order = [("b", 0), (None, 0), ("a", 96), ("b", 96), (None, 96), ("ab", 0)]
    for salt, cached in order:
        out = run(engine, salt)
        assert (salt, out.cached_tokens) == (salt, cached)
        assert out.token_ids == straight.token_ids
    assert_pools_returned(engine)


def test_the_store_serves_a_salted_prefix_to_its_salt_only(model):
    ident = ModelIdentity.create(model.cfg.to_dict(), "tiny-seed-0", "float32", PS)
    store = TieredStore(root_key(ident), PS, GRID, HostTier(64 << 20))
    bridge = StoreBridge(store, PayloadLayout.for_model(model.cfg, PS, "float32"))
    engine = make(model, bridge)
    straight = run(engine, "tenant-a")
    assert straight.cached_tokens == 0
    for salt, cached in [("tenant-b", 0), (None, 0), ("tenant-a", 96)]:
        engine.flush_prefix_cache()  # the store alone answers
        out = run(engine, salt)
        assert (salt, out.cached_tokens) == (salt, cached)
        assert out.token_ids == straight.token_ids
    assert engine.stats().prefix.get("hits_host", 0) == 1
    store.close()


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7])
def test_a_salt_that_is_empty_long_or_not_a_string_is_refused(engine, salt):
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        engine.add_request(PROMPT, GREEDY, cache_salt=salt)
    assert not engine.has_unfinished()
