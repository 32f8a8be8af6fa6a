"""The native causal conv over pooled conv windows (`kernels_pallas/gdn/conv_pool.cc`) against
`causal_conv` over rows gathered from the pool, the form the engine ran before it: outputs to
rounding, and each row's new window in the slot it writes, the rest of the pool untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax.model.gated_deltanet import causal_conv
from kernels_pallas import native
from kernels_pallas.gdn import native_binding

SLOTS, WINDOW, CHANNELS = 6, 3, 40


def run(pool, reads, writes, x, weight, valid):
    kernel = jax.jit(native_binding.pooled_conv, static_argnums=0)
    return kernel(native.target("conv_pool"), pool, reads, writes, x, weight, valid)


@pytest.mark.parametrize("lengths", [[1, 1, 1, 0], [5, 3, 1, 0]], ids=["decode", "prefill"])
def test_the_conv_and_the_new_windows_are_causal_conv_over_the_gathered_rows(lengths):
    rng = np.random.default_rng(0)
    tokens = max(lengths)
    pool = jnp.asarray(rng.normal(size=(SLOTS, WINDOW, CHANNELS)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, tokens, CHANNELS)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(CHANNELS, WINDOW + 1)), jnp.float32)
    valid = jnp.arange(tokens)[None, :] < jnp.asarray(lengths)[:, None]
    # Row 0 continues slot 4; row 1 starts fresh (reads no slot) into slot 1; row 2 continues
    # slot 0; row 3 is padding (reads and writes no slot).
    reads = jnp.asarray([4, SLOTS, 0, SLOTS], jnp.int32)
    writes = jnp.asarray([4, 1, 0, SLOTS], jnp.int32)
    gathered = jnp.take(pool, reads, axis=0, mode="fill", fill_value=0)
    want_y, want_windows = causal_conv(x, weight, gathered, valid)
    y, new_pool = run(pool, reads, writes, x, weight, valid)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(y)[real], np.asarray(want_y)[real], rtol=1e-5, atol=1e-6)
    want_pool = np.asarray(pool).copy()
    for row in range(3):
        want_pool[int(writes[row])] = np.asarray(want_windows[row])
    np.testing.assert_allclose(np.asarray(new_pool), want_pool, rtol=1e-6, atol=1e-6)
    untouched = [2, 3, 5]
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])


def test_channels_read_in_place_from_columns_of_a_wider_projection():
    """As the GDN layer calls it: q, k and v are runs of columns of the projection's rows,
    interleaved per key head with z, which the conv does not read."""
    rng = np.random.default_rng(1)
    lengths = [3, 1, 0]
    groups, width = 3, 20  # per key head: q 4, k 4, v 6, z 6 columns
    columns = np.concatenate(
        [
            np.arange(h * width + lo, h * width + hi)
            for lo, hi in ((0, 4), (4, 8), (8, 14))
            for h in range(groups)
        ]
    )
    channels = len(columns)
    x = jnp.asarray(rng.normal(size=(3, 3, groups * width)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(4, WINDOW, channels)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(channels, WINDOW + 1)), jnp.float32)
    valid = jnp.arange(3)[None, :] < jnp.asarray(lengths)[:, None]
    reads = writes = jnp.asarray([2, 0, 4], jnp.int32)
    target = native.target("conv_pool")
    kernel = jax.jit(native_binding.pooled_conv, static_argnums=0, static_argnames="columns")
    y, new_pool = kernel(target, pool, reads, writes, x, weight, valid, columns=tuple(columns))
    want_y, want_pool = kernel(target, pool, reads, writes, x[..., columns], weight, valid)
    real = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(y)[real], np.asarray(want_y)[real])
    np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(want_pool))
    gathered = jnp.take(pool, reads, axis=0, mode="fill", fill_value=0)
    causal_y, _ = causal_conv(x[..., columns], weight, gathered, valid)
    np.testing.assert_allclose(np.asarray(y)[real], np.asarray(causal_y)[real], rtol=1e-5)
    with pytest.raises(ValueError, match="conv pool: need a column of x's 60 for each"):
        native_binding.pooled_conv(target, pool, reads, writes, x, weight, valid, columns + 10)
    ffi = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((3, 3, channels), jnp.float32),) * 2)
    bad = jnp.asarray(columns, jnp.int32).at[5].set(60)
    ids, lens = jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.int32)
    with pytest.raises(Exception, match="conv pool: channel 5 names column 60 of a row of 60"):
        jax.block_until_ready(ffi(pool[:3], ids, ids, x, bad, weight, lens))


def test_mismatched_shapes_are_refused_by_name():
    pool = jnp.zeros((SLOTS, WINDOW, CHANNELS), jnp.float32)
    x = jnp.zeros((2, 1, CHANNELS), jnp.float32)
    ids = jnp.zeros((2,), jnp.int32)
    valid = jnp.ones((2, 1), bool)
    with pytest.raises(Exception, match="conv pool: channel, tap or row counts disagree"):
        jax.block_until_ready(run(pool, ids, ids, x, jnp.zeros((CHANNELS, 3)), valid))
    with pytest.raises(ValueError, match="must be float32"):
        run(pool.astype(jnp.bfloat16), ids, ids, x, jnp.zeros((CHANNELS, 4)), valid)
