"""The Gated DeltaNet mixer layer (Qwen3-Next `linear_attn`): projections, conv, delta rule.

The math lives in `kernels_pallas.gdn_reference`; this module only shapes checkpoint tensors
into its inputs. `gdn.prefill_rule` picks the delta-rule form for the call's length and backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.layers import Linear, RMSNormGated
from kernels_pallas import gdn_reference as gdn


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
        self, x: jax.Array, positions: jax.Array, state: gdn.GDNState
    ) -> tuple[jax.Array, gdn.GDNState]:
        cfg = self.cfg
        b, t, _ = x.shape
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
        valid = positions >= 0

        # Projections are grouped per key head: q (dk), k (dk), v (r*dv), z (r*dv); b (r), a (r).
        qkvz = self.in_proj_qkvz(x).reshape(b, t, hk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(b, t, hv, dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(b, t, hv, dv)
        ba = self.in_proj_ba(x).reshape(b, t, hk, 2 * r)
        beta_logit, a = ba[..., :r].reshape(b, t, hv), ba[..., r:].reshape(b, t, hv)

        mixed = jnp.concatenate(
            [q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1
        )
        mixed, conv_state = gdn.causal_conv(
            mixed, self.conv1d.weight[...][:, 0, :], state.conv, valid
        )
        kd = cfg.key_dim
        q = mixed[..., :kd].reshape(b, t, hk, dk)
        k = mixed[..., kd : 2 * kd].reshape(b, t, hk, dk)
        v = mixed[..., 2 * kd :].reshape(b, t, hv, dv)

        beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        rule = gdn.prefill_rule(t)
        o, recurrent = rule(q, k, v, g, beta, state.recurrent, valid)

        o = self.norm(o.astype(x.dtype), z)
        out = self.out_proj(o.reshape(b, t, cfg.value_dim))
        return out, gdn.GDNState(recurrent=recurrent, conv=conv_state)

    @staticmethod
    def empty_state(cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> gdn.GDNState:
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return gdn.GDNState(
            recurrent=jnp.zeros((batch, hv, dk, dv), jnp.float32),
            conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
        )
