"""The paged engine against the contiguous reference and against itself (straight-through)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.qwen3_next import forward, init_cache
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.model_runner import Row
from tests.support.internals import params, parts
from tests.support.pool_checks import assert_pools_returned

# Compiled whole: run op by op, the contiguous forward compiled about 500 programs.
contiguous_forward = jax.jit(forward, static_argnums=(0, 5))
PROMPTS = [[(i * 7 + 3) % 256 for i in range(n)] for n in (1, 5, 15, 16, 17, 31, 44, 60)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def make(model, **options) -> Engine:
    config = FlipjaxConfig.build(dtype="float32", **options)
    return Engine(model, ByteTokenizer(), config, name="tiny")


@pytest.fixture(scope="module")
def engine(model):
    return make(model)


def test_paged_logits_equal_contiguous_forward(engine):
    """Prefill then decode over pages gives the contiguous cache's logits, step by step."""
    prompt = PROMPTS[6]
    cache = init_cache(engine.info.model, 1, 64, jnp.float32)
    inside = parts(engine)
    pool, slots = inside.allocator.pages, inside.allocator.slots
    pages = pool.allocate(4, "t")
    slot = slots.allocate("t")
    try:
        ids, start = list(prompt), 0
        paged = inside.runner.run([Row(ids, 0, pages, slot)], decode=False)
        for _ in range(8):
            tokens = jnp.asarray([ids[start:]], jnp.int32)
            positions = jnp.arange(start, len(ids), dtype=jnp.int32)[None]
            want, cache = contiguous_forward(
                inside.graphdef, params(engine), tokens, positions, cache, True
            )
            # Blockwise online softmax vs one softmax: fp32 sums in another order (logits ~2.5),
            # which also depends on the CPU's matmul kernels (2.6e-5 seen on an AVX-512 part).
            np.testing.assert_allclose(np.asarray(paged[0]), np.asarray(want[0]), atol=5e-5, rtol=0)
            start = len(ids)
            ids.append(int(np.argmax(want[0])))
            paged = inside.runner.run([Row(ids[-1:], start, pages, slot)], decode=True)
    finally:
        pool.release(pages, "t")
        slots.release(slot, "t")
    engine.check()


def test_batch_equals_one_by_one(engine):
    together = engine.generate(PROMPTS, max_new_tokens=12)
    alone = [engine.generate([p], max_new_tokens=12)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert_pools_returned(engine)


@pytest.mark.parametrize("chunk", [16, 24, 32])
def test_chunked_prefill_equals_one_shot(model, engine, chunk):
    """Chunk 24 with 16-token pages puts a chunk boundary in the middle of a page."""
    params = SamplingParams(temperature=0, logprobs=5)
    one_shot = engine.generate(PROMPTS, max_new_tokens=8, sampling=params)
    chunked = make(model, max_prefill_tokens=chunk).generate(PROMPTS, 8, sampling=params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in one_shot]
    # Splitting the GDN scan reorders fp32 sums: a few ulps, never a different token.
    for a, b in zip(chunked, one_shot, strict=True):
        np.testing.assert_allclose(
            [lp for _, lp in a.logprobs[0].top], [lp for _, lp in b.logprobs[0].top], atol=5e-5
        )


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    hot = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=16)
    alone = engine.generate([PROMPTS[4]], sampling=hot)[0].token_ids
    again = engine.generate([PROMPTS[4]], sampling=hot)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=9) for s in range(5)]
    mixed = engine.generate(PROMPTS[:5] + [PROMPTS[4]], sampling=others + [hot])[-1].token_ids
    assert alone == again == mixed
    other_seed = engine.generate([PROMPTS[4]], sampling=hot.replace(seed=99))[0].token_ids
    assert other_seed != alone


