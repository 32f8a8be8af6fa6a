"""8-bit KV pages (`--kv-cache-dtype fp8_e4m3 | int8`): the engine stores K and V in 8 bits
with a scale per page and KV head, keeps GDN states in their own dtypes, decodes close to the
float pages' tokens, and its store keeps pages of one KV dtype apart from another's; the same
memory holds about twice bf16's pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.tiny import tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from flipjax.runtime.cache_io import read_pages
from store.open import open_store
from tests.support.internals import parts

PS, GRID = 16, 32
PROMPTS = [[(i * 11 + 5 + j) % 256 for i in range(70)] for j in range(2)]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
OPTIONS = dict(num_pages=64, max_running_requests=2, max_prefill_tokens=32, page_size=PS)


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def make(model, kv: str, bridge=None, layout: str | None = None) -> Engine:
    config = FlipjaxConfig.build(dtype="float32", kv_cache_dtype=kv, layout=layout, **OPTIONS)
    return Engine(model, ByteTokenizer(), config, name="tiny", prefix_store=bridge)


def tokens(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, sampling=GREEDY)]


def logprobs(engine: Engine, sequences: list[list[int]]) -> np.ndarray:
    """Each position's logprob of the token that follows it (teacher forced)."""
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = engine.generate(sequences, sampling=score)
    return np.array([[t.logprob for t in o.prompt_logprobs[1:]] for o in outs])


@pytest.fixture(scope="module")
def float_scores(model) -> tuple[list[list[int]], np.ndarray]:
    """The float pages' own greedy continuations of the prompts, and their logprobs."""
    floats = make(model, "auto")
    sequences = [p + t for p, t in zip(PROMPTS, tokens(floats), strict=True)]
    return sequences, logprobs(floats, sequences)


@pytest.mark.parametrize(
    "kv,dtype,mean_tol", [("fp8_e4m3", jnp.float8_e4m3fn, 0.05), ("int8", jnp.int8, 0.01)]
)
def test_8bit_pages_hold_the_kv_and_score_as_the_float_pages_do(
    model, float_scores, kv, dtype, mean_tol
):
    """Over the float pages' own greedy continuations (teacher forced, so a near tie that
    rounding flips does not end the comparison), every position's logprob stays close; the
    tolerances are about 3x what 3 (fp8) and 7 (int8) bits of mantissa gave when measured
    (mean |diff| 0.017 and 0.0023 nats)."""
    sequences, want = float_scores
    engine = make(model, kv)
    diff = np.abs(logprobs(engine, sequences) - want)
    state = parts(engine).runner.state
    assert state.kv[0].k.dtype == dtype and state.kv[0].k_scale.shape == (64, 2)
    assert state.gdn[0].recurrent.dtype == jnp.float32 and state.gdn[0].conv.dtype == jnp.float32
    assert diff.mean() < mean_tol and diff.max() < 20 * mean_tol, (diff.mean(), diff.max())


def test_a_store_hit_across_layouts_is_byte_identical_in_fp8(model, tmp_path):
    """Pages (values and scales) published by a pipeline seed a tensor-parallel engine with
    the same bytes, and the seeded request gives the straight run's tokens."""
    bridge, _ = open_store(
        model.cfg, "tiny-seed-0", "float32", PS, GRID, 64 << 20, None, 0, page_dtype="float8_e4m3fn"
    )
    bridge.sync_reads = True
    straight = tokens(make(model, "fp8", bridge, "pp:5,3"))
    engine = make(model, "fp8", bridge, "tp:2")
    rid = engine.add_request(PROMPTS[0], GREEDY)
    seq = parts(engine).requests[rid]
    engine.step()
    assert seq.cached_tokens == 64
    held = read_pages(parts(engine).runner.state, seq.pages[:4])
    fetched = bridge.fetch(PROMPTS[0])
    assert held.values.dtype == jnp.float8_e4m3fn and held.scales.shape == (4, 2, 2, 2)
    assert np.all(held.scales > 0)
    np.testing.assert_array_equal(held.values, fetched.kv.values)
    np.testing.assert_array_equal(held.scales, fetched.kv.scales)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == straight[0]
    bridge.store.close()


def test_a_store_of_another_kv_dtype_is_refused_by_name(model):
    bridge, identity = open_store(model.cfg, "tiny-seed-0", "float32", PS, GRID, 1 << 20, None, 0)
    with pytest.raises(ValueError, match="holds float32 KV pages .* are float8_e4m3fn pages"):
        make(model, "fp8", bridge)
    fp8, other = open_store(
        model.cfg, "tiny-seed-0", "float32", PS, GRID, 1 << 20, None, 0, page_dtype="int8"
    )
    assert other.digest() != identity.digest()  # the KV dtype is part of every key
    with pytest.raises(ValueError, match="holds int8 KV pages"):
        make(model, "auto", fp8)


def test_fp8_pages_fit_about_twice_bf16s_in_the_same_budget():
    options = dict(
        dtype="bfloat16", device_memory="40MiB", max_running_requests=2, max_prefill_tokens=16
    )
    pages = {}
    for kv in ("auto", "fp8"):
        engine = Engine.from_pretrained("tiny", kv_cache_dtype=kv, **options)
        pages[kv] = engine.info.config.engine.num_pages
    assert pages["fp8"] >= 1.9 * pages["auto"], pages
