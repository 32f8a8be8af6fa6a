"""The chunkwise GDN form must equal the token-by-token recurrence, state included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flipjax.model.gated_deltanet import causal_conv
from kernels_pallas.gdn import reference as gdn


def _inputs(seed: int, b: int, t: int, hk: int, hv: int, dk: int, dv: int):
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(keys[0], (b, t, hk, dk))
    k = jax.random.normal(keys[1], (b, t, hk, dk))
    v = jax.random.normal(keys[2], (b, t, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, hv)))
    state = jax.random.normal(keys[5], (b, hv, dk, dv)) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize(
    "b,t,hk,hv,dk,dv,chunk",
    [
        (1, 1, 2, 2, 8, 8, 64),
        (2, 63, 2, 4, 16, 8, 64),
        (2, 64, 1, 3, 8, 16, 64),
        (1, 130, 2, 2, 16, 16, 64),
        (3, 37, 2, 4, 8, 8, 16),
    ],
)
def test_chunked_equals_recurrent(b, t, hk, hv, dk, dv, chunk):
    q, k, v, g, beta, state = _inputs(t, b, t, hk, hv, dk, dv)
    valid = jnp.ones((b, t), bool)
    o_r, s_r = gdn.delta_rule_recurrent(q, k, v, g, beta, state, valid)
    o_c, s_c = gdn.delta_rule_chunked(q, k, v, g, beta, state, valid, chunk_size=chunk)
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=1e-5, rtol=1e-5)


def test_split_sequence_continues_exactly():
    """Running [0:a] then [a:T] from the returned state equals running [0:T] at once."""
    q, k, v, g, beta, state = _inputs(7, 2, 100, 2, 4, 8, 8)
    valid = jnp.ones((2, 100), bool)
    o_all, s_all = gdn.delta_rule_chunked(q, k, v, g, beta, state, valid)
    a = 41
    o1, s1 = gdn.delta_rule_chunked(
        q[:, :a], k[:, :a], v[:, :a], g[:, :a], beta[:, :a], state, valid[:, :a]
    )
    o2, s2 = gdn.delta_rule_recurrent(
        q[:, a:], k[:, a:], v[:, a:], g[:, a:], beta[:, a:], s1, valid[:, a:]
    )
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_all, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s2, s_all, atol=1e-5, rtol=1e-5)


def test_padding_leaves_state_untouched():
    q, k, v, g, beta, state = _inputs(3, 2, 20, 2, 2, 8, 8)
    valid = jnp.arange(20)[None, :] < jnp.array([[12], [20]])
    _, s_pad = gdn.delta_rule_chunked(q, k, v, g, beta, state, valid)
    _, s_short = gdn.delta_rule_recurrent(
        q[:1, :12], k[:1, :12], v[:1, :12], g[:1, :12], beta[:1, :12], state[:1], valid[:1, :12]
    )
    np.testing.assert_allclose(s_pad[:1], s_short, atol=1e-5, rtol=1e-5)


def test_causal_conv_state_continues():
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (2, 10, 6))
    w = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
    state0 = jnp.zeros((2, 3, 6))
    ones = jnp.ones((2, 10), bool)
    y_all, s_all = causal_conv(x, w, state0, ones)
    y1, s1 = causal_conv(x[:, :7], w, state0, ones[:, :7])
    y2, s2 = causal_conv(x[:, 7:], w, s1, ones[:, 7:])
    np.testing.assert_allclose(np.concatenate([y1, y2], 1), y_all, atol=1e-6)
    np.testing.assert_allclose(s2, s_all)
    np.testing.assert_allclose(s_all, x[:, -3:])


def _chunked_loss(q, k, v, g, beta, state, valid):
    o, s = gdn.delta_rule_chunked(q, k, v, g, beta, state, valid, chunk_size=16)
    return jnp.sum(o * o) + jnp.sum(s * s)


def test_chunked_form_and_its_gradient_call_no_lapack_solve():
    """The chunked form is what training differentiates on the CPU. XLA:CPU's batched LAPACK
    triangular solve waits on the intra-op pool from inside it, and two at once deadlock a
    two-thread pool; neither the forward nor the backward program may contain one."""
    args = _inputs(1, 2, 40, 2, 2, 8, 8)
    valid = jnp.ones((2, 40), bool)
    grad = jax.jit(jax.grad(_chunked_loss, argnums=(0, 1, 2, 3, 4, 5)))
    for program in (jax.jit(_chunked_loss), grad):
        lowered = program.lower(*args, valid)
        assert "stablehlo.triangular_solve" not in lowered.as_text()
        compiled = lowered.compile().as_text()
        assert "triangular-solve(" not in compiled and 'custom_call_target="lapack' not in compiled


def test_chunked_gradient_equals_the_recurrent_gradient():
    args = _inputs(2, 2, 40, 2, 4, 8, 8)
    valid = jnp.arange(40)[None, :] < jnp.array([[40], [29]])

    def recurrent_loss(q, k, v, g, beta, state, valid):
        o, s = gdn.delta_rule_recurrent(q, k, v, g, beta, state, valid)
        return jnp.sum(o * o) + jnp.sum(s * s)

    argnums = (0, 1, 2, 3, 4, 5)
    chunked = jax.grad(_chunked_loss, argnums=argnums)(*args, valid)
    recurrent = jax.grad(recurrent_loss, argnums=argnums)(*args, valid)
    for got, want in zip(chunked, recurrent, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("c", [1, 2, 16, 64])
def test_the_chunk_block_inverse_equals_numpy_s_without_decay(c):
    """No decay and beta = 1: the block's powers do not shrink (a power series of it loses
    precision, a truncated one is wrong); normalised keys keep the inverse's entries moderate."""
    k = np.asarray(gdn.l2norm(jax.random.normal(jax.random.PRNGKey(c), (3, c, 8))))
    strict = np.tril(k @ np.swapaxes(k, -1, -2), -1)
    want = np.linalg.inv(np.eye(c) + strict.astype(np.float64))
    got = np.asarray(gdn.unit_lower_inverse(jnp.asarray(strict, jnp.float32)))
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=1e-5)
