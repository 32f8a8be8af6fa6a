"""One Qwen3-Next decoder layer: a mixer (gated full attention or Gated DeltaNet) and an MLP
(dense or mixture of experts), each behind a zero-centred RMSNorm and a residual."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.attention import Qwen3NextAttention
from flipjax.model.config import FULL_ATTENTION, ModelConfig
from flipjax.model.gated_deltanet import Qwen3NextGatedDeltaNet
from flipjax.model.layers import RMSNorm
from flipjax.model.mlp import Qwen3NextMLP, Qwen3NextSparseMoeBlock


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        layer_type: str | None = None,
    ):
        """`layer_type` overrides `cfg.layer_types[layer_idx]` (the MTP head's layer is full
        attention whatever the model's layer of that index is)."""
        layer_type = cfg.layer_types[layer_idx] if layer_type is None else layer_type
        self.is_full_attention = layer_type == FULL_ATTENTION
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
