"""The engine over the store: published prefixes seed later requests, across a restart, with
token-identical results (straight-through generation is the reference)."""

from __future__ import annotations

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.cache_io import read_pages, read_slot
from store.bridge import StoreBridge
from store.disk import DiskTier
from store.entry import Kind
from store.host import HostTier
from store.keys import ModelIdentity, page_keys, root_key
from store.payload import PayloadLayout
from store.tiered import TieredStore
from tests.support.internals import parts

PS, GRID = 16, 32
PROMPT = [(i * 11 + 5) % 256 for i in range(100)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def open_store(model, folder: str) -> StoreBridge:
    ident = ModelIdentity.create(model.cfg.to_dict(), "tiny-seed-0", "float32", PS)
    store = TieredStore(
        root_key(ident),
        PS,
        GRID,
        HostTier(64 << 20),
        DiskTier(folder, ident.digest(), budget_bytes=256 << 20),
    )
    return StoreBridge(store, PayloadLayout.for_model(model.cfg, PS, "float32"))


def make(model, bridge=None, layout: str | None = None, max_prefill_tokens=48, **options):
    config = FlipjaxConfig.build(
        dtype="float32",
        page_size=PS,
        max_prefill_tokens=max_prefill_tokens,
        layout=layout,
        **options,
    )
    return Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=bridge)


def generate_after_prefetch(engine: Engine, prompts, sampling) -> list:
    """`generate`, letting every request's prefetch land before the first step, so that the
    seeds come from host memory at admission (the race with the prefetch is taken out)."""
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
    for rid in ids:
        ticket = parts(engine).requests[rid].prefetch
        assert ticket is not None and ticket.done.wait(30)
    done = {}
    while len(done) < len(ids):
        done.update((o.request_id, o) for o in engine.step())
    return [done[i] for i in ids]


def test_store_hits_are_token_identical_across_a_restart(model, tmp_path):
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12),
    ]
    straight = make(model).generate([PROMPT, PROMPT], sampling=params)

    bridge = open_store(model, str(tmp_path))
    first = make(model, bridge).generate([PROMPT], sampling=params[:1])[0]
    assert first.cached_tokens == 0 and first.token_ids == straight[0].token_ids
    bridge.store.close()

    restarted = open_store(model, str(tmp_path))  # new store objects over the same folder
    assert restarted.store.host.used_bytes == 0
    engine = make(model, restarted, num_pages=64)  # other pool sizes, other page ids
    again = generate_after_prefetch(engine, [PROMPT, PROMPT], params)
    # 100 prompt tokens (+ generated ones published too): deepest grid point below 100 is 96
    assert [o.cached_tokens for o in again] == [96, 96]
    assert [o.token_ids for o in again] == [o.token_ids for o in straight]
    assert restarted.store.stats()["store"]["hits_disk"] > 0
    # The second rode on the first's promotion.
    assert engine.stats().prefix.get("hits_disk", 0) == 1
    engine.check()
    restarted.store.close()


def publish_to_disk(model, folder) -> None:
    """PROMPT computed once, its pages and states in a disk tier in `folder`."""
    bridge = open_store(model, str(folder))
    make(model, bridge).generate([PROMPT], max_new_tokens=8)
    bridge.store.close()


def hold_reads(bridge: StoreBridge) -> threading.Event:
    """Keep the store's read worker busy until the returned event is set."""
    gate = threading.Event()
    assert bridge.store.reads.submit(gate.wait)
    return gate


def test_no_step_reads_the_disk(model, tmp_path):
    """With the store's reader held up, a request whose prefix is on disk waits its bounded
    `prefetch_wait_s`, then computes, and not one disk read happens on the engine's thread;
    reading in place (the former behaviour) is the contrast."""
    straight = make(model).generate([PROMPT], max_new_tokens=8)[0]
    publish_to_disk(model, tmp_path)

    held = open_store(model, str(tmp_path))
    gate = hold_reads(held)  # the reader is busy (a slow disk, say)
    out = make(model, held).generate([PROMPT], max_new_tokens=8)[0]
    assert out.token_ids == straight.token_ids and out.cached_tokens == 0
    assert held.store.disk.counters["checked"] == 0
    gate.set()
    held.store.close()

    in_place = open_store(model, str(tmp_path))
    in_place.sync_reads = True
    out = make(model, in_place).generate([PROMPT], max_new_tokens=8)[0]
    assert out.token_ids == straight.token_ids and out.cached_tokens == 96
    assert in_place.store.disk.counters["checked"] > 0
    in_place.store.close()