def test_retraction_loses_no_output(model, engine):
    """A pool too small for the batch forces retractions; outputs equal the roomy run."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=40)
    sampling = [greedy, seeded] * 4
    roomy = engine.generate(PROMPTS, sampling=sampling)
    tight = make(model, num_pages=12, page_size=16)
    squeezed = tight.generate(PROMPTS, sampling=sampling)
    assert tight.stats().scheduling.get("retracted", 0) > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    assert_pools_returned(tight)


def test_stop_conditions(engine):
    base = engine.generate([PROMPTS[3]], max_new_tokens=20)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop_tok = base.token_ids[5]
    out = engine.generate(
        [PROMPTS[3]],
        sampling=SamplingParams(temperature=0, stop_token_ids=[stop_tok], max_tokens=20),
    )[0]
    assert (
        out.finish_reason == "stop"
        and out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    )
    # a stop string spanning two tokens cuts the text before it
    text = ByteTokenizer().decode(base.token_ids)
    needle = text[6:8]
    if len(needle) == 2 and needle in text:
        out = engine.generate(
            [PROMPTS[3]], sampling=SamplingParams(temperature=0, stop=[needle], max_tokens=20)
        )[0]
        assert out.finish_reason == "stop" and out.text == text[: text.index(needle)]
    eos = engine.info.tokenizer.eos_token_id
    ignored = engine.generate(
        [PROMPTS[3]],
        sampling=SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=[], max_tokens=3),
    )[0]
    assert len(ignored.token_ids) == 3 and ignored.finish_reason == "length"
    assert eos is not None


def test_stop_string_across_tokens_with_byte_text(engine):
    """Bytes 'a','b' as two tokens form the stop string 'ab' only together."""
    out = engine.generate([PROMPTS[2]], max_new_tokens=30)[0]
    text = out.text
    pairs = [text[i : i + 2] for i in range(len(text) - 1) if text[i : i + 2].isascii()]
    assert pairs, "the tiny model produced no ASCII pair to stop on"
    needle = pairs[0]
    stopped = engine.generate(
        [PROMPTS[2]], sampling=SamplingParams(temperature=0, stop=[needle], max_tokens=30)
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(needle)]


def test_abort_frees_at_once(engine):
    rid = engine.add_request(PROMPTS[7], max_new_tokens=50)
    engine.step()
    engine.step()
    pools = engine.stats().pools
    assert pools["pages_free"] < pools["pages_total"]
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and not engine.has_unfinished()
    assert_pools_returned(engine)
    with pytest.raises(KeyError, match="not in flight"):
        engine.abort(rid)


def test_refusals_queue_nothing(engine):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([PROMPTS[0], [999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="sampling"):
        engine.generate(PROMPTS[:2], sampling=[SamplingParams()])
    assert not engine.has_unfinished()
    engine.check()


def test_request_larger_than_the_pool_is_refused(model):
    small = make(model, num_pages=2, page_size=16)
    with pytest.raises(ValueError, match="max_tokens: prompt plus max_tokens needs 3 pages"):
        small.generate([PROMPTS[5]], max_new_tokens=8)
    assert not small.has_unfinished()


def test_two_hundred_mixed_requests_leave_pools_free(model):
    rng = random.Random(0)
    eng = make(
        model,
        num_pages=48,
        max_running_requests=8,
        max_prefill_tokens=64,
        gdn_checkpoint_interval=32,
    )
    shared = [[rng.randrange(256) for _ in range(48)] for _ in range(3)]  # for prefix hits
    live: list[str] = []
    finished = 0
    for i in range(200):
        head = rng.choice(shared)[: rng.randint(0, 48)]
        prompt = head + [rng.randrange(256) for _ in range(rng.randint(1, 70 - len(head)))]
        params = rng.choice(
            [
                SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)),
                SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=rng.randint(1, 12)),
                SamplingParams(temperature=0.7, stop=["e"], max_tokens=10, repetition_penalty=1.2),
            ]
        )
        live.append(eng.add_request(prompt, params))
        if i % 3 == 0:
            finished += len(eng.step())
        if i % 17 == 0 and live:
            victim = live.pop(rng.randrange(len(live)))
            try:
                eng.abort(victim)
            except KeyError:
                pass  # it had already finished
    while eng.has_unfinished():
        eng.step()
    stats = eng.stats()
    assert stats.prefix.get("hits_device", 0) > 0 and stats.scheduling.get("evicted", 0) > 0
    assert_pools_returned(eng)
    assert parts(eng).allocator.pages.counters["checked"] == 2


def test_no_recompilation_after_warmup(model):
    eng = make(model, max_prefill_tokens=64, max_running_requests=8)
    eng.warmup()
    warm = eng.stats().compiles
    workload = PROMPTS + [PROMPTS[7] * 2]
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=6)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    eng.generate(workload, sampling=[(greedy, hot)[i % 2] for i in range(len(workload))])
    eng.generate(workload[::-1], sampling=greedy)
    eng.generate(workload[2:5], sampling=hot)
    assert eng.stats().compiles == warm


def test_step_updates_pools_in_place(engine):
    """No step program copies a whole KV or GDN pool (a copy costs the pool's size per token)."""
    r = parts(engine).runner
    pool_shapes = {
        f"f32[{','.join(map(str, a.shape))}]" for a in jax.tree_util.tree_leaves(r.state)
    }
    for t in (1, 16):
        step, write = r.binding.programs(0, (1, t))
        text = step.as_text() + write.as_text()
        copies = [
            line
            for line in text.splitlines()
            if " copy(" in line and any(s in line.split("=")[1] for s in pool_shapes)
        ]
        assert not copies, copies[:3]
