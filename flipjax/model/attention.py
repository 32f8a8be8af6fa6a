"""Gated full attention (Qwen3-Next) and the contiguous per-request KV cache.

The module computes q/k/v and hands them to its layer cache's `update_and_attend`, so the same
layer runs over a contiguous per-request cache (`ContiguousKV`, the reference) and over paged
KV in the engine (`flipjax.runtime.paged.PagedKV`). Masking is by position: padding has position -1.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import ModelConfig
from flipjax.model.layers import (
    Linear,
    RMSNorm,
    apply_partial_rotary,
    project,
    rotary_cos_sin,
)
from flipjax.model.state_shapes import state_shapes
from kernels_pallas import dispatch
from kernels_pallas.paged_attention.reference import masked_attention


class AttentionCache(Protocol):
    def update_and_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, AttentionCache]: ...


class ContiguousKV(NamedTuple):
    """One request row per batch entry, token t of a row stored at index t.

    k, v: [B, max_len, kv_heads, head_dim].
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> ContiguousKV:
        shape = (batch, max_len, *state_shapes(cfg).kv_token)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def update_and_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, ContiguousKV]:
        b, s = self.k.shape[:2]
        rows = jnp.arange(b)[:, None]
        # Padding (position -1) is sent out of bounds and dropped.
        idx = jnp.where(positions >= 0, positions, s)
        new_k = self.k.at[rows, idx].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[rows, idx].set(v.astype(self.v.dtype), mode="drop")
        # Rows are filled contiguously, so every index <= a query's position is written.
        k_pos = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
        out = masked_attention(q, new_k.astype(q.dtype), new_v.astype(q.dtype), positions, k_pos)
        return out, ContiguousKV(new_k, new_v)


class Qwen3NextAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, h * d * 2, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: AttentionCache
    ) -> tuple[jax.Array, AttentionCache]:
        cfg = self.cfg
        b, t, _ = x.shape
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # Query and gate are interleaved per head: [.., heads, 2 * head_dim].
        qg, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        qg = qg.reshape(b, t, h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, h * d)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(b, t, hkv, d))
        v = v.reshape(b, t, hkv, d)
        cos, sin = rotary_cos_sin(cfg, jnp.maximum(positions, 0))
        q = apply_partial_rotary(q, cos, sin)
        k = apply_partial_rotary(k, cos, sin)
        out, cache = cache.update_and_attend(q, k, v, positions)
        out = out.reshape(b, t, h * d)
        kernel = dispatch.gate("sigmoid", out.dtype) if gate.dtype == out.dtype else None
        out = kernel(gate, out) if kernel else out * jax.nn.sigmoid(gate)
        return self.o_proj(out), cache