def test_the_queue_head_waits_for_its_prefetch_while_others_step(model, tmp_path):
    """Within `prefetch_wait_s`, a request whose prefix is on its way waits at the head of the
    queue while a running request keeps decoding; once the prefix lands it is seeded whole."""
    straight = make(model).generate([PROMPT], max_new_tokens=8)[0]
    publish_to_disk(model, tmp_path)

    restarted = open_store(model, str(tmp_path))
    engine = make(model, restarted, prefetch_wait_s=30)
    other = parts(engine).requests[engine.add_request([3] * 20, SamplingParams(temperature=0))]
    engine.step()
    gate = hold_reads(restarted)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    seq = parts(engine).requests[rid]
    before = len(other.output_ids)
    for _ in range(3):
        engine.step()
    assert len(other.output_ids) == before + 3  # the running request stepped on
    assert seq.num_computed == 0 and engine.stats().scheduling.get("prefetch_waits", 0) == 3
    gate.set()
    assert seq.prefetch.done.wait(30)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                assert out.token_ids == straight.token_ids and out.cached_tokens == 96
    assert engine.stats().prefix.get("hits_disk", 0) == 1
    engine.check()
    restarted.store.close()


def test_a_prefetch_that_lands_mid_prefill_is_caught_up(model, tmp_path):
    """Admitted before its prefetch landed, a request computes its first chunks; the step after
    the prefetch lands skips it to the stored 96 tokens, with the straight-through tokens."""
    prompt = PROMPT[:-1] + [7]
    straight = make(model).generate([prompt], max_new_tokens=8)[0]
    publish_to_disk(model, tmp_path)

    restarted = open_store(model, str(tmp_path))
    gate = hold_reads(restarted)
    engine = make(model, restarted, max_prefill_tokens=16, prefetch_wait_s=0)  # admit at once
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    seq = parts(engine).requests[rid]
    engine.step()
    assert seq.num_computed == 16 and seq.cached_tokens == 0
    gate.set()
    assert seq.prefetch.done.wait(30) and seq.prefetch.tokens == 96
    engine.step()  # tokens 16...32 compute, then the catch-up writes 32...96 from host memory
    assert seq.num_computed == 96 and seq.cached_tokens == 64
    while engine.has_unfinished():
        out = engine.step()
    assert out[0].token_ids == straight.token_ids and out[0].cached_tokens == 64
    prefix = engine.stats().prefix
    assert prefix.get("catch_ups", 0) == 1
    assert prefix.get("hit_tokens_disk", 0) == 64
    engine.check()
    restarted.store.close()


