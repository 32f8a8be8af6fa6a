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

from flipjax.model.attention import ContiguousKV
from flipjax.model.config import FULL_ATTENTION, ModelConfig
from flipjax.model.decoder_layer import Qwen3NextDecoderLayer
from flipjax.model.gated_deltanet import Qwen3NextGatedDeltaNet
from flipjax.model.layers import Embedding, Linear, RMSNorm
from flipjax.model.mtp import Qwen3NextMTP

Cache = tuple[Any, ...]


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
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, mtp: bool = False):
        """`mtp`: with the multi-token-prediction head (`self.mtp`), which the config must
        give layers; without it, a checkpoint's `mtp.*` tensors are not loaded."""
        self.cfg = cfg
        self.model = Qwen3NextModel(cfg, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        if mtp:
            self.mtp = Qwen3NextMTP(cfg, dtype=dtype, rngs=rngs)

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

    def mtp_hidden_states(
        self, next_tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: Any
    ) -> tuple[jax.Array, Any]:
        """The MTP head's normed hidden states for tokens t+2 (`logits` of them predict it),
        from `next_tokens` (t+1) and `hidden` (this model's `hidden_states` at t)."""
        embeds = self.model.embed_tokens(next_tokens)
        return self.mtp(embeds, hidden, positions, cache)

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
