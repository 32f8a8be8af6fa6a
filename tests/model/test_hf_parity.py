"""Parity with transformers' Qwen3NextForCausalLM on random weights: logits and greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

from flipjax import Engine
from flipjax.model.qwen3_next import forward, init_cache
from kernels_pallas import dispatch, head_parallel
from tests.support.hf_oracle import CONFIGS, make_checkpoint
from tests.support.internals import params, parts, prompt_logits

PROMPT = [5, 17, 99, 3, 42, 7, 64, 1, 88, 23, 11, 120, 9, 33, 71, 2, 45, 60, 12, 101]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = make_checkpoint(folder, seed=len(request.param), **CONFIGS[request.param])
    return hf, Engine.from_pretrained(folder, dtype="float32"), folder


def test_prompt_logits_match(pair):
    hf, engine, _ = pair
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    got = prompt_logits(engine, PROMPT)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_generation_matches(pair):
    hf, engine, _ = pair
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
    want = out[0, len(PROMPT) :].tolist()
    got = engine.generate([PROMPT], max_new_tokens=16)[0].token_ids
    assert got == want


def test_prefill_in_two_chunks_continues_exactly(pair):
    """Prefill [0:7] then [7:20] over the cache gives the one-shot (HF) logits."""
    hf, engine, _ = pair
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    cache = init_cache(engine.info.model, 1, 32, jnp.float32)
    split = 7
    pieces = []
    for lo, hi in ((0, split), (split, len(PROMPT))):
        tokens = jnp.asarray([PROMPT[lo:hi]], jnp.int32)
        positions = jnp.arange(lo, hi, dtype=jnp.int32)[None]
        step = jax.jit(forward, static_argnums=0)  # one program, not one per operation
        logits, cache = step(parts(engine).graphdef, params(engine), tokens, positions, cache)
        pieces.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(pieces), want, atol=1e-4, rtol=0)


def test_prompt_logits_match_with_the_native_kernels_on_one_device(pair):
    """As a one-device stage runs the model: the native kernels where they apply (the
    experts' grouped matmul at every size, the matmul at decode's row counts)."""
    hf, engine, _ = pair
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    cache = init_cache(engine.info.model, 1, 32, jnp.float32)
    tokens = jnp.asarray([PROMPT], jnp.int32)
    positions = jnp.arange(len(PROMPT), dtype=jnp.int32)[None]
    one = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with dispatch.kernels("native"), head_parallel.across(one):
        step = jax.jit(forward, static_argnums=0)  # traced here, under the kernels
        logits, _ = step(parts(engine).graphdef, params(engine), tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(logits[0]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_both_prefill_forms_match(pair, monkeypatch, form):
    hf, _, folder = pair
    monkeypatch.setenv(dispatch.PREFILL_FORM_ENV, form)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT * 4])).logits[0].numpy()  # 80 tokens: two chunks
    got = prompt_logits(Engine.from_pretrained(folder), PROMPT * 4)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