def run_prompt(engine: Engine, prompt: list[int]):
    """Admit `prompt` and step until all of it is computed; returns the live sequence."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30))
    seq = parts(engine).requests[rid]
    while seq.num_computed < len(prompt):
        engine.step()
    return seq


def test_published_payloads_are_the_device_bytes(model, tmp_path):
    bridge = open_store(model, str(tmp_path))
    engine = make(model, bridge)
    seq = run_prompt(engine, PROMPT[:64])
    kv = read_pages(parts(engine).runner.state, seq.pages[:4])
    keys = page_keys(bridge.store.root, PROMPT[:64], PS)
    layout = bridge.layout
    for i, k in enumerate(keys):
        values, scales = layout.decode_kv(bridge.store.get(k, Kind.KV_PAGE))
        np.testing.assert_array_equal(values, kv.values[i])
        assert scales is None and kv.scales is None
    fetched = bridge.fetch(PROMPT[:64])
    assert fetched.tokens == 64
    np.testing.assert_array_equal(fetched.kv.values, kv.values)
    engine.abort(seq.request_id)
    bridge.store.close()


def test_pages_without_a_state_seed_nothing(model, tmp_path):
    bridge = open_store(model, str(tmp_path))
    make(model, bridge).generate([PROMPT], max_new_tokens=2)
    # delete every GDN anchor: the pages alone are worth zero tokens
    keys = page_keys(bridge.store.root, PROMPT, PS)
    for k in keys:
        bridge.store.host.delete(k, Kind.GDN_ANCHOR)
        bridge.store.flush()
        if bridge.store.disk is not None:
            bridge.store.disk.delete(k, Kind.GDN_ANCHOR)
    out = make(model, bridge).generate([PROMPT], max_new_tokens=2)[0]
    assert out.cached_tokens == 0
    bridge.store.close()


def test_slot_state_is_what_was_published(model, tmp_path):
    bridge = open_store(model, str(tmp_path))
    engine = make(model, bridge)
    seq = run_prompt(engine, PROMPT[:32])
    rec, conv = read_slot(parts(engine).runner.state, seq.slot)
    fetched = bridge.fetch(PROMPT[:32] + [1])
    np.testing.assert_array_equal(fetched.recurrent, rec)
    np.testing.assert_array_equal(fetched.conv, conv)
    engine.abort(seq.request_id)
    bridge.store.close()


def test_payloads_are_layout_neutral_across_layouts(model, tmp_path):
    """Pages and states published by a pipeline read back bit-identical into a tensor-parallel
    state (KV heads and GDN value heads split over two devices), and generation continues the
    same; then the request finishes after a flip back to the pipeline."""
    bridge = open_store(model, str(tmp_path))
    small = dict(max_running_requests=1)  # fewer step shapes to compile for two layouts
    straight = make(model, bridge, "pp:5,3", **small).generate([PROMPT], max_new_tokens=8)[0]
    bridge.store.flush()

    engine = make(model, bridge, "tp:2", **small)
    assert len(parts(engine).runner.state.kv[0].k.sharding.device_set) == 2
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    seq = parts(engine).requests[rid]
    engine.step()  # admission seeds 96 tokens from the store, then prefills the rest
    assert seq.cached_tokens == 96
    fetched = bridge.fetch(PROMPT)
    held = read_pages(parts(engine).runner.state, seq.pages[:6])
    np.testing.assert_array_equal(held.values, fetched.kv.values)
    engine.step()
    engine.flip("pp:5,3")
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == straight.token_ids
    engine.check()
    bridge.store.close()


def test_warmup_compiles_the_store_path_too(model, tmp_path):
    """After warm-up, seeding from the store and publishing to it compile nothing, and the
    warm-up itself changed no pooled state."""
    bridge = open_store(model, str(tmp_path))
    engine = make(model, bridge, max_running_requests=2)
    runner = parts(engine).runner
    before = jax.tree.map(np.array, runner.state)  # host copies: warm-up donates pools
    engine.warmup()
    chex.assert_trees_all_equal(before, jax.device_get(runner.state))
    compiles = engine.stats().compiles
    first = engine.generate([PROMPT], max_new_tokens=4)[0]
    bridge.store.flush()
    second = engine.generate([PROMPT], max_new_tokens=4)[0]
    assert second.cached_tokens == 96 and second.token_ids == first.token_ids
    assert engine.stats().compiles == compiles
    bridge.store.close()


def test_a_store_with_another_page_size_or_grid_is_refused(model, tmp_path):
    bridge = open_store(model, str(tmp_path))
    config = FlipjaxConfig.build(dtype="float32", page_size=8)
    with pytest.raises(ValueError, match="page size 16 is not the engine's 8"):
        Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=bridge)
    with pytest.raises(ValueError, match="64 is not the prefix store's 32"):
        make(model, bridge, gdn_checkpoint_interval=64)
    assert make(model, bridge, gdn_checkpoint_interval=GRID).stats().gdn_interval == GRID
