"""The sampler against HF's logits processors, and its seeding contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flipjax.runtime.sampler import (
    SamplerRow,
    _apply_filters,
    _apply_penalties,
    build_inputs,
    first_max,
    sample,
)
from flipjax.runtime.sampling import SamplingParams

VOCAB = 64


def _hf_filter(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    scores = torch.tensor(logits[None])
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores[0].numpy()


PARAMS = [
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.3),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=20, top_p=0.8),
    SamplingParams(top_k=30, top_p=0.9, min_p=0.05),
    SamplingParams(top_p=0.95, min_p=0.3),
    # on a flat row, top-p must measure mass within what top-k kept (renormalised)
    SamplingParams(top_k=4, top_p=0.6),
]


def test_filters_keep_what_hf_warpers_keep():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(PARAMS), VOCAB)).astype(np.float32) * 3
    logits[-1] *= 0.1
    rows = [SamplerRow(p, seed=0) for p in PARAMS]
    inputs, _ = build_inputs(rows, len(rows), VOCAB)
    ours = np.asarray(_apply_filters(logits, inputs))
    for i, p in enumerate(PARAMS):
        want = np.isfinite(_hf_filter(logits[i], p))
        assert (np.isfinite(ours[i]) == want).all(), p


def test_penalties_match_hf_and_openai_formula():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 7, 9]
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    inputs, _ = build_inputs([SamplerRow(p, 0, prompt, output), None], 2, VOCAB)
    ours = np.asarray(_apply_penalties(logits, inputs))[0]
    want = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([prompt + output]), torch.tensor(logits[:1])
    )[0].numpy()
    counts = np.bincount(output, minlength=VOCAB)
    want = want - 0.25 * counts - 0.5 * (counts > 0)
    np.testing.assert_allclose(ours, want, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(_apply_penalties(logits, inputs))[1], logits[1])


def test_draws_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125] + [1e-9] * 4, np.float32))
    n = 4000
    rows = [SamplerRow(SamplingParams(temperature=1.0), seed=s) for s in range(n)]
    inputs, flags = build_inputs(rows, n, len(logits))
    out = sample(np.tile(logits, (n, 1)), inputs, **flags)
    freq = np.bincount(np.asarray(out.tokens), minlength=8) / n
    np.testing.assert_allclose(freq[:4], [0.5, 0.25, 0.125, 0.125], atol=0.03)
    assert freq[4:].sum() == 0


def test_first_max_is_jax_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 3, size=(9, 4000)).astype(np.float32)  # many ties
    x[1, 17] = x[1, 900] = np.nan
    x[2] = -np.inf
    x[3, :10] = np.inf
    x[4, 3999] = 99.0
    x[5] = rng.normal(size=4000)
    np.testing.assert_array_equal(first_max(jnp.asarray(x)), jnp.argmax(x, axis=-1))


def test_a_draw_is_jax_categorical_for_the_same_key():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(6, VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    inputs, flags = build_inputs([SamplerRow(params, s) for s in range(6)], 6, VOCAB)
    out = sample(logits, inputs, **flags)
    keys = [jax.random.fold_in(jax.random.key(s), 0) for s in range(6)]
    expected = [int(jax.random.categorical(k, row)) for k, row in zip(keys, logits, strict=True)]
    assert np.asarray(out.tokens).tolist() == expected


def test_temperature_zero_is_argmax_and_seed_is_per_row():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    hot = SamplingParams(temperature=1.5)
    rows = [SamplerRow(SamplingParams.greedy(), 0), SamplerRow(hot, 7), SamplerRow(hot, 7), None]
    inputs, flags = build_inputs(rows, 4, VOCAB)
    out = sample(logits, inputs, **flags)
    assert out.tokens[0] == np.argmax(logits[0])
    # row 2 alone, at a different batch index and size, draws the same as row 1 with its seed
    alone, flags1 = build_inputs([SamplerRow(hot, 7)], 1, VOCAB)
    assert sample(logits[1:2], alone, **flags1).tokens[0] == out.tokens[1]


def test_logprobs_are_the_model_distribution():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(1, VOCAB)).astype(np.float32)
    rows = [SamplerRow(SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), 0)]
    inputs, flags = build_inputs(rows, 1, VOCAB)
    out = sample(logits, inputs, **flags)
    lsm = logits[0] - np.log(np.exp(logits[0]).sum())
    order = np.argsort(-lsm)[:3]
    np.testing.assert_array_equal(np.asarray(out.top_ids)[0, :3], order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0, :3], lsm[order], atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(stop=["ok", ""]), "stop"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
