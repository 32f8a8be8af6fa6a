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

from flipjax.model.config import KV_CACHE_DTYPES, ModelConfig
from flipjax.model.state_shapes import RECURRENT_DTYPE, state_shapes
from kernels_pallas.paged_attention.pages import SCALED_PAGE_DTYPES


def kv_page_dtype(name: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The KV pages' dtype for a `--kv-cache-dtype` name: 'auto' is the model's."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {list(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_CACHE_DTYPES[name] or model_dtype)


class KVPages(NamedTuple):
    """k, v: [pages, page_size, kv_heads, head_dim] for one full-attention layer; with 8-bit
    pages, k_scale and v_scale: float32 [pages, kv_heads], a value being page * its scale
    (`kernels_pallas.paged_attention.pages`). None for float pages, so their tree is (k, v)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def kv_scaled(state: CacheState) -> bool:
    """Whether `state`'s KV pages are 8-bit, with scales."""
    return bool(state.kv) and state.kv[0].k_scale is not None


class GDNSlots(NamedTuple):
    """recurrent: [slots, Hv, dk, dv] fp32; conv: [slots, K-1, conv_dim] for one GDN layer."""

    recurrent: jax.Array
    conv: jax.Array


class CacheState(NamedTuple):
    kv: tuple[KVPages, ...]
    gdn: tuple[GDNSlots, ...]


def init_cache_state(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    num_slots: int,
    dtype: jnp.dtype,
    kv_dtype: jnp.dtype | None = None,
) -> CacheState:
    """Pools of zeros: KV pages in `kv_dtype` (default `dtype`; 8-bit ones with scales), GDN
    conv states in `dtype` and recurrent states in float32."""
    shapes = state_shapes(cfg)
    kv_shape = (num_pages, page_size, *shapes.kv_token)
    rec_shape = (num_slots, *shapes.recurrent)
    conv_shape = (num_slots, *shapes.conv)
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    scaled = kv_dtype in SCALED_PAGE_DTYPES

    def layer() -> KVPages:
        pages = (jnp.zeros(kv_shape, kv_dtype), jnp.zeros(kv_shape, kv_dtype))
        if not scaled:
            return KVPages(*pages)
        scale_shape = (num_pages, shapes.kv_token[0])
        return KVPages(*pages, *(jnp.zeros(scale_shape, jnp.float32) for _ in range(2)))

    return CacheState(
        kv=tuple(layer() for _ in cfg.full_attention_layers),
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
        kv=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((num_pages, *x.shape[1:]), x.dtype), state.kv
        ),
        gdn=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.gdn),
    )
