"""The engine's pooled state on the device: KV pages and GDN state slots.

`CacheState` is one plain pytree: per full-attention layer a `KVPages`, per GDN layer a
`GDNSlots`. Page and slot ids are logical indices into the leading axis; nothing outside the
pool may depend on where a page physically sits, which is what lets a layout move the arrays.
The ledgers that own the ids are `flipjax.runtime.pools`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flipjax.model.config import ModelConfig
from flipjax.model.state_shapes import RECURRENT_DTYPE, state_shapes


class KVPages(NamedTuple):
    """k, v: [pages, page_size, kv_heads, head_dim] for one full-attention layer."""

    k: jax.Array
    v: jax.Array


class GDNSlots(NamedTuple):
    """recurrent: [slots, Hv, dk, dv] fp32; conv: [slots, K-1, conv_dim] for one GDN layer."""

    recurrent: jax.Array
    conv: jax.Array


class CacheState(NamedTuple):
    kv: tuple[KVPages, ...]
    gdn: tuple[GDNSlots, ...]


def init_cache_state(
    cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype: jnp.dtype
) -> CacheState:
    shapes = state_shapes(cfg)
    kv_shape = (num_pages, page_size, *shapes.kv_token)
    rec_shape = (num_slots, *shapes.recurrent)
    conv_shape = (num_slots, *shapes.conv)
    return CacheState(
        kv=tuple(
            KVPages(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype))
            for _ in cfg.full_attention_layers
        ),
        gdn=tuple(
            GDNSlots(jnp.zeros(rec_shape, RECURRENT_DTYPE), jnp.zeros(conv_shape, dtype))
            for _ in cfg.linear_attention_layers
        ),
    )


def resized(state: CacheState, num_pages: int) -> CacheState | None:
    """`state`'s shapes (abstract) with `num_pages` KV pages, a layout's pool of another size;
    None when its pools already have that many (or it has no KV pools)."""
    if not state.kv or num_pages == state.kv[0].k.shape[0]:
        return None
    return CacheState(
        kv=tuple(
            KVPages(*(jax.ShapeDtypeStruct((num_pages, *x.shape[1:]), x.dtype) for x in kv))
            for kv in state.kv
        ),
        gdn=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.gdn),
    )
