"""The one rule for the shapes of the model's per-token and per-request state.

A full-attention layer keeps K and V per token as [kv_heads, head_dim]; a GDN layer keeps a
recurrent state [v_heads, k_head_dim, v_head_dim] in float32 (the recurrence is unstable in
lower precision) and a conv state [conv_kernel - 1, conv_dim] in the model dtype. The
contiguous cache, the paged pools and the store's canonical payloads all build on these.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from flipjax.model.config import ModelConfig

RECURRENT_DTYPE = jnp.float32


@dataclass(frozen=True)
class StateShapes:
    kv_layers: int  # full-attention layers
    gdn_layers: int
    kv_token: tuple[int, int]  # [kv_heads, head_dim], for K and for V
    recurrent: tuple[int, int, int]  # [v_heads, k_head_dim, v_head_dim]
    conv: tuple[int, int]  # [conv_kernel - 1, conv_dim]


def state_shapes(cfg: ModelConfig) -> StateShapes:
    return StateShapes(
        kv_layers=len(cfg.full_attention_layers),
        gdn_layers=len(cfg.linear_attention_layers),
        kv_token=(cfg.num_key_value_heads, cfg.head_dim),
        recurrent=(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        conv=(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim),
    )
