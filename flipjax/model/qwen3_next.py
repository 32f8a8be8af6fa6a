"""Qwen3-Next hybrid decoder in Flax NNX, and the functional forward over explicit caches.

Module names mirror the HF checkpoint (`model.layers.3.self_attn.q_proj`), so the loader is a
rename plus two transposes: a `Linear` keeps its `weight` as an [in, out] `kernel`, and the
experts are stacked [E, in, out]. The cache is a tuple with one entry per
layer: an attention cache (anything with `update_and_attend`) for full-attention layers, a
`GDNState` for linear-attention layers. `forward` is pure over (params, cache) so it can be
jitted once and placed under any sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.attention import ContiguousKV, Qwen3NextAttention
from flipjax.model.config import FULL_ATTENTION, ModelConfig
from flipjax.model.gated_deltanet import Qwen3NextGatedDeltaNet
from flipjax.model.layers import Embedding, Linear, RMSNorm
from flipjax.model.mlp import Qwen3NextMLP, Qwen3NextSparseMoeBlock

Cache = tuple[Any, ...]


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.is_full_attention = cfg.layer_types[layer_idx] == FULL_ATTENTION
        if self.is_full_attention:
            self.self_attn = Qwen3NextAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.linear_attn = Qwen3NextGatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = Qwen3NextSparseMoeBlock(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = Qwen3NextMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, rngs=rngs)

    def __call__(self, h: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        mixer = self.self_attn if self.is_full_attention else self.linear_attn
        out, cache = mixer(self.input_layernorm(h), positions, cache)
        h = h + out
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache


class Qwen3NextModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                Qwen3NextDecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)


class Qwen3NextForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Qwen3NextModel(cfg, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache
    ) -> tuple[jax.Array, Cache]:
        """tokens, positions: [B, T] (position -1 = padding). Returns final-normed hidden."""
        h = self.model.embed_tokens(tokens)
        new_cache = []
        for layer, layer_cache in zip(self.model.layers, cache, strict=True):
            h, layer_cache = layer(h, positions, layer_cache)
            new_cache.append(layer_cache)
        return self.model.norm(h), tuple(new_cache)

    def logits(self, h: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return jnp.einsum("...h,vh->...v", h, self.model.embed_tokens.weight[...])
        return self.lm_head(h)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> Cache:
    """A contiguous cache: per full-attention layer [B, max_len] KV, per GDN layer a zero state."""
    return tuple(
        ContiguousKV.empty(cfg, batch, max_len, dtype)
        if t == FULL_ATTENTION
        else Qwen3NextGatedDeltaNet.empty_state(cfg, batch, dtype)
        for t in cfg.layer_types
    )


def forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Cache,
    last_only: bool = False,
) -> tuple[jax.Array, Cache]:
    """Pure forward: logits [B, T, V] (or [B, V] at each row's last real token) and new cache."""
    model = nnx.merge(graphdef, params)
    h, cache = model.hidden_states(tokens, positions, cache)
    if last_only:
        last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    return model.logits(h).astype(jnp.float32), cache
