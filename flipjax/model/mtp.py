"""Qwen3-Next's multi-token-prediction head (`mtp.*` in a checkpoint).

From the model's final hidden state at position t and the embedding of token t+1, it makes the
hidden state that predicts token t+2 through the model's own lm head. The wiring is the one
reference serving code runs: `fc` over `[pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h)]`
(in that order), a full-attention decoder layer at position t, then `norm`. It shares the
model's embedding and lm head, so it holds neither.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.model.config import FULL_ATTENTION, ModelConfig
from flipjax.model.decoder_layer import Qwen3NextDecoderLayer
from flipjax.model.layers import Linear, RMSNorm


class Qwen3NextMTP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        if cfg.mtp_num_hidden_layers < 1:
            raise ValueError("mtp_num_hidden_layers: the config gives the model no MTP layers")
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, dtype=dtype, rngs=rngs)
        # The MLP of layer i is the kind the model's layer i has (dense or experts).
        self.layers = nnx.List(
            [
                Qwen3NextDecoderLayer(cfg, i, dtype=dtype, rngs=rngs, layer_type=FULL_ATTENTION)
                for i in range(cfg.mtp_num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(hidden, eps, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        next_embeds: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        cache: Any,
        step: int = 0,
    ) -> tuple[jax.Array, Any]:
        """next_embeds: the embeddings of tokens t+1, hidden: the model's final-normed hidden
        states at t, both [B, T, H]; positions: t, [B, T] (-1: padding); cache: the attention
        cache of layer `step % layers`. Returns the normed hidden states for t+2 and the cache."""
        x = jnp.concatenate(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        layer = self.layers[step % len(self.layers)]
        x, cache = layer(self.fc(x), positions, cache)
        return self.norm(x), cache
