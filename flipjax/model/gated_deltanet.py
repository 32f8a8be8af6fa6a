"""The Gated DeltaNet mixer layer (Qwen3-Next `linear_attn`): projections, conv, delta rule.

The layer owns its per-request state (`GDNState`) and the causal conv that feeds the delta
rule; the delta rule itself is picked by `kernels_pallas.dispatch.delta_rule` for the call's
length and backend (the Pallas kernels, or the pure-JAX references beside them). State goes in
and comes out explicitly, so prefill, chunked prefill and decode continue one another exactly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.layers import Linear, RMSNormGated, project
from flipjax.model.state_shapes import RECURRENT_DTYPE, state_shapes
from kernels_pallas import dispatch


class GDNState(NamedTuple):
    """Per-request GDN layer state.

    recurrent: [B, Hv, dk, dv] float32, the delta-rule memory S.
    conv: [B, K-1, conv_dim], the last K-1 conv inputs (time-major).
    """

    recurrent: jax.Array
    conv: jax.Array

    def advance(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """The delta rule over the call's tokens from this state: (o, the new recurrent state).

        A pooled cache (the engine's step) has the same method and reads its rows itself."""
        rule = dispatch.delta_rule(q.shape[1])
        return rule(q, k, v, g, beta, self.recurrent, valid)

    def convolve(
        self, x: jax.Array, weight: jax.Array, valid: jax.Array, source: Columns | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """The causal conv over the call's inputs from this state: (y, the new conv state).

        `source` gives the same inputs as columns of the layer's projection, for a kernel that
        reads them there (XLA then drops the copies that made x). A cache that keeps other conv
        states (a speculative step's, one per position) has the same method."""
        return causal_conv(x, weight, self.conv, valid)


class Columns(NamedTuple):
    """A conv's inputs as columns of a wider array: channel i of a token is `array[..., at[i]]`."""

    array: jax.Array
    at: tuple[int, ...]


@functools.cache
def conv_columns(cfg: ModelConfig) -> tuple[int, ...]:
    """Where the conv's channels (q, then k, then v, each over the key heads) lie in a row of
    the qkvz projection, grouped per key head as q (dk), k (dk), v (r*dv), z (r*dv)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rdv = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    group = 2 * dk + 2 * rdv
    parts = ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + rdv))
    return tuple(h * group + c for lo, hi in parts for h in range(hk) for c in range(lo, hi))


def causal_conv(
    x: jax.Array, weight: jax.Array, conv_state: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d then SiLU.

    x: [B, T, C]; weight: [C, K]; conv_state: [B, K-1, C]; valid: [B, T] bool.
    Returns y: [B, T, C] and the new conv state (the last K-1 valid inputs).
    """
    kernel = weight.shape[-1]
    t = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(x.dtype)
    y = sum(xx[:, j : j + t, :] * w[:, j] for j in range(kernel))
    lengths = jnp.sum(valid.astype(jnp.int32), axis=1)
    idx = lengths[:, None] + jnp.arange(kernel - 1)[None, :]
    new_state = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
    return jax.nn.silu(y), new_state.astype(conv_state.dtype)


class Conv1d(nnx.Module):
    """Depthwise conv weight kept in the checkpoint's shape: [conv_dim, 1, kernel]."""

    def __init__(self, channels: int, kernel: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        std = kernel**-0.5
        w = jax.random.normal(rngs.params(), (channels, 1, kernel), jnp.float32) * std
        self.weight = nnx.Param(w.astype(dtype))


class Qwen3NextGatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        hv = cfg.linear_num_value_heads
        self.in_proj_qkvz = Linear(
            cfg.hidden_size, 2 * cfg.key_dim + 2 * cfg.value_dim, dtype=dtype, rngs=rngs
        )
        self.in_proj_ba = Linear(cfg.hidden_size, 2 * hv, dtype=dtype, rngs=rngs)
        self.conv1d = Conv1d(cfg.conv_dim, cfg.linear_conv_kernel_dim, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(dtype))
        self.norm = RMSNormGated(
            cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype=dtype, rngs=rngs
        )
        self.out_proj = Linear(cfg.value_dim, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, state: GDNState
    ) -> tuple[jax.Array, GDNState]:
        cfg = self.cfg
        b, t, _ = x.shape
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
        valid = positions >= 0

        # Projections are grouped per key head: q (dk), k (dk), v (r*dv), z (r*dv); b (r), a (r).
        projected, ba = project(x, self.in_proj_qkvz, self.in_proj_ba)
        qkvz = projected.reshape(b, t, hk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(b, t, hv, dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(b, t, hv, dv)
        ba = ba.reshape(b, t, hk, 2 * r)
        beta_logit, a = ba[..., :r].reshape(b, t, hv), ba[..., r:].reshape(b, t, hv)

        mixed = jnp.concatenate(
            [q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1
        )
        source = Columns(projected, conv_columns(cfg))
        mixed, conv_state = state.convolve(mixed, self.conv1d.weight[...][:, 0, :], valid, source)
        kd = cfg.key_dim
        q = mixed[..., :kd].reshape(b, t, hk, dk)
        k = mixed[..., kd : 2 * kd].reshape(b, t, hk, dk)
        v = mixed[..., 2 * kd :].reshape(b, t, hv, dv)

        beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        o, recurrent = state.advance(q, k, v, g, beta, valid)

        o = self.norm(o.astype(x.dtype), z)
        out = self.out_proj(o.reshape(b, t, cfg.value_dim))
        return out, GDNState(recurrent=recurrent, conv=conv_state)

    @staticmethod
    def empty_state(cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> GDNState:
        shapes = state_shapes(cfg)
        return GDNState(
            recurrent=jnp.zeros((batch, *shapes.recurrent), RECURRENT_DTYPE),
            conv=jnp.zeros((batch, *shapes.conv), dtype),
        )
