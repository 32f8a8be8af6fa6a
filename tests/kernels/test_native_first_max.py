"""The native first maximum (`kernels_pallas/sampling/first_max.cc`), the sampler's greedy token,
against `jnp.argmax` index for index, for every instruction set this CPU runs: ties, NaNs,
infinities and signed zeros, in the vector part of a row and in its tail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax.runtime.sampler import SamplerRow, build_inputs, sample
from flipjax.runtime.sampling import SamplingParams
from kernels_pallas import dispatch, native
from kernels_pallas.sampling import native_binding, reference


def rows(v: int) -> np.ndarray:
    """Rows of width v that each test one rule of `jnp.argmax`."""
    rng = np.random.default_rng(v)
    x = rng.integers(-3, 3, size=(14, v)).astype(np.float32)  # ties everywhere
    x[1] = rng.normal(size=v)
    x[2] = -np.inf  # nothing above -inf: the first index
    x[3, v // 3 :] = np.inf
    x[4, v - 1] = 99.0  # the maximum last, in the tail when v is not a multiple of 16
    x[5, [v - 1, v // 2]] = np.nan  # the first NaN wins over a later one and any maximum
    x[6, v - 1] = np.nan
    x[7] = 0.0
    x[7, : v // 2] = -0.0  # -0.0 == 0.0: the first of either
    x[8] = np.nan
    x[9, 0] = 7.0
    x[10, v // 2] = 7.0
    x[11, v // 2 :] = 5.0  # a run of ties from the middle
    x[12] = np.float32(3.4e38)
    x[12, v - 1] = np.inf
    x[13] = -np.inf
    x[13, v - 1] = -3.4e38
    return x


@pytest.mark.parametrize("isa", sorted(native.ISAS))
@pytest.mark.parametrize("v", [1, 15, 16, 17, 31, 32, 33, 48, 65, 4001])
def test_the_kernel_is_jax_argmax(isa, v):
    if not native.runs_here(isa):
        pytest.skip(f"this CPU lacks the features of {isa}: {native.ISA_NEEDS[isa]}")
    x = rows(v)
    want = np.asarray(jnp.argmax(x, axis=-1))
    got = jax.jit(lambda a: native_binding.first_max(a, isa))(x)
    assert got.dtype == jnp.int32 and got.shape == (len(x),)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(reference.first_max(jnp.asarray(x)), want)


def test_leading_dimensions_are_rows():
    x = rows(33).reshape(2, 7, 33)
    got = jax.jit(native_binding.first_max)(x)
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


def test_rows_shared_among_threads_each_get_their_own_index():
    # 48 rows of a 32k vocabulary: enough logits for every thread of the pool.
    x = np.tile(rows(32000), (4, 1))[:48]
    x[-1, 31999] = np.inf  # the last row's maximum in its last element
    got = jax.jit(native_binding.first_max)(x)
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


def test_the_kernel_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="0 < V"):
        native_binding.first_max(jnp.zeros((3, 0), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        native_binding.first_max(jnp.zeros((3, 8), jnp.bfloat16))


def test_the_sampler_takes_greedy_and_drawn_tokens_by_the_kernel_in_native_mode():
    logits = jnp.asarray(rows(64))
    for params in (SamplingParams.greedy(), SamplingParams(temperature=0.7)):
        inputs, flags = build_inputs([SamplerRow(params, 3)] * len(logits), *logits.shape)
        with dispatch.kernels("native"):
            text = sample.lower(logits, inputs, **flags).as_text()
        assert native.target("first_max") in text, params
    with dispatch.kernels("native"):
        greedy = sample.__wrapped__(logits, None, **build_inputs([None], 1, 64)[1]).tokens
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, axis=-1))
